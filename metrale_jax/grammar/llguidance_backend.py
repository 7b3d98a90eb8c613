"""The llguidance backend: Lark grammars (GBNF converted), JSON schemas, regexes.

The llguidance tokenizer is built once from our tokenizer's `tokenizer.json` (the Rust
`tokenizers` serialization, so byte-level BPE and HF tokenizers both load). A compiled
grammar is kept as a prototype matcher in its initial state; each sequence gets a deep copy
(cheap). llguidance stops a matcher by itself once the grammar allows only EOS.
"""

from __future__ import annotations

import json
import threading

import numpy as np

from metrale_jax.grammar.matcher import mask_width
from metrale_jax.request import RequestError
from metrale_jax.tokenizer import Tokenizer

# JSON with no whitespace between tokens: the output is exactly the constrained string, and
# a model cannot spend its max_tokens on blanks (llguidance's default allows any whitespace).
JSON_OPTIONS = {"whitespace_flexible": False}


class LlguidanceMatcher:
    def __init__(self, matcher):
        self._m = matcher                     # llguidance.LLMatcher

    def fill_mask(self, out: np.ndarray) -> None:
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def accept(self, token: int) -> bool:
        return self._m.consume_token(token)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)

    def reset(self) -> None:
        self._m.reset()

    @property
    def stopped(self) -> bool:
        return self._m.is_stopped()

    def error(self) -> str | None:
        return self._m.get_error() or None


class LlguidanceBackend:
    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer, n_vocab: int):
        import llguidance  # here, not at import time: unconstrained serving never loads it

        self._llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=n_vocab, eos_token=tokenizer.eos_token_id)
        self.full_width = mask_width(n_vocab)
        self._lock = threading.Lock()         # prototypes are shared: copied under it

    def compile(self, kind: str, text: str, where: str):
        grammar = self._grammar_text(kind, text, where)
        matcher = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(f"{where}: {first_lines(matcher.get_error())}")
        return matcher

    def matcher(self, compiled) -> LlguidanceMatcher:
        with self._lock:
            return LlguidanceMatcher(compiled.deep_copy())

    def _grammar_text(self, kind: str, text: str, where: str) -> str:
        M = self._llg.LLMatcher
        try:
            if kind == "json":
                return M.grammar_from_json_schema(text, overrides=JSON_OPTIONS)
            if kind == "json_object":
                return M.grammar_from_json_schema('{"type": "object"}', overrides=JSON_OPTIONS)
            if kind == "regex":
                return M.grammar_from_regex(text)
            if kind == "choice":
                # Each choice a quoted Lark string literal (JSON escapes are Lark's too).
                return M.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(c) for c in json.loads(text)))
            return self._llg.grammar_from("grammar", text)  # Lark, or GBNF converted
        except (ValueError, TypeError, RuntimeError) as err:
            raise RequestError(f"{where}: {first_lines(str(err))}") from None


def first_lines(message: str, limit: int = 6) -> str:
    """Grammar engines' errors can end in a dump of their state: keep what names the
    problem."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    cut = next((i for i, line in enumerate(lines) if line.startswith("<state>")), len(lines))
    return "\n".join(lines[:min(cut, limit)]) or "does not compile"
