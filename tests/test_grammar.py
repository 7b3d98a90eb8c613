"""Structured outputs end to end: parameters, compile errors, the device mask, and 100%
valid constrained outputs on the built-in model and a random-weights Llama, greedy and
sampled, identical (greedy) however the engine schedules them."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax import LLM, RequestError, SamplingParams, StructuredOutputsParams
from metrale_jax.grammar.compiler import GrammarCompiler
from metrale_jax.runner.token_mask import TokenMask, apply_token_mask
from tests.grammar_cases import LARK, cases
from tests.scheduler_harness import TOKENIZER

ENGINE = dict(max_batch_size=8, max_tokens_per_tick=32, max_seq_len=128, block_size=8,
              num_kv_blocks=120, seq_buckets=(8,), token_buckets=(16, 32),
              query_buckets=(1, 8, 32), block_buckets=(16,), max_logprobs=3)
PROMPTS = ["To be, or not to be", "KING HENRY:"]
MAX_TOKENS = 40


@pytest.fixture(scope="session")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(TOKENIZER, vocab_size=4096)


@pytest.fixture(scope="session")
def builtin() -> LLM:
    return LLM(**ENGINE, warmup=False)  # compiles only the shapes these tests take


@pytest.fixture(scope="session")
def llama(tmp_path_factory) -> LLM:
    from tests.hf_models import save_tiny_llama

    path = tmp_path_factory.mktemp("llama-grammar")
    save_tiny_llama(path)
    return LLM(str(path), **ENGINE, warmup=False)


def _params(spec: dict, temperature: float = 0.0, **kw) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS, seed=5,
                          structured_outputs=StructuredOutputsParams(**spec), **kw)


# ---- parameters and compile errors --------------------------------------------------------

def test_exactly_one_kind_and_its_shape():
    with pytest.raises(RequestError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(RequestError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(RequestError, match=r"structured_outputs\.json: is not valid JSON"):
        StructuredOutputsParams(json="{bad")
    with pytest.raises(RequestError, match=r"structured_outputs\.choice"):
        StructuredOutputsParams(choice=[])
    text = StructuredOutputsParams(json='{"type": "object", "properties": {"b": {}, "a": {}}}')
    assert text.key() == StructuredOutputsParams(
        json={"type": "object", "properties": {"b": {}, "a": {}}}).key()  # dict or its text
    params = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    assert params.structured_outputs.kind == "regex"
    with pytest.raises(RequestError, match="structured_outputs"):
        SamplingParams(structured_outputs={"pattern": "x"})


@pytest.mark.parametrize("spec, field", [
    ({"regex": "(abc"}, "structured_outputs.regex"),
    ({"regex": "[a-"}, "structured_outputs.regex"),
    ({"json": {"type": "foo"}}, "structured_outputs.json"),
    ({"json": {"$ref": "#/nowhere"}}, "structured_outputs.json"),
    ({"json": {"type": "string", "pattern": "[a-"}}, "structured_outputs.json"),
    ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar"),
    ({"grammar": "start: (("}, "structured_outputs.grammar"),
])
def test_invalid_constraints_name_the_field(compiler, spec, field):
    with pytest.raises(RequestError, match=field.replace(".", r"\.")):
        compiler.compile(StructuredOutputsParams(**spec))


def test_compiled_grammars_are_cached_and_states_independent(compiler):
    spec = StructuredOutputsParams(choice=["ab", "cd"])
    assert compiler.compile(spec) is compiler.compile(StructuredOutputsParams(choice=["ab", "cd"]))
    one, two = compiler.new_state(spec), compiler.new_state(spec)
    a = TOKENIZER.encode("a")[0]
    assert _allowed(one.next_mask())[a]
    assert one.advance(a) is None and one.consumed == 1 and two.consumed == 0
    assert _allowed(two.next_mask())[TOKENIZER.encode("c")[0]]
    assert one.advance(TOKENIZER.encode("c")[0]) is not None  # "ac" is not a choice


def test_gbnf_is_accepted_as_a_grammar(compiler):
    state = compiler.new_state(StructuredOutputsParams(grammar='root ::= "x" [0-9]'))
    assert state.advance(TOKENIZER.encode("x")[0]) is None


def _allowed(mask: np.ndarray) -> np.ndarray:
    return np.unpackbits(mask.view(np.uint8), bitorder="little").astype(bool)


# ---- the device mask ----------------------------------------------------------------------

def test_token_mask_matches_a_reference_and_skips_unconstrained_rows():
    rng = np.random.default_rng(0)
    vocab, width = 70, 3
    logits = rng.normal(size=(3, vocab)).astype(np.float32)
    bits = rng.integers(-2**31, 2**31, size=(3, width), dtype=np.int64).astype(np.int32)
    bits[2] = 0                            # a constrained row that allows nothing
    out = np.asarray(apply_token_mask(jnp.asarray(logits), TokenMask(
        jnp.asarray(bits), jnp.asarray([True, False, True]))))
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab] > 0
    np.testing.assert_array_equal(out[0], np.where(allowed[0], logits[0], -np.inf))
    np.testing.assert_array_equal(out[1], logits[1])   # not constrained
    np.testing.assert_array_equal(out[2], logits[2])   # nothing allowed: left for the host
    wide = np.asarray(apply_token_mask(jnp.zeros((1, 100)), TokenMask(
        jnp.full((1, 2), -1, jnp.int32), jnp.asarray([True]))))
    assert np.isinf(wide[0, 64:]).all() and (wide[0, :64] == 0).all()  # past the bits: banned


def test_an_unconstrained_batch_sends_no_mask():
    from metrale_jax.runner.token_mask import MaskSource

    source = MaskSource(vocab_size=100)
    assert source.for_rows([None, None], 4) is source.for_rows([None], 4)  # a device constant
    mask = source.for_rows([None, np.zeros(4, np.int32)], 4)
    assert np.asarray(mask.on).tolist() == [False, True, False, False]


# ---- 100% valid outputs -----------------------------------------------------------------

def _check_all_valid(llm: LLM, temperature: float) -> None:
    specs = cases()
    prompts, params, checks = [], [], []
    for spec, check in specs:
        for prompt in PROMPTS:
            prompts.append(prompt)
            params.append(_params(spec, temperature))
            checks.append((spec, check))
    outs = llm.generate(prompts, params)
    bad = [(spec, o.outputs[0].text, o.outputs[0].finish_reason)
           for o, (spec, check) in zip(outs, checks)
           if o.outputs[0].finish_reason != "stop" or not check(o.outputs[0].text)]
    assert not bad, bad
    assert len(outs) >= 60


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_builtin_model_outputs_are_all_valid(builtin, temperature):
    _check_all_valid(builtin, temperature)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_random_llama_outputs_are_all_valid(llama, temperature):
    _check_all_valid(llama, temperature)


def test_json_object_logprobs_and_length(builtin):
    out = builtin.generate(PROMPTS[0], SamplingParams(
        temperature=0.0, max_tokens=6, logprobs=3,
        structured_outputs=StructuredOutputsParams(json_object=True)))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6  # partial output
    assert out.text.startswith("{")
    first = out.logprobs[0]
    # As vLLM: logprobs are those of the masked distribution; "{" is the only token allowed.
    assert first[out.token_ids[0]].logprob == 0.0
    assert all(e.logprob == -np.inf for t, e in first.items() if t != out.token_ids[0])


def test_each_of_n_completions_has_its_own_matcher(builtin):
    out = builtin.generate(PROMPTS[1], _params({"choice": ["alpha", "beta", "gamma delta"]},
                                               temperature=1.0, n=4))[0]
    assert all(c.text in ("alpha", "beta", "gamma delta") and c.finish_reason == "stop"
               for c in out.outputs)


# ---- exactness ---------------------------------------------------------------------------

EXACT = [({"json": c}, None) for c in (
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "n": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["name", "n"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["x", "yy"]}, "maxItems": 4})] + [
    ({"regex": r"[a-z ]{3,12}\."}, None), ({"choice": ["alpha", "beta", "gamma"]}, None),
    ({"grammar": LARK}, None)]
LONG = ("A long prompt that needs more than one chunk of the token budget to be prefilled "
        "completely before the first token comes out of the model")


def _greedy(llm: LLM, prompts, specs) -> list[list[int]]:
    params = [_params(s) for s in specs]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_greedy_constrained_outputs_do_not_depend_on_scheduling(builtin):
    specs = [s for s, _ in EXACT]
    prompts = [PROMPTS[i % 2] if i % 3 else LONG for i in range(len(specs))]
    levers = builtin.engine.levers
    before = levers.get()
    try:
        levers.set(pipeline_enabled=False, prefix_cache_enabled=False)
        alone = [_greedy(builtin, [p], [s])[0] for p, s in zip(prompts, specs)]
        levers.set(pipeline_enabled=True, prefix_cache_enabled=True)
        assert _greedy(builtin, prompts, specs) == alone                 # batched, pipelined
        assert _greedy(builtin, prompts[::-1], specs[::-1]) == alone[::-1]  # other rows
        levers.set(prefill_chunk_size=8)                                 # chunked prefill
        mixed = _greedy(builtin, prompts + ["x"], specs + [specs[0]])
        assert mixed[:-1] == alone
    finally:
        levers.set(**{k: getattr(before, k) for k in
                      ("pipeline_enabled", "prefix_cache_enabled", "prefill_chunk_size")})
    # Unconstrained rows beside constrained ones: the unconstrained keep their own tokens.
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    solo = builtin.generate(PROMPTS[0], plain)[0].outputs[0].token_ids
    together = builtin.generate([PROMPTS[0], PROMPTS[1]], [plain, _params(specs[0])])
    assert together[0].outputs[0].token_ids == solo


def test_greedy_constrained_outputs_survive_preemption():
    # 16 usable blocks of 8 tokens cannot hold 4 sequences of ~50 tokens: decodes preempt.
    small = LLM(**{**ENGINE, "num_kv_blocks": 17}, warmup=False)
    spec = {"regex": r"[a-z ,]{100,140}\."}
    prompts = [LONG[:30 + 5 * i] for i in range(4)]
    crowded = _greedy(small, prompts, [spec] * 4)
    counters = small.engine.core.tel.counters()
    assert counters.get("preemptions", 0) + counters.get("spills", 0) > 0
    assert counters.get("spills", 0) == 0  # constrained sequences are never spilled
    assert crowded == [_greedy(small, [p], [spec])[0] for p in prompts]
    small.engine.close()
