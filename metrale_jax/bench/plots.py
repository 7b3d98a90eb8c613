"""PNG plots of a comparison run (matplotlib, headless): throughput against concurrency,
served latency percentiles, our ratio to each peer, and the roofline."""

from __future__ import annotations

import pathlib

STYLE = {"metrale_jax": "tab:blue", "transformers": "tab:orange", "llama.cpp": "tab:green"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def throughput_plot(result: dict, path: pathlib.Path) -> pathlib.Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for mode, marker, dash in (("offline", "o", "-"), ("served", "s", "--")):
        rows = result.get(mode) or []
        for engine in sorted({r["engine"] for r in rows}):
            pts = sorted((r["concurrency"], r["output_tokens_per_s"]) for r in rows
                         if r["engine"] == engine)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], dash, marker=marker,
                    color=STYLE.get(engine), label=f"{engine} ({mode})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Throughput: {pathlib.Path(result['model']).name}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def latency_plot(result: dict, path: pathlib.Path) -> pathlib.Path:
    plt = _plt()
    rows = result.get("served") or []
    metrics = ("ttft", "tpot", "itl", "e2e")
    fig, axes = plt.subplots(1, len(metrics), figsize=(13, 3.6))
    for ax, metric in zip(axes, metrics):
        for engine in sorted({r["engine"] for r in rows}):
            mine = sorted((r for r in rows if r["engine"] == engine),
                          key=lambda r: r["concurrency"])
            xs = [r["concurrency"] for r in mine]
            for key, dash in (("median_ms", "-"), ("p90_ms", "--"), ("p99_ms", ":")):
                ys = [r[metric][key] for r in mine]
                ax.plot(xs, ys, dash, marker="o", color=STYLE.get(engine),
                        label=f"{engine} {key.split('_')[0]}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(metric.upper())
        ax.set_xlabel("concurrent requests")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("milliseconds")
    axes[-1].legend(fontsize=7)
    fig.suptitle("Served latency percentiles (same client, same prompts)")
    return _save(fig, path)


def ratio_plot(result: dict, path: pathlib.Path) -> pathlib.Path:
    plt = _plt()
    rows = (result.get("offline_ratios") or []) + (result.get("served_ratios") or [])
    groups = sorted({(r["mode"], r["peer"]) for r in rows})
    levels = sorted({r["concurrency"] for r in rows})
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    width = 0.8 / max(len(groups), 1)
    for i, (mode, peer) in enumerate(groups):
        by_level = {r["concurrency"]: r["ratio"] for r in rows
                    if r["mode"] == mode and r["peer"] == peer}
        xs = [j + i * width for j, c in enumerate(levels) if c in by_level]
        ys = [by_level[c] for c in levels if c in by_level]
        bars = ax.bar(xs, ys, width, label=f"vs {peer} ({mode})",
                      color=STYLE.get(peer), alpha=1.0 if mode == "offline" else 0.55)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(levels))], [str(c) for c in levels])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("metrale_jax / peer, output tokens/s")
    ax.set_title("Ratio to peers (above 1: metrale_jax is faster)")
    ax.legend(fontsize=8)
    return _save(fig, path)


def roofline_plot(result: dict, path: pathlib.Path) -> pathlib.Path:
    plt = _plt()
    roof = result["roofline"]
    peak_f, peak_b = roof["peaks"]["flops_per_s"], roof["peaks"]["bytes_per_s"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    xs = [2 ** (k / 4) for k in range(-16, 41)]
    ax.plot(xs, [min(peak_f, x * peak_b) for x in xs], color="black", label="roofline")
    for row in roof["decode"]:
        ax.plot(row["arithmetic_intensity"], row["achieved_flops_per_s"], "o",
                label=f"decode step, batch {row['batch']}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("FLOPs per byte")
    ax.set_ylabel("FLOP/s")
    ax.set_title("Decode step on this machine's roofline (measured through XLA)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _save(fig, path: pathlib.Path) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def plot_compare(result: dict, prefix: pathlib.Path) -> list[pathlib.Path]:
    out = []
    if result.get("offline") or result.get("served"):
        out.append(throughput_plot(result, prefix.with_name(prefix.name + "-throughput.png")))
    if result.get("served"):
        out.append(latency_plot(result, prefix.with_name(prefix.name + "-latency.png")))
    if result.get("offline_ratios") or result.get("served_ratios"):
        out.append(ratio_plot(result, prefix.with_name(prefix.name + "-ratios.png")))
    if result.get("roofline"):
        out.append(roofline_plot(result, prefix.with_name(prefix.name + "-roofline.png")))
    return out
