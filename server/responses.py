"""Response bodies in OpenAI's shapes (vLLM's extras included): choices, logprobs, usage.

A `Choice` accumulates one completion's deltas; the same object renders a streaming chunk or
the final non-streaming choice, so streamed and non-streamed text cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import time
import uuid

from collections.abc import Callable

from metrale_jax.outputs import PositionLogprobs

# One token's text as logprobs show it (`AsyncLLM.token_text`).
TokenText = Callable[[int], str]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# JSON has no -Infinity: a token a grammar rules out (logprob -inf) is reported as vLLM's
# server reports it.
MIN_LOGPROB = -9999.0


def _lp(value: float) -> float:
    return max(value, MIN_LOGPROB)


def _token_text(entries: PositionLogprobs, token: int, token_text: TokenText) -> str:
    entry = entries.get(token)
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return token_text(token)


@dataclasses.dataclass
class CompletionLogprobs:
    """The legacy completions logprobs object: parallel lists, one entry per token."""
    tokens: list = dataclasses.field(default_factory=list)
    token_logprobs: list = dataclasses.field(default_factory=list)
    top_logprobs: list = dataclasses.field(default_factory=list)
    text_offset: list = dataclasses.field(default_factory=list)
    offset: int = 0

    def add(self, token: int, entries: PositionLogprobs | None, token_text: TokenText) -> None:
        text = _token_text(entries or {}, token, token_text)
        self.tokens.append(text)
        chosen = (entries or {}).get(token)
        self.token_logprobs.append(_lp(chosen.logprob) if chosen else None)
        self.top_logprobs.append(
            {_token_text(entries, t, token_text): _lp(e.logprob)
             for t, e in sorted(entries.items(), key=lambda kv: kv[1].rank)}
            if entries else None)
        self.text_offset.append(self.offset)
        self.offset += len(text)

    def as_dict(self, start: int = 0) -> dict:
        return {"tokens": self.tokens[start:], "token_logprobs": self.token_logprobs[start:],
                "top_logprobs": self.top_logprobs[start:], "text_offset": self.text_offset[start:]}


def chat_logprob_entries(tokens: list[int], logprobs: list[PositionLogprobs], top: int,
                         token_text: TokenText) -> list[dict]:
    out = []
    for token, entries in zip(tokens, logprobs):
        text = _token_text(entries, token, token_text)
        chosen = entries.get(token)
        ranked = sorted(entries.items(), key=lambda kv: kv[1].rank)[:top]
        out.append({
            "token": text, "logprob": _lp(chosen.logprob) if chosen else None,
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [{"token": _token_text(entries, t, token_text),
                              "logprob": _lp(e.logprob),
                              "bytes": list(_token_text(entries, t, token_text).encode("utf-8"))}
                             for t, e in ranked]})
    return out


def prompt_logprobs_json(prompt_logprobs: list | None) -> list | None:
    """vLLM's `prompt_logprobs`: None for the first token, then {id: {logprob, rank, ...}}."""
    if prompt_logprobs is None:
        return None
    return [None if pos is None else
            {str(t): {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.decoded_token}
             for t, e in pos.items()}
            for pos in prompt_logprobs]


@dataclasses.dataclass
class Choice:
    """One completion (a prompt's i-th sample) as its deltas arrive."""
    index: int
    text: str = ""
    token_ids: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list | None = None
    prompt_logprobs: list | None = None
    error: str | None = None
    started: bool = False   # a chunk was sent (chat: the role chunk)
    sent_tokens: int = 0    # tokens already reported in streamed logprobs
    sent_text: int = 0      # characters already streamed


def finish_fields(choice: Choice, end_of_turn_ids: tuple[int, ...]) -> tuple[str | None, object]:
    """The finish reason and vLLM's stop_reason (None for EOS or an end-of-turn token)."""
    stop_reason = choice.stop_reason
    if isinstance(stop_reason, int) and stop_reason in end_of_turn_ids:
        stop_reason = None
    return choice.finish_reason, stop_reason
