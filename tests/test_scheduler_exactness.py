"""Hypothesis workloads on the fake runner: every request's output equals the request run
alone, whatever the configuration (prefix cache, pipeline, budgets, chunk sizes, block
sizes, a pool small enough to force preemption and spilling), arrival ticks and aborts."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fake_runner import reference_continuation
from tests.scheduler_harness import assert_accounted, make_core, make_request

configs = st.fixed_dictionaries({
    "block_size": st.sampled_from([1, 2, 4, 8]),
    "budget": st.sampled_from([4, 8, 16, 64]),
    "chunk": st.sampled_from([1, 3, 8, 64]),
    "pipeline": st.booleans(),
    "prefix": st.booleans(),
    "swap": st.booleans(),
    "has_ssm": st.booleans(),
    "tight": st.booleans(),  # a KV pool just big enough for one sequence
})

workloads = st.lists(st.fixed_dictionaries({
    "shared": st.integers(0, 2),          # which common prefix it starts with (0: none)
    "prefix_len": st.integers(0, 20),
    "tail": st.lists(st.integers(0, 96), min_size=1, max_size=12),
    "max_tokens": st.integers(1, 10),
    "arrive": st.integers(0, 6),          # tick of submission
    "abort_at": st.one_of(st.none(), st.integers(0, 12)),
    "prompt_logprobs": st.booleans(),
}), min_size=1, max_size=7)

PREFIXES = {1: list(range(1, 40)), 2: list(range(50, 90))}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs, work=workloads)
def test_outputs_equal_solo_runs(cfg, work):
    bs = cfg["block_size"]
    max_len = 64
    num_blocks = (max_len // bs + 2) if cfg["tight"] else 4 * max_len // bs
    budget = max(cfg["budget"], 4)
    core = make_core(num_blocks=num_blocks, block_size=bs, max_batch=4, budget=budget,
                     chunk=cfg["chunk"], pipeline=cfg["pipeline"], prefix=cfg["prefix"],
                     swap=cfg["swap"], has_ssm=cfg["has_ssm"], max_seq_len=max_len)
    reqs = []
    for w in work:
        prefix = PREFIXES[w["shared"]][:w["prefix_len"]] if w["shared"] else []
        prompt = (prefix + w["tail"])[:40]
        pl = 1 if w["prompt_logprobs"] else None
        reqs.append((w, make_request(prompt, w["max_tokens"], max_len=max_len,
                                     prompt_logprobs=pl)))
    for tick in range(3000):
        for w, r in reqs:
            if w["arrive"] == tick:
                core.inbox.submit(r)
            if w["abort_at"] is not None and w["abort_at"] == tick and w["arrive"] <= tick:
                core.inbox.abort(r.request_id)
        if tick > 12 and all(r.finished for _, r in reqs):
            break
        core.tick()
    else:
        raise AssertionError("workload did not finish")
    core.settle()
    for w, r in reqs:
        s = r.sequences[0]
        if s.finish_reason == "abort":
            continue
        want = reference_continuation(s.prompt_ids, s.params.max_tokens)
        assert s.output_ids == want, (w, s.finish_reason, s.error)
        assert s.finish_reason == "length"
        if s.prompt_logprobs is not None:
            assert len(s.prompt_logprobs) == len(s.prompt_ids)
    assert_accounted(core)
