"""metrale_jax against its peers on the same weights, workload by workload, in one run.

For each concurrency level the same token-id prompts go through: our engine offline
(`LLMEngine`), transformers `generate`, llama.cpp offline (its batched C API), our server and
llama-server, both loaded by the same streaming client. Then the engine-overhead ratio and
the roofline of the same model. Ratios are ours over the peer's output tokens/s, measured
minutes apart on the same machine, never across runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import pathlib

from metrale_jax.bench.datasets import BenchRequest, random_requests, remapped


@dataclasses.dataclass(frozen=True)
class CompareSpec:
    checkpoint: str | None                  # a HF checkpoint; None: the built-in model
    concurrencies: tuple[int, ...] = (1, 16, 64)
    input_len: int = 128
    output_len: int = 128
    waves: int = 1                          # requests per level: max(2, waves * concurrency)
    rounds: int = 1                         # offline: engines take turns, best round kept
    threads: int | None = None              # peers' CPU threads (default: all cores)
    peers: tuple[str, ...] = ("transformers", "llama.cpp")
    offline: bool = True
    served: bool = True
    overhead_batches: tuple[int, ...] = (1, 8, 64)
    roofline_batches: tuple[int, ...] = (1, 8, 64)
    overhead_ticks: int = 30
    overhead_rounds: int = 5
    gguf: str | None = None
    llama_server: str | None = None
    llama_src: str | None = None
    seed: int = 0

    def __post_init__(self):
        if self.rounds < 1:
            raise ValueError(f"rounds must be at least 1, got {self.rounds}")

    def requests(self, concurrency: int, seed_offset: int = 0) -> list[BenchRequest]:
        n = max(2, self.waves * concurrency)
        return random_requests(n, self.input_len, self.output_len, vocab_size(self.checkpoint),
                               seed=self.seed + 7919 * concurrency + seed_offset)

    def warmup(self, concurrency: int) -> list[BenchRequest]:
        """The level's workload spelled with other tokens: same shapes, no prefix hits."""
        return remapped(self.requests(concurrency), vocab_size(self.checkpoint))

    @property
    def context(self) -> int:
        return self.input_len + self.output_len + 16


def vocab_size(checkpoint: str | None) -> int:
    if checkpoint is None:
        from metrale_jax.default_model import model as default_model

        return default_model.CONFIG.vocab_size
    cfg = pathlib.Path(checkpoint) / "config.json"
    if cfg.is_file():
        return int(json.loads(cfg.read_text())["vocab_size"])
    from metrale_jax.loader.checkpoint import read_checkpoint_config

    return read_checkpoint_config(checkpoint).vocab_size


def _log(msg: str) -> None:
    print(f"[compare] {msg}", flush=True)


def _offline_engines(spec: CompareSpec, gguf: str | None) -> dict:
    """Each engine of the offline comparison: name -> run(requests, concurrency) -> row."""
    from metrale_jax.bench.throughput import run_metrale_offline

    engines = {"metrale": lambda reqs, c: run_metrale_offline(spec.checkpoint, reqs, c)}
    if "transformers" in spec.peers:
        from metrale_jax.bench.peers import hf

        engines["transformers"] = lambda reqs, c: hf.run_offline(spec.checkpoint, reqs, c,
                                                                 threads=spec.threads)
    if gguf is not None:
        from metrale_jax.bench.peers import llamacpp

        engines["llama.cpp"] = lambda reqs, c: llamacpp.run_offline(gguf, reqs, c,
                                                                    threads=spec.threads)
    return engines


def offline_rows(spec: CompareSpec, gguf: str | None) -> list[dict]:
    """Per level, every engine on the same requests, in turns for `spec.rounds` rounds (the
    machine's speed drifts: turns spread the drift over every engine); each engine's best
    round is its row, with every round's tok/s beside it."""
    engines = _offline_engines(spec, gguf)
    rows = []
    for c in spec.concurrencies:
        reqs = spec.requests(c)
        runs: dict[str, list[dict]] = {name: [] for name in engines}
        for _ in range(spec.rounds):
            for name, run in engines.items():
                r = run(reqs, c).as_dict()
                _log(f"offline {name} c={c}: {r['output_tokens_per_s']} tok/s")
                runs[name].append(r)
        for name, rounds in runs.items():
            best = max(rounds, key=lambda r: r["output_tokens_per_s"])
            if spec.rounds > 1:
                best = {**best, "rounds_output_tokens_per_s": [r["output_tokens_per_s"]
                                                               for r in rounds]}
            rows.append(best)
    return rows


def _load_levels(engine: str, base_url: str, spec: CompareSpec, startup_s: float | None
                 ) -> list[dict]:
    from metrale_jax.bench.serve import LoadSpec, run_load

    rows = []
    for c in spec.concurrencies:
        load = LoadSpec(base_url=base_url, max_concurrency=c)
        # Warm-up on other prompts of the same shapes: compiles (ours) and first-touch costs.
        asyncio.run(run_load(load, spec.warmup(c), progress=False))
        summary = asyncio.run(run_load(load, spec.requests(c)))
        if summary["failed"]:
            raise RuntimeError(f"{engine} failed {summary['failed']} requests at c={c}: "
                               f"{summary['errors']}")
        _log(f"served {engine} c={c}: {summary['output_tokens_per_s']} tok/s, "
             f"TTFT p50 {summary['ttft']['median_ms']} ms")
        rows.append({"engine": engine, "concurrency": c, "server_startup_s": startup_s,
                     **summary})
    return rows


def served_rows(spec: CompareSpec, gguf: str | None) -> list[dict]:
    from metrale_jax.bench.servers import metrale_server

    top = max(spec.concurrencies)
    with metrale_server(spec.checkpoint, max_batch_size=top, max_seq_len=spec.context) as srv:
        rows = _load_levels("metrale_jax", srv.base_url, spec, srv.startup_s)
    if gguf is not None:
        from metrale_jax.bench.peers import llamacpp

        with llamacpp.LlamaServer(gguf, parallel=top, ctx_per_slot=spec.context,
                                  threads=spec.threads, binary=spec.llama_server) as srv:
            rows += _load_levels("llama.cpp", srv.base_url, spec, None)
    return rows


def ratios(rows: list[dict], mode: str) -> list[dict]:
    """Ours over each peer's output tokens/s, level by level."""
    ours = {r["concurrency"]: r for r in rows if r["engine"] == "metrale_jax"}
    out = []
    for r in rows:
        if r["engine"] == "metrale_jax" or r["concurrency"] not in ours:
            continue
        mine = ours[r["concurrency"]]["output_tokens_per_s"]
        out.append({"mode": mode, "concurrency": r["concurrency"], "peer": r["engine"],
                    "metrale_output_tokens_per_s": mine,
                    "peer_output_tokens_per_s": r["output_tokens_per_s"],
                    "ratio": round(mine / r["output_tokens_per_s"], 3)})
    return out


def prepare_gguf(spec: CompareSpec) -> str | None:
    if "llama.cpp" not in spec.peers:
        return None
    if spec.checkpoint is None:
        raise ValueError("llama.cpp runs Hugging Face Llama checkpoints, not the built-in "
                         "hybrid model: give --model, or drop llama.cpp with --peers")
    from metrale_jax.bench.peers import llamacpp

    llamacpp.import_llama_cpp()          # fail early, with how to make the peer
    llamacpp.find_llama_server(spec.llama_server)
    if spec.gguf is not None:
        return spec.gguf
    return str(llamacpp.convert_to_gguf(spec.checkpoint, outtype=gguf_outtype(spec.checkpoint),
                                        source=spec.llama_src))


# The checkpoint's stored dtype -> the GGUF type that keeps it: the same weights and dtype
# on both sides (what ours and transformers load with dtype "auto").
GGUF_OUTTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def gguf_outtype(checkpoint: str) -> str:
    cfg = json.loads((pathlib.Path(checkpoint) / "config.json").read_text())
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    if dtype not in GGUF_OUTTYPES:
        raise ValueError(f"{checkpoint}: dtype {dtype!r} has no GGUF type here "
                         f"(one of {sorted(GGUF_OUTTYPES)})")
    return GGUF_OUTTYPES[dtype]


def run_compare(spec: CompareSpec) -> dict:
    from metrale_jax.bench.overhead import overhead
    from metrale_jax.bench.roofline import roofline

    if spec.threads:
        os.environ.setdefault("OMP_NUM_THREADS", str(spec.threads))
    gguf = prepare_gguf(spec)
    result: dict = {"model": spec.checkpoint or "built-in default",
                    "spec": {k: v for k, v in dataclasses.asdict(spec).items()},
                    "gguf": gguf}
    if spec.offline:
        result["offline"] = offline_rows(spec, gguf)
        result["offline_ratios"] = ratios(result["offline"], "offline")
    if spec.served:
        result["served"] = served_rows(spec, gguf)
        result["served_ratios"] = ratios(result["served"], "served")
    if spec.overhead_batches:
        result["engine_overhead"] = []
        for b in spec.overhead_batches:
            row = overhead(spec.checkpoint, b, spec.overhead_ticks, spec.overhead_rounds)
            _log(f"overhead b={b}: pipeline on {row['ratio_pipeline_on']}, "
                 f"off {row['ratio_pipeline_off']}")
            result["engine_overhead"].append(row)
    if spec.roofline_batches:
        result["roofline"] = roofline(spec.checkpoint, list(spec.roofline_batches))
        for row in result["roofline"]["decode"]:
            _log(f"roofline b={row['batch']}: {row['fraction_of_peak_flops']} of peak FLOP/s, "
                 f"{row['fraction_of_peak_bandwidth']} of peak bandwidth")
    return result
