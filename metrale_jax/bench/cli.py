"""`metrale bench ...`: the benchmark commands. Imports stay light until a command runs."""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import shlex


def _model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="a local Hugging Face or metrale checkpoint (default: the built-in model)")


def _output_arg(p: argparse.ArgumentParser, default: str | None = None) -> None:
    p.add_argument("--output", default=default,
                   help="write the result (with the command and machine facts) to this JSON file")


def _dataset_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", choices=("random", "shared-prefix", "file"), default="random")
    g.add_argument("--num-prompts", type=int, default=64)
    g.add_argument("--input-len", type=int, default=128)
    g.add_argument("--output-len", type=int, default=128)
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="random: lengths uniform in len * [1 - r, 1 + r]")
    g.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: groups")
    g.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: shared tokens")
    g.add_argument("--prompts-file", default=None, help="file: one prompt per line")
    g.add_argument("--seed", type=int, default=0)


def _requests(args, vocab_size: int, tokenizer_fn, seed_offset: int = 0, n: int | None = None):
    from metrale_jax.bench import datasets

    n = args.num_prompts if n is None else n
    seed = args.seed + seed_offset
    if args.dataset == "random":
        return datasets.random_requests(n, args.input_len, args.output_len, vocab_size,
                                        range_ratio=args.range_ratio, seed=seed)
    if args.dataset == "shared-prefix":
        return datasets.shared_prefix_requests(n, args.num_prefixes, args.prefix_len,
                                               args.input_len, args.output_len, vocab_size,
                                               seed=seed)
    if not args.prompts_file:
        raise SystemExit("error: --dataset file needs --prompts-file")
    return datasets.file_requests(args.prompts_file, tokenizer_fn(), args.output_len, n=n)


def _tokenizer_for(model: str | None):
    from metrale_jax.loader.resolve import load_tokenizer

    return load_tokenizer(model)


def _command(args) -> str:
    return shlex.join(["metrale", *getattr(args, "argv", [])])


def _finish(args, payload: dict) -> int:
    print(json.dumps(payload, indent=2, default=float))
    if args.output:
        from metrale_jax.bench.results import write_json

        print(f"wrote {write_json(args.output, payload, _command(args))}")
    return 0


# ---- commands ----------------------------------------------------------------------------

def _throughput(args) -> int:
    from metrale_jax.bench.compare import vocab_size
    from metrale_jax.bench.datasets import describe

    vocab = vocab_size(args.model)
    reqs = _requests(args, vocab, lambda: _tokenizer_for(args.model))
    if args.engine == "metrale":
        from metrale_jax.bench.throughput import EngineShape, run_metrale_offline

        shape = EngineShape.for_requests(reqs, args.concurrency,
                                         max_tokens_per_tick=args.max_tokens_per_tick,
                                         enable_pipeline=not args.no_pipeline,
                                         enable_prefix_cache=not args.no_prefix_cache)
        result = run_metrale_offline(args.model, reqs, args.concurrency, shape=shape)
    elif args.engine == "transformers":
        from metrale_jax.bench.peers import hf

        if args.model is None:
            raise SystemExit("error: transformers needs --model (a Hugging Face checkpoint)")
        result = hf.run_offline(args.model, reqs, args.concurrency, threads=args.threads)
    else:
        from metrale_jax.bench.peers import llamacpp

        if args.gguf is None and args.model is None:
            raise SystemExit("error: llama.cpp needs --gguf or --model (a HF Llama checkpoint)")
        gguf = args.gguf or str(llamacpp.convert_to_gguf(args.model))
        result = llamacpp.run_offline(gguf, reqs, args.concurrency, threads=args.threads)
    return _finish(args, {"benchmark": "throughput", "model": args.model or "built-in default",
                          "dataset": args.dataset, "workload": describe(reqs),
                          "result": result.as_dict()})


def _goodput(specs: list[str] | None):
    from metrale_jax.bench.metrics import SLO

    limits = {}
    for item in specs or []:
        key, _, value = item.partition(":")
        names = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2e_ms", "e2e": "e2e_ms"}
        if key not in names or not value:
            raise SystemExit(f"error: --goodput takes ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        limits[names[key]] = float(value)
    return SLO(**limits)


def _serve(args) -> int:
    import asyncio

    from metrale_jax.bench.compare import vocab_size
    from metrale_jax.bench.datasets import describe
    from metrale_jax.bench.serve import LoadSpec, run_load

    tokenizer = None
    if args.dataset == "file" or args.endpoint.endswith("chat/completions"):
        tokenizer = _tokenizer_for(args.tokenizer)
    vocab = args.vocab_size or vocab_size(args.tokenizer)
    reqs = _requests(args, vocab, lambda: tokenizer)
    spec = LoadSpec(base_url=args.base_url, endpoint=args.endpoint, model=args.served_model,
                    request_rate=args.request_rate, burstiness=args.burstiness,
                    max_concurrency=args.max_concurrency, max_duration_s=args.max_duration,
                    api_key=args.api_key, allow_remote=args.allow_remote, seed=args.seed)
    summary = asyncio.run(run_load(spec, reqs, slo=_goodput(args.goodput), tokenizer=tokenizer))
    return _finish(args, {"benchmark": "serve", "dataset": args.dataset,
                          "workload": describe(reqs), "result": summary})


def _latency(args) -> int:
    from metrale_jax.bench.latency import run_latency

    rows = run_latency(args.model, args.prompt_lens, args.output_len, repeats=args.repeats,
                       seed=args.seed)
    return _finish(args, {"benchmark": "latency", "model": args.model or "built-in default",
                          "rows": rows})


def _overhead(args) -> int:
    from metrale_jax.bench.overhead import overhead

    rows = [overhead(args.model, b, args.ticks, args.rounds) for b in args.batches]
    return _finish(args, {"benchmark": "engine overhead", "model": args.model or
                          "built-in default", "rows": rows})


def _roofline(args) -> int:
    from metrale_jax.bench.roofline import roofline

    result = roofline(args.model, args.batches, steps=args.steps,
                      matmul_sizes=tuple(args.matmul_sizes), buffer_mb=args.buffer_mb)
    return _finish(args, {"benchmark": "roofline", "model": args.model or "built-in default",
                          **result})


def _step(args) -> int:
    from metrale_jax.bench.step import step_benchmark

    result = step_benchmark(args.model, args.batch, args.context, args.steps,
                            tuple(args.scaling_contexts), dtype=args.dtype)
    return _finish(args, {"benchmark": "decode step vs dense ceiling and bandwidth floor",
                          "model": args.model or "built-in default", **result})


def _mtp(args) -> int:
    from metrale_jax.bench.mtp import mtp_benchmark

    result = mtp_benchmark(args.model, args.batches, args.output_len, args.rounds, args.depth,
                           args.min_round_s)
    return _finish(args, {"benchmark": "MTP speculative decoding: delivered tok/s off / on / "
                                       "gated", "model": args.model or "built-in default",
                          **result})


def _sessions(args) -> int:
    from metrale_jax.bench.sessions import sessions_benchmark

    result = sessions_benchmark(args.model, args.turns, args.turn_len, args.reply_len,
                                args.prefix_len, args.suffix_len, seed=args.seed)
    return _finish(args, {"benchmark": "hybrid state reuse: TTFT per chat turn with "
                                       "sessions / prefix cache / recompute; warm vs cold "
                                       "shared prefix", "model": args.model or
                          "built-in default", **result})


def _startup(args) -> int:
    from metrale_jax.bench.startup import startup

    result = startup(args.model, args.serve_args, args.cached_runs)
    return _finish(args, {"benchmark": "metrale serve start-up (exec to /health 200)",
                          "model": args.model or "built-in default", **result})


def _compare(args) -> int:
    from metrale_jax.bench.compare import CompareSpec, run_compare
    from metrale_jax.bench.plots import plot_compare
    from metrale_jax.bench.results import RESULTS_DIR, write_json

    spec = CompareSpec(
        checkpoint=args.model, concurrencies=tuple(args.concurrency),
        input_len=args.input_len, output_len=args.output_len, waves=args.waves,
        rounds=args.rounds, threads=args.threads, peers=tuple(args.peers),
        offline=not args.no_offline,
        served=not args.no_served, overhead_batches=tuple(args.overhead_batches),
        roofline_batches=tuple(args.roofline_batches), overhead_ticks=args.overhead_ticks,
        overhead_rounds=args.overhead_rounds, gguf=args.gguf,
        llama_server=args.llama_server, llama_src=args.llama_src, seed=args.seed)
    result = run_compare(spec)
    name = args.name or ("compare-" + (pathlib.Path(args.model).name if args.model
                                       else "default"))
    out_dir = pathlib.Path(args.output_dir) if args.output_dir else RESULTS_DIR
    path = write_json(out_dir / f"{name}.json", result, _command(args))
    pngs = plot_compare(result, out_dir / name)
    print(f"wrote {path}" + "".join(f"\nwrote {p}" for p in pngs))
    return 0


def _make_nemotronh(args) -> int:
    from metrale_jax.bench.checkpoint import count_parameters, make_nemotronh_checkpoint

    out = make_nemotronh_checkpoint(args.out, seed=args.seed)
    print(f"wrote {out} ({count_parameters(out) / 1e6:.1f}M parameters)")
    return 0


def _make_llama(args) -> int:
    from metrale_jax.bench.checkpoint import count_parameters, make_llama_checkpoint

    out = make_llama_checkpoint(args.out, args.preset, text_file=args.text, seed=args.seed,
                                dtype=args.dtype)
    print(f"wrote {out} ({count_parameters(out) / 1e6:.1f}M parameters)")
    return 0


# ---- the parser --------------------------------------------------------------------------

def add_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks: throughput, serving load, latency, "
                                         "engine overhead, roofline, peers side by side")
    cmds = bench.add_subparsers(dest="bench_command", required=True)

    p = cmds.add_parser("throughput", help="offline throughput of N requests")
    _model_arg(p)
    _dataset_args(p)
    p.add_argument("--concurrency", type=int, default=64, help="requests running at once")
    p.add_argument("--engine", choices=("metrale", "transformers", "llama.cpp"),
                   default="metrale")
    p.add_argument("--gguf", default=None, help="llama.cpp: the GGUF file (default: convert)")
    p.add_argument("--threads", type=int, default=None, help="peers' CPU threads")
    p.add_argument("--max-tokens-per-tick", type=int, default=512)
    p.add_argument("--no-pipeline", action="store_true")
    p.add_argument("--no-prefix-cache", action="store_true")
    _output_arg(p)
    p.set_defaults(func=_throughput)

    p = cmds.add_parser("serve", help="load an OpenAI-compatible server and time the streams")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions",
                   choices=("/v1/completions", "/v1/chat/completions"))
    p.add_argument("--served-model", default=None, help="the model field (default: ask)")
    p.add_argument("--tokenizer", default=None, help="checkpoint whose tokenizer/vocabulary "
                   "the prompts use (default: the built-in model's)")
    p.add_argument("--vocab-size", type=int, default=None)
    _dataset_args(p)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s (default inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 is Poisson, below 1 burstier")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--max-duration", type=float, default=None, help="seconds; then cancel")
    p.add_argument("--goodput", nargs="*", default=None, metavar="KEY:MS",
                   help="SLOs for goodput: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--api-key", default=None)
    p.add_argument("--allow-remote", action="store_true",
                   help="allow a base URL that is not a loopback address")
    _output_arg(p)
    p.set_defaults(func=_serve)

    p = cmds.add_parser("latency", help="single-request prefill and decode latency")
    _model_arg(p)
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[16, 128, 512])
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    _output_arg(p)
    p.set_defaults(func=_latency)

    p = cmds.add_parser("overhead", help="engine decode tokens/s over the bare jitted step")
    _model_arg(p)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--ticks", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5)
    _output_arg(p)
    p.set_defaults(func=_overhead)

    p = cmds.add_parser("roofline", help="peak FLOP/s and bandwidth; the decode step's share")
    _model_arg(p)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--matmul-sizes", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--buffer-mb", type=int, default=512)
    _output_arg(p)
    p.set_defaults(func=_roofline)

    p = cmds.add_parser("step", help="the engine's decode step against the dense head-major "
                                     "ceiling and the read-bandwidth floor; context scaling")
    _model_arg(p)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=5, help="timed steps per round")
    p.add_argument("--scaling-contexts", type=int, nargs="*", default=[128, 256, 512, 896])
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                   help="weights and activations (default: the checkpoint's)")
    _output_arg(p)
    p.set_defaults(func=_step)

    p = cmds.add_parser("mtp", help="MTP speculative decoding: delivered tok/s with it off, "
                                    "on and gated, per batch size, and acceptance per depth")
    _model_arg(p)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--depth", type=int, default=2, help="num_speculative_tokens")
    p.add_argument("--min-round-s", type=float, default=1.0,
                   help="a round repeats the workload until it has run this long")
    _output_arg(p)
    p.set_defaults(func=_mtp)

    p = cmds.add_parser("sessions", help="hybrid state reuse: TTFT of each turn of a chat "
                                         "with sessions, prefix cache only and recompute; "
                                         "warm vs cold shared prefix")
    _model_arg(p)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--turn-len", type=int, default=180, help="new tokens per turn")
    p.add_argument("--reply-len", type=int, default=16, help="generated tokens per turn")
    p.add_argument("--prefix-len", type=int, default=2000, help="the shared prefix")
    p.add_argument("--suffix-len", type=int, default=32,
                   help="each shared-prefix request's own tokens after the prefix")
    p.add_argument("--seed", type=int, default=0)
    _output_arg(p)
    p.set_defaults(func=_sessions)

    p = cmds.add_parser("startup", help="metrale serve: cold start (empty compilation "
                                        "cache) and cached start, exec to /health 200")
    _model_arg(p)
    p.add_argument("--cached-runs", type=int, default=2)
    p.add_argument("serve_args", nargs="*", help="more `metrale serve` options (after --)")
    _output_arg(p)
    p.set_defaults(func=_startup)

    p = cmds.add_parser("compare", help="ours vs transformers and llama.cpp, same weights, "
                                        "same run; JSON and PNG plots to benchmarks/results")
    _model_arg(p)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--waves", type=int, default=1,
                   help="requests per level: max(2, waves x concurrency)")
    p.add_argument("--rounds", type=int, default=1,
                   help="offline: the engines take turns this many times per level, each "
                        "one's best round kept (a machine whose speed drifts)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--peers", nargs="*", default=["transformers", "llama.cpp"],
                   choices=("transformers", "llama.cpp"))
    p.add_argument("--no-offline", action="store_true")
    p.add_argument("--no-served", action="store_true")
    p.add_argument("--overhead-batches", type=int, nargs="*", default=[1, 8, 64])
    p.add_argument("--overhead-ticks", type=int, default=30)
    p.add_argument("--overhead-rounds", type=int, default=5)
    p.add_argument("--roofline-batches", type=int, nargs="*", default=[1, 8, 64])
    p.add_argument("--gguf", default=None)
    p.add_argument("--llama-server", default=None, help="the llama-server binary "
                   "(default: $METRALE_LLAMA_SERVER or PATH)")
    p.add_argument("--llama-src", default=None, help="llama.cpp sources with "
                   "convert_hf_to_gguf.py (default: $METRALE_LLAMA_CPP_SRC)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default=None, help="result file stem (default compare-<model>)")
    p.add_argument("--output-dir", default=None, help="default: benchmarks/results")
    p.set_defaults(func=_compare)

    p = cmds.add_parser("make-llama", help="make a Llama-shaped HF checkpoint with a "
                                           "SentencePiece tokenizer (random weights)")
    p.add_argument("out")
    p.add_argument("--preset", choices=("llama-50m", "llama-tiny"), default="llama-50m")
    p.add_argument("--text", default=None, help="tokenizer training text (default: the "
                   "built-in model's Shakespeare corpus)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the stored weights' dtype (same seed: same weights, rounded)")
    p.set_defaults(func=_make_llama)

    p = cmds.add_parser("make-nemotronh", help="make a NemotronH-shaped hybrid HF checkpoint "
                                               "(random weights, the built-in tokenizer)")
    p.add_argument("out")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_make_nemotronh)
