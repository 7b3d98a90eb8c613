"""A table of bad requests: each gets the right status and an OpenAI error object naming the
problem, and a valid request right after it succeeds (the server keeps serving)."""

from __future__ import annotations

import json


import pytest

from server.app import create_app
from server.state import ServerConfig
from tests.server_fixtures import running_engine

KEY = "k3y"
BODY_LIMIT = 64 * 1024

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
OK = {"prompt": "Hello", "max_tokens": 2}
USER = [{"role": "user", "content": "Hi"}]

# (id, method, path, body (dict: JSON; bytes: raw), headers, status, param, words in message)
CASES = [
    ("malformed-json", "post", CMPL, b'{"prompt": "x",', None, 400, "body", "malformed JSON"),
    ("body-not-object", "post", CMPL, b"[1, 2]", None, 400, "body", "JSON object"),
    ("invalid-utf8", "post", CMPL, b'{"prompt": "\xff\xfe"}', None, 400, "body", "UTF-8"),
    ("lone-surrogate-prompt", "post", CMPL, b'{"prompt": "a\\ud800", "max_tokens": 2}', None,
     400, "body", "surrogate"),
    ("lone-surrogate-chat", "post", CHAT,
     b'{"messages": [{"role": "user", "content": "\\udfff"}]}', None, 400, "body",
     "surrogate"),
    ("lone-surrogate-tokenize", "post", "/tokenize", b'{"prompt": "\\ud83d"}', None, 400,
     "body", "surrogate"),
    ("response-format-unknown", "post", CHAT,
     {"messages": USER, "response_format": {"type": "yaml"}}, None, 400,
     "response_format", "json_schema"),
    ("response-format-schema-missing", "post", CMPL,
     {**OK, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, None,
     400, "response_format", "schema"),
    ("tools-on-completions", "post", CMPL, {**OK, "tools": [{"type": "function", "function":
                                                               {"name": "f"}}]},
     None, 400, "tools", "chat"),
    ("tool-choice-without-tools", "post", CHAT, {"messages": USER, "tool_choice": "required"},
     None, 400, "tool_choice", "needs tools"),
    ("tool-choice-unknown-function", "post", CHAT,
     {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}},
     None, 400, "tool_choice", "not among"),
    ("tools-malformed", "post", CHAT, {"messages": USER, "tools": [{"name": "f"}],
                                       "tool_choice": "required"},
     None, 400, "tools", "function"),
    ("functions", "post", CHAT, {"messages": USER, "functions": [{"name": "f"}]},
     None, 400, "functions", "not supported"),
    ("guided-json-bad-schema", "post", CMPL, {**OK, "guided_json": {"type": "foo"}}, None,
     400, "guided_json", "type"),
    ("two-constraints", "post", CMPL, {**OK, "guided_regex": "a", "guided_choice": ["a"]},
     None, 400, "guided_choice", "only one"),
    ("seed-beyond-64-bits", "post", CMPL, {**OK, "seed": 2 ** 80}, None, 400, "seed",
     "must be in"),
    ("too-many-stop-strings", "post", CMPL, {**OK, "stop": [f"s{i}" for i in range(1000)]},
     None, 400, "stop", "at most"),
    ("deeply-nested", "post", CMPL, b'{"prompt": "x", "user": ' + b"[" * 5000 + b"]" * 5000
     + b"}", None, 400, "body", "nested"),
    ("empty-body", "post", CMPL, b"", None, 400, "body", "malformed JSON"),
    ("missing-prompt", "post", CMPL, {"max_tokens": 2}, None, 400, "prompt", "required"),
    ("prompt-wrong-type", "post", CMPL, {"prompt": 5}, None, 400, "prompt", "expected"),
    ("prompt-empty-list", "post", CMPL, {"prompt": []}, None, 400, "prompt", "non-empty"),
    ("prompt-mixed-list", "post", CMPL, {"prompt": ["a", 1]}, None, 400, "prompt", "token"),
    ("prompt-token-out-of-vocab", "post", CMPL, {"prompt": [99999999]}, None, 400, "prompt",
     "token ids"),
    ("prompt-negative-token", "post", CMPL, {"prompt": [[3, -1]]}, None, 400, "prompt",
     "token ids"),
    ("prompt-empty-string", "post", CMPL, {"prompt": ""}, None, 400, "prompt", "empty"),
    ("prompt-too-long", "post", CMPL, {"prompt": "word " * 200}, None, 400, "prompt",
     "context length"),
    ("max-tokens-negative", "post", CMPL, {**OK, "max_tokens": -1}, None, 400, "max_tokens",
     "must be in"),
    ("max-tokens-zero", "post", CMPL, {**OK, "max_tokens": 0}, None, 400, "max_tokens",
     "echo: true"),
    ("max-tokens-zero-echo-min-tokens", "post", CMPL,
     {**OK, "max_tokens": 0, "echo": True, "min_tokens": 1}, None, 400, "min_tokens",
     "max_tokens"),
    # Found by the fuzzer (tests/reliability/test_fuzz.py); each was a 500.
    ("integer-past-digit-limit", "post", CMPL,
     b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", None, 400, "body", "too long"),
    ("float-field-huge-integer", "post", CMPL, {**OK, "top_p": 10 ** 400}, None, 400, "top_p",
     "out of range"),
    ("min-tokens-over-default-max-tokens", "post", CMPL, {"prompt": "Hello", "min_tokens": 10**6},
     None, 400, "min_tokens", "max_tokens"),
    ("chat-template-kwargs-messages", "post", CHAT,
     {"messages": USER, "max_tokens": 2, "chat_template_kwargs": {"messages": []}}, None, 400,
     "chat_template_kwargs", "set by the request"),
    ("max-tokens-huge", "post", CMPL, {**OK, "max_tokens": 10**9}, None, 400, "max_tokens",
     "context length"),
    ("max-tokens-string", "post", CMPL, {**OK, "max_tokens": "10"}, None, 400, "max_tokens",
     "integer"),
    ("max-tokens-float", "post", CMPL, {**OK, "max_tokens": 1.5}, None, 400, "max_tokens",
     "integer"),
    ("temperature-negative", "post", CMPL, {**OK, "temperature": -0.5}, None, 400,
     "temperature", "must be in"),
    ("temperature-too-high", "post", CMPL, {**OK, "temperature": 3}, None, 400,
     "temperature", "must be in"),
    ("temperature-string", "post", CMPL, {**OK, "temperature": "hot"}, None, 400,
     "temperature", "number"),
    ("top-p-zero", "post", CMPL, {**OK, "top_p": 0}, None, 400, "top_p", "(0, 1]"),
    ("top-p-too-high", "post", CMPL, {**OK, "top_p": 1.5}, None, 400, "top_p", "(0, 1]"),
    ("top-k-negative", "post", CMPL, {**OK, "top_k": -5}, None, 400, "top_k", "must be in"),
    ("min-p-too-high", "post", CMPL, {**OK, "min_p": 2}, None, 400, "min_p", "[0, 1]"),
    ("n-zero", "post", CMPL, {**OK, "n": 0}, None, 400, "n", "must be in"),
    ("n-huge", "post", CMPL, {**OK, "n": 1000}, None, 400, "n", "must be in"),
    ("logprobs-over-cap", "post", CMPL, {**OK, "logprobs": 3}, None, 400, "logprobs",
     "must be in"),
    ("logprobs-negative", "post", CMPL, {**OK, "logprobs": -1}, None, 400, "logprobs",
     "must be in"),
    ("presence-penalty-range", "post", CMPL, {**OK, "presence_penalty": 5}, None, 400,
     "presence_penalty", "[-2, 2]"),
    ("repetition-penalty-zero", "post", CMPL, {**OK, "repetition_penalty": 0}, None, 400,
     "repetition_penalty", "(0, 10]"),
    # Found by the fuzzer: 0 on the device, NaN logits past a grammar mask.
    ("repetition-penalty-subnormal", "post", CMPL,
     {**OK, "repetition_penalty": 5e-324, "guided_json": {}}, None, 400,
     "repetition_penalty", "normal float32"),
    ("seed-string", "post", CMPL, {**OK, "seed": "abc"}, None, 400, "seed", "integer"),
    ("stop-not-strings", "post", CMPL, {**OK, "stop": [1]}, None, 400, "stop", "string"),
    ("logit-bias-bad-key", "post", CMPL, {**OK, "logit_bias": {"abc": 1}}, None, 400,
     "logit_bias", "token id"),
    ("logit-bias-out-of-range", "post", CMPL, {**OK, "logit_bias": {"5": 500}}, None, 400,
     "logit_bias", "[-100, 100]"),
    ("logit-bias-too-many", "post", CMPL, {**OK, "logit_bias": {str(i): 1 for i in range(1025)}},
     None, 400, "logit_bias", "max_logit_bias (1024)"),
    ("stream-not-bool", "post", CMPL, {**OK, "stream": "yes"}, None, 400, "stream", "true"),
    ("stream-options-without-stream", "post", CMPL,
     {**OK, "stream_options": {"include_usage": True}}, None, 400, "stream_options", "stream"),
    ("unknown-model", "post", CMPL, {**OK, "model": "gpt-9"}, None, 404, "model",
     "does not exist"),
    ("chat-missing-messages", "post", CHAT, {"max_tokens": 2}, None, 400, "messages",
     "non-empty"),
    ("chat-empty-messages", "post", CHAT, {"messages": []}, None, 400, "messages", "non-empty"),
    ("chat-messages-string", "post", CHAT, {"messages": "hi"}, None, 400, "messages", "list"),
    ("chat-bad-role", "post", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, None,
     400, "messages[0].role", "wizard"),
    ("chat-message-not-object", "post", CHAT, {"messages": ["hi"]}, None, 400, "messages[0]",
     "object"),
    ("chat-image-part", "post", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, None, 400,
     "messages[0].content", "text parts"),
    ("chat-content-number", "post", CHAT, {"messages": [{"role": "user", "content": 5}]}, None,
     400, "messages[0].content", "string"),
    ("chat-top-logprobs-without-logprobs", "post", CHAT, {"messages": USER, "top_logprobs": 1},
     None, 400, "top_logprobs", "logprobs"),
    ("chat-top-logprobs-over-cap", "post", CHAT,
     {"messages": USER, "logprobs": True, "top_logprobs": 50}, None, 400, "top_logprobs",
     "must be in"),
    ("chat-max-completion-tokens-negative", "post", CHAT,
     {"messages": USER, "max_completion_tokens": -3}, None, 400, "max_completion_tokens",
     "must be in"),
    ("chat-unknown-model", "post", CHAT, {"messages": USER, "model": "nope"}, None, 404,
     "model", "does not exist"),
    ("oversized-body", "post", CMPL, {"prompt": "x" * (BODY_LIMIT + 1)}, None, 413, "body",
     "limit"),
    ("unknown-lever", "post", "/v1/admin/levers", {"no_such_lever": 1}, None, 400,
     "no_such_lever", "unknown lever"),
    ("lever-out-of-range", "post", "/v1/admin/levers", {"max_batch_size": 0}, None, 400,
     "max_batch_size", "must be in"),
    ("lever-wrong-type", "post", "/v1/admin/levers", {"pipeline_enabled": "yes"}, None, 400,
     "pipeline_enabled", "expected bool"),
    ("detokenize-bad-tokens", "post", "/detokenize", {"tokens": ["a"]}, None, 400, "tokens",
     "token ids"),
    ("tokenize-missing-prompt", "post", "/tokenize", {}, None, 400, "prompt", "required"),
    ("unknown-endpoint", "post", "/v1/nothing", {}, None, 404, None, "no such endpoint"),
    ("wrong-method", "get", CMPL, None, None, 405, None, "not allowed"),
    ("missing-api-key", "post", CMPL, OK, {}, 401, "Authorization", "Bearer"),
    ("bad-api-key", "post", CMPL, OK, {"Authorization": "Bearer wrong"}, 401,
     "Authorization", "Bearer"),
    ("api-key-wrong-scheme", "get", "/v1/models", None, {"Authorization": f"Basic {KEY}"},
     401, "Authorization", "Bearer"),
]
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def llm():
    yield from running_engine()


@pytest.fixture
async def client(llm, aiohttp_client):
    app = create_app(llm, ServerConfig(api_key=KEY, max_body_bytes=BODY_LIMIT))
    return await aiohttp_client(app)


def test_the_table_is_large_enough():
    assert len(CASES) >= 30 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
async def test_bad_input_gets_an_error_object_and_the_server_keeps_serving(client, case):
    _, method, path, body, headers, status, param, words = case
    kwargs = {"headers": AUTH if headers is None else headers}
    if isinstance(body, bytes):
        kwargs["data"] = body
        kwargs["headers"] = {**kwargs["headers"], "Content-Type": "application/json"}
    elif body is not None:
        kwargs["json"] = body
    resp = await getattr(client, method)(path, **kwargs)
    data = await resp.json()
    assert resp.status == status, data
    error = data["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"], error
    assert error["param"] == param, error
    assert isinstance(error["type"], str) and error["type"]

    ok = await client.post(CMPL, json={**OK, "temperature": 0.0}, headers=AUTH)
    assert ok.status == 200, await ok.text()
    assert (await ok.json())["usage"]["completion_tokens"] >= 1


async def test_fields_that_ask_for_nothing_are_accepted(client):
    for path, body in ((CMPL, {**OK, "response_format": {"type": "text"}, "tools": [],
                               "tool_choice": "none", "seed": 2 ** 64 - 1}),
                       (CHAT, {"messages": USER, "max_tokens": 2, "tools": []})):
        resp = await client.post(path, json=body, headers=AUTH)
        assert resp.status == 200, await resp.text()


async def test_a_body_of_another_type_is_refused(client):
    # JSON text sent as text/plain (or a form, as `curl -d` sends) was read as JSON anyway.
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        resp = await client.post(CMPL, data=json.dumps(OK).encode(),
                                 headers={**AUTH, "Content-Type": content_type})
        error = (await resp.json())["error"]
        assert resp.status == 415 and error["param"] == "Content-Type", error
        assert "expected application/json" in error["message"]
    ok = await client.post(CMPL, data=json.dumps(OK).encode(),
                           headers={**AUTH, "Content-Type": "application/json; charset=utf-8"})
    assert ok.status == 200, await ok.text()


async def test_a_chat_template_that_cannot_render_the_messages_is_a_400(client, llm,
                                                                         monkeypatch):
    # A model's template is jinja run on the client's messages and chat_template_kwargs; a
    # TypeError from it (an int where it joins strings) was a 500.
    def render(messages, **options):
        return "<|im_start|>" + options.get("enable_thinking", 0)

    monkeypatch.setattr(llm, "apply_chat_template", render)
    resp = await client.post(CHAT, json={"messages": USER, "chat_template_kwargs": {
        "enable_thinking": 1}}, headers=AUTH)
    error = (await resp.json())["error"]
    assert resp.status == 400 and error["param"] == "messages", error
    assert "TypeError" in error["message"]


async def test_a_top_k_past_int32_keeps_every_token_and_fails_no_step(client):
    # Found by the fuzzer: top_k >= 2**31 overflowed the step's int32 inputs, failing the
    # step; three such requests in a row stopped the engine (every later request a 503).
    for _ in range(3):
        resp = await client.post(CMPL, json={**OK, "top_k": 3_000_885_068}, headers=AUTH)
        assert resp.status == 200, await resp.text()
    health = await client.get("/health")
    assert health.status == 200
