"""What every kernel wrapper shares: Triton compiler parameters and small shape helpers.

`pl.pallas_call` lowers to Mosaic GPU by default on CUDA; our kernels are written for Triton
(pointer loads, `jnp.dot` on 2-D tiles), so every call passes Triton `CompilerParams`
explicitly, as the library's own Triton ops do. Interpret mode ignores them.
"""

from __future__ import annotations

from jax.experimental.pallas import triton as pltriton


def triton_params(num_warps: int, num_stages: int) -> pltriton.CompilerParams:
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def require(ok: bool, what: str) -> None:
    """Raise the wrapper's ValueError: every shape or tiling problem names its argument."""
    if not ok:
        raise ValueError(what)


def check_triton_tile(interpret: bool, name: str, size: int) -> None:
    # Triton tiles must be powers of two, and tl.dot wants every side >= 16; interpret mode
    # runs any size, which is what lets the CPU tests use tiny shapes.
    if not interpret:
        require(size >= 16 and size & (size - 1) == 0,
                f"{name}={size}: a compiled (Triton) tile must be a power of two >= 16")
