"""Data parallel routing: the prefix-cache hit rate of prefix affinity against round robin.

Workload: `--prefixes` system prompts of `--prefix-blocks` full blocks, each request one of
them (at random) plus a tail of its own, `--concurrency` requests in flight.

1. Simulated (host only, no model): M engines whose prefix caches are LRUs of
   `--cache-blocks` block hashes each (what the block pool keeps), for M in `--engines`;
   the router under test sends each request, the engine counts the leading blocks it
   already holds. Hit rate: prompt blocks found over prompt blocks sent.
2. Real (`--real-requests` > 0): `DataParallelLLM` with two engines of the built-in model
   on two simulated CPU devices (set here before jax loads), the same workload in waves of
   `--concurrency` requests, once with each router; the hit rate is the engines' own
   prefix-cache counters (prompt tokens found over prompt tokens looked up; the hybrid
   model finds a prefix only where an SSM snapshot was kept for it).

   On 2 shared CPU cores this part compiles every prefill shape for both engines and did
   not finish within 15 minutes, so the committed result is the simulated part only
   (`--real-requests 0`); on an accelerator machine run it with `--real-requests 64`.

Run: `python -m benchmarks.data_parallel_affinity --real-requests 0`; it writes
benchmarks/results/data_parallel_affinity.json.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import time

if "jax" not in sys.modules:  # the simulated devices must be asked for before jax loads
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=2").strip()

from metrale_jax.parallel.router import (PrefixAffinityRouter, RoundRobinRouter,  # noqa: E402
                                         RouterConfig, block_hashes)

ROUTERS = {"prefix_affinity": PrefixAffinityRouter, "round_robin": RoundRobinRouter}


def workload(args, block_size: int, num_requests: int, vocab: int = 4000) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(10, vocab) for _ in range(args.prefix_blocks * block_size)]
                for _ in range(args.prefixes)]
    return [rng.choice(prefixes) + [rng.randrange(10, vocab) for _ in range(args.tail_len)]
            for _ in range(num_requests)]


class _LruCache:
    """An engine's prefix cache as an LRU of block hashes."""

    def __init__(self, blocks: int):
        self.blocks, self.lru = blocks, collections.OrderedDict()

    def serve(self, hashes: list[int]) -> int:
        hit = next((k for k, h in enumerate(hashes) if h not in self.lru), len(hashes))
        for h in hashes:
            self.lru[h] = None
            self.lru.move_to_end(h)
        while len(self.lru) > self.blocks:
            self.lru.popitem(last=False)
        return hit


def simulate(router_name: str, engines: int, args) -> dict:
    cfg = RouterConfig(num_engines=engines, block_size=args.block_size)
    router, caches = ROUTERS[router_name](cfg), [_LruCache(args.cache_blocks)
                                                for _ in range(engines)]
    hits = total = 0
    per_engine = [0] * engines
    in_flight: collections.deque = collections.deque()
    for i, prompt in enumerate(workload(args, args.block_size, args.requests)):
        engine = router.route(str(i), prompt)
        hashes = block_hashes(prompt, args.block_size)
        hits += caches[engine].serve(hashes)
        total += len(hashes)
        per_engine[engine] += 1
        in_flight.append(str(i))
        if len(in_flight) > args.concurrency:
            router.finished(in_flight.popleft())
    return {"router": router_name, "engines": engines, "hit_rate": round(hits / total, 3),
            "requests_per_engine": per_engine}


def real(router_name: str, args) -> dict:
    from metrale_jax.parallel.data_parallel import DataParallelLLM
    from metrale_jax.request import SamplingParams

    block = 16
    dp = DataParallelLLM(None, data_parallel_size=2, block_size=block,
                         max_batch_size=args.concurrency, num_kv_blocks=args.real_kv_blocks,
                         max_seq_len=args.prefix_blocks * block + args.tail_len + 8)
    if router_name == "round_robin":
        dp.router = RoundRobinRouter(dp.router.config)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = workload(args, block, args.real_requests, dp.engines[0].model_config.vocab_size)
    served = [0, 0]
    start = time.perf_counter()
    for wave in range(0, len(prompts), args.concurrency):
        dp.generate([{"prompt_token_ids": p} for p in prompts[wave:wave + args.concurrency]],
                    params)
        for i in dp.last_engines:
            served[i] += 1
    seconds = time.perf_counter() - start
    snaps = [e.snapshot() for e in dp.engines]
    dp.close()
    queried = sum(s.prefix_query_tokens for s in snaps)
    found = sum(s.prefix_hit_tokens for s in snaps)
    return {"router": router_name, "engines": 2, "hit_rate": round(found / queried, 3),
            "prompt_tokens_found": found, "prompt_tokens_looked_up": queried,
            "requests_per_engine": served, "seconds": round(seconds, 2)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--engines", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--prefixes", type=int, default=8)
    p.add_argument("--prefix-blocks", type=int, default=4)
    p.add_argument("--tail-len", type=int, default=20)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--cache-blocks", type=int, default=20,
                   help="simulated: blocks each engine's prefix cache holds")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--real-requests", type=int, default=0)
    p.add_argument("--real-kv-blocks", type=int, default=48,
                   help="real: each engine's KV pool (fewer than the prefixes need together)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    simulated = [simulate(name, m, args) for m in args.engines for name in ROUTERS]
    for row in simulated:
        print("simulated", row)
    measured = []
    if args.real_requests:
        measured = [real(name, args) for name in ROUTERS]
        for row in measured:
            print("real", row)
    from benchmarks.common import write_result

    write_result("data_parallel_affinity", {
        "what": "prefix-cache hit rate under data parallel routing: prefix affinity "
                "(metrale_jax/parallel/router.py) against round robin",
        "workload": {"prefixes": args.prefixes, "prefix_blocks": args.prefix_blocks,
                     "tail_len": args.tail_len, "concurrency": args.concurrency},
        "simulated": {"requests": args.requests, "block_size": args.block_size,
                      "cache_blocks_per_engine": args.cache_blocks,
                      "max_hit_rate": round(args.prefix_blocks
                                            / (args.prefix_blocks
                                               + args.tail_len // args.block_size), 3),
                      "results": simulated},
        "real": {"model": "metrale-default", "requests": args.real_requests,
                 "kv_blocks_per_engine": args.real_kv_blocks,
                 "note": "two engines on two simulated CPU devices sharing the same cores",
                 "results": measured},
    })


if __name__ == "__main__":
    main()
