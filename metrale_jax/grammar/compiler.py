"""Compiling a request's constraint once per (kind, text), on the chosen backend.

`GrammarCompiler` owns one grammar backend (grammar/backend.py: llguidance or xgrammar) for
one tokenizer and one model vocabulary, and an LRU cache of compiled grammars. Compiling
runs on the caller's thread (`LLMEngine.make_request`, or a worker thread the server hands
it to), never on the engine thread: the request waits for its grammar, the tick does not.
Each sequence gets its own matcher from the shared compiled grammar (`new_state`).

An invalid schema, regex or grammar raises `RequestError` naming the field.
"""

from __future__ import annotations

import collections
import threading

from metrale_jax.grammar.backend import make_backend
from metrale_jax.grammar.matcher import GrammarState, mask_width
from metrale_jax.grammar.params import FIELD, StructuredOutputsParams
from metrale_jax.tokenizer import Tokenizer

CACHE_SIZE = 256


class GrammarCompiler:
    """Compiled grammars for one tokenizer and one model vocabulary (thread-safe)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, backend: str = "llguidance"):
        self.vocab_size = vocab_size          # the model's logits width that the masks cover
        # Ids up to the larger of the two: ids past the tokenizer's are never allowed.
        self.backend = make_backend(backend, tokenizer, max(vocab_size, tokenizer.vocab_size))
        self.width = mask_width(vocab_size)
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def new_state(self, spec: StructuredOutputsParams) -> GrammarState:
        """A fresh matcher for one sequence (compiling the grammar if not cached)."""
        matcher = self.backend.matcher(self.compile(spec))
        return GrammarState(matcher, self.width, self.backend.full_width)

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar for `spec`; raises RequestError when it does not compile."""
        key = spec.key()
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        kind, text = key
        # Outside the lock: both backends compile without holding the GIL.
        compiled = self.backend.compile(kind, text, f"{FIELD}.{kind}")
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled
