"""Grammar-checked MTP drafts: a constrained row verifies the drafts its grammar allows, with
one mask per verified position, so its outputs equal plain constrained decoding's.

Host side: `GrammarState.check_drafts` cuts drafts where the grammar rejects one or
completes, gives a mask per position and leaves the matcher as it was; the runner packs
k+1 masks per row. Device side: masked targets keep rejection sampling's distribution
the masked one. End to end: greedy constrained outputs equal with MTP on and off (pipeline
on and off) on a NemotronH with random MTP modules (drafts mostly cut or rejected) and on the
built-in model (trained MTP modules: drafts accepted), sampled ones are all valid, and
constrained rows do accept drafts."""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from scipy.stats import chisquare

from metrale_jax import LLM, SamplingParams, StructuredOutputsParams
from metrale_jax.grammar.compiler import GrammarCompiler
from metrale_jax.grammar.matcher import allows
from metrale_jax.runner.sampler import host_tables, make_sampling_arrays
from metrale_jax.runner.spec_step import accept_drafts
from metrale_jax.runner.token_mask import TokenMask, apply_token_mask, pack_masks
from metrale_jax.types import RowSampling
from pallas_kernels.backend import XLA
from tests.grammar_cases import CHOICES, REGEXES, SCHEMAS, cases
from tests.hf_models import add_nemotronh_mtp, save_tiny_nemotronh
from tests.scheduler_harness import TOKENIZER

ENGINE = dict(max_batch_size=4, max_tokens_per_tick=32, max_seq_len=128, block_size=8,
              num_kv_blocks=80, seq_buckets=(4,), token_buckets=(16, 32),
              query_buckets=(1, 8, 32), block_buckets=(16,), max_logprobs=2,
              num_ssm_snapshots=4)
SPEC = {"method": "mtp", "num_speculative_tokens": 2, "gate": "on"}
PROMPTS = ["To be, or not to be", "KING HENRY:"]
MAX_TOKENS = 40
# Constraints with room for the model's own words (drafts can pass) and forced strings.
SPECS = ([{"json": SCHEMAS[i]} for i in (1, 5, 7, 14)]
         + [{"regex": r} for r in (REGEXES[0], REGEXES[6], r"[A-Za-z ,.;:'!?]{20,60}\.")]
         + [{"choice": c} for c in CHOICES[1:3]])
LONG_CHOICE = ["To be, or not to be, that is the question: whether 'tis nobler in the mind "
               "to suffer", "No"]


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory) -> LLM:
    path = tmp_path_factory.mktemp("nemotronh-grammar-mtp")
    # The tokenizer's vocabulary (4096): with a smaller model vocabulary, a string the
    # grammar forces can have canonical tokens past the model's, which no mask can allow.
    save_tiny_nemotronh(
        path, vocab_size=4096, intermediate_size=96, mamba_num_heads=4, ssm_state_size=8,
        max_position_embeddings=128,
        layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention"])
    add_nemotronh_mtp(path, num_modules=2)
    return LLM(str(path), speculative_config=SPEC, warmup=False, **ENGINE)


@pytest.fixture(scope="module")
def builtin() -> LLM:
    return LLM(speculative_config=SPEC, warmup=False, **ENGINE)


def _params(spec: dict, temperature: float = 0.0) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS, seed=3,
                          structured_outputs=StructuredOutputsParams(**spec))


def _run(llm: LLM, specs, *, mtp: str, pipeline: bool = True, temperature: float = 0.0):
    llm.engine.levers.set(mtp_policy=mtp, pipeline_enabled=pipeline)
    prompts = [PROMPTS[i % 2] for i in range(len(specs))]
    return [o.outputs[0] for o in llm.generate(prompts, [_params(s, temperature)
                                                          for s in specs])]


def _drafts(llm: LLM) -> tuple[int, int]:
    c = llm.engine.core.tel.counters()
    return c.get("spec_decode_num_draft_tokens", 0), c.get("spec_decode_num_accepted_tokens", 0)


# ---- host: checking drafts ---------------------------------------------------------------

def test_check_drafts_cuts_at_a_rejected_draft_and_rolls_back():
    compiler = GrammarCompiler(TOKENIZER, vocab_size=4096)
    state = compiler.new_state(StructuredOutputsParams(choice=["abcabc", "xyz"]))
    ids = TOKENIZER.encode("abcabc")
    before = state.next_mask()
    kept, masks = state.check_drafts(ids[:2])
    assert kept == ids[:2] and masks.shape == (3, before.shape[0])
    np.testing.assert_array_equal(masks[0], before)
    assert allows(masks[1], ids[1]) and not allows(masks[1], ids[0] if ids[0] != ids[1] else 0)
    assert state.consumed == 0                    # rolled back
    np.testing.assert_array_equal(state.next_mask(), before)
    bad = TOKENIZER.encode("xyz")[0]
    kept, masks = state.check_drafts([ids[0], bad, ids[1]])
    assert kept == [ids[0]] and len(masks) == 2    # cut at the rejected draft
    kept, masks = state.check_drafts([bad])
    assert kept == [bad] and len(masks) == 2       # "x..." starts the other choice
    # A draft that completes the grammar ends the drafts: nothing follows a stop.
    done = compiler.new_state(StructuredOutputsParams(choice=["ab"]))
    ab = TOKENIZER.encode("ab")
    kept, masks = done.check_drafts(ab + [ab[0]])
    assert kept == ab and len(masks) == len(ab) + 1
    assert all(done.advance(t) is None for t in ab) and done.done


def test_pack_masks_puts_each_rows_positions_in_its_block():
    w = 3
    a = np.arange(2 * w, dtype=np.int32).reshape(2, w)   # a row with one draft
    b = np.full(w, 7, np.int32)                          # a plain [W] mask: one position
    packed = pack_masks([a, None, b], num_rows=4, width=w, positions=3)
    assert packed.bits.shape == (12, w)
    assert packed.on.tolist() == [True, True, False, False, False, False,
                                  True, False, False, False, False, False]
    np.testing.assert_array_equal(packed.bits[:2], a)
    np.testing.assert_array_equal(packed.bits[6], b)
    assert (packed.bits[2] == -1).all()
    with pytest.raises(ValueError, match="token masks of shape"):
        pack_masks([np.zeros((4, w), np.int32)], num_rows=1, width=w, positions=3)


# ---- device: acceptance sees the masked target -----------------------------------------------

def test_rejection_sampling_keeps_the_masked_distribution():
    """A disallowed draft is never emitted and the first token follows softmax over the
    allowed tokens only; an allowed draft keeps the masked distribution too."""
    n, v = 20000, 8
    logits = np.array([[1.0, 0.2, -0.5, 1.4, 0.0, -1.0, 0.7, 0.3],
                       [0.1, 1.1, 0.4, -0.3, 0.9, 0.0, -2.0, 0.5]], np.float32)
    allowed = np.array([1, 1, 0, 0, 1, 0, 1, 0], bool)      # token 3 (the likeliest) banned
    bits = np.packbits(allowed, bitorder="little").view(np.uint8)
    word = np.zeros(4, np.uint8)
    word[:1] = bits
    mask = TokenMask(jnp.asarray(np.tile(word.view(np.int32), (2 * n, 1))),
                     jnp.ones((2 * n,), bool))
    masked = apply_token_mask(jnp.asarray(np.tile(logits, (n, 1))), mask)
    rows = [RowSampling(temperature=1.0, seed=s) for s in range(n)]
    sampling = dataclasses.replace(make_sampling_arrays(rows, n), slots=np.ones(n, np.int32))
    tables = host_tables(rows[:1], 8, 4)
    expected = np.where(allowed, np.exp(logits[0].astype(np.float64)), 0.0)
    expected /= expected.sum()
    for draft in (3, 0):  # banned, then allowed
        _, tokens = jax.jit(lambda l, d, s, t: accept_drafts(l, d, s, t, ops=XLA))(
            masked, jnp.full((n, 1), draft, jnp.int32), sampling, tables)
        first = np.asarray(tokens)[:, 0]
        assert allowed[first].all()
        counts = np.bincount(first, minlength=v)[allowed]
        assert chisquare(counts, expected[allowed] * counts.sum()).pvalue > 1e-3


# ---- end to end --------------------------------------------------------------------------

@pytest.mark.parametrize("pipeline", [True, False])
def test_nemotronh_greedy_outputs_equal_with_mtp_on_and_off(nemotron, pipeline):
    off = _run(nemotron, SPECS, mtp="off", pipeline=pipeline)
    drafted = _drafts(nemotron)
    on = _run(nemotron, SPECS, mtp="on", pipeline=pipeline)
    assert [(o.token_ids, o.finish_reason) for o in on] == \
        [(o.token_ids, o.finish_reason) for o in off]
    assert _drafts(nemotron)[0] >= drafted[0]


@pytest.mark.parametrize("pipeline", [True, False])
def test_builtin_greedy_outputs_equal_with_mtp_on_and_off(builtin, pipeline):
    specs = SPECS + [{"choice": LONG_CHOICE}]
    off = _run(builtin, specs, mtp="off", pipeline=pipeline)
    on = _run(builtin, specs, mtp="on", pipeline=pipeline)
    assert [(o.token_ids, o.finish_reason, o.text) for o in on] == \
        [(o.token_ids, o.finish_reason, o.text) for o in off]


def test_constrained_rows_accept_drafts(builtin):
    before = _drafts(builtin)
    outs = _run(builtin, [{"choice": LONG_CHOICE}, {"regex": r"[A-Za-z ,.;:'!?]{20,60}\."}],
                mtp="on")
    assert outs[0].text in LONG_CHOICE and outs[0].finish_reason == "stop"
    drafted, accepted = (a - b for a, b in zip(_drafts(builtin), before))
    assert drafted > 0 and accepted > 0, (drafted, accepted)


@pytest.mark.parametrize("model", ["nemotron", "builtin"])
def test_sampled_outputs_are_all_valid_with_mtp_on(request, model):
    llm = request.getfixturevalue(model)
    specs = cases()[::2]
    outs = _run(llm, [s for s, _ in specs], mtp="on", temperature=1.0)
    bad = [(s, o.text, o.finish_reason) for o, (s, check) in zip(outs, specs)
           if o.finish_reason != "stop" or not check(o.text)]
    assert not bad, bad


def test_xgrammar_drafts_are_checked_the_same_way(builtin):
    """The xgrammar backend's matchers roll back too: greedy outputs equal with MTP on and
    off, and constrained rows accept drafts (the engine's compiler swapped for the test)."""
    engine = builtin.engine
    saved = engine._grammar
    engine._grammar = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size,
                                      backend="xgrammar")
    try:
        specs = [{"choice": LONG_CHOICE}, {"regex": r"[A-Za-z ,.;:'!?]{20,60}\."},
                 {"json": SCHEMAS[1]}]
        off = _run(builtin, specs, mtp="off")
        before = _drafts(builtin)
        on = _run(builtin, specs, mtp="on")
        assert [(o.text, o.finish_reason) for o in on] == [(o.text, o.finish_reason)
                                                           for o in off]
        assert on[0].text in LONG_CHOICE and re.fullmatch(specs[1]["regex"], on[1].text)
        jsonschema.validate(json.loads(on[2].text), SCHEMAS[1])
        assert _drafts(builtin)[1] > before[1]
    finally:
        engine._grammar = saved
