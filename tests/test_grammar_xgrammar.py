"""The xgrammar backend (`structured_outputs_backend="xgrammar"`): the same checks as
llguidance's on a subset of the cases, the same packed mask layout, greedy outputs equal to
llguidance's where a constraint has one canonical form, and a clear startup error naming the
extra when xgrammar is not installed."""

from __future__ import annotations

import re

import numpy as np
import pytest

from metrale_jax import LLM, RequestError, StructuredOutputsParams
from metrale_jax.config import ConfigError, EngineConfig
from metrale_jax.grammar import backend as grammar_backend
from metrale_jax.grammar.compiler import GrammarCompiler
from tests.grammar_cases import CHOICES, LARK, LARK_RE, REGEXES, SCHEMAS, cases
from tests.scheduler_harness import TOKENIZER
from tests.test_grammar import ENGINE, PROMPTS, _params, builtin  # noqa: F401 - a fixture


@pytest.fixture(scope="session")
def xcompiler() -> GrammarCompiler:
    return GrammarCompiler(TOKENIZER, vocab_size=4096, backend="xgrammar")


@pytest.fixture(scope="session")
def xbuiltin() -> LLM:
    return LLM(**ENGINE, structured_outputs_backend="xgrammar", warmup=False)


def _allowed(mask: np.ndarray) -> np.ndarray:
    return np.unpackbits(mask.view(np.uint8), bitorder="little").astype(bool)


# ---- compile, masks, matcher ---------------------------------------------------------------

@pytest.mark.parametrize("spec, field", [
    ({"regex": "(abc"}, "structured_outputs.regex"),
    ({"regex": "[a-"}, "structured_outputs.regex"),
    ({"json": {"type": "foo"}}, "structured_outputs.json"),
    ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar"),
    ({"grammar": "root ::= undefined"}, "structured_outputs.grammar"),
])
def test_invalid_constraints_name_the_field(xcompiler, spec, field):
    with pytest.raises(RequestError, match=field.replace(".", r"\.")) as err:
        xcompiler.compile(StructuredOutputsParams(**spec))
    assert ".cc:" not in str(err.value)  # no C++ source locations in a user's error


def test_masks_have_llguidance_layout_and_states_roll_back(xcompiler):
    lcompiler = GrammarCompiler(TOKENIZER, vocab_size=4096)
    spec = StructuredOutputsParams(regex=r"(cat|dog)s?")
    x, ll = xcompiler.new_state(spec), lcompiler.new_state(spec)
    for token in TOKENIZER.encode("cat"):
        mx, ml = x.next_mask(), ll.next_mask()
        assert mx.shape == ml.shape == (128,) and mx.dtype == np.int32
        np.testing.assert_array_equal(_allowed(mx), _allowed(ml))
        assert x.advance(token) is None and ll.advance(token) is None
    np.testing.assert_array_equal(_allowed(x.next_mask()), _allowed(ll.next_mask()))
    assert not x.done and not ll.done             # "s" may follow
    s = next(int(t) for t in np.flatnonzero(_allowed(x.next_mask()))
             if t != TOKENIZER.eos_token_id)  # "s"
    kept, masks = x.check_drafts([s, 7])
    assert kept == [s] and masks.shape == (2, 128)  # complete after "s": cut there
    assert x.consumed == 2 and not x.done           # rolled back
    assert x.advance(s) is None and x.done          # only EOS left: stopped, as llguidance


def test_choices_json_and_lark_accept_their_canonical_text(xcompiler):
    for spec, text in [({"choice": ["négatif", 'a"b']}, "négatif"),
                       ({"choice": ["négatif", 'a"b']}, 'a"b'),
                       ({"json": {"type": "object", "properties": {"a": {"type": "integer"}},
                                  "required": ["a"]}}, '{"a":1}'),
                       ({"json_object": True}, '{"k":[1,2]}'),
                       ({"grammar": LARK}, "(1+22*3)"),
                       ({"grammar": 'root ::= "x" [0-9]'}, "x7")]:
        state = xcompiler.new_state(StructuredOutputsParams(**spec))
        assert all(state.advance(t) is None for t in TOKENIZER.encode(text)), (spec, text)
        assert state.done, (spec, text)


# ---- engine outputs ------------------------------------------------------------------------

def _subset() -> list[tuple[dict, object]]:
    every = cases()
    n = len(SCHEMAS)
    return every[0:n:3] + every[n:]  # a third of the schemas, every regex, choice, grammar


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_xgrammar_outputs_are_all_valid(xbuiltin, temperature):
    specs = _subset()
    prompts = [PROMPTS[i % 2] for i in range(len(specs))]
    outs = xbuiltin.generate(prompts, [_params(s, temperature) for s, _ in specs])
    bad = [(s, o.outputs[0].text, o.outputs[0].finish_reason)
           for o, (s, check) in zip(outs, specs)
           if o.outputs[0].finish_reason != "stop" or not check(o.outputs[0].text)]
    assert not bad, bad


CANONICAL = ([{"choice": c} for c in CHOICES] + [{"regex": r} for r in REGEXES[:4]]
             + [{"json": {"enum": ["red", "green", "blue"]}}, {"json": {"type": "boolean"}},
                {"json": SCHEMAS[12]}, {"grammar": LARK}])


def test_greedy_outputs_equal_llguidance_where_canonical(builtin, xbuiltin):  # noqa: F811
    prompts = [PROMPTS[i % 2] for i in range(len(CANONICAL))]
    params = [_params(s) for s in CANONICAL]
    ll = [o.outputs[0] for o in builtin.generate(prompts, params)]
    xg = [o.outputs[0] for o in xbuiltin.generate(prompts, params)]
    # The texts, not the token ids: where the grammar forces a string, llguidance allows
    # only its canonical tokenization ("y" then "es"), xgrammar any ("y" "e" "s" too).
    assert [(o.text, o.finish_reason) for o in xg] == [(o.text, o.finish_reason) for o in ll]
    assert all(o.finish_reason == "stop" for o in xg)
    assert re.fullmatch(LARK_RE, xg[-1].text)


# ---- choosing the backend ------------------------------------------------------------------

def test_the_backend_is_an_engine_setting_and_a_serve_flag():
    with pytest.raises(ConfigError, match="structured_outputs_backend"):
        EngineConfig(structured_outputs_backend="outlines")
    from metrale_jax.cli import build_parser
    from server.serve import engine_kwargs

    args = build_parser().parse_args(["serve", "--structured-outputs-backend", "xgrammar"])
    assert engine_kwargs(args)["structured_outputs_backend"] == "xgrammar"
    args = build_parser().parse_args(["serve"])
    assert engine_kwargs(args)["structured_outputs_backend"] == "llguidance"


def test_a_missing_xgrammar_fails_at_startup_naming_the_extra(monkeypatch):
    real = grammar_backend.importlib.util.find_spec
    monkeypatch.setattr(grammar_backend.importlib.util, "find_spec",
                        lambda name, *a: None if name == "xgrammar" else real(name, *a))
    with pytest.raises(ImportError, match=r"metrale-jax\[grammar-xgrammar\]"):
        LLM(structured_outputs_backend="xgrammar", warmup=False)
