"""The xgrammar backend (optional: extra `grammar-xgrammar`; xgrammar imports torch).

Same kinds and the same output as llguidance: JSON without whitespace between tokens
(separators "," and ":"), regexes, choices (an EBNF alternation of string literals), and
grammars in Lark (xgrammar's converter) or in EBNF/GBNF (`root ::= ...`, xgrammar's own
syntax). xgrammar fills the same packed int32 bitmask, one word per 32 token ids.

Where llguidance stops a matcher once the grammar allows only EOS, an xgrammar matcher
waits for the stop token; `XgrammarMatcher.stopped` reads that state from the mask, so
both backends end a sequence at the same token.
"""

from __future__ import annotations

import json
import re

import numpy as np

from metrale_jax.grammar.matcher import mask_width
from metrale_jax.request import RequestError
from metrale_jax.tokenizer import Tokenizer

# xgrammar's errors start with a timestamp and a C++ source location: not the user's business.
_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


class XgrammarMatcher:
    def __init__(self, matcher, full_width: int, stop_bits: np.ndarray):
        self._m = matcher                     # xgrammar.GrammarMatcher
        self._stop_bits = stop_bits           # [full width] the stop tokens' bits
        self._mask = np.zeros((1, full_width), np.int32)
        self._fresh = False                   # `_mask` is the current state's

    def _fill(self) -> np.ndarray:
        if not self._fresh:
            if self._m.is_terminated():
                self._mask[:] = 0
            else:
                self._m.fill_next_token_bitmask(self._mask)
            self._fresh = True
        return self._mask[0]

    def fill_mask(self, out: np.ndarray) -> None:
        out[:] = self._fill()

    def accept(self, token: int) -> bool:
        ok = self._m.accept_token(token)
        self._fresh = self._fresh and not ok
        return ok

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)
            self._fresh = False

    def reset(self) -> None:
        self._m.reset()
        self._fresh = False

    @property
    def stopped(self) -> bool:
        """Terminated, or nothing but a stop token allowed next (llguidance's stop)."""
        return self._m.is_terminated() or not np.any(self._fill() & ~self._stop_bits)

    def error(self) -> str | None:
        return None  # xgrammar logs why; the caller's message names the token


class XgrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer: Tokenizer, n_vocab: int):
        import xgrammar
        from transformers import PreTrainedTokenizerFast  # xgrammar depends on transformers

        self._xgr = xgrammar
        stop = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        # xgrammar reads the vocabulary type (byte-level, byte-fallback, raw) from a HF
        # tokenizer: wrap ours, the same `tokenizer.json`, without loading anything.
        info = xgrammar.TokenizerInfo.from_huggingface(
            PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend), vocab_size=n_vocab,
            stop_token_ids=stop or None)
        self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)  # ours caches
        self.full_width = mask_width(n_vocab)
        bits = np.zeros(self.full_width * 32, np.uint8)
        bits[list(info.stop_token_ids)] = 1
        self._stop_bits = np.packbits(bits, bitorder="little").view(np.int32)

    def compile(self, kind: str, text: str, where: str):
        c = self._compiler
        try:
            if kind == "json":
                return c.compile_json_schema(text, any_whitespace=False, separators=(",", ":"))
            if kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                             separators=(",", ":"))
            if kind == "regex":
                return c.compile_regex(text)
            if kind == "choice":
                return c.compile_grammar("root ::= " + " | ".join(
                    json.dumps(choice) for choice in json.loads(text)))
            if "::=" in text:  # EBNF / GBNF rules; Lark writes "rule: ..."
                return c.compile_grammar(text)
            return c.compile_lark(text)
        except Exception as err:  # noqa: BLE001 - xgrammar raises RuntimeError and others
            raise RequestError(f"{where}: {_message(err)}") from None

    def matcher(self, compiled) -> XgrammarMatcher:
        return XgrammarMatcher(self._xgr.GrammarMatcher(compiled), self.full_width,
                               self._stop_bits)


def _message(err: Exception) -> str:
    lines = [_LOCATION.sub("", line) for line in str(err).strip().splitlines() if line.strip()]
    return "\n".join(lines[:6]) or type(err).__name__
