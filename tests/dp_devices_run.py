"""dp=2 through the server on two simulated CPU devices, as its own process.

`python -m tests.dp_devices_run` sets `--xla_force_host_platform_device_count=2` before jax is
imported (a pytest worker has imported it already), builds `DataParallelAsyncLLM` (engine i
on device i, each with its own tick loop) behind the aiohttp app in-process, and sends a
mixed workload through the official `openai` client: two prompt families sharing a prefix of
several blocks (the first request carries one of each, so the router puts them on
different engines; the rest, streamed and not, follow their prefix), prompts sharing
nothing, a chat request. It then prints one JSON line: the served texts, one engine's greedy
texts for the same prompts (the offline `LLM` on one device), the per-engine prefix-cache
queries from /metrics, the family prompts' token counts, /health and the admin snapshot's
engine count. tests/test_server_data_parallel.py asserts on it.
"""

from __future__ import annotations

import os

DEVICES = 2
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={DEVICES}").strip()

import asyncio  # noqa: E402  (after XLA_FLAGS)
import json  # noqa: E402

GREEDY = dict(temperature=0.0, max_tokens=6)
PREFIX_A = "The quick brown fox jumps over the lazy dog while the sun sets slowly"
PREFIX_B = "Four score and seven years ago our fathers brought forth on this continent"
TAILS = [" and then", " so it goes"]
OTHERS = ["Now is the winter", "What light through yonder"]
CHAT = [{"role": "user", "content": "Speak of love."}]


async def serve(group) -> dict:
    import openai
    from aiohttp.test_utils import TestClient, TestServer
    from prometheus_client.parser import text_string_to_metric_families

    from server.app import create_app

    async with TestClient(TestServer(create_app(group))) as client:
        c = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="none",
                               max_retries=0)
        model, extra = group.limits.model_name, {"ignore_eos": True}

        async def complete(prompt: str, stream: bool) -> str:
            if not stream:
                out = await c.completions.create(model=model, prompt=prompt, **GREEDY,
                                                 extra_body=extra)
                return out.choices[0].text
            chunks = await c.completions.create(model=model, prompt=prompt, **GREEDY,
                                                extra_body=extra, stream=True)
            return "".join([ch.choices[0].text async for ch in chunks if ch.choices])

        fam_a, fam_b = [PREFIX_A + t for t in TAILS], [PREFIX_B + t for t in TAILS]
        first = await c.completions.create(model=model, prompt=[fam_a[0], fam_b[0]], **GREEDY,
                                           extra_body=extra)
        served = [ch.text for ch in sorted(first.choices, key=lambda ch: ch.index)]
        rest = fam_a[1:] + fam_b[1:]
        served += await asyncio.gather(*(complete(p, i % 2 == 0) for i, p in enumerate(rest)))
        text = await (await client.get("/metrics")).text()
        queries = {s.labels["engine"]: s.value
                   for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "metrale:prefix_cache_queries_total"}
        served += await asyncio.gather(*(complete(p, i % 2 == 1) for i, p in enumerate(OTHERS)))
        chat = await c.chat.completions.create(model=model, messages=CHAT, **GREEDY,
                                               extra_body=extra)
        served.append(chat.choices[0].message.content)
        health = (await client.get("/health")).status
        snap = await (await client.get("/v1/admin/snapshot")).json()
        await c.close()
    prompts = [fam_a[0], fam_b[0]] + rest + OTHERS
    return {"served": served, "queries": queries, "health": health,
            "engines_in_snapshot": len(snap["engines"]),
            "family_tokens": [sum(len(group.tokenize(p)) for p in fam)
                              for fam in (fam_a, fam_b)],
            "prompts": prompts}


def one_engine(prompts: list[str], chat_ids: list[int]) -> list[str]:
    from metrale_jax.engine import LLM
    from metrale_jax.request import SamplingParams
    from tests.server_fixtures import ENGINE, MODEL

    llm = LLM(MODEL, **ENGINE, warmup=False)
    inputs = prompts + [{"prompt_token_ids": chat_ids}]
    outs = llm.generate(inputs, SamplingParams(**GREEDY, ignore_eos=True))
    return [o.outputs[0].text for o in outs]


def main() -> None:
    import jax

    from metrale_jax.parallel.async_data_parallel import DataParallelAsyncLLM
    from metrale_jax.parallel.config import ParallelConfig
    from tests.server_fixtures import ENGINE, MODEL

    assert len(jax.devices()) >= DEVICES, jax.devices()
    group = DataParallelAsyncLLM(MODEL, parallel=ParallelConfig(1, DEVICES), **ENGINE)
    group.start()
    try:
        run = asyncio.run(serve(group))
    finally:
        group.shutdown(timeout=30)
    chat_ids = group.tokenize(group.apply_chat_template(CHAT), add_special_tokens=False)
    run["one_engine"] = one_engine(run.pop("prompts"), chat_ids)
    run["devices"] = [[d.id for d in e.engine.runner.placement.mesh.devices.flat]
                      for e in group.engines]
    print(json.dumps(run))


if __name__ == "__main__":
    main()
