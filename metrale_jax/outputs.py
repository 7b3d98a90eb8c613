"""What leaves the engine: results in the shape vLLM's offline API returns them, and the
`StreamDelta`s a stream yields (host only: no jax import)."""

from __future__ import annotations

import dataclasses

# Per position: token id -> its Logprob entry (the top-n plus the chosen token).
PositionLogprobs = dict[int, "Logprob"]


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop", "length" or None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool


@dataclasses.dataclass
class StreamDelta:
    """What one sequence produced since its previous delta (the streaming API's unit)."""

    request_id: str
    index: int
    text: str                        # new text since the previous delta
    token_ids: list[int]             # new tokens since the previous delta
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    prompt_token_ids: list[int] | None = None   # on the first delta of each sequence
    prompt_logprobs: list | None = None
