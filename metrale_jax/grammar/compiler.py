"""Compiling a request's constraint into llguidance matchers, once per (kind, text).

The llguidance tokenizer is built once from our tokenizer's `tokenizer.json` (the Rust
`tokenizers` serialization, so byte-level BPE and HF tokenizers both load). A compiled
grammar is kept as a prototype matcher in its initial state; each sequence gets a deep copy
(cheap) and advances it alone. Compiling runs on the caller's thread (`LLMEngine.
make_request`, or a worker thread the server hands it to), never on the engine thread: the
request waits for its grammar, the tick does not.

An invalid schema, regex or grammar raises `RequestError` naming the field.
"""

from __future__ import annotations

import collections
import json
import threading

from metrale_jax.grammar.matcher import GrammarState, mask_width
from metrale_jax.grammar.params import FIELD, StructuredOutputsParams
from metrale_jax.request import RequestError
from metrale_jax.tokenizer import Tokenizer

# JSON with no whitespace between tokens: the output is exactly the constrained string, and
# a model cannot spend its max_tokens on blanks (llguidance's default allows any whitespace).
JSON_OPTIONS = {"whitespace_flexible": False}
CACHE_SIZE = 256


class GrammarCompiler:
    """Compiled grammars for one tokenizer and one model vocabulary (thread-safe)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        import llguidance  # here, not at import time: unconstrained serving never loads it

        self._llg = llguidance
        self.vocab_size = vocab_size          # the model's logits width that the masks cover
        # Ids up to the larger of the two: ids past the tokenizer's are never allowed.
        n_vocab = max(vocab_size, tokenizer.vocab_size)
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=n_vocab, eos_token=tokenizer.eos_token_id)
        self.width = mask_width(vocab_size)
        self._full_width = mask_width(n_vocab)
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def new_state(self, spec: StructuredOutputsParams) -> GrammarState:
        """A fresh matcher for one sequence (compiling the grammar if not cached)."""
        proto = self.compile(spec)
        with self._lock:  # the prototype is shared: copy it under the lock
            return GrammarState(proto.deep_copy(), self.width, self._full_width)

    def compile(self, spec: StructuredOutputsParams):
        """The prototype matcher for `spec`; raises RequestError when it does not compile."""
        key = spec.key()
        with self._lock:
            proto = self._cache.get(key)
            if proto is not None:
                self._cache.move_to_end(key)
                return proto
        proto = self._build(*key)  # outside the lock: llguidance drops the GIL here
        with self._lock:
            self._cache[key] = proto
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return proto

    def _build(self, kind: str, text: str):
        where = f"{FIELD}.{kind}"
        grammar = self._grammar_text(kind, text, where)
        matcher = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(f"{where}: {_first_lines(matcher.get_error())}")
        return matcher

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
            raise RequestError(f"{where}: {_first_lines(str(err))}") from None


def _first_lines(message: str, limit: int = 6) -> str:
    """llguidance's errors can end in a dump of its state: keep what names the problem."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    cut = next((i for i, line in enumerate(lines) if line.startswith("<state>")), len(lines))
    return "\n".join(lines[:min(cut, limit)]) or "does not compile"
