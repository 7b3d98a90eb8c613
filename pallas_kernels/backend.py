"""Which implementation of each kernel the model runs: `EngineConfig.kernel_backend`.

* "xla": the jnp references (what XLA compiles on any platform).
* "pallas": the Pallas kernels; compiled (Triton) on a GPU, interpreted elsewhere, which is
  slow and only meant for tests.
* "auto": the Pallas kernels on a GPU; on the CPU, paged attention through the C++ custom
  call (`pallas_kernels/cpu`, compiled on first use; the reference if that fails) and the
  references for the rest; the references elsewhere.

`KernelOps` is a frozen, hashable value: the model keeps it as a static attribute, so the
choice is part of the compiled program and never a traced branch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels._pallas import next_pow2
from pallas_kernels.cpu import (amx_matmul as cpu_amx, build as cpu_build,
                                packed_matmul as cpu_packed, paged_attention as cpu_attention,
                                small_matmul as cpu_matmul)
from pallas_kernels.mtp import kernel as mtp_kernel, reference as mtp_reference
from pallas_kernels.paged_attention import kernel as attn_kernel, reference as attn_reference
from pallas_kernels.ssm_scan import kernel as ssd_kernel, reference as ssd_reference

BACKENDS = ("auto", "pallas", "xla")


def _finish(layer, y):
    """A custom call's f32 product `y` as `layer(x)` returns it: bias added, layer dtype."""
    if layer.bias is not None:
        y = y + layer.bias[...].astype(jnp.float32)
    return y.astype(layer.dtype)


@dataclasses.dataclass(frozen=True)
class KernelOps:
    use_pallas: bool = False
    interpret: bool = False  # only meaningful with use_pallas
    # The C++ custom calls on XLA:CPU (pallas_kernels/cpu): paged attention, small-batch
    # and AMX matmuls; everything else stays on the references.
    cpu_kernels: bool = False

    def _kernel_fits(self, *sizes: int) -> bool:
        # Compiled Triton tiles are powers of two >= 16; a model whose head sizes are not
        # runs that op on the reference rather than failing (interpret mode runs anything).
        return self.use_pallas and (self.interpret or all(
            n >= 16 and n & (n - 1) == 0 for n in sizes))

    @property
    def name(self) -> str:
        if not self.use_pallas:
            return "cpu" if self.cpu_kernels else "xla"
        return "pallas-interpret" if self.interpret else "pallas"

    def linear(self, layer, x):
        """`layer(x)` (an nnx.Linear, kernel [in, out]). With the CPU kernels, a layer
        applied to a few rows runs the small-matmul custom call where it streams the
        weights faster than XLA (`small_matmul.takes`: bf16 always, large f32 layers), and
        a bf16 layer applied to more rows runs on the AMX tiles where the processor has
        them (`amx_matmul.takes`). A layer with a packed copy of its kernel
        (model/packing.py) applied to a decode step's rows reads that instead, except where
        more than a few bf16 rows can go to AMX."""
        kernel = layer.kernel[...]
        packed = getattr(layer, "packed", None)
        if self.reads_packed(x, packed, kernel):
            y = cpu_packed.packed_matmul(x, packed[...], kernel.shape[1])
        elif self.cpu_kernels and cpu_matmul.takes(x.shape[0], kernel):
            y = cpu_matmul.small_matmul(x, kernel)
        elif self.cpu_kernels and cpu_amx.takes(x, kernel):
            if layer.bias is None and layer.dtype == jnp.bfloat16:  # rounded once, in the kernel
                return cpu_amx.amx_matmul(x, kernel, jnp.bfloat16)
            y = cpu_amx.amx_matmul(x, kernel)
        else:
            return layer(x)
        return _finish(layer, y)

    def linear_group(self, layers, x, packed, norm=None):
        """`layer(x)` for each of `layers` (nnx.Linear over the same input). `packed`: one
        packed copy of their kernels side by side (model/packing.py `PACK_GROUPS`), or
        None; where a decode step's rows would read packed copies, the group is one call
        that streams all of them (one hand-off to the kernel's threads, not one per
        layer), split by columns afterwards. `norm`: an RMSNorm (`scale`, `eps`) to apply
        to `x` first, the block's pre-norm; that call then does it too (a decode step's
        block runs a custom call where XLA ran four small fusions)."""
        kernel = layers[0].kernel[...]
        fold = (norm is not None and self.reads_packed(x, packed, kernel)
                and norm.scale[...].dtype == x.dtype)
        if norm is not None and not fold:
            x = norm(x)
        if not self.reads_packed(x, packed, kernel):
            return tuple(self.linear(layer, x) for layer in layers)
        widths = [layer.kernel.shape[1] for layer in layers]
        if fold:
            y = cpu_packed.packed_norm_matmul(x, norm.scale[...], norm.eps, packed[...],
                                              sum(widths))
        else:
            y = cpu_packed.packed_matmul(x, packed[...], sum(widths))
        starts = [sum(widths[:i]) for i in range(len(widths))]
        return tuple(_finish(layer, y[:, a:a + n])
                     for layer, a, n in zip(layers, starts, widths))

    def reads_packed(self, x, packed, kernel=None) -> bool:
        """Whether rows `x` read `packed` (a packed copy of `kernel` [in, out], or None)
        through the packed matmul: the decode steps' rows in the copy's dtype, except
        where more than a few bf16 rows can go to the AMX tiles (with a `kernel` to
        give them)."""
        return (self.cpu_kernels and packed is not None and cpu_packed.takes(x, packed[...])
                and (x.shape[0] <= cpu_matmul.MAX_ROWS or kernel is None
                     or not cpu_amx.takes(x, kernel)))

    @staticmethod
    def packed_product(x, packed, n: int):
        """`x @ w` in float32 from `packed`, the packed copy of `w` [in, n] (`reads_packed`)."""
        return cpu_packed.packed_matmul(x, packed[...], n)

    def write_kv_pages(self, k_pages, v_pages, k, v, slot_mapping):
        if self.cpu_kernels and k_pages.dtype == jnp.bfloat16:
            return cpu_attention.write_kv_pages(k_pages, v_pages, k, v, slot_mapping)
        if not self._kernel_fits(k_pages.shape[1] * k_pages.shape[3]):
            return attn_reference.write_kv_pages(k_pages, v_pages, k, v, slot_mapping)
        return attn_kernel.write_kv_pages(k_pages, v_pages, k, v, slot_mapping,
                                          interpret=self.interpret)

    def paged_attention(self, q, k_pages, v_pages, block_tables, context_lens, q_positions, *,
                        scale: float, soft_cap: float | None = None,
                        sliding_window: int | None = None):
        args = (q, k_pages, v_pages, block_tables, context_lens, q_positions)
        if self.cpu_kernels and cpu_attention.supports(k_pages):
            return cpu_attention.paged_attention(*args, scale=scale, soft_cap=soft_cap,
                                                 sliding_window=sliding_window)
        block_size = k_pages.shape[2]
        odd_pages = not self.interpret and block_size & (block_size - 1)
        if not self._kernel_fits(q.shape[-1]) or odd_pages:
            return attn_reference.paged_attention(*args, scale=scale, soft_cap=soft_cap,
                                                  sliding_window=sliding_window)
        # ~64 keys per inner step: a power of two, >= 16 for tl.dot, no wider than the table.
        pages = max(1, 16 // block_size, min(next_pow2(block_tables.shape[1]), 64 // block_size))
        return attn_kernel.paged_attention(*args, scale=scale, soft_cap=soft_cap,
                                           sliding_window=sliding_window, pages_per_step=pages,
                                           interpret=self.interpret)

    def ragged_paged_attention(self, q, k_pages, v_pages, layout, *, scale: float,
                               soft_cap: float | None = None,
                               sliding_window: int | None = None):
        """Attention for the step's flat queries `[T, H, D]`. `layout` is the step's ragged
        layout (`RaggedLayout`). The CPU kernel reads the flat tokens in place; every other
        backend pads them to `[S, Q]` with the layout's gather map, runs `paged_attention`
        and flattens the result."""
        kw = dict(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)
        if self.cpu_kernels and cpu_attention.supports(k_pages):
            return cpu_attention.ragged_paged_attention(
                q, k_pages, v_pages, layout.block_tables, layout.context_lens,
                layout.positions, layout.gather_index[:, 0], layout.gather_valid.sum(axis=1),
                **kw)
        out = self.paged_attention(layout.to_padded(q), k_pages, v_pages, layout.block_tables,
                                   layout.context_lens, layout.to_padded(layout.positions), **kw)
        return layout.to_flat(out)

    def ssd_chunk_scan(self, x, dt, a, b, c, init_state, *, chunk_size: int):
        if not self._kernel_fits(x.shape[-1], b.shape[-1], chunk_size):
            return ssd_reference.ssd_chunk_scan(x, dt, a, b, c, init_state, chunk_size=chunk_size)
        return ssd_kernel.ssd_chunk_scan(x, dt, a, b, c, init_state, chunk_size=chunk_size,
                                         interpret=self.interpret)

    def ssm_decode_step(self, x, dt, a, b, c, state):
        if not self._kernel_fits(x.shape[-1], b.shape[-1]):
            return ssd_reference.ssm_decode_step(x, dt, a, b, c, state)
        return ssd_kernel.ssm_decode_step(x, dt, a, b, c, state, interpret=self.interpret)

    def ssd_scan_states(self, x, dt, a, b, c, init_state):
        if not self._kernel_fits(x.shape[-1], b.shape[-1]):
            return ssd_reference.ssd_scan_states(x, dt, a, b, c, init_state)
        return ssd_kernel.ssd_scan_states(x, dt, a, b, c, init_state, interpret=self.interpret)

    def mtp_accept(self, target_logits, draft_tokens, draft_probs, keys, temperatures):
        args = (target_logits, draft_tokens, draft_probs, keys, temperatures)
        if not self.use_pallas:
            return mtp_reference.mtp_accept(*args)
        return mtp_kernel.mtp_accept(*args, interpret=self.interpret)


XLA = KernelOps()
CPU = KernelOps(cpu_kernels=True)


def resolve(kernel_backend: str, platform: str | None = None) -> KernelOps:
    """The op set for `kernel_backend` on `platform` (default: JAX's default backend)."""
    if kernel_backend not in BACKENDS:
        raise ValueError(f"kernel_backend: must be one of {BACKENDS}, got {kernel_backend!r}")
    platform = platform or jax.default_backend()
    on_gpu = platform == "gpu"
    if kernel_backend == "auto" and platform == "cpu":
        return CPU if cpu_build.load() is not None else XLA
    if kernel_backend == "xla" or (kernel_backend == "auto" and not on_gpu):
        return XLA
    return KernelOps(use_pallas=True, interpret=not on_gpu)
