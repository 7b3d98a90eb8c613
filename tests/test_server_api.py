"""The OpenAI-compatible server through aiohttp's test client: endpoints, SSE, usage,
logprobs, echo, n > 1, stop strings, seeds, admin, tokenize, metrics, auth, the waiting cap,
and an engine failure turning the server unhealthy."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from metrale_jax.engine import LLM
from metrale_jax.request import SamplingParams
from server.app import create_app
from server.state import ServerConfig
from metrale_jax.async_engine import AsyncLLM
from metrale_jax.scheduler.faults import MAX_STEP_FAILURES_IN_A_ROW
from tests.server_fixtures import ENGINE, MODEL, running_engine

PROMPTS = ["To be, or not to be", "What light through yonder", "Now is the winter"]


@pytest.fixture(scope="module")
def llm():
    yield from running_engine()


@pytest.fixture
async def client(llm, aiohttp_client):
    return await aiohttp_client(create_app(llm), server_kwargs={"handler_cancellation": True})


async def post(client, path, body, status=200, headers=None):
    resp = await client.post(path, json=body, headers=headers)
    data = await resp.json()
    assert resp.status == status, data
    return data


async def sse_events(resp) -> list:
    """The `data:` payloads of an SSE body, ending with the literal [DONE]."""
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    raw = (await resp.read()).decode()
    events = [block.strip() for block in raw.split("\n\n") if block.strip()]
    assert all(e.startswith("data: ") for e in events), raw
    payloads = [e[len("data: "):] for e in events]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def greedy(**kw):
    return {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True, **kw}


# ---- completions ----------------------------------------------------------------------------

async def test_completion_matches_offline_generate(client, llm):
    data = await post(client, "/v1/completions", {"prompt": PROMPTS, **greedy()})
    assert data["object"] == "text_completion" and data["id"].startswith("cmpl-")
    offline = LLM(MODEL, **ENGINE, warmup=False).generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    got = [c["text"] for c in sorted(data["choices"], key=lambda c: c["index"])]
    assert got == [o.outputs[0].text for o in offline]
    assert all(c["finish_reason"] == "length" for c in data["choices"])
    prompt_tokens = sum(len(o.prompt_token_ids) for o in offline)
    assert data["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 24,
                             "total_tokens": prompt_tokens + 24}


async def test_streamed_text_equals_non_streamed_for_a_seed(client):
    body = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0.9, "seed": 1234,
            "ignore_eos": True}
    whole = await post(client, "/v1/completions", body)
    events = await sse_events(await client.post("/v1/completions", json={
        **body, "stream": True, "stream_options": {"include_usage": True}}))
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == whole["choices"][0]["text"]
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert all(e["usage"] is None for e in events[:-1] if "usage" in e)
    again = await post(client, "/v1/completions", body)
    assert again["choices"][0]["text"] == whole["choices"][0]["text"]


async def test_streamed_logprobs_equal_non_streamed_when_text_is_held_back(client):
    # Text that could still become a stop string is held back, so some chunks carry tokens
    # but no text; their logprob entries used to be dropped from the stream.
    body = {"prompt": "To be, or not to be, that is the question:", "max_tokens": 32,
            "temperature": 0.8, "seed": 20, "logprobs": 2, "ignore_eos": True,
            "stop": [" the end of the play", "\n\n\n\n"]}
    whole = (await post(client, "/v1/completions", body))["choices"][0]
    events = await sse_events(await client.post("/v1/completions",
                                                json={**body, "stream": True}))
    tokens = [t for e in events for c in e["choices"] if c["logprobs"]
              for t in c["logprobs"]["tokens"]]
    logprobs = [x for e in events for c in e["choices"] if c["logprobs"]
                for x in c["logprobs"]["token_logprobs"]]
    assert tokens == whole["logprobs"]["tokens"]
    assert logprobs == whole["logprobs"]["token_logprobs"]


async def test_continuous_usage_counts_tokens_chunk_by_chunk(client):
    body = {"prompt": [5, 9, 41, 7], "max_tokens": 9, "temperature": 0.0, "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    for path, extra in (("/v1/completions", {}),
                        ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                "content": "Hi"}]})):
        payload = {**body, **extra}
        if extra:
            del payload["prompt"]
        events = await sse_events(await client.post(path, json=payload))
        counts = [e["usage"]["completion_tokens"] for e in events]
        assert counts == sorted(counts) and counts[-1] == 9
        assert events[-1]["choices"] == []
        assert all(e["usage"]["prompt_tokens"] == events[-1]["usage"]["prompt_tokens"]
                   for e in events)
    bad = await client.post("/v1/completions", json={
        **body, "stream_options": {"continuous_usage_stats": True}})
    assert bad.status == 400
    assert "include_usage" in (await bad.json())["error"]["message"]


async def test_n_logprobs_and_prompt_token_ids(client):
    data = await post(client, "/v1/completions", {
        "prompt": [[5, 9, 41, 7]], "n": 3, "temperature": 1.0, "seed": 7, "logprobs": 2,
        "max_tokens": 5, "ignore_eos": True})
    assert sorted(c["index"] for c in data["choices"]) == [0, 1, 2]
    for c in data["choices"]:
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 5
        assert all(x <= 0.0 for x in lp["token_logprobs"])
        assert all(2 <= len(top) <= 3 for top in lp["top_logprobs"])
        assert lp["text_offset"][0] == 0
    assert data["usage"]["prompt_tokens"] == 4 and data["usage"]["completion_tokens"] == 15


async def test_echo_with_prompt_logprobs(client):
    prompt = "To be, or not"
    tokens = (await post(client, "/tokenize", {"prompt": prompt}))["tokens"]
    data = await post(client, "/v1/completions", {
        "prompt": prompt, "echo": True, "logprobs": 1, "prompt_logprobs": 1, **greedy()})
    choice = data["choices"][0]
    assert choice["text"].startswith(prompt)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(tokens) + 8
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(x is not None for x in lp["token_logprobs"][1:])
    pl = choice["prompt_logprobs"]
    assert len(pl) == len(tokens) and pl[0] is None
    for position, token in enumerate(tokens[1:], start=1):
        assert str(token) in pl[position]


async def test_max_tokens_zero_with_echo_scores_the_prompt(client):
    """Prompt scoring (lm-eval's loglikelihood): the prompt and its logprobs, no token."""
    prompt = "To be, or not to be, that is"
    n_prompt = len((await post(client, "/tokenize", {"prompt": prompt}))["tokens"])
    body = {"prompt": prompt, "echo": True, "logprobs": 1, "temperature": 0.0}
    one = (await post(client, "/v1/completions", {**body, "max_tokens": 1}))["choices"][0]
    whole = await post(client, "/v1/completions", {**body, "max_tokens": 0})
    choice = whole["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert choice["stop_reason"] is None
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == n_prompt and lp["token_logprobs"][0] is None
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert lp[key] == one["logprobs"][key][:n_prompt], key
    assert whole["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 0,
                              "total_tokens": n_prompt}

    events = await sse_events(await client.post("/v1/completions", json={
        **body, "max_tokens": 0, "stream": True, "stream_options": {"include_usage": True}}))
    chunks = [c for e in events for c in e["choices"]]
    assert "".join(c["text"] for c in chunks) == prompt
    assert [t for c in chunks for t in c["logprobs"]["token_logprobs"]] == \
        lp["token_logprobs"]
    assert chunks[-1]["finish_reason"] == "length"
    assert events[-1]["usage"] == whole["usage"]


async def test_prompt_scoring_through_the_openai_client(client, llm):
    oai = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="none",
                             max_retries=0)
    prompt, model = "Now is the winter", llm.engine.model_name
    scored = await oai.completions.create(model=model, prompt=prompt,
                                          max_tokens=0, echo=True, logprobs=1)
    choice = scored.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs[0] is None
    assert all(isinstance(x, float) for x in choice.logprobs.token_logprobs[1:])
    assert scored.usage.completion_tokens == 0
    assert scored.usage.total_tokens == scored.usage.prompt_tokens
    stream = await oai.completions.create(model=model, prompt=prompt,
                                          max_tokens=0, echo=True, logprobs=1, stream=True)
    streamed = [c async for c in stream]
    assert "".join(c.choices[0].text for c in streamed) == prompt
    assert streamed[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="echo"):
        await oai.completions.create(model=model, prompt=prompt, max_tokens=0)
    await oai.close()


async def test_stop_string_cuts_streamed_and_whole_alike(client):
    base = await post(client, "/v1/completions", {"prompt": PROMPTS[1], **greedy(max_tokens=16)})
    text = base["choices"][0]["text"]
    stop = text[5:7] if len(text) > 7 else text[-2:]
    body = {"prompt": PROMPTS[1], "stop": [stop], **greedy(max_tokens=16)}
    whole = await post(client, "/v1/completions", body)
    choice = whole["choices"][0]
    assert choice["text"] == text[:text.index(stop)]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    events = await sse_events(await client.post("/v1/completions",
                                                json={**body, "stream": True}))
    assert "".join(c["text"] for e in events for c in e["choices"]) == choice["text"]


# ---- chat -----------------------------------------------------------------------------------

async def test_chat_whole_and_streamed(client, llm):
    messages = [{"role": "system", "content": "You are a poet."},
                {"role": "user", "content": [{"type": "text", "text": "Speak of love."}]}]
    body = {"messages": messages, "max_completion_tokens": 8, "temperature": 0.0,
            "logprobs": True, "top_logprobs": 2}
    whole = await post(client, "/v1/chat/completions", body)
    assert whole["object"] == "chat.completion"
    choice = whole["choices"][0]
    assert choice["message"]["role"] == "assistant"
    content = choice["logprobs"]["content"]
    assert len(content) == whole["usage"]["completion_tokens"]
    assert all(len(entry["top_logprobs"]) == 2 for entry in content)
    rendered = llm.engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": "You are a poet."},
         {"role": "user", "content": "Speak of love."}])
    assert whole["usage"]["prompt_tokens"] == len(
        llm.engine.tokenizer.encode(rendered, add_special_tokens=False))
    events = await sse_events(await client.post("/v1/chat/completions", json={
        **body, "stream": True, "stream_options": {"include_usage": True}}))
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    streamed = "".join(c["delta"].get("content", "") for e in events for c in e["choices"])
    assert streamed == choice["message"]["content"]
    assert events[-1]["usage"] == whole["usage"]


# ---- the other endpoints --------------------------------------------------------------------

async def test_models_health_tokenize_detokenize(client, llm):
    assert (await client.get("/health")).status == 200
    models = await (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == llm.engine.model_name
    tok = await post(client, "/tokenize", {"prompt": "Hello there"})
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 64
    detok = await post(client, "/detokenize", {"tokens": tok["tokens"]})
    assert detok["prompt"] == "Hello there"
    chat = await post(client, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]})
    assert chat["count"] > tok["count"] - 10


async def test_admin_snapshot_and_levers(client):
    await post(client, "/v1/completions", {"prompt": "x", **greedy()})
    snap = await (await client.get("/v1/admin/snapshot")).json()
    assert snap["snapshot"]["kv_blocks_total"] == 39 and snap["snapshot"]["steps_total"] > 0
    assert snap["now"]["kv_blocks_used"] == 0
    levers = await (await client.get("/v1/admin/levers")).json()
    assert levers["max_batch_size"] == 4
    changed = await post(client, "/v1/admin/levers", {"pipeline_enabled": False})
    assert changed["pipeline_enabled"] is False
    await post(client, "/v1/completions", {"prompt": "x", **greedy()})
    restored = await post(client, "/v1/admin/levers", {"pipeline_enabled": True})
    assert restored["pipeline_enabled"] is True


async def test_metrics_names(client):
    await post(client, "/v1/completions", {"prompt": "metrics", **greedy()})
    resp = await client.get("/metrics")
    text = await resp.text()
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
    for name in ("metrale:num_requests_running", "metrale:num_requests_waiting",
                 "metrale:num_requests_swapped", "metrale:kv_cache_usage_perc",
                 "metrale:prefix_cache_hit_rate", "metrale:prefix_cache_queries_total",
                 "metrale:prompt_tokens_total", "metrale:generation_tokens_total",
                 "metrale:time_to_first_token_seconds_bucket",
                 "metrale:time_per_output_token_seconds_bucket",
                 "metrale:e2e_request_latency_seconds_bucket",
                 "metrale:request_queue_time_seconds_bucket",
                 'metrale:request_success_total{finished_reason="length"',
                 "metrale:num_spills_total", "metrale:num_preemptions_total",
                 'metrale:tick_phase_duration_seconds_count{model_name',
                 "metrale:compiled_variants"):
        assert name in text, name
    assert 'phase="dispatch"' in text


async def test_api_key_guards_everything_but_health(llm, aiohttp_client):
    client = await aiohttp_client(create_app(llm, ServerConfig(api_key="s3cret")))
    assert (await client.get("/health")).status == 200
    for method, path in (("get", "/v1/models"), ("get", "/metrics"),
                         ("get", "/v1/admin/levers"), ("post", "/v1/completions")):
        resp = await getattr(client, method)(path)
        assert resp.status == 401
        assert (await resp.json())["error"]["type"] == "authentication_error"
    ok = await client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
    assert ok.status == 200


async def test_waiting_cap_answers_429(llm, aiohttp_client):
    client = await aiohttp_client(create_app(llm, ServerConfig(max_waiting=0)))
    long = await client.post("/v1/completions", json={
        "prompt": "hold", "n": 4, "stream": True, **greedy(max_tokens=40)})
    await long.content.readline()  # the first chunk: 4 sequences are in flight
    refused = await client.post("/v1/completions", json={"prompt": "one more", **greedy()})
    assert refused.status == 429 and int(refused.headers["Retry-After"]) >= 1
    data = await refused.json()
    assert data["error"]["type"] == "rate_limit_error"
    events = await sse_events(long)
    assert events  # the held request still finishes
    await post(client, "/v1/completions", {"prompt": "one more", **greedy()})


async def test_client_that_disconnects_aborts(client, llm):
    resp = await client.post("/v1/completions", json={
        "prompt": "going away", "stream": True, **greedy(max_tokens=50)})
    await resp.content.readline()
    resp.close()
    for _ in range(500):  # bounded poll: each round trip lets the engine tick
        snap = await (await client.get("/v1/admin/snapshot")).json()
        if snap["now"]["requests_in_engine"] == 0 and snap["now"]["kv_blocks_used"] == 0:
            break
        await post(client, "/tokenize", {"prompt": "tick"})
    assert snap["now"]["requests_in_engine"] == 0 and snap["now"]["kv_blocks_used"] == 0


async def test_engine_failure_turns_unhealthy_and_answers_5xx(aiohttp_client, monkeypatch):
    engine = AsyncLLM(MODEL, **ENGINE)
    client = await aiohttp_client(create_app(engine, ServerConfig(watchdog_interval_s=0.01)))

    def broken(rows):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.engine.runner, "dispatch", broken)
    engine.start()
    # Each failed step fails its own request; the server turns unhealthy once
    # MAX_STEP_FAILURES_IN_A_ROW steps in a row have failed (tests/reliability/test_faults.py).
    for _ in range(MAX_STEP_FAILURES_IN_A_ROW):
        data = await post(client, "/v1/completions", {"prompt": "doomed", **greedy()}, 500)
        assert "engine" in data["error"]["message"]
    health = await client.get("/health")
    assert health.status == 503 and (await health.json())["status"] == "unhealthy"
    data = await post(client, "/v1/completions", {"prompt": "after", **greedy()}, 503)
    assert data["error"]["type"] == "service_unavailable"
    await asyncio.to_thread(engine.shutdown, 5)


async def test_non_streaming_client_that_disconnects_aborts(client, llm):
    task = asyncio.create_task(client.post("/v1/completions", json={
        "prompt": "never read", **greedy(max_tokens=50)}))
    for _ in range(2000):  # bounded: until the engine holds the request
        snap = await (await client.get("/v1/admin/snapshot")).json()
        if snap["now"]["requests_in_engine"]:
            break
    task.cancel()  # the client closes its connection without reading the answer
    for _ in range(2000):
        snap = await (await client.get("/v1/admin/snapshot")).json()
        if snap["now"]["requests_in_engine"] == 0:
            break
    assert snap["now"]["requests_in_engine"] == 0 and snap["now"]["kv_blocks_used"] == 0
    metrics = await (await client.get("/metrics")).text()
    assert 'finished_reason="abort"' in metrics


async def test_starting_and_served_model_names(llm, aiohttp_client):
    starting = await aiohttp_client(create_app(llm, status="starting"))
    health = await starting.get("/health")
    assert health.status == 503 and (await health.json())["status"] == "starting"
    await post(starting, "/v1/completions", {"prompt": "early", **greedy()}, 503)

    named = await aiohttp_client(create_app(llm, ServerConfig(
        served_model_names=("bard", "will"))))
    models = await (await named.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["bard", "will"]
    data = await post(named, "/v1/completions", {"model": "will", "prompt": "x", **greedy()})
    assert data["model"] == "bard"
    await post(named, "/v1/completions", {"model": llm.engine.model_name, "prompt": "x"}, 404)


async def test_streamed_echo_of_a_chunked_prompt_carries_every_prompt_logprob(client):
    """A prompt prefilled in several chunks: the first streamed chunk still holds the
    logprobs of every prompt position (not just those of the first chunk)."""
    prompt = " ".join(["To be, or not to be, that is the question."] * 4)
    ids = (await post(client, "/tokenize", {"prompt": prompt}))["tokens"]
    assert 32 < len(ids) < 60  # longer than one tick's token budget
    events = await sse_events(await client.post("/v1/completions", json={
        "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 2, "stream": True,
        "temperature": 0.0}))
    logprobs = [t for e in events for c in e["choices"] for t in c["logprobs"]["tokens"]]
    assert len(logprobs) == len(ids) + 2


async def test_a_bug_mid_stream_ends_the_stream_with_an_error(client, monkeypatch):
    """Headers are sent: the client gets an error event and [DONE], not a hung stream."""
    from server import openai_routes

    def broken(*args, **kwargs):
        raise IndexError("injected")

    monkeypatch.setattr(openai_routes, "_completion_logprobs", broken)
    resp = await client.post("/v1/completions", json={
        "prompt": PROMPTS[0], "max_tokens": 2, "logprobs": 1, "stream": True})
    raw = (await asyncio.wait_for(resp.read(), 60)).decode()
    events = [e.strip()[len("data: "):] for e in raw.split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "IndexError" in error["message"] and error["code"] == "500"
    monkeypatch.undo()
    assert (await post(client, "/v1/completions", {"prompt": PROMPTS[0], **greedy()}))["choices"]


async def test_sessions_through_both_endpoints_and_delete(client, llm):
    """`session_id` on completions and chat keeps the turn for the next one (same greedy
    text as without); DELETE ends the session (404 after); session counts in /metrics."""
    first = await post(client, "/v1/completions",
                       {"prompt": "To be, or not", "session_id": "srv-a", **greedy()})
    text = "To be, or not" + first["choices"][0]["text"]
    plain = await post(client, "/v1/completions", {"prompt": text + " to", **greedy()})
    again = await post(client, "/v1/completions",
                       {"prompt": text + " to", "session_id": "srv-a", **greedy()})
    assert again["choices"][0]["text"] == plain["choices"][0]["text"]
    chat = {"messages": [{"role": "user", "content": "hi"}], **greedy()}
    await post(client, "/v1/chat/completions", {**chat, "session_id": "srv-b"})
    await post(client, "/v1/completions", {"prompt": "x", "session_id": ""}, status=400)
    metrics = await (await client.get("/metrics")).text()
    assert "metrale:sessions_open" in metrics and "metrale:session_tail_hits_total" in metrics
    assert "metrale:ssm_snapshot_slots_total" in metrics
    for sid in ("srv-a", "srv-b"):
        resp = await client.delete(f"/v1/sessions/{sid}")
        assert resp.status == 200 and (await resp.json())["deleted"] is True
    resp = await client.delete("/v1/sessions/srv-a")
    assert resp.status == 404 and (await resp.json())["error"]["param"] == "session_id"
