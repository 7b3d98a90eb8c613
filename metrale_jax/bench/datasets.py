"""Benchmark workloads: lists of requests given as token ids, so every engine (ours and the
peers) is fed exactly the same prompts whatever its tokenizer would have made of a text."""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: tuple[int, ...]
    output_len: int            # tokens generated, end-of-sequence ignored

    @property
    def input_len(self) -> int:
        return len(self.prompt_token_ids)


def _lengths(rng: np.random.Generator, n: int, mean: int, range_ratio: float) -> np.ndarray:
    """`n` lengths drawn uniformly from mean * [1 - range_ratio, 1 + range_ratio]."""
    if mean < 1:
        raise ValueError(f"length must be at least 1, got {mean}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    low = max(1, int(mean * (1 - range_ratio)))
    high = max(low, int(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=n)


def _token_range(vocab_size: int, first_id: int) -> tuple[int, int]:
    # The low ids are special tokens (pad/bos/eos/unk) in every tokenizer we load.
    if vocab_size <= first_id + 1:
        raise ValueError(f"vocab_size {vocab_size} leaves no ordinary tokens above {first_id}")
    return first_id, vocab_size


def random_requests(n: int, input_len: int, output_len: int, vocab_size: int, *,
                    range_ratio: float = 0.0, seed: int = 0,
                    first_id: int = 3) -> list[BenchRequest]:
    """`n` prompts of uniformly random ordinary tokens (no two alike, so no prefix hits)."""
    rng = np.random.default_rng(seed)
    low, high = _token_range(vocab_size, first_id)
    ins = _lengths(rng, n, input_len, range_ratio)
    outs = _lengths(rng, n, output_len, range_ratio)
    return [BenchRequest(tuple(int(t) for t in rng.integers(low, high, size=int(i))), int(o))
            for i, o in zip(ins, outs)]


def shared_prefix_requests(n: int, num_prefixes: int, prefix_len: int, suffix_len: int,
                           output_len: int, vocab_size: int, *, seed: int = 0,
                           first_id: int = 3) -> list[BenchRequest]:
    """`n` prompts in `num_prefixes` groups: each group shares a `prefix_len`-token prefix (a
    system prompt, a few-shot header) and adds its own `suffix_len` tokens."""
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes must be at least 1, got {num_prefixes}")
    rng = np.random.default_rng(seed)
    low, high = _token_range(vocab_size, first_id)
    prefixes = [rng.integers(low, high, size=prefix_len) for _ in range(num_prefixes)]
    out = []
    for i in range(n):
        suffix = rng.integers(low, high, size=suffix_len)
        ids = np.concatenate([prefixes[i % num_prefixes], suffix])
        out.append(BenchRequest(tuple(int(t) for t in ids), output_len))
    return out


def file_requests(path: str | pathlib.Path, tokenizer, output_len: int, *,
                  n: int | None = None) -> list[BenchRequest]:
    """One prompt per non-empty line of a text file, tokenized with the model's tokenizer;
    `n` cycles through the lines (or stops early) to make exactly `n` requests."""
    lines = [line for line in pathlib.Path(path).read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path}: no prompts (one per non-empty line expected)")
    n = len(lines) if n is None else n
    encoded = [tuple(tokenizer.encode(line)) for line in lines]
    return [BenchRequest(encoded[i % len(encoded)], output_len) for i in range(n)]


def describe(requests: list[BenchRequest]) -> dict:
    ins = [r.input_len for r in requests]
    outs = [r.output_len for r in requests]
    return {"requests": len(requests), "input_tokens": int(sum(ins)),
            "output_tokens": int(sum(outs)), "mean_input_len": float(np.mean(ins)),
            "mean_output_len": float(np.mean(outs))}


def remapped(requests: list[BenchRequest], vocab_size: int, *, seed: int = 1,
             first_id: int = 3) -> list[BenchRequest]:
    """The same workload spelled with other tokens: every ordinary token id goes through one
    random permutation. Lengths, order and which prompts share which prefixes are kept, so a
    warm-up on the result takes the engine through the same step shapes as the workload
    itself, while no prefix of it is left in the cache."""
    low, high = _token_range(vocab_size, first_id)
    perm = np.arange(high)
    perm[low:] = low + np.random.default_rng(seed).permutation(high - low)
    return [BenchRequest(tuple(int(perm[t]) if low <= t < high else t
                               for t in r.prompt_token_ids), r.output_len) for r in requests]
