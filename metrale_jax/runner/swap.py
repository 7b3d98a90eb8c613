"""Swap: move one sequence's KV pages and SSM state between the device caches and the host.

Swap-out (`gather_sequence`) copies the rows a sequence owns (its KV blocks in every KV layer,
its conv and SSM slot in every Mamba2 layer) to host numpy arrays, which `cache/spill.py`
writes to disk. Swap-in (`scatter_sequence`) writes them back into whatever blocks and slot
the pools hand out then, with the caches donated so XLA updates them in place.

Both directions are one jitted call each. The block count is padded to a power of two so the
number of compiled variants stays bounded (a handful per cache layout, all of them compiled
at warm-up by `warm_buckets`): gather pads with the null block 0 and slices the padding off on
the host; scatter pads with an out-of-range block id and `mode="drop"`, so padding writes
nowhere, not even into the null block.
Under tensor parallelism (`placement`) the pools are sharded by head: `jax.device_get` of
the gathered (still sharded) rows assembles every device's heads on the host, and swap-in
puts each host array straight onto its pool's sharding (each device receives its own heads)
before the scatter, whose output keeps the pools' shardings. Across processes
(`placement.multi_process`) no process can read the others' heads: there the gather's
output is declared replicated (XLA all-gathers the rows), every process reads its local
copy and spills the whole sequence to its own spill directory, and swap-in puts those
identical host arrays onto the shardings as on one process.
Array names: `kv{i}_k`, `kv{i}_v` ([n_blocks, kv_heads, block_size, head_dim]) per KV layer,
`conv{i}` ([K-1, conv_dim]) and `ssm{i}` ([H, P, N] float32) per Mamba2 layer.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np
from jaxtyping import Array, Int, Shaped

from metrale_jax.model.caches import DeviceCaches

if TYPE_CHECKING:
    from metrale_jax.parallel.placement import TensorParallel

HostArray = Shaped[np.ndarray, "..."]


def gather_sequence(caches: DeviceCaches, blocks: Sequence[int], slot: int | None,
                    placement: "TensorParallel | None" = None) -> dict[str, HostArray]:
    """Copy a sequence's KV blocks (and, with a slot, its conv/SSM rows) to the host; the
    same host arrays whether or not the pools are sharded (a sharded array is read back
    whole)."""
    _check_blocks(caches, blocks)
    _check_slot(caches, slot)
    ids = np.zeros(block_bucket(len(blocks)), np.int32)  # pad with the null block: read, never kept
    ids[:len(blocks)] = blocks
    kv, conv, ssm = jax.device_get(_gather_program(placement)(
        caches, ids, np.int32(slot or 0), with_state=slot is not None))
    n = len(blocks)
    out: dict[str, np.ndarray] = {}
    for i, (k, v) in enumerate(kv):
        out[f"kv{i}_k"], out[f"kv{i}_v"] = _take_rows(k, n), _take_rows(v, n)
    for i, (c, s) in enumerate(zip(conv, ssm)):
        out[f"conv{i}"], out[f"ssm{i}"] = np.asarray(c), np.asarray(s)
    return out


def scatter_sequence(caches: DeviceCaches, arrays: Mapping[str, HostArray],
                     blocks: Sequence[int], slot: int | None,
                     placement: "TensorParallel | None" = None) -> DeviceCaches:
    """Write gathered state into `blocks` (and `slot`); `caches` is donated, use the result."""
    _check_blocks(caches, blocks, distinct=True)
    _check_slot(caches, slot)
    _check_arrays(caches, arrays, len(blocks), with_state=slot is not None)
    bucket = block_bucket(len(blocks))
    ids = np.full(bucket, caches.num_blocks, np.int32)  # out of range: dropped by the scatter
    ids[:len(blocks)] = blocks
    kv = tuple((_pad_rows(arrays[f"kv{i}_k"], bucket), _pad_rows(arrays[f"kv{i}_v"], bucket))
               for i in range(len(caches.kv)))
    with_state = slot is not None
    conv = tuple(arrays[f"conv{i}"] for i in range(len(caches.conv))) if with_state else ()
    ssm = tuple(arrays[f"ssm{i}"] for i in range(len(caches.ssm))) if with_state else ()
    return _run_scatter(caches, kv, conv, ssm, ids, np.int32(slot or 0), with_state,
                        placement)


def _run_scatter(caches, kv, conv, ssm, ids, slot, with_state: bool, placement,
                 ) -> DeviceCaches:
    if placement is None:
        return _scatter(caches, kv, conv, ssm, ids, slot, with_state=with_state)
    kv, conv, ssm = placement.place_swap_rows(kv, conv, ssm)
    program = _sharded_scatter(placement.cache_shardings(caches))
    return program(caches, kv, conv, ssm, ids, slot, with_state=with_state)


def expected_layout(caches: DeviceCaches, num_blocks: int, with_state: bool,
                    ) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Name -> (shape, dtype) of what `gather_sequence` returns for `num_blocks` blocks."""
    layout: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    for i, (k, v) in enumerate(caches.kv):
        layout[f"kv{i}_k"] = ((num_blocks, *k.shape[1:]), np.dtype(k.dtype))
        layout[f"kv{i}_v"] = ((num_blocks, *v.shape[1:]), np.dtype(v.dtype))
    if with_state:
        for i, (c, s) in enumerate(zip(caches.conv, caches.ssm)):
            layout[f"conv{i}"] = (tuple(c.shape[1:]), np.dtype(c.dtype))
            layout[f"ssm{i}"] = (tuple(s.shape[1:]), np.dtype(s.dtype))
    return layout


# -- the jitted halves -------------------------------------------------------------------

def _gather_rows(caches: DeviceCaches, block_ids: Int[Array, "B"], slot: Int[Array, ""],
                 with_state: bool) -> tuple[tuple, tuple, tuple]:
    kv = tuple((k[block_ids], v[block_ids]) for k, v in caches.kv)
    if not with_state:
        return kv, (), ()
    return kv, tuple(c[slot] for c in caches.conv), tuple(s[slot] for s in caches.ssm)


_gather = jax.jit(_gather_rows, static_argnames=("with_state",))


@functools.cache
def _replicated_gather(out_sharding):
    """The gather across processes: its rows replicated, so each process holds them all."""
    return jax.jit(_gather_rows, static_argnames=("with_state",), out_shardings=out_sharding)


def _gather_program(placement: "TensorParallel | None"):
    if placement is None or not placement.multi_process:
        return _gather
    return _replicated_gather(placement.replicated)


def _scatter_rows(caches: DeviceCaches, kv: tuple, conv: tuple, ssm: tuple,
             block_ids: Int[Array, "B"], slot: Int[Array, ""], with_state: bool,
             ) -> DeviceCaches:
    new_kv = tuple((k.at[block_ids].set(nk, mode="drop"), v.at[block_ids].set(nv, mode="drop"))
                   for (k, v), (nk, nv) in zip(caches.kv, kv))
    if not with_state:
        return dataclasses.replace(caches, kv=new_kv)
    return DeviceCaches(kv=new_kv,
                        conv=tuple(c.at[slot].set(x) for c, x in zip(caches.conv, conv)),
                        ssm=tuple(s.at[slot].set(x) for s, x in zip(caches.ssm, ssm)))


_scatter = jax.jit(_scatter_rows, static_argnames=("with_state",), donate_argnums=(0,))


@functools.cache
def _sharded_scatter(out_shardings: DeviceCaches):
    """The scatter for sharded pools, its output declared on the pools' shardings."""
    return jax.jit(_scatter_rows, static_argnames=("with_state",), donate_argnums=(0,),
                   out_shardings=out_shardings)


# -- host-side checks and padding ----------------------------------------------------------

def block_bucket(n: int) -> int:
    """Smallest power of two >= n (and >= 1): bounds the compiled variants per cache layout."""
    return 1 << max(n - 1, 0).bit_length()


def warm_buckets(caches: DeviceCaches, max_blocks: int, with_state: bool,
                 placement: "TensorParallel | None" = None,
                 ) -> tuple[DeviceCaches, list[int]]:
    """Compile gather and scatter for every bucket a sequence of up to `max_blocks` blocks
    can need, on padding only (reads of the null block, dropped writes, the null slot 0),
    with arguments of the kinds a real swap passes (host arrays in, as read from disk), so
    a real swap finds its program. `caches` is donated; returns them and the buckets."""
    buckets = [1]
    while buckets[-1] < max_blocks:
        buckets.append(2 * buckets[-1])
    for b in buckets:
        jax.block_until_ready(_gather_program(placement)(
            caches, np.zeros(b, np.int32), np.int32(0), with_state=with_state))
        host = {name: np.zeros(shape, dtype) for name, (shape, dtype)
                in expected_layout(caches, b, with_state).items()}
        kv = tuple((host[f"kv{i}_k"], host[f"kv{i}_v"]) for i in range(len(caches.kv)))
        conv = tuple(host[f"conv{i}"] for i in range(len(caches.conv))) if with_state else ()
        ssm = tuple(host[f"ssm{i}"] for i in range(len(caches.ssm))) if with_state else ()
        caches = _run_scatter(caches, kv, conv, ssm, np.full(b, caches.num_blocks, np.int32),
                              np.int32(0), with_state, placement)
    return caches, buckets


def _take_rows(a: np.ndarray, rows: int) -> np.ndarray:
    """Drop the padding rows; copy so the padded buffer is not kept alive by a view."""
    a = np.asarray(a)
    return a if a.shape[0] == rows else a[:rows].copy()


def _pad_rows(a: np.ndarray, rows: int) -> np.ndarray:
    if a.shape[0] == rows:
        return a
    out = np.zeros((rows, *a.shape[1:]), a.dtype)
    out[:a.shape[0]] = a
    return out


def _check_blocks(caches: DeviceCaches, blocks: Sequence[int], distinct: bool = False) -> None:
    """Out-of-range ids would be clamped silently by the device; the null block is never owned."""
    bad = [b for b in blocks if not 1 <= b < caches.num_blocks]
    if bad:
        raise ValueError(f"blocks: {bad} outside 1..{caches.num_blocks - 1} "
                         f"(block 0 is the null block)")
    if distinct and len(set(blocks)) != len(blocks):
        raise ValueError(f"blocks: {list(blocks)} repeats a block")


def _check_slot(caches: DeviceCaches, slot: int | None) -> None:
    if slot is not None and not 1 <= slot < caches.num_slots:
        raise ValueError(f"slot: {slot} outside 1..{caches.num_slots - 1} "
                         f"(slot 0 is the null slot)")


def _check_arrays(caches: DeviceCaches, arrays: Mapping[str, np.ndarray], num_blocks: int,
                  with_state: bool) -> None:
    layout = expected_layout(caches, num_blocks, with_state)
    missing, extra = sorted(layout.keys() - arrays.keys()), sorted(arrays.keys() - layout.keys())
    if missing or extra:
        raise ValueError(f"swap arrays: missing {missing}, unexpected {extra}")
    for name, (shape, dtype) in layout.items():
        a = arrays[name]
        if tuple(a.shape) != shape or np.dtype(a.dtype) != dtype:
            raise ValueError(f"swap array {name!r}: got {tuple(a.shape)} {np.dtype(a.dtype)}, "
                             f"caches need {shape} {dtype}")
