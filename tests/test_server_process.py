"""A real `metrale serve` process on loopback, driven by the official `openai` client:
completions and chat (streamed and not), n > 1, logprobs, echo with prompt logprobs, stop
strings, seeds, greedy parity with `LLM.generate`, 64 concurrent streaming clients, 50
clients that disconnect mid-stream, and a SIGTERM drain. Runs last: the drain stops it."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time

import aiohttp
import openai
import pytest

from metrale_jax.engine import LLM
from metrale_jax.request import SamplingParams
from tests.server_process import MODEL, health, start_server, stop_server

KEY = "process-test-key"
ENGINE_ARGS = ["--max-seq-len", "128", "--max-batch-size", "16", "--max-tokens-per-tick", "64",
               "--block-size", "8", "--num-kv-blocks", "160", "--max-logprobs", "2",
               "--token-buckets", "32,64", "--seq-buckets", "16", "--query-buckets", "1,16,64",
               "--block-buckets", "16"]
ENGINE = dict(max_seq_len=128, max_batch_size=16, max_tokens_per_tick=64, block_size=8,
              num_kv_blocks=160, max_logprobs=2, token_buckets=(32, 64), seq_buckets=(16,),
              query_buckets=(1, 16, 64), block_buckets=(16,))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    server = start_server(["--api-key", KEY, *ENGINE_ARGS], log)
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def offline():
    return LLM(MODEL, **ENGINE, warmup=False)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server['base']}/v1", api_key=KEY, max_retries=0)


def test_ready_after_starting_and_logged(server):
    assert "ok" in server["seen"]
    assert "metrale is ready" in server["log"].read_text()


def test_health_counts_the_variants_compiling_beside_serving_down_to_zero(server):
    # The server answered once the covering shapes were compiled; the rest compile beside
    # serving, and /health counts them down (bounded poll of the child process).
    counts, deadline = [], time.monotonic() + 300
    while time.monotonic() < deadline:
        status, body = health(server["base"])
        assert status == 200
        counts.append(body["compiling_variants"])
        if counts[-1] == 0:
            break
        with pytest.raises(subprocess.TimeoutExpired):
            server["proc"].wait(timeout=0.2)  # the poll interval; raises while it runs
    assert counts[-1] == 0 and counts == sorted(counts, reverse=True)
    assert "more compiling beside serving" in server["log"].read_text()


def test_completions_greedy_equal_offline_and_stream(client, offline):
    prompts = ["To be, or not to be", "Friends, Romans", "All the world's a stage"]
    got = client.completions.create(model=offline.engine.model_name, prompt=prompts,
                                    max_tokens=10, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    want = offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10,
                                                    ignore_eos=True))
    texts = [c.text for c in sorted(got.choices, key=lambda c: c.index)]
    assert texts == [o.outputs[0].text for o in want]
    assert got.usage.completion_tokens == 30
    stream = client.completions.create(model=offline.engine.model_name, prompt=prompts[0],
                                       max_tokens=10, temperature=0.0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == texts[0]
    assert chunks[-1].usage.completion_tokens == 10


def test_seeded_n_logprobs_stop_and_echo(client, offline):
    name = offline.engine.model_name
    kwargs = dict(model=name, prompt="Once more unto the breach", max_tokens=12, n=2,
                  temperature=0.8, seed=42, logprobs=2, extra_body={"ignore_eos": True})
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len(first.choices) == 2
    assert all(len(c.logprobs.token_logprobs) == 12 for c in first.choices)
    streamed = {}
    for chunk in client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(2)] == [c.text for c in first.choices]

    text = first.choices[0].text
    stop = text[3:5] if len(text) >= 5 else text
    cut = client.completions.create(**{**kwargs, "n": 1, "logprobs": None}, stop=[stop])
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"

    echo = client.completions.create(model=name, prompt="Once more", max_tokens=3,
                                     temperature=0.0, echo=True, logprobs=1,
                                     extra_body={"prompt_logprobs": 1})
    choice = echo.choices[0]
    assert choice.text.startswith("Once more")
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.model_extra["prompt_logprobs"][0] is None


def test_chat_streamed_and_not(client, offline):
    name = offline.engine.model_name
    messages = [{"role": "user", "content": "Shall I compare thee"}]
    whole = client.chat.completions.create(model=name, messages=messages, max_tokens=8,
                                           temperature=0.7, seed=3, logprobs=True,
                                           top_logprobs=2)
    assert whole.choices[0].message.role == "assistant"
    assert len(whole.choices[0].logprobs.content) == whole.usage.completion_tokens
    stream = client.chat.completions.create(model=name, messages=messages, max_tokens=8,
                                            temperature=0.7, seed=3, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0) \
            .models.list()
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=name, messages=[], max_tokens=2)


async def _solo_and_concurrent(base: str, name: str):
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)

    def body(i: int) -> dict:
        sampled = i % 2 == 1
        return dict(model=name, prompt=f"Scene {i}: enter the ghost of", max_tokens=8,
                    temperature=0.8 if sampled else 0.0, seed=i if sampled else None,
                    extra_body={"ignore_eos": True})

    async def one(i: int, stream: bool) -> str:
        if not stream:
            return (await client.completions.create(**body(i))).choices[0].text
        text = ""
        async for chunk in await client.completions.create(**body(i), stream=True):
            text += "".join(c.text for c in chunk.choices)
        return text

    alone = [await one(i, stream=False) for i in range(64)]
    together = await asyncio.gather(*(one(i, stream=True) for i in range(64)))
    await client.close()
    return alone, together


def test_64_concurrent_streaming_clients_get_their_solo_output(server, offline):
    alone, together = asyncio.run(_solo_and_concurrent(server["base"],
                                                       offline.engine.model_name))
    assert together == alone


async def _disconnect_50(base: str) -> dict:
    headers = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession(headers=headers) as session:
        async def leave(i: int) -> None:
            resp = await session.post(f"{base}/v1/completions", json={
                "prompt": f"Leaving {i}", "max_tokens": 100, "stream": True,
                "temperature": 0.0, "ignore_eos": True})
            assert resp.status == 200
            await resp.content.readline()  # the first chunk arrived: mid-stream
            resp.close()                    # ... and the client goes away

        await asyncio.gather(*(leave(i) for i in range(50)))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # bounded poll of the engine's pool
            async with session.get(f"{base}/v1/admin/snapshot") as resp:
                now = (await resp.json())["now"]
            if now["requests_in_engine"] == 0 and now["kv_blocks_used"] == 0:
                return now  # each poll is one round trip to the server: no sleeping
        return now


async def _aborted(base: str) -> float:
    headers = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession(headers=headers) as session:
        async with session.get(f"{base}/metrics") as resp:
            text = await resp.text()
    line = next(x for x in text.splitlines()
                if x.startswith("metrale:request_success_total") and '"abort"' in x)
    return float(line.rsplit(" ", 1)[1])


def test_50_clients_that_disconnect_give_their_blocks_back(server):
    now = asyncio.run(_disconnect_50(server["base"]))
    assert now["requests_in_engine"] == 0 and now["kv_blocks_used"] == 0
    assert now["kv_blocks_free"] + now["kv_blocks_cached"] == now["kv_blocks_usable"]
    assert asyncio.run(_aborted(server["base"])) >= 50  # aborted, not run to the end


async def _drain(server) -> tuple[list, int, int]:
    base, proc = server["base"], server["proc"]
    headers = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession(headers=headers) as session:
        resp = await session.post(f"{base}/v1/completions", json={
            "prompt": "The last words", "max_tokens": 60, "stream": True, "temperature": 0.0,
            "ignore_eos": True})
        first = await resp.content.readline()
        proc.send_signal(signal.SIGTERM)
        status = None
        for _ in range(5000):  # bounded: until the server has seen the signal
            async with session.get(f"{base}/health") as health:
                if (await health.json())["status"] == "draining":
                    async with session.post(f"{base}/v1/completions", json={
                            "prompt": "too late", "max_tokens": 2}) as late:
                        status = late.status
                    break
        rest = (first + await resp.read()).decode()
    events = [e.strip()[len("data: "):] for e in rest.split("\n\n") if e.strip()]
    code = await asyncio.to_thread(proc.wait, 120)
    return events, status, code


def test_sigterm_drains_in_flight_then_exits(server):
    events, late_status, code = asyncio.run(_drain(server))
    assert late_status == 503
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert code == 0
    assert "stopped" in server["log"].read_text()
