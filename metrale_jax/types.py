"""The contract between the scheduler (host) and the runner (device): host only, no jax.

Going down, one `ScheduledRow` per sequence in the step (DESIGN's `SchedulerOutput`, one row
of it); coming back, one `RowResult` per row; in between, the opaque `StepHandle` of a step
dispatched and not yet read back. `Runner` is everything the scheduler asks of a runner: the
real `ModelRunner` and the tests' `FakeRunner` both satisfy it. The scheduler imports this
module, never the runner's implementation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from metrale_jax.lora.weights import LoraWeights


@dataclasses.dataclass(frozen=True)
class RowSampling:
    """Host-side sampling settings of one row (plain Python values; the runner packs them
    into per-row device arrays, so changing one never recompiles)."""

    temperature: float = 0.0          # 0.0: greedy
    top_k: int = 0                    # 0: off
    top_p: float = 1.0                # 1.0: off
    min_p: float = 0.0                # 0.0: off
    seed: int = 0                     # the sequence's seed; with `counter`, its random stream
    counter: int = 0                  # tokens sampled so far: a fresh draw per position
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    prompt_ids: Sequence[int] = ()    # history for the penalties (only read when one is on)
    output_ids: Sequence[int] = ()
    logit_bias: Mapping[int, float] = dataclasses.field(default_factory=dict)
    # Reports logprobs (its token's, its rank, the top ones): a batch where no row does skips
    # them (passes over the vocabulary and a top-k). A sequence that asked for none: False.
    logprobs: bool = True

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def uses_filters(self) -> bool:
        return self.temperature > 0.0 and (self.top_k > 0 or self.top_p < 1.0
                                           or self.min_p > 0.0)


@dataclasses.dataclass(frozen=True)
class ScheduledRow:
    """One sequence's share of a step (scheduler -> runner).

    The first four fields are what the runner's batch builder reads (the same as its bare
    `RowChunk`); the rest say what to sample and score. Features that add to a row (MTP
    drafts, grammar masks, LoRA adapters) add a field here.
    """

    tokens: Sequence[int]             # token ids to run; -slot: the token still on the device
                                      # in that slot's future cell (pipelined decode)
    start: int                        # tokens of this sequence already in the caches
    block_table: Sequence[int]        # physical KV blocks covering at least start+len(tokens)
    ssm_slot: int = 0                 # SSM state slot (and future-token cell); 0: null slot
    sampling: RowSampling = RowSampling()
    # Prompt-logprob targets for this chunk's positions: the token that follows each one
    # (-1 where there is none or it is not wanted). Empty when not asked for.
    targets: Sequence[int] = ()
    seq_id: int = 0                   # the sequence's identity, unique for the engine's life:
                                      # the runner trusts what earlier steps left in a slot's
                                      # device tables only for the same sequence (0: never)
    # Speculative steps only. The last `num_drafts` tokens are MTP drafts to verify (the
    # token before them is the sequence's last one); `follow` holds the known tokens right
    # after a chunk that does not reach the sequence's end (the MTP modules read them).
    num_drafts: int = 0
    follow: Sequence[int] = ()
    # Grammar (structured outputs): [1 + num_drafts, ceil(V/32)] packed int32 bits of the
    # tokens allowed at each position the row samples (its last token's, then each draft's;
    # bit i of word i // 32 set: token i allowed); None: unconstrained.
    token_mask: np.ndarray | None = None
    # LoRA: the device slot of the row's adapter (0: the base model, no adapter work).
    adapter_slot: int = 0
    # Speculative steps only: the row was packed before the speculative step ahead of it was
    # read back. Its tokens are placeholders: the device starts it from that step's newest
    # token and drafts, `advance` (the drafts that step accepted) positions further on
    # (`spec_step.place_ahead_rows`). `block_table` covers that far (`reach`).
    ahead: bool = False

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def reach(self) -> int:
        """The positions the row may write: past `end` by its drafts when `ahead`."""
        return self.end + (self.num_drafts if self.ahead else 0)

    @property
    def verified_end(self) -> int:
        """Where the sequence's known tokens end in this row: drafts are not known yet."""
        return self.end - self.num_drafts


@dataclasses.dataclass
class RowResult:
    """What one row's step produced (runner -> scheduler), as numpy on the host."""

    token: int                        # the sampled token (meaningful when the row samples)
    logprob: float                    # its logprob
    rank: int                         # its rank in the distribution (1: most likely)
    top_ids: np.ndarray               # [num_top] top-n token ids
    top_logprobs: np.ndarray          # [num_top]
    prompt_logprobs: np.ndarray | None = None      # [chunk] logprob of each target
    prompt_ranks: np.ndarray | None = None         # [chunk]
    prompt_top_ids: np.ndarray | None = None       # [chunk, num_top]
    prompt_top_logprobs: np.ndarray | None = None  # [chunk, num_top]
    # Speculative steps: the tokens emitted after `token` in the same step (the accepted
    # drafts' run goes on), in order; so `len(following)` drafts were accepted.
    following: list["RowResult"] = dataclasses.field(default_factory=list)
    drafts: list[int] = dataclasses.field(default_factory=list)  # the next step's drafts


@dataclasses.dataclass
class StepHandle:
    """A dispatched step: its rows, and the runner's output not yet read back."""

    rows: list[ScheduledRow]
    out: Any                          # the runner's own (device) output; opaque here
    speculative: bool = False         # verified drafts and drafted (spec_step)
    dispatched_at: float = 0.0        # the scheduler's clock at dispatch
    decoding: int = 0                 # decoding sequences in its tick (the MTP gate's batch)


class Runner(Protocol):
    """What the scheduler needs of a runner."""

    num_blocks: int                   # KV blocks, the null block 0 included
    num_seq_slots: int                # SSM/future slots for sequences, the null slot included

    @property
    def has_ssm(self) -> bool: ...

    @property
    def spec_depth(self) -> int:
        """k: drafts per sequence a speculative step verifies and makes (0: cannot)."""

    @property
    def speculation_ready(self) -> bool:
        """Whether the speculative step runs without compiling (False while its variants
        compile beside serving)."""

    @property
    def compiling(self) -> int:
        """Step variants still compiling beside serving (0: all are ready)."""

    def dispatch(self, rows: Sequence[ScheduledRow], speculative: bool = False) -> StepHandle:
        """Start a step (the speculative one when asked); returns at once."""

    def collect(self, handle: StepHandle) -> list[RowResult]:
        """Wait for a dispatched step; one result per row."""

    def gather(self, blocks: Sequence[int], slot: int | None) -> dict[str, np.ndarray]:
        """A sequence's KV pages (and SSM slot) on the host, for a spill."""

    def scatter(self, arrays: dict[str, np.ndarray], blocks: Sequence[int],
                slot: int | None) -> None:
        """A spilled sequence's state back into new blocks and slot."""

    def copy_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy SSM state slots (snapshots), ordered after every step dispatched."""

    @property
    def max_loras(self) -> int:
        """Adapter slots besides slot 0 (0: LoRA off)."""

    def load_adapter(self, slot: int, weights: "LoraWeights") -> None:
        """Copy an adapter into device slot `slot` (1..max_loras), replacing what it held;
        ordered after every step dispatched before it."""

    def unload_adapter(self, slot: int) -> None:
        """Zero device slot `slot`: a row that names it would run the base model."""

    def close(self) -> None:
        """Stop what runs in the background (a compilation), when the engine closes."""

    def recover(self) -> bool:
        """After `dispatch` or `collect` raised: True when the device caches were lost
        (and re-allocated empty), False when they are intact."""
