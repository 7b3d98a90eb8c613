"""Structured outputs: constrained decoding on llguidance or xgrammar (host only, no jax).

1. A request names its constraint with `StructuredOutputsParams` (params.py).
2. `GrammarCompiler` (compiler.py) compiles it on the engine's backend (backend.py:
   llguidance by default, xgrammar with `structured_outputs_backend="xgrammar"`), once per
   (kind, text) on the caller's thread, and gives each sequence its own matcher, a
   `GrammarState` (matcher.py), kept in `Sequence.grammar_state`.
3. When the scheduler packs a row that samples, the state's packed int32 token masks ride in
   the row (`ScheduledRow.token_mask`, one per position the row samples: a row verifying
   MTP drafts gets the mask after each draft, checked by `GrammarState.check_drafts`); the
   runner sends the batch's masks to the device, where disallowed logits become -inf before
   sampling and draft acceptance (runner/token_mask.py).
4. Each committed token advances the matcher (`Sequence.append`): a grammar that is complete
   stops the sequence ("stop"); a rejected token fails the request with a clear error.
5. While a grammar-constrained sequence decodes, the pipelined loop settles before each
   dispatch (scheduler/settle.py): the next mask needs the token just sampled.
6. Grammar-constrained sequences are never swap-out victims (scheduler/phases.py, core).
"""

from metrale_jax.grammar.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
