"""Shape buckets: the one owner of padded step shapes and of the compiled-variant count.

A step is compiled once per `StepShape`: no sampling feature is a shape or a static switch
(filters, penalties, logit bias and prompt scoring are traced conds). Ladders the config
leaves empty are a few sizes up to the engine's limits, or powers of two
(`EngineConfig.ladders`); the block-table width is one
bucket (`max_blocks_per_seq`) unless named, since attention stops at the longest context.
Warm-up compiles the shapes in `warmup_shapes()` and the runner's other programs (slot-table
writes, snapshot copy, swap buckets); `CompileCounter` counts every compiled variant of
every program so tests and telemetry can see a compilation in the middle of serving.
"""

from __future__ import annotations

import dataclasses
import threading

from metrale_jax.config import EngineConfig


@dataclasses.dataclass(frozen=True, order=True)
class StepShape:
    tokens: int      # T: flat token slots
    rows: int        # S: sequence rows
    query_len: int   # Q: widest chunk of any row (1 for a pure decode step)
    max_blocks: int  # MB: block-table width

    def covers(self, other: "StepShape") -> bool:
        """Whether a batch laid out for `other` also fits this shape: every dimension at
        least as large (a decode batch fits a prefill shape too: its rows are chunks of one
        token). Padding changes no row's result, only the step's cost."""
        return (self.tokens >= other.tokens and self.rows >= other.rows
                and self.query_len >= other.query_len and self.max_blocks >= other.max_blocks)


def serve_first(shapes: list[StepShape]) -> list[StepShape]:
    """The shapes to compile before serving when the others compile beside it: every
    decode shape, and the largest shapes with prefill chunks, which cover every other
    (`covers`), so any batch can run. Decode ticks are nearly every tick under load, and
    a decode step padded to more rows costs every token it makes (a 16-row batch in the
    64-row shape ran at a quarter of its speed, while a serving engine left the compiling
    thread a fraction of the cores); a prefill tick padded to a larger chunk costs one
    tick, once per prompt."""
    prefill = [s for s in shapes if s.query_len > 1]
    largest = {s for s in prefill if not any(o != s and o.covers(s) for o in prefill)}
    return [s for s in shapes if s.query_len == 1 or s in largest]


def _powers_of_two(limit: int, start: int = 1) -> tuple[int, ...]:
    ladder, b = [], start
    while b < limit:
        ladder.append(b)
        b *= 2
    ladder.append(limit)
    return tuple(sorted(set(ladder)))


def _sizes(*sizes: int, limit: int) -> tuple[int, ...]:
    """`sizes` capped at `limit`, and `limit` itself (the ladder must reach it)."""
    return tuple(sorted({min(s, limit) for s in sizes} | {limit}))


def _fit(ladder: tuple[int, ...], n: int, what: str) -> int:
    for b in ladder:
        if b >= n:
            return b
    raise ValueError(f"{what}: {n} exceeds the largest bucket {ladder[-1]}")


@dataclasses.dataclass(frozen=True)
class BucketLadders:
    tokens: tuple[int, ...]
    rows: tuple[int, ...]          # rows of a pure decode step
    query: tuple[int, ...]
    blocks: tuple[int, ...]
    prefill_rows: tuple[int, ...] = ()  # rows of a step with prefill chunks (empty: rows)
    # k+1 with speculative decoding on (0: off): a speculative step whose rows are all
    # decodes with their drafts is laid out exactly, rows x (k+1) tokens, like a decode step.
    spec_query: int = 0

    def __post_init__(self):
        if not self.prefill_rows:
            object.__setattr__(self, "prefill_rows", self.rows)

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> "BucketLadders":
        """The config's ladders; an empty one gets the `cfg.ladders` default: "sparse" (a
        few sizes, so warm-up compiles ~20 shapes at the server's limits) or "pow2"."""
        budget = cfg.max_tokens_per_tick
        rows = cfg.seq_buckets or _powers_of_two(cfg.max_batch_size)
        widest = min(budget, cfg.max_seq_len)
        if cfg.ladders == "sparse":
            # Decode rows stay powers of two (padding a decode step's rows costs every
            # token; its shapes compile fast); prefill steps share a few sizes.
            tokens = _sizes(64, 128, 256, limit=budget)
            prefill_rows = _sizes(8, limit=cfg.max_batch_size)
            query = tuple(sorted({1, *_sizes(32, 128, limit=widest)}))
        else:
            tokens = _powers_of_two(budget, start=8 if budget >= 8 else 1)
            prefill_rows = rows
            query = _powers_of_two(widest, start=1)
        spec = cfg.speculative
        return cls(
            spec_query=spec.num_speculative_tokens + 1 if spec is not None else 0,
            tokens=cfg.token_buckets or tokens, rows=rows,
            prefill_rows=cfg.prefill_seq_buckets or prefill_rows,
            query=cfg.query_buckets or query,
            # One width by default: attention's cost follows the real context, not the width.
            blocks=cfg.block_buckets or (cfg.max_blocks_per_seq,),
        )

    def shape_for(self, num_tokens: int, num_rows: int, widest_chunk: int, most_blocks: int,
                  speculative: bool = False) -> StepShape:
        if speculative and widest_chunk <= self.spec_query and \
                num_tokens <= num_rows * self.spec_query:
            rows = _fit(self.rows, num_rows, "rows")
            return StepShape(rows * self.spec_query, rows, self.spec_query,
                             _fit(self.blocks, max(most_blocks, 1), "blocks"))
        q = _fit(self.query, widest_chunk, "query length")
        rows = _fit(self.rows if q == 1 else self.prefill_rows, num_rows, "rows")
        # A pure decode step has one token per row; otherwise pad the flat tokens separately.
        # Flat tokens never fewer than the query bucket or the rows, so warm-up can enumerate
        # exactly the shapes that occur.
        tokens = rows if q == 1 else _fit(self.tokens, max(num_tokens, q, rows), "tokens")
        return StepShape(tokens=tokens, rows=rows, query_len=q,
                         max_blocks=_fit(self.blocks, max(most_blocks, 1), "blocks"))

    def decode_shapes(self) -> list[StepShape]:
        return [StepShape(r, r, 1, b) for r in self.rows for b in self.blocks]

    def spec_decode_shapes(self) -> list[StepShape]:
        """Speculative steps of decodes with drafts only (none with speculation off)."""
        q = self.spec_query
        return [StepShape(r * q, r, q, b) for r in self.rows for b in self.blocks] if q else []


class CompileCounter:
    """Counts compiled variants by key (("step", shape, options), ("swap", bucket, with_state),
    ...); thread-safe because the server reads it."""

    def __init__(self) -> None:
        self._seen: set = set()
        self._lock = threading.Lock()

    def record(self, key) -> bool:
        """Note `key`; True when it is new (a compilation is about to happen)."""
        with self._lock:
            if key in self._seen:
                return False
            self._seen.add(key)
            return True

    @property
    def count(self) -> int:
        with self._lock:
            return len(self._seen)
