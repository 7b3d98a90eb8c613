"""The runner's LoRA slots: rows on different adapters share one step exactly, a step with no
adapter row runs the no-LoRA variant, loads and unloads are checked, warm-up compiles both
variants (nothing compiles after it), and the speculative step verifies with the adapter.

A tiny random hybrid (Mamba2, attention, MLP; two MTP modules) with random adapters: parity
with PEFT itself is tests/test_lora_parity.py.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from metrale_jax.config import EngineConfig, ModelConfig
from metrale_jax.lora import LoraConfig, LoraError, LoraWeights
from metrale_jax.lora.targets import model_targets
from metrale_jax.model import HybridLM
from metrale_jax.runner.buckets import CompileCounter
from metrale_jax.runner.model_runner import ModelRunner
from metrale_jax.types import ScheduledRow
from tests.jax_events import BACKEND_COMPILE, EventWatch

CFG = ModelConfig(vocab_size=128, hidden_size=32, layer_pattern="MAF", num_heads=2,
                  num_kv_heads=1, head_dim=16, intermediate_size=64, mamba_num_heads=4,
                  mamba_head_dim=16, ssm_state_size=8, mamba_chunk_size=8, num_mtp_modules=2)
LORA = LoraConfig(max_loras=3, max_lora_rank=8)
BLOCK = 4
ENGINE = dict(max_batch_size=4, max_tokens_per_tick=32, max_seq_len=32, seq_buckets=(4,),
              token_buckets=(32,), query_buckets=(1, 32), block_size=BLOCK, num_kv_blocks=40,
              block_buckets=(8,), max_logprobs=4, program_cache="none", lora=LORA)
TOL = 1e-5


class KeyCounter(CompileCounter):
    """Also keeps the order of the keys it sees."""

    def __init__(self):
        super().__init__()
        self.keys: list = []

    def record(self, key) -> bool:
        self.keys.append(key)
        return super().record(key)


@pytest.fixture(scope="module")
def model() -> HybridLM:
    m = HybridLM(CFG, nnx.Rngs(0))
    # A wider init than 0.02 spreads the logits, so a wrong adapter shows.
    graphdef, state = nnx.split(m)
    state = jax.tree.map(lambda x: x * 5.0 if x.ndim == 2 else x, state)
    return nnx.merge(graphdef, state)


def random_adapter(name: str, seed: int, rank: int = 8, targets: str = "") -> LoraWeights:
    rng = np.random.RandomState(seed)
    out = {}
    for path, t in model_targets(CFG).items():
        if targets in path:
            out[path] = (rng.randn(t.d_in, rank).astype(np.float32) * 0.3,
                         rng.randn(rank, t.d_out).astype(np.float32) * 0.3)
    return LoraWeights(name=name, rank=rank, scaling=0.5, targets=out)


@pytest.fixture(scope="module")
def runner(model) -> ModelRunner:
    r = ModelRunner(model, EngineConfig(**ENGINE), counter=KeyCounter())
    r.load_adapter(1, random_adapter("a", 1))
    r.load_adapter(2, random_adapter("b", 2, rank=4, targets="mixer.in_proj"))
    r.load_adapter(3, random_adapter("c", 3, rank=8, targets="blocks.1"))
    return r


PROMPTS = [[5, 9, 2, 44, 17, 3, 8], [7, 7, 1, 90, 31], [12, 64, 3, 3, 100, 2, 9, 11, 4],
           [33, 2, 8]]


def _rows(slots: list[int], decode: list[int] | None = None, which=range(4)) -> list:
    rows = []
    for i in which:
        table = [1 + 8 * i + j for j in range(8)]
        if decode is None:
            rows.append(ScheduledRow(PROMPTS[i], 0, table, ssm_slot=i + 1, seq_id=i + 1,
                                     adapter_slot=slots[i]))
        else:
            rows.append(ScheduledRow([decode[i]], len(PROMPTS[i]), table, ssm_slot=i + 1,
                                     seq_id=i + 1, adapter_slot=slots[i]))
    return rows


def _same(a, b) -> None:
    assert a.token == b.token
    np.testing.assert_array_equal(a.top_ids, b.top_ids)
    np.testing.assert_allclose(a.top_logprobs, b.top_logprobs, atol=TOL, rtol=0)


def test_rows_on_different_adapters_share_a_step_exactly(runner):
    slots = [0, 1, 2, 3]
    batched = runner.run(_rows(slots))
    decoded = runner.run(_rows(slots, [r.token for r in batched]))
    for i in range(4):
        alone = runner.run(_rows(slots, which=[i]))[0]
        _same(batched[i], alone)
        _same(decoded[i], runner.run(_rows(slots, [alone.token] * 4, which=[i]))[0])
    # Each adapter changes the row's output (slot 0 is the base model).
    base = runner.run(_rows([0, 0, 0, 0]))
    for i in (1, 2, 3):
        moved = np.abs(runner.run(_rows(slots, which=[i]))[0].top_logprobs
                       - base[i].top_logprobs).max()
        assert moved > 1e-2, i


def test_a_step_without_adapter_rows_runs_the_plain_variant(runner):
    counter = runner.counter
    counter.keys.clear()
    runner.run(_rows([0, 0, 0, 0]))
    steps = [k for k in counter.keys if k[0] == "step"]
    assert len(steps) == 1 and steps[0][2].lora is False
    counter.keys.clear()
    runner.run(_rows([0, 2, 0, 0]))
    steps = [k for k in counter.keys if k[0] == "step"]
    assert len(steps) == 1 and steps[0][2].lora is True
    # A base-model row gets the same result in either variant.
    _same(runner.run(_rows([0, 0, 0, 0]))[0], runner.run(_rows([0, 2, 0, 0]))[0])


def test_unload_and_reload(model):
    r = ModelRunner(model, EngineConfig(**ENGINE))
    base = r.run(_rows([0], which=[0]))[0]
    r.load_adapter(1, random_adapter("a", 1))
    adapted = r.run(_rows([1], which=[0]))[0]
    assert np.abs(adapted.top_logprobs - base.top_logprobs).max() > 1e-2
    r.unload_adapter(1)
    _same(r.run(_rows([1], which=[0]))[0], base)
    r.load_adapter(1, random_adapter("b", 2))  # replaces: nothing of "a" is left
    r.load_adapter(2, random_adapter("b", 2))
    _same(r.run(_rows([1], which=[0]))[0], r.run(_rows([2], which=[0]))[0])


def test_load_errors(runner, model):
    good = random_adapter("x", 4)
    path = next(iter(good.targets))
    a, b = good.targets[path]
    cases = {
        "exceeds max_lora_rank 8": random_adapter("x", 4, rank=9),
        "model needs": LoraWeights("x", 8, 1.0, {path: (a[:-1], b)}),
        "not a target of this model": LoraWeights("x", 8, 1.0, {"blocks.9.mixer.q_proj": (a, b)}),
    }
    for message, weights in cases.items():
        with pytest.raises(LoraError, match=message):
            runner.load_adapter(1, weights)
    with pytest.raises(ValueError, match=r"must be in 1\.\.3"):
        runner.load_adapter(4, good)
    with pytest.raises(ValueError, match=r"must be in 1\.\.3"):
        runner.unload_adapter(0)
    with pytest.raises(ValueError, match=r"adapter slot 4: must be in 0\.\.3"):
        runner.run(_rows([4, 0, 0, 0]))
    off = ModelRunner(model, EngineConfig(**{**ENGINE, "lora": None}))
    assert off.max_loras == 0 and off.lora_slots is None
    with pytest.raises(ValueError, match="LoRA is off"):
        off.load_adapter(1, good)


def test_warmup_compiles_both_variants(model):
    r = ModelRunner(model, EngineConfig(**ENGINE), counter=KeyCounter())
    variants = r.warmup_variants()
    assert sorted({v[2] for v in variants}) == [False, True]
    assert len(variants) == 2 * len(r.warmup_shapes())
    r.warmup(progress=False)
    before = r.counter.count
    with EventWatch(BACKEND_COMPILE) as watch:
        r.load_adapter(1, random_adapter("a", 1))
        first = r.run(_rows([1, 0, 1, 0]))
        r.run(_rows([1, 0, 1, 0], [x.token for x in first]))
        r.run(_rows([0, 0, 0, 0]))
        r.unload_adapter(1)
    assert r.counter.count == before
    assert watch.names == []


# ---- speculative ------------------------------------------------------------------------

def _greedy_spec(r: ModelRunner, prompt: list[int], new: int, slot: int,
                 oracle: list[int] | None = None) -> tuple[list[int], int]:
    """Greedy decoding through the speculative step: each step verifies the drafts of the
    one before it (or, with `oracle`, that sequence's next tokens as drafts); returns the
    tokens and how many drafts were accepted."""
    table = list(range(1, 9))
    res = r.run([ScheduledRow(prompt, 0, table, ssm_slot=1, adapter_slot=slot)], True)[0]
    out, drafts, cached, accepted = [res.token], res.drafts, len(prompt), 0
    while len(out) < new:
        if oracle is not None:
            drafts = oracle[len(out):len(out) + len(drafts)]
        row = ScheduledRow([out[-1], *drafts], cached, table, ssm_slot=1, adapter_slot=slot,
                           num_drafts=len(drafts))
        res = r.run([row], True)[0]
        emitted = [res.token] + [f.token for f in res.following]
        cached += len(emitted)  # the last token and the accepted drafts are now cached
        out += emitted
        accepted += len(res.following)
        drafts = res.drafts
    return out[:new], accepted


def _greedy_plain(r: ModelRunner, prompt: list[int], new: int, slot: int) -> list[int]:
    table = list(range(1, 9))
    out = [r.run([ScheduledRow(prompt, 0, table, ssm_slot=1, adapter_slot=slot)])[0].token]
    while len(out) < new:
        row = ScheduledRow([out[-1]], len(prompt) + len(out) - 1, table, ssm_slot=1,
                           adapter_slot=slot)
        out.append(r.run([row])[0].token)
    return out


def test_speculative_step_verifies_with_the_adapter(model):
    engine = EngineConfig(**{**ENGINE, "speculative": {"num_speculative_tokens": 2}})
    r = ModelRunner(model, engine)
    r.load_adapter(1, random_adapter("a", 1))
    prompt = PROMPTS[0]
    want = _greedy_plain(r, prompt, 14, slot=1)
    base = _greedy_plain(r, prompt, 14, slot=0)
    assert want != base
    assert _greedy_spec(r, prompt, 10, slot=1)[0] == want[:10]
    # Drafts that are the adapted model's own tokens are all accepted (verification runs
    # with the adapter); the base model's tokens as drafts are rejected where they differ.
    tokens, accepted = _greedy_spec(r, prompt, 10, slot=1, oracle=want)
    assert tokens == want[:10] and accepted >= 6
    assert _greedy_spec(r, prompt, 10, slot=1, oracle=base)[0] == want[:10]
