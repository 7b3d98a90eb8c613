"""A runner with hand-computable outputs, so scheduler tests are exact and need no model.

It keeps a "KV pool" of the tokens written at each slot and one integer "SSM state" per
slot. A row's next token is a function of the tokens it can see through its block table
and of its SSM state, so a wrong block, a stale state or a missed swap-in changes the
output, exactly as it would on a real model. Run alone, a sequence's continuation is
`reference_continuation`.

LoRA: each adapter slot holds the `LoraWeights` loaded into it, and a row computes with the
code of the weights in its `adapter_slot` (`adapter_code`): it is mixed into every KV entry
and SSM state update as well as the token, so a row run on the wrong slot, with replaced
weights, or reusing another adapter's cached prefix or SSM snapshot, gives another token.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from metrale_jax.types import RowResult, StepHandle

VOCAB = 97
_KV_CODE = 1000  # a KV entry is token + code * _KV_CODE: the adapter shows in the cache


def adapter_code(weights) -> int:
    """The fake's stand-in for what an adapter changes: a small number from its weights
    object (name and scaling, so a replace with other weights changes it); 0: none."""
    if weights is None:
        return 0
    return 1 + (sum(map(ord, weights.name)) * 7 + int(weights.scaling * 1000)) % 89


def next_token(tokens: list[int], code: int = 0) -> int:
    """What a sequence whose tokens are `tokens` produces next (the ground truth), under the
    adapter whose `adapter_code` is `code`."""
    state = 0
    for t in tokens:
        state = (state * 31 + t + 1 + code) % 1_000_003
    visible = sum((i + 1) * (t + code * _KV_CODE) for i, t in enumerate(tokens))
    return (visible + state + code) % VOCAB


def reference_continuation(prompt: list[int], n: int, eos: int | None = None,
                           adapter=None) -> list[int]:
    """`adapter`: the LoraWeights the sequence runs under (None: the base model)."""
    code = adapter_code(adapter)
    out = []
    for _ in range(n):
        t = next_token(prompt + out, code)
        out.append(t)
        if t == eos:
            break
    return out


@dataclasses.dataclass
class _Ladders:
    query: tuple[int, ...]


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int, max_batch: int, has_ssm: bool = True,
                 num_snapshot_slots: int = 4, max_loras: int = 0):
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
        self.max_loras = max_loras
        self.adapters: list = [None] * (max_loras + 1)  # slot -> LoraWeights (0: none)
        self.adapter_calls: list[tuple] = []             # ("load", slot, name) / ("unload", slot)
        self.counter = _Counter()

    speculation_ready = True  # no speculative step to compile
    compiling = 0  # nothing compiles beside serving

    def close(self) -> None:
        pass  # nothing compiles in the background

    def load_adapter(self, slot: int, weights) -> None:
        assert 1 <= slot <= self.max_loras, slot
        self.adapters[slot] = weights
        self.adapter_calls.append(("load", slot, weights.name))

    def unload_adapter(self, slot: int) -> None:
        assert 1 <= slot <= self.max_loras, slot
        self.adapters[slot] = None
        self.adapter_calls.append(("unload", slot))

    def dispatch(self, rows) -> StepHandle:
        results = []
        for row in rows:
            chunk = row
            table = list(chunk.block_table)
            code = adapter_code(self.adapters[row.adapter_slot]) if row.adapter_slot else 0
            state = 0 if chunk.start == 0 else int(self.ssm[chunk.ssm_slot])
            for i, tok in enumerate(chunk.tokens):
                tok = int(self.future[-tok]) if tok < 0 else tok
                pos = chunk.start + i
                self.kv[table[pos // self.block_size], pos % self.block_size] = \
                    tok + code * _KV_CODE
                state = (state * 31 + tok + 1 + code) % 1_000_003
            end = chunk.end
            seen = [int(self.kv[table[p // self.block_size], p % self.block_size])
                    for p in range(end)]
            visible = sum((i + 1) * t for i, t in enumerate(seen))
            ssm = state if self.has_ssm else _state_of(seen)
            token = (visible + ssm + code) % VOCAB
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


def _state_of(kv: list[int]) -> int:
    """The SSM-less fake's state, from KV entries (token + code * _KV_CODE)."""
    state = 0
    for entry in kv:
        t, code = entry % _KV_CODE, entry // _KV_CODE
        state = (state * 31 + t + 1 + code) % 1_000_003
    return state


class _Counter:
    count = 0  # compiled variants: the fake compiles nothing


def _apply_bias(token: int, sampling) -> int:
    # min_tokens bans EOS through a large negative bias: honour it like a real sampler.
    if sampling.logit_bias.get(token, 0.0) < -1e6:
        return (token + 1) % VOCAB
    return token
