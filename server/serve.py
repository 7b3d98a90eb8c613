"""`metrale serve`: the OpenAI-compatible server as a process.

1. Load the model and build the engine (before the port opens).
2. Bind; `/health` answers "starting" (503) and the API 503 while the few step shapes that
   cover every batch compile.
3. Warm-up done: start the engine thread, `/health` says "ok", log the ready line; the
   other shapes compile beside serving (`compiling_variants` in `/health` counts them).
4. SIGTERM/SIGINT: stop accepting (503 "draining"), finish what is in flight, shut the
   engine down, exit 0.

This module imports nothing heavy at import time: the CLI builds its parser cheaply.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib

from metrale_jax.config import KV_CACHE_DTYPES
from metrale_jax.parallel import distributed as multi_process
from metrale_jax.parallel.config import ParallelConfig, ParallelConfigError

API_KEY_ENV = "METRALE_API_KEY"
DEFAULT_CACHE = pathlib.Path.home() / ".cache" / "metrale_jax" / "xla"
logger = logging.getLogger("metrale.server")


def _ladder(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated sizes, got {text!r}") from None


def _lora_module(text: str) -> tuple[str, str]:
    """vLLM's `--lora-modules` entry: name=path, or {"name": ..., "path": ...}."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
            return str(spec["name"]), str(spec["path"])
        except (ValueError, KeyError, TypeError):
            raise argparse.ArgumentTypeError(f"expected name=path or a JSON object with name "
                                             f"and path, got {text!r}") from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path, got {text!r}")
    return name, path


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a local checkpoint directory "
                                                 "(default: the built-in model)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default loopback; 0.0.0.0 exposes the server)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})")
    p.add_argument("--served-model-name", action="append", default=None,
                   help="name(s) clients use for the model (repeatable)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="sequences allowed to wait beyond the running batch before 429")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    p.add_argument("--drain-timeout", type=float, default=120.0,
                   help="seconds SIGTERM waits for in-flight requests")
    p.add_argument("--compilation-cache", default=str(DEFAULT_CACHE),
                   help="JAX persistent compilation cache directory ('none' to disable)")
    p.add_argument("--log-level", default="INFO")
    e = p.add_argument_group("engine")
    e.add_argument("--max-seq-len", type=int, default=2048)
    e.add_argument("--max-batch-size", type=int, default=64)
    e.add_argument("--max-tokens-per-tick", type=int, default=256,
                   help="token budget of one ragged batch (modest: CPU-friendly)")
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--num-kv-blocks", type=int, default=None)
    e.add_argument("--max-logprobs", type=int, default=20)
    e.add_argument("--max-logit-bias", type=int, default=1024,
                   help="logit-bias entries a request may carry (a device table per slot)")
    e.add_argument("--prefill-chunk-size", type=int, default=256)
    e.add_argument("--policy", choices=("fcfs", "priority"), default="fcfs")
    e.add_argument("--kernel-backend", choices=("auto", "pallas", "xla"), default="auto")
    e.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many devices (a mesh axis 'tp'); it must "
                        "divide the attention and Mamba2 head counts. On the CPU, simulate "
                        "devices with XLA_FLAGS=--xla_force_host_platform_device_count=N")
    e.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="run this many engines behind one server, each on its own group of "
                        "--tensor-parallel-size devices with its own tick loop; requests go "
                        "where their prompt's prefix went (sessions stay on one engine). "
                        "LoRA load/unload apply to every engine")
    multi_process.add_arguments(p)  # refused with more than one process (see engine_kwargs)
    e.add_argument("--structured-outputs-backend", choices=("llguidance", "xgrammar"),
                   default="llguidance", help="grammar engine of structured outputs "
                   "(xgrammar: pip install 'metrale-jax[grammar-xgrammar]')")
    e.add_argument("--dtype", default="auto",
                   help="weights and activations: auto (as stored), float32, bfloat16, float16")
    e.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="the KV pool: auto is the model's dtype, except float32 on the CPU "
                   "for a non-bf16 model or without the CPU attention kernel")
    e.add_argument("--spill-dir", default=None)
    e.add_argument("--no-prefix-cache", action="store_true")
    e.add_argument("--prefix-tier-host-bytes", type=int, default=0, metavar="BYTES",
                   help="host RAM for prefix blocks and SSM snapshots evicted from the "
                        "device, restored on a hit (0: off)")
    e.add_argument("--prefix-tier-disk-bytes", type=int, default=0, metavar="BYTES",
                   help="disk (under --spill-dir) for what leaves that RAM (0: off)")
    e.add_argument("--no-pipeline", action="store_true")
    e.add_argument("--no-swap", action="store_true")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--speculative-config", default="auto",
                   help='speculative decoding, vLLM\'s JSON: {"method": "mtp", '
                        '"num_speculative_tokens": 2, "gate": "auto"}; "auto" (default): MTP '
                        'with the gate on auto where the model has MTP modules (its variants '
                        'compile beside serving); "none": off')
    e.add_argument("--ladders", choices=("sparse", "pow2"), default="sparse",
                   help="default bucket ladders: a few sizes (fast warm-up) or powers of two")
    for name in ("token", "seq", "prefill-seq", "query", "block"):
        e.add_argument(f"--{name}-buckets", type=_ladder, default=None,
                       help="comma-separated bucket sizes (overrides --ladders)")
    lora = p.add_argument_group("LoRA adapters")
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    lora.add_argument("--lora-modules", type=_lora_module, nargs="+", default=None,
                      metavar="NAME=PATH", help="adapters loaded at start (PEFT directories); "
                      "a request's model field names one")
    lora.add_argument("--max-loras", type=int, default=None,
                      help="adapters on the device at once (default 4)")
    lora.add_argument("--max-lora-rank", type=int, default=None,
                      help="the largest adapter rank (default 16)")
    lora.add_argument("--lora-dir", default=None,
                      help="allow POST /v1/load_lora_adapter for directories inside DIR "
                           "(default: runtime loading is refused)")
    p.set_defaults(func=main)
    return p


def engine_kwargs(args: argparse.Namespace) -> dict:
    budget = args.max_tokens_per_tick
    kwargs = dict(max_seq_len=args.max_seq_len, max_batch_size=args.max_batch_size,
                  max_tokens_per_tick=budget, block_size=args.block_size,
                  num_kv_blocks=args.num_kv_blocks, max_logprobs=args.max_logprobs,
                  max_logit_bias=args.max_logit_bias,
                  prefill_chunk_size=args.prefill_chunk_size, policy=args.policy,
                  kernel_backend=args.kernel_backend, spill_dir=args.spill_dir,
                  structured_outputs_backend=args.structured_outputs_backend,
                  enable_prefix_cache=not args.no_prefix_cache,
                  enable_pipeline=not args.no_pipeline, enable_swap=not args.no_swap,
                  seed=args.seed, kv_cache_dtype=args.kv_cache_dtype, ladders=args.ladders,
                  parallel=parallel_config(args),
                  prefix_tier={"host_bytes": args.prefix_tier_host_bytes,
                               "disk_bytes": args.prefix_tier_disk_bytes})
    kwargs.update(lora_kwargs(args))
    for name in ("token", "seq", "prefill_seq", "query", "block"):
        ladder = getattr(args, f"{name}_buckets")
        if ladder is not None:
            kwargs[f"{name}_buckets"] = ladder
    return kwargs


def parallel_config(args: argparse.Namespace) -> ParallelConfig:
    """--tensor-parallel-size and --data-parallel-size; more than one process (flags or
    JAX_NUM_PROCESSES) is refused: serving is one process for now."""
    try:
        parallel = multi_process.with_distributed(
            ParallelConfig(args.tensor_parallel_size, args.data_parallel_size),
            multi_process.from_arguments(args))
        multi_process.refuse_serving(parallel)
    except ParallelConfigError as err:
        raise SystemExit(f"metrale serve: {err}") from None
    return parallel


def lora_kwargs(args: argparse.Namespace) -> dict:
    """The engine's LoRA arguments; LoRA options without --enable-lora are an error."""
    if not args.enable_lora:
        given = [flag for flag, value in (("--lora-modules", args.lora_modules),
                                          ("--max-loras", args.max_loras),
                                          ("--max-lora-rank", args.max_lora_rank),
                                          ("--lora-dir", args.lora_dir)) if value is not None]
        if given:
            raise SystemExit(f"{', '.join(given)}: needs --enable-lora")
        return {}
    return {"enable_lora": True, "max_loras": args.max_loras,
            "max_lora_rank": args.max_lora_rank}


def build_engine(args: argparse.Namespace):
    """One `AsyncLLM`, or with --data-parallel-size M > 1 a `DataParallelAsyncLLM` of M
    (the same surface). A parallel setting that cannot hold (M < 1, more devices than the
    process sees) exits naming the count, before a model loads."""
    from metrale_jax.parallel.config import ParallelConfigError

    try:
        kwargs = dict(dtype=args.dtype, speculative_config=speculative_arg(args),
                      **engine_kwargs(args))
        if kwargs["parallel"].dp == 1:
            from metrale_jax.async_engine import AsyncLLM

            return AsyncLLM(args.model, **kwargs)
        from metrale_jax.parallel.async_data_parallel import DataParallelAsyncLLM

        return DataParallelAsyncLLM(args.model, **kwargs)
    except ParallelConfigError as err:
        raise SystemExit(f"metrale serve: {err}") from None


def speculative_arg(args: argparse.Namespace) -> str | None:
    """`--speculative-config`: JSON, "auto" (the engine picks from the model) or "none"."""
    value = args.speculative_config
    return None if value.strip().lower() in ("none", "null", "off") else value


def _enable_compilation_cache(directory: str) -> None:
    if directory.lower() == "none":
        return
    import jax

    pathlib.Path(directory).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def main(args: argparse.Namespace) -> int:
    import asyncio

    # Libraries (jax, orbax) at WARNING; the server's own lines at --log-level.
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("metrale", "metrale_jax"):
        logging.getLogger(name).setLevel(args.log_level.upper())
    _enable_compilation_cache(args.compilation_cache)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    return asyncio.run(_serve(args, api_key))


async def _serve(args: argparse.Namespace, api_key: str | None) -> int:
    import asyncio
    import signal
    import time

    from aiohttp import web

    from metrale_jax.lora.weights import LoraError
    from server.app import create_app
    from server.openai_routes import STATE
    from server.state import ServerConfig

    llm = build_engine(args)
    config = ServerConfig(served_model_names=tuple(args.served_model_name or ()),
                          api_key=api_key, max_waiting=args.max_waiting,
                          max_body_bytes=args.max_body_bytes, lora_dir=args.lora_dir)
    for name, path in args.lora_modules or ():  # read before the port opens
        try:
            await asyncio.to_thread(llm.register_adapter, name, path)
        except LoraError as err:
            raise SystemExit(f"--lora-modules: {err}") from None
        logger.info("LoRA adapter %r from %s", name, path)
    app = create_app(llm, config, status="starting")
    state = app[STATE]
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    url = f"http://{args.host}:{args.port}"
    logger.info("warming up %s on %s (/health says 'starting' until ready)",
                llm.limits.model_name, url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    t0 = time.monotonic()
    await asyncio.to_thread(llm.warmup)
    llm.start()
    state.status = "ok"
    engines = f", {llm.data_parallel_size} engines" if llm.data_parallel_size > 1 else ""
    stats = llm.stats()
    logger.info("metrale is ready: serving %s as %s on %s (warm-up %.1f s, %d compiled "
                "variants, %d more compiling beside serving%s%s)", llm.limits.model_name,
                list(state.limits.model_names), url, time.monotonic() - t0,
                stats["compiled_variants"], stats["compiling_variants"], engines,
                ", API key required" if api_key else "")
    await stop.wait()
    state.status = "draining" if state.status == "ok" else state.status
    logger.info("shutting down: %d requests in flight, accepting no new ones",
                state.open_requests)
    try:
        await asyncio.wait_for(state.idle.wait(), args.drain_timeout)
    except asyncio.TimeoutError:
        logger.warning("drain timed out after %.0f s", args.drain_timeout)
    await asyncio.to_thread(llm.shutdown, 30)
    await runner.cleanup()
    logger.info("stopped")
    return 0
