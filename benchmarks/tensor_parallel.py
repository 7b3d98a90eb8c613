"""Tensor parallel: delivered tokens/s of the built-in model at tp = 1, 2 (and 4 where the
model's heads allow) through the whole engine.

On a CPU the devices are simulated (`--xla_force_host_platform_device_count`, set here
before jax is imported) and share the same cores, so the figures show what splitting costs
(the per-shard programs, the all-reduces, the logits gathered for the sampler), never a
speedup. On a machine with several accelerators the same script measures the real thing.

Each size: one engine, `--requests` greedy requests of `--prompt-len` prompt tokens and
`--output-len` new tokens, all submitted at once; one untimed run (it compiles the shapes
the timed runs use), then the best of `--rounds` timed runs.

Run: `python -m benchmarks.tensor_parallel [--model DIR] [--sizes 1 2] [--requests 8]
[--output-len 32]` (with a model, the result is `tensor_parallel-<its folder name>.json`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if "jax" not in sys.modules:  # the simulated devices must be asked for before jax loads
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=4").strip()


def _run(engine, prompts, output_len: int) -> float:
    from metrale_jax.request import SamplingParams

    start = time.perf_counter()
    reqs = [engine.make_request({"prompt_token_ids": p}, SamplingParams(
        temperature=0.0, max_tokens=output_len, ignore_eos=True)) for p in prompts]
    for r in reqs:
        engine.submit(r)
    while not all(r.finished for r in reqs):
        engine.step()
    engine.drain()
    return time.perf_counter() - start


def measure(tp: int, args) -> dict:
    from metrale_jax.engine import LLM

    llm = LLM(args.model, warmup=False, tensor_parallel_size=tp, max_batch_size=args.requests,
              max_seq_len=args.prompt_len + args.output_len + 1, enable_prefix_cache=False)
    prompts = [[(7 * i + j) % 4000 + 10 for j in range(args.prompt_len)]
               for i in range(args.requests)]
    _run(llm.engine, prompts, args.output_len)
    best = min(_run(llm.engine, prompts, args.output_len) for _ in range(args.rounds))
    llm.engine.close()
    return {"tp": tp, "seconds": round(best, 3),
            "tokens_per_s": round(args.requests * args.output_len / best, 1)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="a checkpoint directory (default: the "
                   "built-in model, whose 6 heads allow tp 1 and 2; `metrale bench make-llama "
                   "--preset llama-tiny DIR` makes one that allows 4)")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    import jax

    from benchmarks.common import write_result

    rows = [measure(tp, args) for tp in args.sizes]
    for row in rows:
        print(row)
    name = os.path.basename(os.path.normpath(args.model)) if args.model else None
    write_result("tensor_parallel", {
        "model": name or "metrale-default", "platform": jax.default_backend(),
        "devices": len(jax.devices()),
        "note": "simulated CPU devices share the same cores: overheads, not speedup"
                if jax.default_backend() == "cpu" else "",
        "requests": args.requests, "prompt_len": args.prompt_len,
        "output_len": args.output_len, "results": rows},
        file=f"tensor_parallel-{name}" if name else None)


if __name__ == "__main__":
    main()
