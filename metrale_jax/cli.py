"""The `metrale` command line."""

from __future__ import annotations

import argparse
import os
import sys


def _generate(args: argparse.Namespace) -> int:
    from metrale_jax import LLM, SamplingParams
    from metrale_jax.parallel import distributed as multi_process
    from metrale_jax.request import RequestError

    # One prompt reaches two or three step shapes: compiling those on use beats warming
    # up all ~25. Several processes (--num-processes) each run this same command in
    # lockstep; only process 0 writes the completion.
    llm = LLM(args.model, max_seq_len=args.max_seq_len, dtype=args.dtype, warmup=False,
              tensor_parallel_size=args.tensor_parallel_size,
              distributed=multi_process.from_arguments(args) or None)
    quiet = llm.engine_config.parallel.process_id != 0
    out = open(os.devnull, "w") if quiet else sys.stdout  # noqa: SIM115 - closed below
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                stop=args.stop or None)
        prompt = args.prompt
        if args.chat:
            prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        out.write(prompt if args.echo else "")
        for delta in llm.stream(prompt, params):
            out.write(delta)
            out.flush()
        out.write("\n")
    except RequestError as err:
        print(f"\nerror: {err}", file=sys.stderr)
        return 2
    finally:
        if quiet:
            out.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="metrale", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream a completion of one prompt to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None,
                     help="a local Hugging Face or metrale checkpoint directory "
                          "(default: the built-in model)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-p", type=float, default=0.95)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="a stop string (repeatable)")
    gen.add_argument("--max-seq-len", type=int, default=2048)
    gen.add_argument("--dtype", default="auto",
                     help="weights and activations: auto (as stored), float32, bfloat16")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--echo", action="store_true", help="print the prompt first")
    gen.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                     help="split the model over this many devices (of every process)")
    from metrale_jax.parallel.distributed import add_arguments  # light: no jax
    add_arguments(gen)
    gen.set_defaults(func=_generate)
    from metrale_jax.train.cli import add_parser as add_train_parser  # light: no jax
    add_train_parser(sub)
    from server.serve import add_parser as add_serve_parser  # light: no jax, no aiohttp
    add_serve_parser(sub)
    from metrale_jax.bench.cli import add_parser as add_bench_parser  # light: no jax
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # what benchmark records quote as their command
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
