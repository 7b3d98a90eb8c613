"""Each Pallas kernel against its XLA reference, over a sweep of shapes and tilings.

For every case the script counts the bytes a kernel must move and the operations it must do,
and reports achieved GB/s and TFLOP/s beside the roofline time max(bytes / bandwidth,
flops / peak) from this machine's measured ceilings (a large streaming sum and a large matmul).

On a GPU the kernels run compiled (Triton). On a CPU they can only run interpreted, which is
orders of magnitude slower and says nothing about the kernel: there the XLA references are
timed at realistic sizes and the kernels, interpreted, only at tiny sizes (marked
"interpret" in the output). Run: `python -m benchmarks.kernels [--budget-s S] [--repeats N]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import write_result
from pallas_kernels.mtp import kernel as mtp_kernel, reference as mtp_reference
from pallas_kernels.paged_attention import kernel as attn_kernel, reference as attn_reference
from pallas_kernels.ssm_scan import kernel as ssd_kernel, reference as ssd_reference


@dataclasses.dataclass
class Case:
    kernel: str
    shape: str
    args: tuple
    reference: Callable      # args -> output
    run: Callable            # (args, interpret, **tiling) -> output
    tilings: list[dict]
    bytes: int               # the minimum a kernel must read and write
    flops: int


def _attention(rng, s, q, h, kvh, d, ctx, bs, dtype, tilings) -> Case:
    mb = -(-ctx // bs)
    nb = 1 + s * mb
    pages = lambda: jnp.asarray(rng.normal(size=(nb, kvh, bs, d)), dtype)
    tables = jnp.asarray(rng.permutation(np.arange(1, nb)).reshape(s, mb), jnp.int32)
    pos = jnp.asarray(np.broadcast_to(np.arange(ctx - q, ctx), (s, q)), jnp.int32)
    args = (jnp.asarray(rng.normal(size=(s, q, h, d)), dtype), pages(), pages(), tables,
            jnp.full((s,), ctx, jnp.int32), pos)
    item = jnp.dtype(dtype).itemsize
    visible = sum(ctx - q + i + 1 for i in range(q))  # keys each query sees, causal
    return Case(
        "paged_attention", f"S={s} Q={q} H={h}/{kvh} D={d} ctx={ctx} bs={bs}", args,
        lambda a: attn_reference.paged_attention(*a, scale=d ** -0.5),
        lambda a, interpret, **t: attn_kernel.paged_attention(*a, scale=d ** -0.5,
                                                              interpret=interpret, **t),
        tilings, bytes=item * s * (2 * q * h * d + 2 * ctx * kvh * d),
        flops=4 * s * h * d * visible)


def _write(rng, t, kvh, d, nb, bs, dtype) -> Case:
    pages = lambda: jnp.asarray(rng.normal(size=(nb, kvh, bs, d)), dtype)
    kv = lambda: jnp.asarray(rng.normal(size=(t, kvh, d)), dtype)
    slots = jnp.asarray(rng.permutation(np.arange(bs, nb * bs))[:t], jnp.int32)
    return Case("write_kv_pages", f"T={t} kvh={kvh} D={d}", (pages(), pages(), kv(), kv(), slots),
                lambda a: attn_reference.write_kv_pages(*a),
                lambda a, interpret, **t_: attn_kernel.write_kv_pages(*a, interpret=interpret),
                [{}], bytes=4 * t * kvh * d * jnp.dtype(dtype).itemsize, flops=0)


def _ssd(rng, s, q, h, p, g, n, tilings) -> Case:
    f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    dt = jnp.asarray(rng.uniform(0.01, 0.2, size=(s, q, h)), jnp.float32)
    args = (f(s, q, h, p), dt, -jnp.ones((h,)), f(s, q, g, n), f(s, q, g, n), f(s, h, p, n))
    chunk = tilings[0]["chunk_size"]
    # Per chunk of L: C B^T (2 L^2 N), scores @ x (2 L^2 P), C state and the state update
    # (2 L N P each).
    flops = 2 * s * h * q * (chunk * (n + p) + 2 * n * p)
    return Case("ssd_chunk_scan", f"S={s} Q={q} H={h} P={p} G={g} N={n}", args,
                lambda a: ssd_reference.ssd_chunk_scan(*a, chunk_size=chunk),
                lambda a, interpret, **t: ssd_kernel.ssd_chunk_scan(*a, interpret=interpret, **t),
                tilings, bytes=4 * (s * q * (2 * h * p + 2 * h + 2 * g * n) + 2 * s * h * p * n),
                flops=flops)


def _decode(rng, s, h, p, g, n, tilings) -> Case:
    f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    args = (f(s, h, p), jnp.full((s, h), 0.1), -jnp.ones((h,)), f(s, g, n), f(s, g, n),
            f(s, h, p, n))
    return Case("ssm_decode_step", f"S={s} H={h} P={p} N={n}", args,
                lambda a: ssd_reference.ssm_decode_step(*a),
                lambda a, interpret, **t: ssd_kernel.ssm_decode_step(*a, interpret=interpret,
                                                                     **t),
                tilings, bytes=4 * s * h * (2 * p * n + 2 * p), flops=6 * s * h * p * n)


def _mtp(rng, s, k, v, tilings) -> Case:
    logits = jnp.asarray(rng.normal(size=(s, k + 1, v)), jnp.float32)
    probs = jax.nn.softmax(jnp.asarray(rng.normal(size=(s, k, v)), jnp.float32), -1)
    args = (logits, jnp.asarray(rng.integers(0, v, size=(s, k)), jnp.int32), probs,
            jax.random.split(jax.random.key(0), s), jnp.ones((s,), jnp.float32))
    return Case("mtp_accept", f"S={s} k={k} V={v}", args,
                lambda a: mtp_reference.mtp_accept(*a),
                lambda a, interpret, **t: mtp_kernel.mtp_accept(*a, interpret=interpret, **t),
                tilings, bytes=4 * s * (2 * k + 1) * v, flops=12 * s * (k + 1) * v)


def gpu_cases(rng) -> list[Case]:
    bf16 = jnp.bfloat16
    return [
        _attention(rng, 64, 1, 32, 8, 128, 2048, 16, bf16,
                   [{"pages_per_step": p} for p in (1, 4, 8)]),
        _attention(rng, 8, 1, 32, 8, 128, 8192, 16, bf16,
                   [{"pages_per_step": p} for p in (4, 8)]),
        _attention(rng, 4, 512, 32, 8, 128, 2048, 16, bf16,
                   [{"block_q": bq, "pages_per_step": p} for bq in (16, 32) for p in (2, 4)]),
        _write(rng, 2048, 8, 128, 4096, 16, bf16),
        _ssd(rng, 8, 512, 64, 64, 8, 128, [{"chunk_size": c} for c in (64, 128)]),
        _ssd(rng, 32, 128, 64, 64, 8, 128, [{"chunk_size": c} for c in (32, 64)]),
        _decode(rng, 128, 64, 64, 8, 128, [{"block_h": b} for b in (1, 4, 16)]),
        _mtp(rng, 64, 4, 32768, [{"block_rows": r, "block_v": bv}
                                 for r in (4, 16) for bv in (512, 2048)]),
    ]


def cpu_cases(rng) -> list[tuple[Case, bool]]:
    """(case, also run the kernel interpreted): only the tiny cases are interpreted."""
    f32 = jnp.float32
    return [
        (_attention(rng, 8, 1, 8, 2, 64, 512, 16, f32, []), False),
        (_attention(rng, 2, 128, 8, 2, 64, 512, 16, f32, []), False),
        (_write(rng, 256, 2, 64, 256, 16, f32), False),
        (_ssd(rng, 4, 256, 8, 64, 1, 16, [{"chunk_size": 64}]), False),
        (_decode(rng, 64, 8, 64, 1, 16, []), False),
        (_mtp(rng, 16, 4, 32768, []), False),
        (_attention(rng, 2, 4, 4, 2, 16, 32, 4, f32,
                    [{"pages_per_step": p} for p in (1, 4)]), True),
        (_ssd(rng, 2, 16, 4, 16, 2, 16, [{"chunk_size": c} for c in (4, 8)]), True),
        (_decode(rng, 2, 4, 16, 2, 16, [{"block_h": b} for b in (1, 4)]), True),
        (_mtp(rng, 4, 2, 256, [{"block_rows": 4, "block_v": 64}]), True),
    ]


def _time(fn: Callable, repeats: int) -> float:
    jax.block_until_ready(fn())  # compile (and warm) first
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def ceilings(repeats: int) -> dict:
    """This machine's streaming bandwidth and matmul peak, measured, for the roofline."""
    on_gpu = jax.default_backend() == "gpu"
    big = jnp.ones((1 << (28 if on_gpu else 25),), jnp.float32)
    bw = big.nbytes / _time(lambda: jax.jit(jnp.sum)(big), repeats)
    n = 8192 if on_gpu else 1024
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    m = jnp.ones((n, n), dtype)
    flops = 2 * n ** 3 / _time(lambda: jax.jit(jnp.matmul)(m, m), repeats)
    return {"bandwidth_gb_s": bw / 1e9, "matmul_tflop_s": flops / 1e12,
            "matmul_dtype": jnp.dtype(dtype).name}


def _figures(case: Case, seconds: float, peak: dict) -> dict:
    roofline = max(case.bytes / (peak["bandwidth_gb_s"] * 1e9),
                   case.flops / (peak["matmul_tflop_s"] * 1e12))
    return {"ms": seconds * 1e3, "gb_s": case.bytes / seconds / 1e9,
            "tflop_s": case.flops / seconds / 1e12, "roofline_ms": roofline * 1e3,
            "of_roofline": roofline / seconds}


def _run_one(case: Case, what: str, fn: Callable, repeats: int, peak: dict, rows: list,
             **extra) -> None:
    try:
        row = {"kernel": case.kernel, "shape": case.shape, "impl": what, **extra,
               **_figures(case, _time(fn, repeats), peak)}
        print(f"{case.kernel:16s} {case.shape:40s} {what:10s} {str(extra or ''):40s} "
              f"{row['ms']:9.3f} ms {row['gb_s']:8.2f} GB/s {row['tflop_s']:7.3f} TFLOP/s "
              f"({row['of_roofline']:.0%} of roofline)", flush=True)
    except Exception as err:  # a tiling that fails to compile is a finding, not a crash
        row = {"kernel": case.kernel, "shape": case.shape, "impl": what, **extra,
               "error": f"{type(err).__name__}: {str(err)[:300]}"}
        print(f"{case.kernel:16s} {case.shape:40s} {what:10s} {extra} ERROR {row['error']}",
              flush=True)
    rows.append(row)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=300.0,
                        help="stop starting new cases after this many seconds")
    args = parser.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    rng = np.random.default_rng(0)
    peak = ceilings(args.repeats)
    mode = ("GPU: kernels compiled (Triton) vs XLA references" if on_gpu else
            "CPU: XLA references at realistic sizes; kernels only INTERPRETED at tiny sizes "
            "(interpret timings measure the interpreter, not the kernel)")
    print(mode)
    print(f"ceilings: {peak['bandwidth_gb_s']:.1f} GB/s, {peak['matmul_tflop_s']:.3f} "
          f"TFLOP/s ({peak['matmul_dtype']} matmul)")
    cases = [(c, True) for c in gpu_cases(rng)] if on_gpu else cpu_cases(rng)
    rows: list[dict] = []
    start = time.perf_counter()
    for case, with_kernel in cases:
        if time.perf_counter() - start > args.budget_s:
            print(f"budget of {args.budget_s:.0f} s spent: skipping {case.kernel} {case.shape}")
            rows.append({"kernel": case.kernel, "shape": case.shape, "skipped": "time budget"})
            continue
        reference = jax.jit(case.reference)
        _run_one(case, "xla", lambda c=case, f=reference: f(c.args), args.repeats, peak, rows)
        if not with_kernel:
            continue
        what = "pallas" if on_gpu else "interpret"
        for tiling in case.tilings:
            fn = lambda c=case, t=tiling: c.run(c.args, not on_gpu, **t)
            _run_one(case, what, fn, args.repeats if on_gpu else 2, peak, rows, tiling=tiling)
    name = "kernels_gpu" if on_gpu else "kernels"
    path = write_result(name, {
        "command": " ".join([sys.executable.rsplit("/", 1)[-1], "-m", "benchmarks.kernels"]
                            + sys.argv[1:]),
        "mode": mode, "ceilings": peak, "repeats": args.repeats, "results": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
