"""A runner with hand-computable outputs, so scheduler tests are exact and need no model.

It keeps a "KV pool" of the tokens written at each slot and one integer "SSM state" per
slot. A row's next token is a function of the tokens it can see through its block table
and of its SSM state, so a wrong block, a stale state or a missed swap-in changes the
output, exactly as it would on a real model. Run alone, a sequence's continuation is
`reference_continuation`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from metrale_jax.types import RowResult, StepHandle

VOCAB = 97


def next_token(tokens: list[int]) -> int:
    """What a sequence whose tokens are `tokens` produces next (the ground truth)."""
    state = 0
    for t in tokens:
        state = (state * 31 + t + 1) % 1_000_003
    visible = sum((i + 1) * t for i, t in enumerate(tokens))
    return (visible + state) % VOCAB


def reference_continuation(prompt: list[int], n: int, eos: int | None = None) -> list[int]:
    out = []
    for _ in range(n):
        t = next_token(prompt + out)
        out.append(t)
        if t == eos:
            break
    return out


@dataclasses.dataclass
class _Ladders:
    query: tuple[int, ...]


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int, max_batch: int, has_ssm: bool = True,
                 num_snapshot_slots: int = 4):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_seq_slots = max_batch + 1
        self.num_slots = self.num_seq_slots + (num_snapshot_slots if has_ssm else 0)
        self.has_ssm = has_ssm
        self.ladders = _Ladders(query=(1024,))
        self.kv = np.full((num_blocks, block_size), -1, np.int64)
        self.ssm = np.zeros(self.num_slots, np.int64)
        self.future = np.zeros(self.num_slots, np.int64)
        self.steps = 0
        self.gather_calls = 0

    def dispatch(self, rows) -> StepHandle:
        results = []
        for row in rows:
            chunk = row
            table = list(chunk.block_table)
            state = 0 if chunk.start == 0 else int(self.ssm[chunk.ssm_slot])
            for i, tok in enumerate(chunk.tokens):
                tok = int(self.future[-tok]) if tok < 0 else tok
                pos = chunk.start + i
                self.kv[table[pos // self.block_size], pos % self.block_size] = tok
                state = (state * 31 + tok + 1) % 1_000_003
            end = chunk.end
            seen = [int(self.kv[table[p // self.block_size], p % self.block_size])
                    for p in range(end)]
            visible = sum((i + 1) * t for i, t in enumerate(seen))
            token = (visible + (state if self.has_ssm else _state_of(seen))) % VOCAB
            token = _apply_bias(token, row.sampling)
            self.ssm[chunk.ssm_slot] = state
            self.future[chunk.ssm_slot] = token
            n = len(chunk.tokens)
            results.append(RowResult(
                token=token, logprob=-1.0, rank=1, top_ids=np.array([token]),
                top_logprobs=np.array([-1.0]),
                prompt_logprobs=np.full(n, -2.0) if len(row.targets) else None,
                prompt_ranks=np.ones(n, np.int64) if len(row.targets) else None,
                prompt_top_ids=np.zeros((n, 1), np.int64) if len(row.targets) else None,
                prompt_top_logprobs=np.full((n, 1), -2.0) if len(row.targets) else None))
        self.steps += 1
        return StepHandle(list(rows), results)

    def collect(self, handle: StepHandle) -> list[RowResult]:
        return handle.out

    def gather(self, blocks, slot):
        self.gather_calls += 1
        arrays = {"kv": self.kv[list(blocks)].copy()}
        if slot is not None:
            arrays["ssm"] = np.array([self.ssm[slot]])
        return arrays

    def scatter(self, arrays, blocks, slot) -> None:
        self.kv[list(blocks)] = arrays["kv"]
        if slot is not None:
            self.ssm[slot] = int(arrays["ssm"][0])

    def recover(self) -> bool:
        return False  # host arrays: a raising step leaves them as they were

    def copy_slots(self, src, dst) -> None:
        if self.has_ssm:
            self.ssm[list(dst)] = self.ssm[list(src)]
            self.future[list(dst)] = self.future[list(src)]


def _state_of(tokens: list[int]) -> int:
    state = 0
    for t in tokens:
        state = (state * 31 + t + 1) % 1_000_003
    return state


def _apply_bias(token: int, sampling) -> int:
    # min_tokens bans EOS through a large negative bias: honour it like a real sampler.
    if sampling.logit_bias.get(token, 0.0) < -1e6:
        return (token + 1) % VOCAB
    return token
