"""The offline API on the built-in model: batching, logprobs, stops, errors, compilation."""

from __future__ import annotations

import pytest

from metrale_jax import LLM, SamplingParams
from metrale_jax.request import RequestError

ENGINE = dict(max_batch_size=4, max_tokens_per_tick=32, max_seq_len=128, block_size=8,
              num_kv_blocks=80, seq_buckets=(2, 4), token_buckets=(16, 32),
              query_buckets=(1, 8, 32), block_buckets=(16,), max_logprobs=5)
PROMPTS = ["To be, or not to be", "The class statement", "x", "Python supports the",
           "A long prompt that needs more than one chunk of the token budget to be prefilled "
           "completely before the first token comes out of the model at all"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="session")
def llm() -> LLM:
    return LLM(**ENGINE)  # warmed up by LLM()


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_batched_equals_alone(llm):
    together = _tokens(llm.generate(PROMPTS, GREEDY))
    alone = [_tokens(llm.generate([p], GREEDY))[0] for p in PROMPTS]
    assert together == alone
    assert all(len(t) == 12 for t in together)
    pool = llm.engine.core.pool
    assert pool.num_free + pool.num_cached == pool.num_usable  # every block came back


def test_preemption_by_recompute_keeps_outputs():
    # 12 usable blocks of 8 tokens cannot hold 4 sequences of ~40 tokens: decodes preempt.
    small = LLM(**{**ENGINE, "num_kv_blocks": 17}, warmup=False)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = [p * 2 for p in PROMPTS[:4]]
    got = _tokens(small.generate(prompts, params))
    assert got == [_tokens(small.generate([p], params))[0] for p in prompts]
    assert small.engine.core.pool.num_used == 0
    assert small.engine.core.tel.counters().get("spills", 0) + \
        small.engine.core.tel.counters().get("preemptions", 0) > 0  # the pool really was too small


def test_seeded_sampling_reproduces_and_varies(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)
    first = _tokens(llm.generate(PROMPTS[:3], params))
    again = _tokens(llm.generate(PROMPTS[:3][::-1], params))[::-1]  # other rows, other order
    assert first == again
    other = _tokens(llm.generate(PROMPTS[:3], SamplingParams(
        temperature=1.0, top_p=0.9, seed=8, max_tokens=10, ignore_eos=True)))
    assert other != first


def test_n_completions_differ(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8,
                                                  ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_logprobs_shape_like_vllm(llm):
    out = llm.generate({"prompt_token_ids": [5, 9, 300, 41, 7]}, SamplingParams(
        temperature=0.0, max_tokens=4, logprobs=3, prompt_logprobs=2))[0]
    assert out.prompt_token_ids == [5, 9, 300, 41, 7]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 5
    for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert out.prompt_token_ids[pos] in entry  # the actual prompt token is always there
        assert len(entry) in (2, 3)
    comp = out.outputs[0]
    assert len(comp.logprobs) == 4
    for token, entry in zip(comp.token_ids, comp.logprobs):
        assert entry[token].rank == 1  # greedy picks the most likely token
        ranks = sorted(lp.rank for lp in entry.values())
        assert ranks[:3] == [1, 2, 3]
    assert comp.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(comp.token_ids, comp.logprobs)), rel=1e-5)


def test_stop_string_is_cut_and_not_emitted(llm):
    base = llm.generate(PROMPTS[1], GREEDY)[0].outputs[0].text
    stop = base[3:6]
    assert stop and stop in base
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=12,
                                                  ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert out.text == base[:base.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_stream_equals_generate(llm):
    text = "".join(llm.stream(PROMPTS[0], GREEDY))
    assert text == llm.generate(PROMPTS[0], GREEDY)[0].outputs[0].text


@pytest.mark.parametrize("prompt, params, field", [
    ("", SamplingParams(), "prompt"),
    ("word " * 200, SamplingParams(), "prompt"),
    ({"prompt_token_ids": [1, 99999]}, SamplingParams(), "prompt_token_ids"),
    ("hi", SamplingParams(logprobs=50), "logprobs"),
    ("a lone \ud800 surrogate", SamplingParams(), "prompt: holds a lone UTF-16 surrogate"),
])
def test_bad_requests_name_the_field(llm, prompt, params, field):
    with pytest.raises(RequestError, match=field):
        llm.generate(prompt, params)


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(stop=[""]), "stop"), (dict(n=0), "n"),
    # Nonzero but below float32's smallest normal: 0 on the device, and NaN logits.
    (dict(repetition_penalty=5e-324), "repetition_penalty"),
    (dict(temperature=1e-45), "temperature"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**kwargs)


def test_no_compilation_after_warmup(llm):
    counter = llm.runner.counter
    before, jit_before = counter.count, llm.runner.step.cache_size()
    for batch in ([PROMPTS[0]], PROMPTS[:2], PROMPTS, PROMPTS[2:4], [PROMPTS[4]] * 3):
        llm.generate(batch, SamplingParams(temperature=0.7, seed=3, max_tokens=9,
                                           ignore_eos=True))
    assert counter.count == before
    assert llm.runner.step.cache_size() == jit_before


def test_sampling_filters_compile_nothing_after_warmup(llm):
    # top-k / top-p / min-p used to be a static switch of the step: the first request using
    # one compiled a new variant in the middle of serving.
    counter = llm.runner.counter
    before = counter.count
    mixes = [dict(temperature=0.8, top_p=0.9), dict(temperature=0.7, top_k=5),
             dict(temperature=1.0, min_p=0.1), dict(temperature=0.0)]
    for i, batch in enumerate(([PROMPTS[0]], PROMPTS[:2], PROMPTS, PROMPTS[2:4])):
        llm.generate(batch, [SamplingParams(seed=i, max_tokens=5, ignore_eos=True,
                                            **mixes[(i + j) % len(mixes)])
                             for j in range(len(batch))])
    assert counter.count == before


def test_prompt_logprobs_compile_nothing_after_warmup(llm):
    # Scoring the prompt was a static switch of the step, compiled on first use.
    counter = llm.runner.counter
    before = counter.count
    out = llm.generate(PROMPTS[:3], [SamplingParams(prompt_logprobs=2, max_tokens=3,
                                                    temperature=0.0)] * 3)
    assert counter.count == before
    assert all(len(o.prompt_logprobs) == len(o.prompt_token_ids) for o in out)


def test_multi_turn_chats_with_sessions_equal_recompute(llm):
    """Decode-time snapshots and session tails on the hybrid, tails restored from the host
    tier after simulated memory pressure: every turn's greedy reply equals the same prompt
    computed from scratch (prefix cache off), short chats included, with nothing compiled
    and, once the session is closed, nothing pinned."""
    core, compiled = llm.engine.core, llm.runner.counter.count
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

    def scratch(prompt):
        llm.engine.levers.set(prefix_cache_enabled=False)
        try:
            return llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
        finally:
            llm.engine.levers.set(prefix_cache_enabled=True)

    # The chats take turns, so a slot freed by one turn holds another chat's state when
    # the next turn of the first starts; replies are checked against scratch runs
    # afterwards. The chat without a session reuses its decode-time snapshots.
    history = {"long": llm.tokenizer.encode("To be, or not to be, that is"),
               "short": llm.tokenizer.encode("x"),
               None: llm.tokenizer.encode("The class statement")}
    turns, hits = [], core.pool.stats.prefix_hit_tokens
    for message in ("", " the question", " y"):
        if message == " y":  # memory pressure: the idle sessions' tails go to host RAM
            while core.sessions.give_back():
                pass
            assert core.sessions.num_stored == 2
        for session in history:
            prompt = history[session] + llm.tokenizer.encode(message)
            out = llm.generate({"prompt_token_ids": prompt}, params, session_id=session)
            reply = out[0].outputs[0].token_ids
            turns.append((prompt, reply))
            history[session] = prompt + reply
    for prompt, reply in turns:
        assert reply == scratch(prompt), prompt
    counters = core.tel.counters()
    assert counters["session_tail_hits"] >= 4  # the short chat's turns too (< one block)
    assert counters["session_tier_restores"] == 2
    assert core.pool.stats.prefix_hit_tokens - hits >= 16 * 2
    assert llm.runner.counter.count == compiled
    assert core.pool.num_used > 0 and core.sessions.pinned_blocks > 0
    assert llm.close_session("long") and llm.close_session("short")
    assert not llm.close_session("short")
    assert core.pool.num_used == 0 and core.sessions.pinned_blocks == 0
    core.check_integrity()
