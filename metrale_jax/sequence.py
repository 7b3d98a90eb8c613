"""One sequence being generated (host only: no jax).

A request with `n` completions becomes `n` sequences sharing a prompt. Each sequence knows
its tokens, how many of them are in the device caches (`num_computed`), its blocks and SSM
slot, and applies the stop rules to what it samples.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from typing import Any

from metrale_jax.outputs import CompletionOutput, Logprob, PositionLogprobs
from metrale_jax.request import SamplingParams
from metrale_jax.types import RowSampling
from metrale_jax.tokenizer import IncrementalDetokenizer, Tokenizer

# Large enough to rule a token out under any temperature, small enough to stay finite.
_BANNED = -1e9
# Sequence identities: never reused in a process, unlike id(), which a new object may
# inherit from a finished one (the runner keys per-slot device state on it).
_uids = itertools.count(1)


class Status(enum.Enum):
    WAITING = "waiting"        # accepted, in pending
    PREFILLING = "prefilling"  # prompt (or a recompute) partly in the caches
    RUNNING = "running"        # decoding
    SWAPPED = "swapped"        # KV and SSM state on disk
    PREEMPTED = "preempted"    # blocks freed; recomputes from scratch on resume
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    request_id: str
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    detok: IncrementalDetokenizer
    eos_token_id: int | None
    max_len: int  # the model's max sequence length: generation stops there
    want_prompt_logprobs: bool = False
    output_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    streamed_chars: int = 0
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    block_table: list[int] = dataclasses.field(default_factory=list)
    slot: int = 0
    num_computed: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Scheduling state (the tick loop's; the fields later issues fill are here already).
    status: Status = Status.WAITING
    priority: int = 0
    arrival: float = 0.0
    order: int = 0                      # admission tie-breaker: submission order
    # LoRA: the adapter the request named (None: the base model), checked where it enters;
    # admission binds it to the adapter's version (`adapter_id`, the prefix-cache key) and
    # device slot, which stay the sequence's for its life (parked and resumed included).
    lora_name: str | None = None
    adapter_id: int = 0                 # LoRA adapter version (0: the base model)
    adapter_slot: int = 0
    grammar_state: Any = None           # a grammar-constrained sequence is never spilled
    session_id: str | None = None
    inflight: int = 0                   # sampled on the device, not yet read back
    epoch: int = 0                      # bumped on preemption: stale results are dropped
    spill: Any = None                   # the SpillHandle while swapped
    spilled_blocks: int = 0
    block_hashes: list = dataclasses.field(default_factory=list)  # committed prefix chain
    # The block hash of this sequence's latest decode-time SSM snapshot: the next one it
    # keeps replaces it, so decoding keeps at most one per sequence (`Memory._kept`).
    decode_snapshot: bytes | None = None
    # Where this prompt's cached KV ends with no SSM snapshot there (it leaves a shared
    # prefix): its prefill stops on that block boundary once, so the state is snapshotted
    # and later prompts sharing the prefix reuse all of it (0: none).
    snapshot_cut: int = 0
    error: str | None = None
    uid: int = dataclasses.field(default_factory=lambda: next(_uids))
    # MTP drafts for the tokens after `output_ids[:drafts_at]` (speculative steps make
    # them); proposals only, used while the outputs still end where they were made.
    drafts: list[int] = dataclasses.field(default_factory=list)
    drafts_at: int = -1
    # Positions past `virtual_len` a row packed ahead may write (its drafts, `can_run_ahead`):
    # its blocks stay while a row is in flight (`Memory.trim`).
    ahead_reach: int = 0

    def __post_init__(self) -> None:
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.want_prompt_logprobs:
            self.prompt_logprobs = [None]

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.prompt_ids)

    @property
    def virtual_len(self) -> int:
        """Tokens of the sequence including those sampled but not yet read back."""
        return len(self.prompt_ids) + len(self.output_ids) + self.inflight

    @property
    def num_sampled(self) -> int:
        return len(self.output_ids) + self.inflight

    def next_chunk(self, budget: int) -> list[int]:
        """The tokens not yet in the caches, at most `budget` of them; a token still on the
        device is the placeholder `-slot` (the step reads it from its future cell)."""
        n_prompt, start = len(self.prompt_ids), self.num_computed
        end = min(n_prompt + len(self.output_ids), start + budget)
        if start >= n_prompt:  # decode: slice the outputs, no copy of the whole sequence
            chunk = self.output_ids[start - n_prompt:end - n_prompt]
        else:
            chunk = self.prompt_ids[start:end] + self.output_ids[:max(0, end - n_prompt)]
        if self.inflight and len(chunk) < budget:
            chunk = chunk + [-self.slot]
        return chunk

    @property
    def seeded_sampling(self) -> bool:
        """Sampled (temperature > 0) from the request's own seed: its text is to be the
        same on every run."""
        return self.params.seed is not None and self.params.temperature > 0

    def may_sample_more(self) -> bool:
        """Count-based limits, known without reading back in-flight tokens."""
        p = self.params
        if p.max_tokens is not None and self.num_sampled >= p.max_tokens:
            return False
        return self.virtual_len < self.max_len

    def can_run_ahead(self, depth: int) -> bool:
        """Whether this sequence's next speculative row may be packed before its row in the
        speculative step ahead is read back (`ScheduledRow.ahead`). That step may emit up
        to depth+1 tokens, which the host does not know yet, so the row must fit every
        outcome: the limits are checked for the most it could emit (a row that emits past
        max_tokens or a stop is cut when read back, as any run). Rows that decode one
        token at a time (penalties, a pending min_tokens) or under a grammar (its masks
        need the tokens first) never run ahead."""
        p = self.params
        if (self.inflight != 1 or p.uses_penalties or self.grammar_state is not None
                or self.num_sampled < p.min_tokens):
            return False
        most = self.virtual_len + depth          # tokens once the step ahead is read back
        if most + depth + 1 > self.max_len:      # this row's last draft, then one more
            return False
        return p.max_tokens is None or self.num_sampled + depth + depth + 1 <= p.max_tokens

    def drafts_to_verify(self, depth: int, budget: int) -> list[int]:
        """The drafts this sequence's next decode row carries (a speculative tick): none
        where speculation could change what it samples or overshoot a limit. Penalties and
        a pending min_tokens change the distribution token by token, so those rows decode
        one token at a time; drafts never run past max_tokens or max_len. A grammar-
        constrained sequence's drafts are then checked against its grammar as the row is
        packed (`grammar.masks.grammar_masks`), which gives a mask for each position."""
        p = self.params
        if (self.drafts_at != len(self.output_ids) or self.inflight
                or self.num_computed != self.virtual_len - 1
                or p.uses_penalties or self.num_sampled < p.min_tokens):
            return []
        room = min(depth, len(self.drafts), budget - 1, self.max_len - self.virtual_len - 1)
        if p.max_tokens is not None:
            room = min(room, p.max_tokens - self.num_sampled - 1)
        return self.drafts[:max(room, 0)]

    def prompt_targets(self, start: int, length: int) -> list[int]:
        """For prompt logprobs: the token after each position, -1 past the prompt."""
        n = len(self.prompt_ids)
        return [self.prompt_ids[p + 1] if p + 1 < n else -1 for p in range(start, start + length)]

    def row_sampling(self) -> RowSampling:
        p = self.params
        bias = dict(p.logit_bias or {})
        if self.num_sampled < p.min_tokens:  # EOS and stop tokens wait for min_tokens
            for t in p.stop_token_ids + ([] if self.eos_token_id is None or p.ignore_eos
                                         else [self.eos_token_id]):
                bias[t] = _BANNED
        return RowSampling(
            temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
            seed=self.seed, counter=self.num_sampled,
            repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty, prompt_ids=self.prompt_ids,
            output_ids=self.output_ids, logit_bias=bias, logprobs=self.logprobs is not None)

    def append(self, token: int, logprob: float, top: PositionLogprobs | None) -> None:
        """Commit one sampled token and apply the stop rules."""
        p = self.params
        self.output_ids.append(token)
        self.cumulative_logprob += logprob
        if self.logprobs is not None:
            self.logprobs.append(top or {})
        if token == self.eos_token_id and not p.ignore_eos:
            self._finish("stop", None)
            self.text += self.detok.flush()
            return
        if token in p.stop_token_ids:
            self._finish("stop", token)
            self.text += self.detok.flush()
            return
        before = len(self.text)
        self.text += self.detok.push(token)
        if p.stop and self._cut_at_stop_string(before):
            return
        if self.grammar_state is not None and self._advance_grammar(token):
            self.text += self.detok.flush()
            return
        if p.max_tokens is not None and len(self.output_ids) >= p.max_tokens:
            self._finish("length", None)
        elif len(self.prompt_ids) + len(self.output_ids) >= self.max_len:
            self._finish("length", None)
        if self.finished:
            self.text += self.detok.flush()
            if p.stop:
                self._cut_at_stop_string(before)

    def _advance_grammar(self, token: int) -> bool:
        """The matcher takes the token; True when that ends the sequence: the grammar is
        complete ("stop"), or it rejected the token (the mask should make that impossible:
        the request fails with the reason rather than return text that breaks it)."""
        error = self.grammar_state.advance(token)
        if error is not None:
            self.error = error
            self._finish("error", None)
        elif self.grammar_state.done:
            self._finish("stop", None)
        return self.finished

    def _cut_at_stop_string(self, before: int) -> bool:
        # A stop string may straddle earlier text: search from where it could begin.
        longest = max(len(s) for s in self.params.stop)
        start = max(0, before - longest + 1)
        hits = [(self.text.find(s, start), s) for s in self.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        self.text = self.text[:index]
        self._finish("stop", stop)
        return True

    def _finish(self, reason: str, stop_reason: int | str | None) -> None:
        if self.finish_reason is None:
            self.finish_reason, self.stop_reason = reason, stop_reason

    def stream_delta(self) -> str:
        """New text safe to show: a tail that may still become a stop string is held back."""
        hold = 0 if self.finished or not self.params.stop else \
            max(len(s) for s in self.params.stop) - 1
        end = max(self.streamed_chars, len(self.text) - hold)
        delta = self.text[self.streamed_chars:end]
        self.streamed_chars = end
        return delta

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index, text=self.text, token_ids=list(self.output_ids),
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=self.logprobs, finish_reason=self.finish_reason,
            stop_reason=self.stop_reason)


def position_logprobs(top_ids, top_logprobs, n: int, chosen: int, chosen_logprob: float,
                      chosen_rank: int) -> PositionLogprobs:
    """The top-n entries plus the chosen token, as vLLM reports them. The text of each
    token is left to the front (`decode_logprobs`), off the engine thread."""
    entries: PositionLogprobs = {}
    for rank, (tid, lp) in enumerate(zip(top_ids[:n], top_logprobs[:n]), start=1):
        entries[int(tid)] = Logprob(float(lp), rank)
    if chosen not in entries:
        entries[chosen] = Logprob(chosen_logprob, chosen_rank)
    return entries


def decode_logprobs(positions, tokenizer: Tokenizer) -> None:
    """Fill in `decoded_token` of every entry still without one (in place)."""
    for entries in positions or ():
        for tid, entry in (entries or {}).items():
            if entry.decoded_token is None:
                entry.decoded_token = tokenizer.decode([tid], skip_special_tokens=False)
