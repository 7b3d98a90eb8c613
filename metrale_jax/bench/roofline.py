"""The roofline of this machine, measured through XLA, and where the decode step sits on it.

Peaks: the best FLOP/s of a square float32 matmul, and the best bytes/s of a streaming read
(a sum) or read-and-write (a scale) over a buffer far larger than the caches. The decode
step's work comes from the model's shape: every weight is read once per step and used in one
multiply-add per row, attention reads each row's K/V, Mamba2 reads and writes each row's
state. Fractions near 1 for bytes mean the step is memory-bound at that batch; the batch at
which FLOP/s takes over is the ridge.
"""

from __future__ import annotations

import time

import numpy as np

from metrale_jax.config import ModelConfig


def _median_time(fn, *args, reps: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def peak_matmul_flops(sizes: tuple[int, ...] = (1024, 2048), reps: int = 5) -> dict:
    import jax
    import jax.numpy as jnp

    best = 0.0
    rows = []
    for n in sizes:
        a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
        b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
        t = _median_time(jax.jit(jnp.matmul), a, b, reps=reps)
        rate = 2.0 * n ** 3 / t
        rows.append({"n": n, "seconds": round(t, 5), "flops_per_s": rate})
        best = max(best, rate)
    return {"flops_per_s": best, "by_size": rows}


def peak_bandwidth(megabytes: int = 512, reps: int = 5) -> dict:
    import jax
    import jax.numpy as jnp

    x = jnp.ones((megabytes * (1 << 20) // 4,), jnp.float32)
    read = x.nbytes / _median_time(jax.jit(jnp.sum), x, reps=reps)
    copy = 2 * x.nbytes / _median_time(jax.jit(lambda v: v * 1.5), x, reps=reps)
    return {"bytes_per_s": max(read, copy), "read_bytes_per_s": read,
            "read_write_bytes_per_s": copy, "buffer_bytes": int(x.nbytes)}


def decode_cost(cfg: ModelConfig, batch: int, context: int) -> dict:
    """FLOPs and bytes of one decode step of `batch` rows at `context` tokens each."""
    item = 2 if cfg.dtype in ("bfloat16", "float16") else 4
    d = cfg.hidden_size
    weights = 0            # parameters read once per step, used once per row
    attn_flops = 0         # per row: QK^T and PV over the context
    row_bytes = 0          # per row: K/V read, SSM/conv state read and written
    for kind in cfg.layer_pattern:
        if kind == "A":
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            weights += d * q + 2 * d * kv + q * d
            attn_flops += 4 * q * context
            row_bytes += 2 * kv * context * item
        elif kind == "M":
            inner = cfg.mamba_inner
            groups_n = cfg.mamba_groups * cfg.ssm_state_size
            weights += d * (2 * inner + 2 * groups_n + cfg.mamba_num_heads) + inner * d
            weights += cfg.conv_dim * cfg.conv_kernel
            state = cfg.mamba_num_heads * cfg.mamba_head_dim * cfg.ssm_state_size * 4
            row_bytes += 2 * state + 2 * cfg.conv_dim * (cfg.conv_kernel - 1) * item
            attn_flops += 6 * cfg.mamba_num_heads * cfg.mamba_head_dim * cfg.ssm_state_size
        else:
            weights += (3 if cfg.mlp_kind == "gated_silu" else 2) * d * cfg.intermediate_size
    weights += d * cfg.vocab_size  # the head (the tied embedding is read as the head)
    return {"flops": batch * (2 * weights + attn_flops),
            "bytes": weights * item + batch * (row_bytes + d * item),
            "weight_bytes": weights * item}


def step_fractions(model: str | None, batches: list[int], peaks: dict, *,
                   steps: int = 20) -> list[dict]:
    """Measure the bare decode step at each batch and place it against the peaks."""
    from metrale_jax.bench.overhead import BareStep

    rows = []
    for batch in batches:
        bare = BareStep(model, batch)
        try:
            rate = float(np.median([bare.tokens_per_s(steps) for _ in range(3)]))
            cfg = bare.engine.model_config
        finally:
            bare.close()
        step_s = batch / rate
        cost = decode_cost(cfg, batch, bare.context)
        flops_s, bytes_s = cost["flops"] / step_s, cost["bytes"] / step_s
        rows.append({"batch": batch, "context": bare.context, "step_ms": round(step_s * 1e3, 3),
                     "tokens_per_s": round(rate, 1), "step_flops": cost["flops"],
                     "step_bytes": cost["bytes"], "achieved_flops_per_s": flops_s,
                     "achieved_bytes_per_s": bytes_s,
                     "fraction_of_peak_flops": round(flops_s / peaks["flops_per_s"], 4),
                     "fraction_of_peak_bandwidth": round(bytes_s / peaks["bytes_per_s"], 4),
                     "arithmetic_intensity": round(cost["flops"] / cost["bytes"], 3)})
    return rows


def roofline(model: str | None, batches: list[int], *, steps: int = 20,
             matmul_sizes: tuple[int, ...] = (1024, 2048), buffer_mb: int = 512) -> dict:
    flops = peak_matmul_flops(matmul_sizes)
    bandwidth = peak_bandwidth(buffer_mb)
    peaks = {"flops_per_s": flops["flops_per_s"], "bytes_per_s": bandwidth["bytes_per_s"]}
    return {"peaks": {**peaks, "ridge_flops_per_byte":
                      round(peaks["flops_per_s"] / peaks["bytes_per_s"], 3),
                      "matmul": flops["by_size"], "bandwidth": bandwidth},
            "decode": step_fractions(model, batches, peaks, steps=steps)}
