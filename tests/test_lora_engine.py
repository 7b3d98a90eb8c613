"""The offline API with LoRA, vLLM-shaped, on the fake runner (the built-in model's tokenizer,
no device step): `LLM(enable_lora=True, max_loras, max_lora_rank)`,
`generate(..., lora_request=...)` with one request or one per prompt, and its errors."""

from __future__ import annotations

import pytest

from metrale_jax import LLM, LoRARequest, SamplingParams
from metrale_jax.request import RequestError
from tests.fake_runner import FakeRunner, reference_continuation
from tests.scheduler_harness import fake_loader

ENGINE = dict(max_batch_size=4, max_tokens_per_tick=32, max_seq_len=64, block_size=4,
              num_kv_blocks=64, enable_swap=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": list(range(1, 9))}, {"prompt_token_ids": list(range(20, 31))},
           {"prompt_token_ids": list(range(40, 45))}]


class RecordingLoader:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, name, path):
        self.calls.append(path)
        return fake_loader(name, path)


def fake_llm(loader=None, **kw) -> LLM:
    runner = FakeRunner(ENGINE["num_kv_blocks"], ENGINE["block_size"],
                        ENGINE["max_batch_size"], max_loras=kw.get("max_loras") or 0)
    return LLM(warmup=False, runner=runner, adapter_loader=loader or fake_loader,
               **ENGINE, **kw)


def _want(prompt, path=None, name=None):
    weights = fake_loader(name, path) if path else None
    return reference_continuation(prompt["prompt_token_ids"], 6, adapter=weights)


def test_one_lora_request_for_all_prompts_and_one_per_prompt():
    loader = RecordingLoader()
    llm = fake_llm(loader, enable_lora=True, max_loras=2, max_lora_rank=8)
    assert llm.engine_config.lora.max_loras == 2 and llm.engine_config.lora.max_lora_rank == 8
    a = LoRARequest("a", 1, "/adapters/a/1.5")
    b = LoRARequest("b", 2, "/adapters/b/0.5")
    out = llm.generate(PROMPTS, GREEDY, lora_request=a)
    assert [o.outputs[0].token_ids for o in out] == [_want(p, a.lora_path, "a") for p in PROMPTS]
    out = llm.generate(PROMPTS, GREEDY, lora_request=[a, None, b])
    assert [o.outputs[0].token_ids for o in out] == [
        _want(PROMPTS[0], a.lora_path, "a"), _want(PROMPTS[1]),
        _want(PROMPTS[2], b.lora_path, "b")]
    assert loader.calls == [a.lora_path, b.lora_path]  # each adapter read once


def test_stream_takes_a_lora_request():
    llm = fake_llm(enable_lora=True, max_loras=1)
    a = LoRARequest("a", 1, "/adapters/a/2.0")
    text = "".join(llm.stream(PROMPTS[0], GREEDY, lora_request=a))
    want = llm.generate([PROMPTS[0]], GREEDY, lora_request=a)[0].outputs[0].text
    assert text == want


def test_lora_errors_are_clear():
    llm = fake_llm(enable_lora=True, max_loras=1)
    a = LoRARequest("a", 1, "/adapters/a")
    with pytest.raises(RequestError, match="lora_request: 1 given for 3 prompts"):
        llm.generate(PROMPTS, GREEDY, lora_request=[a])
    with pytest.raises(RequestError, match="lora_request: expected a LoRARequest"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request="a")
    with pytest.raises(RequestError, match="registered as id 1"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request=[a])  # registers a ...
        llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("a", 2, "/adapters/a"))
    with pytest.raises(RequestError, match="unknown adapter"):
        llm.engine.make_request(PROMPTS[0], GREEDY, lora_name="nope")
    plain = fake_llm()
    with pytest.raises(RequestError, match="enable_lora=True"):
        plain.generate(PROMPTS[:1], GREEDY, lora_request=a)
    with pytest.raises(ValueError, match="enable_lora=True"):
        fake_llm(max_loras=2)


# ---- on the built-in model (needs the device side: metrale_jax.lora.targets and a runner
# with adapter slots) -----------------------------------

class RandomAdapters:
    """Adapters with random A/B on every target of the model, seeded by name (no files)."""

    def __init__(self) -> None:
        self.model_config = None  # set once the engine is built

    def __call__(self, name, path):
        import zlib

        import numpy as np

        from metrale_jax.lora.targets import model_targets
        from metrale_jax.lora.weights import LoraWeights

        rng = np.random.default_rng(zlib.crc32(name.encode()))
        targets = {t.path: (rng.normal(0, 0.5, (t.d_in, 4)).astype(np.float32),
                            rng.normal(0, 0.5, (4, t.d_out)).astype(np.float32))
                   for t in model_targets(self.model_config).values()}
        return LoraWeights(name=name, rank=4, scaling=1.0, targets=targets)


REAL_ENGINE = dict(max_batch_size=4, max_tokens_per_tick=32, max_seq_len=128, block_size=8,
                   num_kv_blocks=80, seq_buckets=(2, 4), token_buckets=(16, 32),
                   query_buckets=(1, 8, 32), block_buckets=(16,), max_logprobs=5)


def test_real_model_mixed_adapters_equal_alone_and_rotate_through_two_slots():
    loader = RandomAdapters()
    llm = LLM(warmup=False, enable_lora=True, max_loras=2, max_lora_rank=8,
              adapter_loader=loader, **REAL_ENGINE)
    loader.model_config = llm.model_config
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = ["To be, or not to be", "The class statement", "Python supports the",
               "Now is the winter"]
    a, b, c = (LoRARequest(n, i, f"/adapters/{n}") for i, n in enumerate("abc", 1))
    loras = [a, None, b, c]  # three adapters on two slots: the cohort gate rotates

    def tokens(outputs):
        return [o.outputs[0].token_ids for o in outputs]

    together = tokens(llm.generate(prompts, params, lora_request=loras))
    alone = [tokens(llm.generate([p], params, lora_request=r))[0]
             for p, r in zip(prompts, loras)]
    assert together == alone
    base = tokens(llm.generate([prompts[0]], params))[0]
    assert base != together[0]  # the adapter changes what the model says
    assert llm.engine.core.pool.num_used == 0


TIGHT_ENGINE = dict(max_batch_size=4, max_tokens_per_tick=32, max_seq_len=48, block_size=8,
                    num_kv_blocks=8, seq_buckets=(2, 4), token_buckets=(16, 32),
                    query_buckets=(1, 8, 32), block_buckets=(6,), max_logprobs=5)


@pytest.mark.parametrize("levers", [
    dict(pipeline_enabled=True, prefix_cache_enabled=True, swap_enabled=True),
    dict(pipeline_enabled=False, prefix_cache_enabled=False, swap_enabled=True),
    dict(pipeline_enabled=True, prefix_cache_enabled=False, swap_enabled=False)])
def test_real_model_mixed_adapters_equal_alone_under_spills_and_preemptions(levers, tmp_path):
    """Three adapters and the base model in a KV pool that holds two of the four sequences:
    spilled (or recomputed) sequences resume under their own adapter, with the pipeline and
    the prefix cache on or off, and every output equals the prompt run alone."""
    loader = RandomAdapters()
    llm = LLM(warmup=False, enable_lora=True, max_loras=3, max_lora_rank=8,
              adapter_loader=loader, spill_dir=str(tmp_path), **TIGHT_ENGINE)
    loader.model_config = llm.model_config
    llm.engine.levers.set(**levers)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = ["To be, or not to be", "The class statement", "Python supports the",
               "Now is the winter"]
    loras = [LoRARequest(n, i, f"/adapters/{n}") if n else None
             for i, n in enumerate(["a", None, "b", "c"], 1)]

    def tokens(outputs):
        return [o.outputs[0].token_ids for o in outputs]

    alone = [tokens(llm.generate([p], params, lora_request=r))[0]
             for p, r in zip(prompts, loras)]
    before = llm.engine.core.tel.counters()
    together = tokens(llm.generate(prompts, params, lora_request=loras))
    after = llm.engine.core.tel.counters()
    assert together == alone
    moved = {k: after.get(k, 0) - before.get(k, 0) for k in ("spills", "preemptions")}
    assert moved["spills" if levers["swap_enabled"] else "preemptions"] > 0, moved
    assert llm.engine.core.pool.num_used == 0
