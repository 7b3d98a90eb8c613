"""Soak: hundreds of concurrent mixed streams over the in-process server, with clients that
disconnect mid-stream and clients that abort, for two bounded rounds.

What must hold after each round: every stream that was read to its end carries `[DONE]`, a
finish reason per choice and a usage whose completion tokens equal the token entries it
streamed (nothing lost, nothing sent twice); greedy streams equal solo runs; the engine
holds no blocks, slots, requests, parked sequences or spill files; the server holds no
open requests, tasks or threads beyond what it had before; and the process's resident
memory does not keep growing from the first round to the second.

Sized for 2 cores: the small shared engine (4 rows a step), short generations, every wait
bounded by `ROUND_TIMEOUT_S`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pathlib
import random
import threading

import aiohttp
import pytest

from server.app import create_app
from server.openai_routes import STATE
from server.state import ServerConfig
from tests.server_fixtures import MODEL, TIGHT_ENGINE

STREAMS = 200               # concurrent requests a round
ROUNDS = 2
DISCONNECT_EVERY = 8        # 1 in 8 closes its connection after a few chunks (12.5%)
ABORT_EVERY = 13            # 1 in 13 cancels its own task after the first chunk (~7.7%)
GREEDY_EVERY = 5            # 1 in 5 is greedy and checked against its solo run
ROUND_TIMEOUT_S = 240
RSS_GROWTH_LIMIT_MB = 48    # round 2 may not add more than this over round 1

PROMPTS = ["To be, or not to be", "What light through yonder window breaks",
           "Now is the winter of our discontent", "Friends, Romans, countrymen",
           "All the world's a stage", "Once more unto the breach"]


@pytest.fixture(scope="module")
def llm():
    from metrale_jax.async_engine import AsyncLLM
    engine = AsyncLLM(MODEL, **TIGHT_ENGINE)
    engine.start()
    yield engine
    engine.shutdown(timeout=60)


@pytest.fixture
async def client(llm, aiohttp_client):
    # Every stream needs its own connection (no client-side pool limit), closed after its
    # response, so a connection task still alive afterwards is a leak, not keep-alive.
    app = create_app(llm, ServerConfig(max_waiting=4 * STREAMS))
    return await aiohttp_client(app, server_kwargs={"handler_cancellation": True},
                                connector=aiohttp.TCPConnector(limit=0, force_close=True))


# ---- one request of the mix ---------------------------------------------------------------

@dataclasses.dataclass
class Plan:
    index: int
    path: str
    body: dict
    ending: str                  # "read" (to the end), "disconnect" or "abort"
    greedy: bool = False


def make_plan(i: int, rng: random.Random) -> Plan:
    chat = rng.random() < 0.3
    greedy = i % GREEDY_EVERY == 0
    prompt = PROMPTS[i % len(PROMPTS)]
    # Some run long enough to crowd the 19-block pool (preemption and swap under load).
    body: dict = {"max_tokens": rng.choice([rng.randint(3, 12), rng.randint(24, 36)])}
    stream = rng.random() < 0.9 or greedy
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    if greedy:
        body.update(temperature=0.0, ignore_eos=True, max_tokens=8)
        chat = False
    else:
        body.update(temperature=rng.choice([0.0, 0.7, 1.0, 1.3]), seed=rng.randrange(2**31),
                    n=rng.choice([1, 1, 1, 2]))
        if rng.random() < 0.3:
            body["top_p"] = rng.choice([0.5, 0.9])
        if rng.random() < 0.3:
            body["top_k"] = rng.choice([1, 5, 40])
        if rng.random() < 0.2:
            body["stop"] = [rng.choice(["e", "the", "\n"])]
    if chat:
        body.update(messages=[{"role": "user", "content": prompt}], logprobs=True,
                    top_logprobs=rng.choice([0, 1]))
    else:
        body.update(prompt=prompt, logprobs=rng.choice([0, 1]))
    ending = ("abort" if i % ABORT_EVERY == 1 else
              "disconnect" if i % DISCONNECT_EVERY == 3 else "read")
    if greedy or not stream:
        ending = "read"
    return Plan(i, "/v1/chat/completions" if chat else "/v1/completions", body, ending, greedy)


@dataclasses.dataclass
class Outcome:
    plan: Plan
    events: list = dataclasses.field(default_factory=list)
    done: bool = False           # the literal [DONE] arrived


async def run_one(client, plan: Plan, first_chunk: asyncio.Event) -> Outcome:
    out = Outcome(plan)
    async with client.post(plan.path, json=plan.body) as resp:
        assert resp.status == 200, await resp.text()
        if not plan.body.get("stream"):
            out.events, out.done = [await resp.json()], True
            return out
        buffer = b""
        async for piece in resp.content.iter_any():
            buffer += piece
            while b"\n\n" in buffer:
                block, buffer = buffer.split(b"\n\n", 1)
                payload = block.decode().removeprefix("data: ")
                if payload == "[DONE]":
                    out.done = True
                    continue
                out.events.append(json.loads(payload))
                first_chunk.set()
                if plan.ending == "disconnect" and len(out.events) >= 2:
                    resp.close()  # drop the connection mid-stream
                    return out
    return out


def as_stream(body: dict) -> list:
    """A non-streamed answer in the shape of its stream: its choices, then its usage."""
    choices = [{**c, "delta": c.get("message", {})} for c in body["choices"]]
    return [{"choices": choices}, {"choices": [], "usage": body["usage"]}]


def streamed_text(events: list, chat: bool) -> dict[int, str]:
    text: dict[int, str] = {}
    for e in events:
        for c in e["choices"]:
            piece = c["delta"].get("content", "") if chat else c["text"]
            text[c["index"]] = text.get(c["index"], "") + (piece or "")
    return text


def token_entries(events: list, chat: bool) -> int:
    n = 0
    for e in events:
        for c in e["choices"]:
            if c.get("logprobs"):
                n += len(c["logprobs"]["content"] if chat else c["logprobs"]["tokens"])
    return n


def check_complete(out: Outcome, solo: dict[str, str]) -> int:
    """A stream read to its end: [DONE], a finish reason per choice, usage equal to what
    was streamed, and a greedy stream equal to its solo run. Returns its tokens."""
    plan, chat = out.plan, out.plan.path.endswith("chat/completions")
    assert out.done, f"stream {plan.index} ended without [DONE]"
    if not plan.body.get("stream"):
        out.events = as_stream(out.events[0])
    usage = [e for e in out.events if not e["choices"]]
    assert len(usage) == 1, f"stream {plan.index}: {len(usage)} usage chunks"
    finishes = {c["index"]: c["finish_reason"] for e in out.events for c in e["choices"]
                if c["finish_reason"] is not None}
    assert set(finishes) == set(range(plan.body.get("n", 1))), (plan.index, finishes)
    assert set(finishes.values()) <= {"stop", "length"}, finishes
    tokens = token_entries(out.events, chat)
    assert usage[0]["usage"]["completion_tokens"] == tokens, (plan.index, usage, tokens)
    if plan.greedy:
        assert streamed_text(out.events, chat) == {0: solo[plan.body["prompt"]]}, plan.index
    return tokens


# ---- rounds -------------------------------------------------------------------------------

async def solo_runs(client) -> dict[str, str]:
    solo = {}
    for prompt in PROMPTS:  # one at a time: each runs alone in its steps
        resp = await client.post("/v1/completions", json={
            "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True})
        solo[prompt] = (await resp.json())["choices"][0]["text"]
    return solo


async def run_round(client, seed: int, solo: dict[str, str]) -> dict:
    rng = random.Random(seed)
    plans = [make_plan(i, rng) for i in range(STREAMS)]
    tasks = []
    for plan in plans:
        first = asyncio.Event()
        tasks.append((plan, first, asyncio.create_task(run_one(client, plan, first))))
    aborted = 0
    for plan, first, task in tasks:
        if plan.ending == "abort":
            await asyncio.wait_for(first.wait(), ROUND_TIMEOUT_S)
            task.cancel()
            aborted += 1
    results = await asyncio.wait_for(
        asyncio.gather(*(t for _, _, t in tasks), return_exceptions=True), ROUND_TIMEOUT_S)
    figures = {"streams": STREAMS, "aborted": aborted, "disconnected": 0, "completed": 0,
               "tokens": 0}
    for (plan, _, _), result in zip(tasks, results):
        if plan.ending == "abort":
            assert isinstance(result, (asyncio.CancelledError, Outcome)), result
            continue
        assert isinstance(result, Outcome), f"stream {plan.index} raised {result!r}"
        if plan.ending == "disconnect":
            figures["disconnected"] += 1
            continue
        figures["tokens"] += check_complete(result, solo)
        figures["completed"] += 1
    return figures


async def settle(client, llm) -> None:
    """Wait (on events, not time) until the server has no open request, then run one more
    request: the engine drains aborts before admitting it, and publishes its snapshot
    after releasing it, so the snapshot read afterwards is the state after the round."""
    state = client.server.app[STATE]
    await asyncio.wait_for(state.idle.wait(), ROUND_TIMEOUT_S)
    resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert resp.status == 200
    await resp.read()


def check_no_leaks(llm, state) -> None:
    snap = llm.snapshot()
    assert snap.requests_len == 0 and snap.running_seqs == 0, snap
    assert snap.waiting_len == 0 and snap.swapped_seqs == 0, snap
    assert snap.kv_blocks_used == 0, snap  # only free or reclaimable cached blocks
    assert snap.ssm_slots_used <= snap.ssm_slots_total, snap
    assert state.open_requests == 0 and state.open_seqs == 0
    assert not llm._sink.targets, "the engine still streams to finished requests"
    spill = llm.engine._own_spill_dir
    if spill is not None:
        # No request here opens a session, so nothing may stay on disk: neither a spilled
        # sequence's files nor a tier entry (the tier's own empty folder is not a leak).
        left = [p for p in pathlib.Path(spill).rglob("*") if p.is_file()]
        assert not left, f"spill files left behind: {left}"


def rss_mb() -> float:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def test_soak_mixed_streams_with_disconnects(client, llm):
    state = client.server.app[STATE]
    solo = await solo_runs(client)
    await settle(client, llm)
    tasks_before = {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}
    threads_before = threading.active_count()
    rss, rounds = [], []
    for r in range(ROUNDS):
        figures = await run_round(client, seed=r, solo=solo)
        await settle(client, llm)
        check_no_leaks(llm, state)
        rss.append(rss_mb())
        rounds.append(figures)
        assert figures["disconnected"] + figures["aborted"] >= STREAMS // 10, figures
        assert figures["completed"] + figures["disconnected"] + figures["aborted"] == STREAMS
    tasks_after = {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}
    assert len(tasks_after - tasks_before) == 0, tasks_after - tasks_before
    assert threading.active_count() <= threads_before
    assert rss[1] - rss[0] < RSS_GROWTH_LIMIT_MB, rss
    counters = llm.stats()["counters"]
    # The tight pool must actually have been crowded, or the soak proved less than it says.
    assert counters.get("preemptions", 0) + counters.get("spills", 0) > 0, counters
    print(f"soak: {rounds}, rss MB {rss}, engine {llm.stats()['counters']}")
