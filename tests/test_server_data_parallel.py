"""`--data-parallel-size`: M engines behind one server (metrale_jax/parallel/async_data_parallel.py).

Most tests run two engines on the fake runner (the built-in model's tokenizer, no device
step), in-process through aiohttp's test client and the official `openai` client, so they
are host-only and exact: every output is `reference_continuation`, what one engine gives.
They check the routing (shared prefixes on one engine, sessions sticking to theirs, aborts
reaching the holder), the fan-out (LoRA loads and unloads, levers, session DELETE), the
merged reads (/metrics valid with each engine and the totals, the admin snapshot, /health
unhealthy when one engine fails) and the startup errors. The last test runs the real model
as dp=2 on two simulated CPU devices in its own process (tests/dp_devices_run.py: the
device count must be set before jax is imported) against one engine's greedy outputs.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import subprocess
import sys

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from metrale_jax.async_engine import AsyncLLM
from metrale_jax.lora.weights import LoraError
from metrale_jax.parallel.async_data_parallel import DataParallelAsyncLLM, merge_snapshots
from metrale_jax.parallel.router import RouterConfig
from metrale_jax.scheduler.faults import MAX_STEP_FAILURES_IN_A_ROW
from server.app import create_app
from server.serve import add_parser, build_engine
from server.state import ServerConfig
from tests.fake_runner import FakeRunner, reference_continuation
from tests.scheduler_harness import fake_loader

ROOT = pathlib.Path(__file__).parent.parent
ENGINE = dict(max_batch_size=4, max_tokens_per_tick=32, max_seq_len=64, block_size=4,
              num_kv_blocks=64, enable_swap=False)
# Two families of prompts sharing a prefix of several blocks, one per engine.
PREFIX_A = "The quick brown fox jumps over the lazy dog while the sun sets slowly"
PREFIX_B = "Four score and seven years ago our fathers brought forth on this continent"
TAILS = [" and then", " so it goes", " at last"]


def fake_engine(**extra) -> AsyncLLM:
    runner = FakeRunner(ENGINE["num_kv_blocks"], ENGINE["block_size"], ENGINE["max_batch_size"],
                        max_loras=2)
    return AsyncLLM(None, runner=runner, adapter_loader=fake_loader, enable_lora=True,
                    max_loras=2, **ENGINE, **extra)


@pytest.fixture(scope="module")
def group():
    dp = DataParallelAsyncLLM.from_engines(
        [fake_engine(), fake_engine()],
        RouterConfig(num_engines=2, block_size=ENGINE["block_size"]))
    dp.start()
    yield dp
    dp.shutdown(timeout=30)
    assert not any(e._thread.is_alive() for e in dp.engines)  # shutdown stops every engine


@pytest.fixture
async def client(group, aiohttp_client, tmp_path):
    app = create_app(group, ServerConfig(lora_dir=str(tmp_path)))
    return await aiohttp_client(app, server_kwargs={"handler_cancellation": True})


def oai(client) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="none",
                              max_retries=0)


def expected(llm, prompt: str, n: int, adapter=None) -> str:
    return llm.detokenize(reference_continuation(llm.tokenize(prompt), n, adapter=adapter))


async def complete(c, model: str, prompt: str, n: int = 6, stream: bool = False, **extra):
    body = dict(model=model, prompt=prompt, max_tokens=n, temperature=0.0,
                extra_body={"ignore_eos": True, **extra})
    if not stream:
        return (await c.completions.create(**body)).choices[0].text
    chunks = await c.completions.create(**body, stream=True)
    return "".join([ch.choices[0].text async for ch in chunks if ch.choices])


async def metrics(client) -> dict:
    """{(sample name, engine label): value} of the engine-level samples (the text must
    parse as Prometheus exposition)."""
    text = await (await client.get("/metrics")).text()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "engine" in s.labels and len(s.labels) == 2:  # model_name and engine only
                out[s.name, s.labels["engine"]] = s.value
    return out


async def snapshot(client) -> dict:
    return await (await client.get("/v1/admin/snapshot")).json()


# ---- routing --------------------------------------------------------------------------------

async def test_shared_prefixes_land_on_one_engine_with_one_engines_output(client, group):
    """The first request carries one prompt of each family (the router: A to engine 0, B
    to the less loaded engine 1); the rest, streamed and not, all at once, follow their
    prefix. Per-engine prefix-cache queries show where every prompt went."""
    c, model = oai(client), group.limits.model_name
    fam_a, fam_b = [PREFIX_A + t for t in TAILS], [PREFIX_B + t for t in TAILS]
    before = await metrics(client)
    first = await c.completions.create(model=model, prompt=[fam_a[0], fam_b[0]], max_tokens=5,
                                       temperature=0.0, extra_body={"ignore_eos": True})
    texts = [ch.text for ch in sorted(first.choices, key=lambda ch: ch.index)]
    assert texts == [expected(group, fam_a[0], 5), expected(group, fam_b[0], 5)]
    rest = [(p, i % 2 == 0) for i, p in enumerate(fam_a[1:] + fam_b[1:])]
    got = await asyncio.gather(*(complete(c, model, p, 7, stream=s) for p, s in rest))
    assert got == [expected(group, p, 7) for p, _ in rest]
    after = await metrics(client)
    queries = {e: after["metrale:prefix_cache_queries_total", e]
               - before.get(("metrale:prefix_cache_queries_total", e), 0)
               for e in ("0", "1", "total")}
    length = lambda prompts: sum(len(group.tokenize(p)) for p in prompts)  # noqa: E731
    assert queries == {"0": length(fam_a), "1": length(fam_b),
                       "total": length(fam_a) + length(fam_b)}
    assert group.router.loads == [0, 0]
    await c.close()


async def test_different_prompts_and_chat_equal_one_engine(client, group):
    c, model = oai(client), group.limits.model_name
    prompts = ["Now is the winter", "What light through yonder", "To be, or not to be", "x"]
    got = await asyncio.gather(*(complete(c, model, p, 6, stream=bool(i % 2))
                                 for i, p in enumerate(prompts)))
    assert got == [expected(group, p, 6) for p in prompts]
    messages = [{"role": "user", "content": "Speak of love."}]
    rendered = group.apply_chat_template(messages)
    ids = group.tokenize(rendered, add_special_tokens=False)
    want = group.detokenize(reference_continuation(ids, 5))
    whole = await c.chat.completions.create(model=model, messages=messages, max_tokens=5,
                                            temperature=0.0, extra_body={"ignore_eos": True})
    assert whole.choices[0].message.content == want
    stream = await c.chat.completions.create(model=model, messages=messages, max_tokens=5,
                                             temperature=0.0, stream=True,
                                             extra_body={"ignore_eos": True})
    assert "".join([ch.choices[0].delta.content or "" async for ch in stream]) == want
    await c.close()


async def test_a_session_sticks_to_its_engine_and_delete_finds_it(client, group):
    """Turn 2 starts with family B's prefix (engine 1 by affinity) but stays with its
    session on engine 0; DELETE ends it there; an unknown id is asked of every engine."""
    c, model = oai(client), group.limits.model_name
    await complete(c, model, PREFIX_B + " warm", 3)        # family B's prefix on engine 1
    first = "Entirely fresh words for a session"
    before = await snapshot(client)
    await complete(c, model, first, 4, session_id="dp-s")   # a fresh prefix: engine 0
    await complete(c, model, PREFIX_B + " turn two", 4, session_id="dp-s")
    snap = await snapshot(client)
    assert [e["snapshot"]["sessions_open"] for e in snap["engines"]] == [1, 0]
    queried = [a["snapshot"]["prefix_query_tokens"] - b["snapshot"]["prefix_query_tokens"]
               for a, b in zip(snap["engines"], before["engines"])]
    assert queried == [len(group.tokenize(first)) + len(group.tokenize(PREFIX_B + " turn two")),
                       0]
    resp = await client.delete("/v1/sessions/dp-s")
    assert resp.status == 200 and (await resp.json())["deleted"] is True
    for _ in range(2000):  # bounded: the ack comes before the tick publishes its snapshot
        snap = await snapshot(client)
        if snap["snapshot"]["sessions_open"] == 0:
            break
    assert [e["snapshot"]["sessions_open"] for e in snap["engines"]] == [0, 0]
    for sid in ("dp-s", "never-opened"):
        resp = await client.delete(f"/v1/sessions/{sid}")
        assert resp.status == 404 and (await resp.json())["error"]["param"] == "session_id"
    await c.close()


async def test_a_client_that_goes_away_aborts_on_the_holding_engine(client, group):
    c, model = oai(client), group.limits.model_name
    stream = await c.completions.create(model=model, prompt=PREFIX_A + " never read",
                                        max_tokens=40, temperature=0.0, stream=True,
                                        extra_body={"ignore_eos": True})
    async for _ in stream:
        break
    await stream.close()
    for _ in range(2000):  # bounded: until the engine has let the request go
        snap = await snapshot(client)
        if snap["now"]["requests_in_engine"] == 0 and snap["router_loads"] == [0, 0]:
            break
        await client.post("/tokenize", json={"prompt": "tick"})
    assert snap["now"]["requests_in_engine"] == 0 and snap["router_loads"] == [0, 0]
    assert all(e["now"]["kv_blocks_used"] == 0 for e in snap["engines"])
    await c.close()


# ---- fan-out --------------------------------------------------------------------------------

async def test_lora_load_and_unload_apply_to_every_engine(client, group, tmp_path):
    (tmp_path / "sql" / "1.5").mkdir(parents=True)
    c = oai(client)
    resp = await client.post("/v1/load_lora_adapter",
                             json={"lora_name": "sql", "lora_path": "sql/1.5"})
    assert resp.status == 200, await resp.text()
    assert all(e.has_adapter("sql") for e in group.engines)
    weights = fake_loader("sql", str(tmp_path / "sql/1.5"))
    # One prompt per engine (the second goes to the less loaded one), both under the adapter.
    out = await c.completions.create(model="sql", prompt=[PREFIX_A, "Another prompt"],
                                     max_tokens=5, temperature=0.0,
                                     extra_body={"ignore_eos": True})
    assert [ch.text for ch in sorted(out.choices, key=lambda ch: ch.index)] == [
        expected(group, p, 5, weights) for p in (PREFIX_A, "Another prompt")]
    models = {m.id for m in (await c.models.list()).data}
    assert "sql" in models
    resp = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
    assert resp.status == 200, await resp.text()
    assert not any(e.has_adapter("sql") for e in group.engines)
    await c.close()


async def test_a_load_that_fails_on_one_engine_is_undone_on_the_others(group, monkeypatch):
    async def refuse(name, path, replace=False):
        raise LoraError(f"adapter {name!r}: refused")

    monkeypatch.setattr(group.engines[1], "load_adapter", refuse)
    with pytest.raises(LoraError, match="refused"):
        await group.load_adapter("half", "/adapters/half/1.0")
    assert not any(e.has_adapter("half") for e in group.engines)


async def test_levers_are_set_on_every_engine(client, group):
    resp = await client.post("/v1/admin/levers", json={"max_tokens_per_tick": 16})
    assert resp.status == 200 and (await resp.json())["max_tokens_per_tick"] == 16
    assert [e.levers.get().max_tokens_per_tick for e in group.engines] == [16, 16]
    resp = await client.post("/v1/admin/levers", json={"max_tokens_per_tick": 0})
    assert resp.status == 400
    assert [e.levers.get().max_tokens_per_tick for e in group.engines] == [16, 16]
    await client.post("/v1/admin/levers", json={"max_tokens_per_tick": 32})


# ---- merged reads ---------------------------------------------------------------------------

async def test_metrics_and_snapshot_show_each_engine_and_the_totals(client, group):
    await complete(oai(client), group.limits.model_name, "metrics", 3)
    values = await metrics(client)
    for name in ("metrale:num_requests_running", "metrale:kv_cache_total_blocks",
                 "metrale:kv_cache_usage_perc", "metrale:prefix_cache_queries_total",
                 "metrale:scheduler_steps_total", "metrale:compiled_variants",
                 "metrale:num_preemptions_total", "metrale:sessions_open"):
        assert {e for n, e in values if n == name} == {"0", "1", "total"}, name
    for name in ("metrale:kv_cache_total_blocks", "metrale:prefix_cache_queries_total"):
        assert values[name, "total"] == values[name, "0"] + values[name, "1"] > 0, name
    assert values["metrale:kv_cache_total_blocks", "0"] == ENGINE["num_kv_blocks"] - 1
    text = await (await client.get("/metrics")).text()
    assert 'metrale:tick_phase_duration_seconds_count{engine="1"' in text.replace(
        'model_name="metrale-default",', "")
    assert "metrale:prompt_tokens_total" in text  # the server's own, unlabelled by engine
    snap = await snapshot(client)
    assert len(snap["engines"]) == 2 and snap["router_loads"] == [0, 0]
    parts = [e["snapshot"] for e in snap["engines"]]
    for field in ("kv_blocks_total", "prefix_query_tokens", "requests_len", "max_loras"):
        assert snap["snapshot"][field] == sum(p[field] for p in parts), field
    assert snap["now"]["kv_blocks_usable"] == 2 * (ENGINE["num_kv_blocks"] - 1)
    assert snap["counters"] == {k: sum(e["counters"].get(k, 0) for e in snap["engines"])
                                for k in snap["counters"]}


def test_merged_snapshot_sums_counts_and_names_adapters_once(group):
    a, b = (e.snapshot() for e in group.engines)
    import dataclasses

    a = dataclasses.replace(a, lora_running=(("sql", 2),), lora_loaded=("sql",),
                            mtp_mode="on", published_at=5.0)
    b = dataclasses.replace(b, lora_running=(("sql", 1), ("chat", 1)),
                            lora_loaded=("sql", "chat"), mtp_mode="off", published_at=3.0)
    m = merge_snapshots([a, b])
    assert m.lora_running == (("sql", 3), ("chat", 1)) and m.lora_loaded == ("sql", "chat")
    assert m.mtp_mode == "mixed" and m.published_at == 3.0
    assert m.kv_blocks_total == a.kv_blocks_total + b.kv_blocks_total


async def test_health_is_unhealthy_once_one_engine_fails(aiohttp_client):
    dp = DataParallelAsyncLLM.from_engines([fake_engine(), fake_engine()])
    client = await aiohttp_client(create_app(dp, ServerConfig(watchdog_interval_s=0.01)))

    def broken(rows):
        raise RuntimeError("device lost")

    dp.engines[1].engine.runner.dispatch = broken
    dp.start()
    assert (await client.get("/health")).status == 200
    c = oai(client)
    for _ in range(MAX_STEP_FAILURES_IN_A_ROW):  # one prompt on each engine: engine 1's fails
        with pytest.raises(openai.InternalServerError, match="engine"):
            await c.completions.create(model=dp.limits.model_name, prompt=["fine", "doomed"],
                                       max_tokens=2, temperature=0.0)
    health = await client.get("/health")
    body = await health.json()
    assert health.status == 503 and body["status"] == "unhealthy"
    assert "engine 1 of 2" in body["error"]
    await c.close()
    await asyncio.to_thread(dp.shutdown, 5)


# ---- startup ----------------------------------------------------------------------------------

def _serve_args(*argv):
    import argparse

    return add_parser(argparse.ArgumentParser().add_subparsers()).parse_args(list(argv))


def test_a_bad_data_parallel_size_fails_at_startup_naming_the_count():
    import jax

    with pytest.raises(SystemExit, match="data_parallel_size: must be a positive integer, "
                                         "got 0"):
        build_engine(_serve_args("--data-parallel-size", "0"))
    too_many = len(jax.devices()) + 1
    with pytest.raises(SystemExit, match=f"data_parallel_size x tensor_parallel_size: "
                                         f"{too_many} devices needed, this process sees "
                                         f"{too_many - 1}"):
        build_engine(_serve_args("--data-parallel-size", str(too_many)))


# ---- the real model on two simulated devices --------------------------------------------------

def test_two_engines_on_two_devices_serve_one_engines_greedy_outputs():
    """dp=2 on 2 simulated CPU devices (each engine its own device and tick loop) through
    the openai client: every request, streamed or not, equals one engine's greedy output;
    each prefix family went to one engine (per-engine metrics), the totals add up."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "tests.dp_devices_run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    assert run["devices"] == [[0], [1]]
    assert run["served"] == run["one_engine"]
    queries = run["queries"]
    assert queries["0"] == run["family_tokens"][0] and queries["1"] == run["family_tokens"][1]
    assert queries["total"] == sum(run["family_tokens"])
    assert run["health"] == 200 and run["engines_in_snapshot"] == 2
