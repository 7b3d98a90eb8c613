"""Shape checks shared by the SSD kernels and their references, so they cannot drift."""

from __future__ import annotations

import dataclasses

import jax

from pallas_kernels._pallas import require


@dataclasses.dataclass(frozen=True)
class SSDDims:
    seqs: int       # S
    length: int     # Q positions per sequence (1 for the decode step)
    heads: int      # H
    head_dim: int   # P
    groups: int     # G: B and C are shared by H // G heads
    state: int      # N: d_state

    @property
    def heads_per_group(self) -> int:
        return self.heads // self.groups


def ssd_dims(x: jax.Array, dt: jax.Array, a: jax.Array, b: jax.Array, c: jax.Array,
             state: jax.Array) -> SSDDims:
    """Checks the chunked-scan layout (x [S, Q, H, P]) and, when x is [S, H, P], the decode
    step's; the state is [S, H, P, N] either way."""
    decode = x.ndim == 3
    require(x.ndim in (3, 4), f"x: expected [S, Q, H, P] or [S, H, P], got shape {x.shape}")
    s, h, p = (x.shape[0], x.shape[-2], x.shape[-1])
    q = 1 if decode else x.shape[1]
    lead = (s,) if decode else (s, q)
    require(dt.shape == lead + (h,), f"dt: expected {lead + (h,)}, got shape {dt.shape}")
    require(a.shape == (h,), f"a: expected [{h}], got shape {a.shape}")
    require(b.ndim == len(lead) + 2 and b.shape[:len(lead)] == lead,
            f"b: expected {lead} + [groups, d_state], got shape {b.shape}")
    require(c.shape == b.shape, f"c: shape {c.shape} differs from b's {b.shape}")
    g, n = b.shape[-2:]
    require(h % g == 0, f"b: {g} groups do not divide the {h} heads")
    require(state.shape == (s, h, p, n),
            f"state: expected [{s}, {h}, {p}, {n}], got shape {state.shape}")
    return SSDDims(s, q, h, p, g, n)
