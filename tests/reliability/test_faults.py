"""Faults, injected through the spill backend, the runner and the clock (never by sleeping),
each with its expected outcome in the test's docstring:

  spill write failure and full disk   nothing lost, exact recompute, back-off, one notice
  corrupt or truncated spill file      detected at swap-in, exact recompute
  an exception in a step               that step's requests fail, everyone else finishes
  repeated step failures               the loop stops, /health 503, no request hangs
  a client that reads slowly           the others are not held up, every token once
  kill -9 then restart; SIGTERM        stale spill directory gone; streams end; exit 0

One offline engine (a small KV pool, so sequences spill), one served engine and two server
processes are shared by the tests; every loop is bounded in count and time.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import signal

import aiohttp
import pytest

from metrale_jax.async_engine import AsyncLLM
from metrale_jax.engine import LLM
from metrale_jax.request import SamplingParams
from metrale_jax.scheduler import parking
from metrale_jax.scheduler.faults import MAX_STEP_FAILURES_IN_A_ROW
from metrale_jax.telemetry import FakeClock
from server.app import create_app
from server.state import ServerConfig
from tests.fake_runner import reference_continuation
from tests.reliability.injection import FaultyRunner, FaultySpill, install
from tests.scheduler_harness import assert_accounted, drive, make_core, make_request
from tests.server_fixtures import ENGINE, MODEL
from tests.server_process import start_server, stop_server

SMALL_POOL = dict(ENGINE, num_kv_blocks=20)  # 19 usable blocks of 8: six 45-token sequences
                                             # need 36, so some spill or are preempted
SPILL_PROMPTS = ["To be, or not", "What light", "Now is the winter", "Friends, Romans",
                 "Once more unto", "All the world"]
STEP_PROMPTS = ["Shall I compare", "If music be", "The quality of", "Cry havoc",
                "Double, double"]  # the fifth waits: max_batch_size is 4
BUDGET = ENGINE["max_tokens_per_tick"]
LIMIT_S = 60  # no await in these tests may take longer


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


class Offline:
    """The offline engine with its injected spill store, clock and runner wrapper."""

    def __init__(self, spill_dir):
        self.store = FaultySpill(spill_dir)
        self.clock = FakeClock()  # time moves only when a test says so (the spill back-off)
        self.llm = LLM(MODEL, clock=self.clock, spill_backend=self.store, warmup=False,
                       **SMALL_POOL)
        self.engine = self.llm.engine
        self.runner = FaultyRunner(self.engine.runner)
        install(self.engine.core, self.runner)
        self._solo: dict = {}

    def solo(self, prompt: str, max_tokens: int):
        """The prompt's completion run alone (no memory pressure, no fault): the reference."""
        key = (prompt, max_tokens)
        if key not in self._solo:
            self._solo[key] = self.llm.generate(prompt, greedy(max_tokens))[0].outputs[0]
        return self._solo[key]

    def counters(self) -> dict:
        return self.engine.stats()["counters"]

    def reset(self) -> None:
        self.store.mode = None
        self.runner.disarm()
        self.engine.levers.set(max_tokens_per_tick=BUDGET)
        self.clock.advance(10 * parking.SPILL_BACKOFF_S[1])  # past any spill pause


@pytest.fixture(scope="module")
def offline_engine(tmp_path_factory):
    return Offline(tmp_path_factory.mktemp("spill"))


@pytest.fixture
def offline(offline_engine):
    offline_engine.reset()
    yield offline_engine
    offline_engine.reset()


def _delta(after: dict, before: dict) -> collections.Counter:
    """What each counter grew by (0 for a counter never touched)."""
    return collections.Counter({k: after.get(k, 0) - before.get(k, 0) for k in after})


def _drive(engine, cond, limit: int = 3000) -> None:
    for _ in range(limit):
        if cond():
            return
        engine.step()
    raise AssertionError("condition never held")


# ---- the spill backend ------------------------------------------------------------------------

def test_spill_write_failures_lose_nothing_back_off_and_recover(offline, caplog):
    """Expected, round by round (six 40-token requests on the small pool):
      1. a full disk (ENOSPC inside the store): the first spill attempt fails, that sequence
         stays where it was, and spilling pauses for SPILL_BACKOFF_S[0] of the injected
         clock, so the run makes no second attempt (no retry storm): room comes from
         preemption by exact recompute. One error line.
      2. after that pause, a bare OSError from the backend: one attempt again, and the pause
         doubles.
      3. the disk works again: sequences spill and swap back in.
    Every round's outputs equal their solo runs; the spill directory ends empty."""
    want = [offline.solo(p, 40).token_ids for p in SPILL_PROMPTS]
    parked, first = offline.engine.core.parking, parking.SPILL_BACKOFF_S[0]
    for mode, pause in [("enospc", first), ("eio", 2 * first), (None, 0.0)]:
        offline.store.mode = mode
        before, writes = offline.counters(), offline.store.writes
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="metrale_jax.scheduler.parking"):
            got = offline.llm.generate(SPILL_PROMPTS, greedy(40))
        assert [o.outputs[0].token_ids for o in got] == want, mode
        delta = _delta(offline.counters(), before)
        notices = [r for r in caplog.records if "swap-out failed" in r.getMessage()]
        if mode is None:
            assert delta["spills"] >= 1 and delta["swap_ins"] == delta["spills"]
            assert delta["spill_failures"] == 0 and not notices
            break
        assert offline.store.writes - writes == 1 and len(notices) == 1, mode
        assert delta["spill_failures"] == 1 and delta["spills"] == 0
        assert delta["preemptions"] >= 1  # recompute made the room instead
        offline.clock.advance(pause - 0.5)
        assert not parked.can_spill()
        offline.clock.advance(0.5)
        assert parked.can_spill()
    assert offline.store.keys() == [] and not list(offline.store.directory.iterdir())


@pytest.mark.parametrize("mode", ["corrupt", "truncate"])
def test_damaged_spill_file_falls_back_to_exact_recompute(offline, mode, caplog):
    """Expected: every spill is written, then damaged on disk (a flipped byte, or the file
    cut in half). Swap-in detects it (the manifest's blake2b checksum, or the file size),
    drops the file set with a warning naming it, and the sequence recomputes from its
    tokens: no swap-in happens, every output equals its solo run, nothing stays on disk."""
    want = [offline.solo(p, 40).token_ids for p in SPILL_PROMPTS]
    offline.store.mode = mode
    before, reads = offline.counters(), offline.store.reads
    with caplog.at_level(logging.WARNING, logger="metrale_jax.scheduler.parking"):
        got = offline.llm.generate(SPILL_PROMPTS, greedy(40))
    assert [o.outputs[0].token_ids for o in got] == want
    delta = _delta(offline.counters(), before)
    assert delta["spills"] >= 1 and delta["spill_corrupt"] == delta["spills"]
    assert delta["swap_ins"] == 0 and offline.store.reads - reads == delta["spills"]
    found = "checksum mismatch" if mode == "corrupt" else "truncated"
    assert sum(found in r.getMessage() for r in caplog.records) == delta["spills"]
    assert offline.store.keys() == [] and not list(offline.store.directory.iterdir())


# ---- the runner: an exception in a step -------------------------------------------------------

@pytest.mark.parametrize("where", ["dispatch", "collect"])
@pytest.mark.parametrize("lose_caches", [False, True], ids=["caches-kept", "caches-lost"])
def test_exception_in_a_step_fails_that_step_alone(offline, where, lose_caches, caplog):
    """Expected: four requests decode, a fifth waits; the token budget is cut to two, so
    each step carries the first two decodes only. The next step raises (at dispatch, or
    when read back). Its two requests end with finish_reason "error" and a message naming
    the failure; the two running sequences left out of the step continue in place (caches
    kept) or recompute exactly (the failure took the caches: they are re-allocated); the
    waiting request then runs. All three equal their solo runs. One error line, with the
    traceback."""
    engine, core, runner = offline.engine, offline.engine.core, offline.runner
    want = {p: offline.solo(p, 12).token_ids for p in STEP_PROMPTS}
    requests = [engine.make_request(p, greedy(12)) for p in STEP_PROMPTS]
    for r in requests:
        engine.submit(r)
    _drive(engine, lambda: all(len(r.sequences[0].output_ids) >= 2 for r in requests[:4]))
    engine.levers.set(max_tokens_per_tick=2)
    engine.step()  # the step left in flight carries two rows as well
    in_step = {s.request_id for s in core.active[:2]}
    before, fired = offline.counters(), runner.fired
    runner.arm(**{where: 1}, lose_caches=lose_caches)
    with caplog.at_level(logging.ERROR, logger="metrale_jax.scheduler.core"):
        _drive(engine, lambda: runner.fired > fired)
    engine.levers.set(max_tokens_per_tick=BUDGET)
    _drive(engine, lambda: all(r.finished for r in requests))
    engine.drain()

    failed = {r.request_id for r in requests if r.sequences[0].finish_reason == "error"}
    assert failed == in_step
    for prompt, r in zip(STEP_PROMPTS, requests):
        seq = r.sequences[0]
        if r.request_id in failed:
            assert "the engine failed the step running this request" in seq.error
            assert f"{where}: InjectedFault" in seq.error
        else:
            assert seq.error is None and seq.output_ids == want[prompt]
    delta = _delta(offline.counters(), before)
    assert delta["step_failures"] == 1 and delta["cache_losses"] == int(lose_caches)
    assert delta["preemptions"] == (2 if lose_caches else 0)
    logged = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(logged) == 1 and logged[0].exc_info is not None
    assert not core.has_work and core.pool.num_used == 0


def test_failures_apart_do_not_stop_the_loop_on_the_fake_runner():
    """Expected (the scheduler on the fake runner, exact outputs; a budget of two tokens,
    so two of the four running sequences sit out each step): the 20th dispatch and the
    28th collect fail, each taking the caches with it. Each failure fails only the
    requests of its step (at most two); the running sequences left out recompute; a step
    read back in between resets the count, so the loop never stops. Every other request
    equals its reference continuation, and every block, slot and spill file comes back."""
    core = make_core(max_batch=4, budget=2)
    runner = FaultyRunner(core.runner)
    install(core, runner)
    runner.arm(dispatch=20, collect=28, lose_caches=True)
    requests = [make_request(list(range(10 * i + 1, 10 * i + 8)), 8) for i in range(6)]
    for r in requests:
        core.inbox.submit(r)
    drive(core, requests)
    assert runner.fired == 2 and core.halted is None
    failed = [r for r in requests if r.sequences[0].finish_reason == "error"]
    assert 2 <= len(failed) <= 4
    for r in requests:
        seq = r.sequences[0]
        if r not in failed:
            assert seq.output_ids == reference_continuation(seq.prompt_ids, 8)
    counters = core.tel.counters()
    assert counters["step_failures"] == 2 and counters["cache_losses"] == 2
    assert counters["preemptions"] >= 2  # running, out of the step: they recomputed
    assert_accounted(core)


def test_repeated_step_failures_stop_the_loop_and_answer_everyone():
    """Expected (fake runner, every dispatch raising): each failed step fails its own
    requests; the MAX_STEP_FAILURES_IN_A_ROW-th failure in a row stops the loop: tick()
    returns False from then on, the inbox refuses new work, and the requests still held
    (waiting behind the failed ones) are answered with "the engine stopped: ...". Every
    request is finished and reported: nothing hangs."""
    core = make_core(max_batch=4)
    runner = FaultyRunner(core.runner)
    runner.always = True
    install(core, runner)
    requests = [make_request([5, 6, 7], 4) for _ in range(4 * MAX_STEP_FAILURES_IN_A_ROW + 2)]
    for r in requests:
        core.inbox.submit(r)
    for _ in range(100):
        if not core.tick():
            break
    assert not core.tick() and core.halted is not None
    with pytest.raises(RuntimeError):
        core.inbox.submit(make_request([1, 2], 2))
    errors = [r.sequences[0].error or "" for r in requests]
    assert all(r.finished for r in requests)
    assert sorted(core.sink.finished) == sorted(r.request_id for r in requests)
    assert sum("failed the step" in e for e in errors) == 4 * MAX_STEP_FAILURES_IN_A_ROW
    assert sum(e.startswith("the engine stopped: 3 steps in a row failed") for e in errors) \
        == 2
    assert core.tel.counters()["step_failures"] == MAX_STEP_FAILURES_IN_A_ROW
    assert_accounted(core)


# ---- the in-process server ----------------------------------------------------------------

@pytest.fixture(scope="module")
def served():
    """A started engine with a runner wrapper the tests arm (disarmed between tests)."""
    llm = AsyncLLM(MODEL, **ENGINE)
    runner = FaultyRunner(llm.engine.runner)
    install(llm.engine.core, runner)
    llm.start()
    yield llm, runner
    llm.shutdown(timeout=30)


def completion(prompt: str, max_tokens: int, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            **extra}


def sse_payloads(raw: bytes) -> list:
    """The `data:` payloads of an SSE body: JSON objects, then the literal "[DONE]"."""
    events = [e.strip() for e in raw.decode().split("\n\n") if e.strip()]
    assert all(e.startswith("data: ") for e in events), raw
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in events]


async def test_a_failed_step_answers_its_request_with_an_openai_error(served, aiohttp_client):
    """Expected: a request whose step raises gets HTTP 500 with an OpenAI error object
    (type "server_error", code "engine_error", the cause in the message) when not
    streamed; when streamed, the tokens already sent, then an error event, then [DONE].
    /health stays 200 "ok" and the next request equals its solo run."""
    llm, runner = served
    client = await aiohttp_client(create_app(llm))
    body = completion("Good night, good night", 8)
    solo = await (await client.post("/v1/completions", json=body)).json()
    try:
        runner.arm(dispatch=1)
        resp = await client.post("/v1/completions", json=body)
        error = (await resp.json())["error"]
        assert resp.status == 500 and error["type"] == "server_error"
        assert error["code"] == "engine_error" and "InjectedFault" in error["message"]

        resp = await client.post("/v1/completions", json=completion("Parting is", 40,
                                                                      stream=True))
        first = await asyncio.wait_for(resp.content.readline(), LIMIT_S)  # one token sent
        runner.arm(dispatch=1)
        events = sse_payloads(first + await asyncio.wait_for(resp.read(), LIMIT_S))
        assert events[-1] == "[DONE]" and events[0]["choices"][0]["text"]
        assert events[-2]["error"]["code"] == "engine_error"
        assert all("choices" in e for e in events[:-2])
    finally:
        runner.disarm()
    health = await client.get("/health")
    assert health.status == 200 and (await health.json())["status"] == "ok"
    again = await (await client.post("/v1/completions", json=body)).json()
    assert again["choices"][0]["text"] == solo["choices"][0]["text"]


async def _snapshot_until(client, cond, limit: int = 5000) -> dict:
    """Poll the admin snapshot (one round trip each, no sleeping) until `cond` holds."""
    for _ in range(limit):
        snap = await (await client.get("/v1/admin/snapshot")).json()
        if cond(snap["now"]):
            return snap["now"]
    raise AssertionError(f"snapshot never matched: {snap['now']}")


async def test_a_slow_reader_holds_no_one_up_and_gets_every_token_once(served,
                                                                       aiohttp_client):
    """Expected: one stream is read one event, then not at all, while three other
    requests run: they finish with their solo outputs, and the engine finishes the slow
    one too (it never waits for a reader). What the slow reader has not read waits in the
    server: its request's delta queue (an unbounded asyncio.Queue, in practice bounded by
    max_tokens deltas) and the socket buffers. Read afterwards, the slow stream carries
    every token exactly once: its text equals its solo run, with one logprobs entry per
    token and usage equal to max_tokens."""
    llm, _ = served
    client = await aiohttp_client(create_app(llm), read_bufsize=256)  # stop reading early
    others = ["Is this a dagger", "Out, damned spot", "Tomorrow, and tomorrow"]
    solo = {}
    for prompt in ["Now is the winter of", *others]:
        data = await (await client.post("/v1/completions", json=completion(prompt, 40))).json()
        solo[prompt] = data["choices"][0]["text"]
    slow = await client.post("/v1/completions", json=completion(
        "Now is the winter of", 40, stream=True, logprobs=1,
        stream_options={"include_usage": True}))
    first = await asyncio.wait_for(slow.content.readline(), LIMIT_S)
    answers = await asyncio.wait_for(asyncio.gather(*(
        client.post("/v1/completions", json=completion(p, 40)) for p in others)), LIMIT_S)
    for prompt, resp in zip(others, answers):
        assert (await resp.json())["choices"][0]["text"] == solo[prompt]
    await _snapshot_until(client, lambda now: now["requests_in_engine"] == 0)

    events = sse_payloads(first + await asyncio.wait_for(slow.read(), LIMIT_S))
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == solo["Now is the winter of"]
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks) == 40
    assert events[-2]["usage"]["completion_tokens"] == 40


async def test_repeated_step_failures_turn_unhealthy_and_nothing_hangs(aiohttp_client):
    """Expected: with every step raising, each of 4 x MAX + 4 concurrent requests is
    answered with an error within LIMIT_S: HTTP 500 (its step failed, or the engine
    stopped while it waited) or 503 (it arrived after the stop), streamed ones as an error
    event then [DONE]. After MAX failed steps in a row the loop stops: /health is 503
    "unhealthy" with the reason, the engine thread has ended, new requests get 503."""
    llm = AsyncLLM(MODEL, **ENGINE)  # never compiles: every dispatch raises first
    runner = FaultyRunner(llm.engine.runner)
    runner.always = True
    install(llm.engine.core, runner)
    client = await aiohttp_client(create_app(llm, ServerConfig(watchdog_interval_s=0.01)))
    llm.start()

    async def one(i: int) -> dict:
        stream = i % 2 == 1
        resp = await client.post("/v1/completions", json=completion(f"doomed {i}", 8,
                                                                      stream=stream))
        if resp.status == 200:
            assert stream
            events = sse_payloads(await resp.read())
            assert events[-1] == "[DONE]"
            return events[-2]["error"]
        assert resp.status in (500, 503)
        return (await resp.json())["error"]

    errors = await asyncio.wait_for(asyncio.gather(*(
        one(i) for i in range(4 * MAX_STEP_FAILURES_IN_A_ROW + 4))), LIMIT_S)
    assert all(e["type"] in ("server_error", "service_unavailable") for e in errors)
    assert any("InjectedFault" in e["message"] for e in errors)
    health = await client.get("/health")
    body = await health.json()
    assert health.status == 503 and body["status"] == "unhealthy"
    assert f"{MAX_STEP_FAILURES_IN_A_ROW} steps in a row failed" in body["error"]
    await asyncio.to_thread(llm._thread.join, LIMIT_S)
    assert not llm._thread.is_alive()
    assert llm.engine.stats()["counters"]["step_failures"] == MAX_STEP_FAILURES_IN_A_ROW
    late = await client.post("/v1/completions", json=completion("after", 2))
    assert late.status == 503
    await asyncio.to_thread(llm.shutdown, LIMIT_S)


# ---- server processes: kill -9, restart, SIGTERM ------------------------------------------

PROCESS_ARGS = ["--max-batch-size", "4", "--max-tokens-per-tick", "32", "--max-seq-len", "64",
                "--seq-buckets", "4", "--token-buckets", "16,32", "--query-buckets", "1,8,32",
                "--block-size", "8", "--num-kv-blocks", "40", "--block-buckets", "8",
                "--max-logprobs", "2"]  # ENGINE's settings


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    """A server killed with SIGKILL, then a second one started in the same temp folder."""
    tmp, logs = tmp_path_factory.mktemp("tmpdir"), tmp_path_factory.mktemp("logs")
    env = {**os.environ, "TMPDIR": str(tmp)}  # where each server makes its spill directory
    killed = start_server(PROCESS_ARGS, logs / "killed.log", env)
    left = sorted(tmp.glob(f"metrale-spill-{killed['proc'].pid}-*"))
    killed["proc"].kill()
    killed["proc"].wait(LIMIT_S)
    left_after_kill = [p for p in left if p.exists()]
    second = start_server(PROCESS_ARGS, logs / "second.log", env)
    yield {"tmp": tmp, "killed": killed, "left": left, "left_after_kill": left_after_kill,
           "second": second}
    stop_server(second)


def test_kill_9_then_restart_removes_the_stale_spill_directory(restarted, offline_engine):
    """Expected: the killed server (exit by SIGKILL) leaves its private spill directory
    behind; the next server started in the same temp folder removes it at start-up, is
    ready, and serves: a greedy completion equals its solo run offline."""
    assert restarted["killed"]["proc"].returncode == -signal.SIGKILL
    assert restarted["left"] and restarted["left_after_kill"] == restarted["left"]
    assert not any(p.exists() for p in restarted["left"])
    second = restarted["second"]
    assert list(restarted["tmp"].glob(f"metrale-spill-{second['proc'].pid}-*"))

    async def ask() -> dict:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{second['base']}/v1/completions",
                                    json=completion("Shall I compare", 12)) as resp:
                assert resp.status == 200
                return await resp.json()

    got = asyncio.run(asyncio.wait_for(ask(), LIMIT_S))
    assert got["choices"][0]["text"] == offline_engine.solo("Shall I compare", 12).text


def test_sigterm_with_streams_in_flight_finishes_them_and_exits_0(restarted, offline_engine):
    """Expected: SIGTERM while 8 streams are in flight (each has received its first
    event): the streams still run to their end: every one carries its solo text, usage
    equal to max_tokens, finish_reason "length" and [DONE] (an error event would also be
    a clear end, but with the default drain timeout none is due); the process exits 0
    and removes its spill directory."""
    second = restarted["second"]
    prompts = [f"Scene {i}: enter the ghost" for i in range(8)]

    async def scenario() -> list[list]:
        async with aiohttp.ClientSession() as session:
            streams = [await session.post(f"{second['base']}/v1/completions", json=completion(
                p, 40, stream=True, stream_options={"include_usage": True}))
                for p in prompts]
            firsts = [await s.content.readline() for s in streams]
            second["proc"].send_signal(signal.SIGTERM)
            return [sse_payloads(f + await s.read()) for f, s in zip(firsts, streams)]

    results = asyncio.run(asyncio.wait_for(scenario(), LIMIT_S))
    code = second["proc"].wait(LIMIT_S)
    for prompt, events in zip(prompts, results):
        assert events[-1] == "[DONE]"
        chunks = [e for e in events[:-1] if e["choices"]]
        assert "".join(c["choices"][0]["text"] for c in chunks) == \
            offline_engine.solo(prompt, 40).text
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert events[-2]["usage"]["completion_tokens"] == 40
    assert code == 0
    assert not list(restarted["tmp"].glob("metrale-spill-*"))
