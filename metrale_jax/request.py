"""What enters the engine (host only: no jax import): `SamplingParams` as users give them,
and the accepted `Request` the scheduler holds.

The fields and defaults follow vLLM's `SamplingParams`, so code written for vLLM's offline
API reads the same here. Validation names the field that is wrong.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from metrale_jax.grammar.params import StructuredOutputsParams
    from metrale_jax.sequence import Sequence as Seq

# float32's smallest normal value: the device flushes anything smaller (but 0) to 0.
_F32_TINY = 1.1754943508222875e-38


class RequestError(ValueError):
    """A request is invalid; raised where it enters, naming the field."""


def check_context(prompt_len: int, max_tokens: int | None, max_seq_len: int, *,
                  max_tokens_must_fit: bool) -> None:
    """The one check of a prompt (and its max_tokens) against the context, made where a
    request enters (`LLMEngine.make_request`). The OpenAI server asks that max_tokens fit
    too (vLLM's rule: an error, never a silent cut); offline, generation stops at the context
    end with finish reason "length"."""
    if prompt_len == 0:
        raise RequestError("prompt: is empty")
    if prompt_len >= max_seq_len:
        raise RequestError(f"prompt: {prompt_len} tokens leave no room to generate within "
                           f"this model's maximum context length of {max_seq_len} tokens "
                           f"(max_seq_len)")
    if max_tokens_must_fit and max_tokens is not None and prompt_len + max_tokens > max_seq_len:
        raise RequestError(f"max_tokens: this model's maximum context length is {max_seq_len} "
                           f"tokens; you asked for {max_tokens} tokens after a prompt of "
                           f"{prompt_len}")


@dataclasses.dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    max_tokens: int | None = 16  # None: up to the model's max sequence length
    min_tokens: int = 0
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per output token (plus the sampled one)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Constrain the output to a JSON schema, regex, choice or grammar (metrale_jax.grammar).
    structured_outputs: "StructuredOutputsParams | None" = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(field: str, why: str) -> None:
            raise RequestError(f"{field}: {why}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"must be an integer >= 1, got {self.n!r}")
        if not 0.0 <= self.temperature <= 100.0:
            bad("temperature", f"must be in [0, 100], got {self.temperature}")
        # The device computes in float32, whose flush-to-zero makes a smaller nonzero value
        # 0: logits / 0 is NaN where a logit is 0 or masked, and a NaN wins the argmax.
        if 0.0 < self.temperature < _F32_TINY:
            bad("temperature", f"must be 0 (greedy) or at least {_F32_TINY:.3g} (float32's "
                               f"smallest normal), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", f"must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not _F32_TINY <= self.repetition_penalty <= 10.0:
            bad("repetition_penalty", f"must be in (0, 10] and a normal float32 (at least "
                                      f"{_F32_TINY:.3g}), got {self.repetition_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            bad("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if self.min_tokens < 0 or (self.max_tokens is not None
                                   and self.min_tokens > self.max_tokens):
            bad("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens}")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a non-empty string or a list of non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative token ids")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                bad(name, f"must be a non-negative integer, got {value!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", f"must be an integer, got {self.seed!r}")
        self._check_structured_outputs()

    def _check_structured_outputs(self) -> None:
        from metrale_jax.grammar.params import StructuredOutputsParams  # request <- grammar

        so = self.structured_outputs
        if isinstance(so, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**so)
            except TypeError as err:  # an unknown key
                raise RequestError(f"structured_outputs: {err}") from None
        elif so is not None and not isinstance(so, StructuredOutputsParams):
            raise RequestError(f"structured_outputs: expected StructuredOutputsParams, got "
                               f"{type(so).__name__}")

    def check_against(self, vocab_size: int, max_logprobs: int, max_logit_bias: int | None = None,
                      eos_token_id: int | None = None) -> None:
        """Checks that need the model and the engine: token ids in range, logprob counts and
        logit-bias entries within the engine's caps."""
        if self.top_k > vocab_size:  # the device holds it as int32: 2**31 failed the step
            raise RequestError(f"top_k: {self.top_k} exceeds the vocabulary (size "
                               f"{vocab_size}); 0 or -1 keep every token")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > max_logprobs:
                raise RequestError(f"{name}: {value} exceeds the engine's max_logprobs "
                                   f"({max_logprobs})")
        for token in list(self.logit_bias or {}) + list(self.stop_token_ids):
            if not 0 <= int(token) < vocab_size:
                raise RequestError(f"logit_bias/stop_token_ids: token id {token} is outside "
                                   f"the vocabulary (size {vocab_size})")
        entries = self.bias_entries(eos_token_id)
        if max_logit_bias is not None and entries > max_logit_bias:
            extra = (" (with min_tokens, the stop token ids and EOS count too)"
                     if entries > len(self.logit_bias or {}) else "")
            raise RequestError(f"logit_bias: {entries} entries{extra} exceed the engine's "
                               f"max_logit_bias ({max_logit_bias})")

    def bias_entries(self, eos_token_id: int | None) -> int:
        """The most logit-bias entries a sequence of this request carries at once: its own,
        plus the tokens banned until min_tokens (`Sequence.row_sampling`)."""
        tokens = {int(t) for t in self.logit_bias or {}}
        if self.min_tokens > 0:
            tokens.update(int(t) for t in self.stop_token_ids)
            if eos_token_id is not None and not self.ignore_eos:
                tokens.add(eos_token_id)
        return len(tokens)

    @property
    def uses_penalties(self) -> bool:
        """Repetition, presence or frequency penalty on (each output token then changes the
        next token's distribution)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclasses.dataclass(eq=False)
class Request:
    """An accepted request: its sequences (n completions sharing a prompt)."""

    request_id: str
    sequences: list["Seq"]
    prompt_text: str | None = None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)
