"""One process of the multi-process test (tests/test_multihost.py), or its one-process
reference: `python -m tests.multihost_worker OUT.json --tp N [multi-process flags]`.

Builds the tiny Llama or hybrid (seeded random weights, the built-in tokenizer), runs `LLM(...)`
greedy on a fixed workload and writes what it generated as JSON to OUT.json. The
multi-process settings come from the flags or the environment (JAX_NUM_PROCESSES,
JAX_PROCESS_ID, JAX_COORDINATOR_ADDRESS), as `metrale_jax.parallel.distributed` reads
them; the caller sets JAX_PLATFORMS=cpu and the CPU device count (XLA_FLAGS) per process.

The workload: one prompt with top-2 logprobs and prompt logprobs, then four prompts
sharing three full blocks, on a KV pool so small that admission spills running sequences
to disk and resumes them (the swap gather runs across processes) and later prompts hit the
prefix cache; the async pipeline on; one step shape, compiled on first use.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

from metrale_jax.parallel import distributed as multi_process

ENGINE = dict(block_size=8, num_kv_blocks=10, max_seq_len=64, max_batch_size=4,
              max_tokens_per_tick=32, prefill_chunk_size=32, seq_buckets=(4,),
              token_buckets=(32,), query_buckets=(32,), block_buckets=(8,),
              max_logprobs=2, num_ssm_snapshots=4, check_every_tick=True,
              program_cache="none")
SCORED = list(range(5, 25))
SHARED = list(range(30, 54))  # three full blocks every prompt of the batch starts with
BATCH = [SHARED + list(range(100 + 7 * i, 104 + 7 * i)) for i in range(4)]


def _install(name: str) -> None:
    """`LLM(None)` builds the tiny model `name`, inside the engine's load (after the
    processes joined: drawing it must not start a JAX backend before `jax.distributed`)."""
    from metrale_jax import engine
    from metrale_jax.default_model import ASSET_DIR
    from metrale_jax.loader.resolve import LoadedModel
    from metrale_jax.tokenizer import Tokenizer

    from tests.helpers import TINY_HYBRID, TINY_LLAMA, random_model

    cfg = {"llama": TINY_LLAMA, "hybrid": TINY_HYBRID}[name]
    engine.load = lambda *_args, **_kwargs: LoadedModel(
        random_model(cfg), cfg, Tokenizer.from_dir(ASSET_DIR), f"tiny-{name}")


def _logprobs(positions) -> list:
    return [sorted((tid, lp.logprob) for tid, lp in pos.items()) if pos else []
            for pos in positions or []]


def run(model: str, tp: int, distributed: dict | None) -> dict:
    from metrale_jax import LLM, SamplingParams

    _install(model)
    start = time.perf_counter()
    llm = LLM(None, tensor_parallel_size=tp, distributed=distributed, warmup=False, **ENGINE)
    try:
        greedy = dict(temperature=0.0, ignore_eos=True)
        scored = llm.generate({"prompt_token_ids": SCORED}, SamplingParams(
            max_tokens=6, logprobs=2, prompt_logprobs=2, **greedy))[0]
        batch = llm.generate([{"prompt_token_ids": p} for p in BATCH],
                             SamplingParams(max_tokens=16, **greedy))
        import jax

        counters = llm.engine.core.tel.counters()
        return {
            "tp": tp, "process_id": jax.process_index(), "processes": jax.process_count(),
            "devices": [d.id for d in jax.devices()],
            "local_devices": [d.id for d in jax.local_devices()],
            "scored": scored.outputs[0].token_ids,
            "logprobs": _logprobs(scored.outputs[0].logprobs),
            "prompt_logprobs": _logprobs(scored.prompt_logprobs[1:]),
            "outputs": [o.outputs[0].token_ids for o in batch],
            "spills": counters.get("spills", 0), "swap_ins": counters.get("swap_ins", 0),
            "prefix_hit_tokens": llm.engine.core.memory.pool.stats.prefix_hit_tokens,
            "seconds": round(time.perf_counter() - start, 1)}
    finally:
        llm.engine.close()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--model", choices=("llama", "hybrid"), default="llama")
    multi_process.add_arguments(parser)
    args = parser.parse_args(argv)
    result = run(args.model, args.tp, multi_process.from_arguments(args) or None)
    args.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
