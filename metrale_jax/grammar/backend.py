"""The grammar engine behind structured outputs, as two small protocols.

A `GrammarBackend` compiles a request's constraint, named by (kind, text) as
`StructuredOutputsParams.key()` gives it, into a compiled grammar that many sequences
share, and makes a fresh `Matcher` from one. A `Matcher` is one sequence's grammar state:
it fills the packed token bitmask of the next token (bit i of word i // 32 set: token i
allowed, over the backend's whole vocabulary), takes tokens, rolls back, and says when it
accepts nothing more. `GrammarState` (matcher.py) is all the scheduler sees of it.

llguidance (llguidance_backend.py) is the default: no Python dependencies. xgrammar
(xgrammar_backend.py) is the option (extra `grammar-xgrammar`; it imports torch). Backends
are imported only when chosen, so serving without constraints loads neither.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Protocol

import numpy as np

from metrale_jax.config import GRAMMAR_BACKENDS as BACKENDS
from metrale_jax.tokenizer import Tokenizer

# The pip extra that installs each backend (llguidance is a dependency of the engine).
EXTRAS = {"llguidance": None, "xgrammar": "grammar-xgrammar"}


class Matcher(Protocol):
    def fill_mask(self, out: np.ndarray) -> None:
        """Write the next token's packed mask into `out` ([full width] int32)."""

    def accept(self, token: int) -> bool:
        """Take a token; False (state unchanged) when the grammar rejects it."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""

    def reset(self) -> None:
        """Back to the initial state (a replay of the committed tokens rebuilds it)."""

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows nothing more but EOS."""

    def error(self) -> str | None:
        """Why the last token was rejected, when the backend says."""


class GrammarBackend(Protocol):
    name: str
    full_width: int     # int32 words of the masks its matchers fill (its whole vocabulary)

    def compile(self, kind: str, text: str, where: str) -> Any:
        """The compiled grammar; raises RequestError naming `where` when it does not compile."""

    def matcher(self, compiled: Any) -> Matcher:
        """A fresh matcher in the grammar's initial state (thread-safe)."""


def check_installed(name: str) -> None:
    """At startup: a backend that cannot be imported is a clear error naming its extra."""
    if name not in BACKENDS:
        raise ValueError(f"structured_outputs_backend: must be one of {BACKENDS}, "
                         f"got {name!r}")
    if importlib.util.find_spec(name) is None:
        raise ImportError(f"structured_outputs_backend={name!r}: the {name} package is not "
                          f"installed; install it with pip install "
                          f"'metrale-jax[{EXTRAS[name] or name}]'")


def make_backend(name: str, tokenizer: Tokenizer, n_vocab: int) -> GrammarBackend:
    """The backend `name` for a tokenizer, its masks covering token ids below `n_vocab`."""
    check_installed(name)
    if name == "xgrammar":
        from metrale_jax.grammar.xgrammar_backend import XgrammarBackend

        return XgrammarBackend(tokenizer, n_vocab)
    from metrale_jax.grammar.llguidance_backend import LlguidanceBackend

    return LlguidanceBackend(tokenizer, n_vocab)
