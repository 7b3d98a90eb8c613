"""Structured outputs through the server: the official `openai` client gets JSON that its
schema accepts, every field (response_format, structured_outputs, guided_*) constrains the
output, and invalid constraints each get a 400 naming the field while the server keeps
serving."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from server.app import create_app
from tests.grammar_cases import LARK, LARK_RE
from tests.server_fixtures import running_engine

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm():
    yield from running_engine()


@pytest.fixture
async def client(llm, aiohttp_client):
    return await aiohttp_client(create_app(llm))


@pytest.fixture
async def oai(client):
    c = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="none", max_retries=0)
    yield c
    await c.close()


async def test_openai_client_gets_schema_valid_json(oai, llm):
    for temperature in (0.0, 1.0):
        reply = await oai.chat.completions.create(
            model=llm.engine.model_name, messages=[{"role": "user", "content": "Who?"}],
            max_tokens=40, temperature=temperature, seed=3,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": SCHEMA,
                                             "strict": True}})
        choice = reply.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


async def test_every_field_constrains_completions(oai, llm):
    model = llm.engine.model_name
    cases = [({"guided_regex": r"[0-9]{2}-[a-z]{3}"},
              lambda t: re.fullmatch(r"[0-9]{2}-[a-z]{3}", t)),
             ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
             ({"guided_grammar": LARK}, lambda t: re.fullmatch(LARK_RE, t)),
             ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA)
              or True),
             ({"structured_outputs": {"regex": "(ab){1,3}c"}},
              lambda t: re.fullmatch("(ab){1,3}c", t)),
             ({"response_format": {"type": "json_object"}},
              lambda t: isinstance(json.loads(t), dict))]
    for extra, check in cases:
        reply = await oai.completions.create(model=model, prompt="Now is the winter",
                                             max_tokens=30, temperature=0.0, extra_body=extra)
        text = reply.choices[0].text
        if "response_format" in extra and reply.choices[0].finish_reason == "length":
            assert text.startswith("{")  # any object: the model may not close it in 30
            continue
        assert reply.choices[0].finish_reason == "stop", (extra, text)
        assert check(text), (extra, text)
    stream = await oai.completions.create(model=model, prompt="Now", max_tokens=30,
                                          temperature=0.0, stream=True,
                                          extra_body={"guided_choice": ["left", "right"]})
    assert "".join([c.choices[0].text async for c in stream]) in ("left", "right")


INVALID = [
    ("guided_regex", "(abc"), ("guided_regex", "[a-"), ("guided_regex", "a{3,1}"),
    ("guided_regex", ""), ("guided_regex", 5),
    ("guided_json", {"type": "foo"}), ("guided_json", "{not json"), ("guided_json", "[1]"),
    ("guided_json", {"$ref": "#/nowhere"}), ("guided_json", {"type": "string",
                                                             "pattern": "(x"}),
    ("guided_choice", []), ("guided_choice", [1, 2]), ("guided_choice", "yes"),
    ("guided_grammar", "start: missing"), ("guided_grammar", "start: (("),
    ("guided_grammar", "root ::= [a-"),
    ("structured_outputs", {"regex": "a", "choice": ["a"]}),
    ("structured_outputs", {"pattern": "a"}), ("structured_outputs", {"json": {"type": 3}}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x",
                                                                "schema": {"type": "bar"}}}),
    ("response_format", {"type": "regex"}),
]


async def test_invalid_constraints_get_400_and_the_server_keeps_serving(client):
    assert len(INVALID) >= 20
    for field, value in INVALID:
        resp = await client.post(CMPL, json={"prompt": "x", "max_tokens": 2, field: value})
        body = await resp.json()
        assert resp.status == 400, (field, value, body)
        assert body["error"]["param"] == field, (field, value, body)
        assert body["error"]["type"] == "invalid_request_error"
    ok = await client.post(CMPL, json={"prompt": "x", "max_tokens": 2,
                                       "guided_choice": ["yes", "no"]})
    assert ok.status == 200 and (await ok.json())["choices"][0]["text"] in ("yes", "no")


async def test_constrained_logprobs_are_json(client):
    resp = await client.post(CHAT, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0,
        "logprobs": True, "top_logprobs": 2, "guided_choice": ["x"]})
    body = await resp.json()  # -inf would not parse: vLLM's -9999.0 stands for it
    assert resp.status == 200, body
    content = body["choices"][0]["logprobs"]["content"]
    assert body["choices"][0]["message"]["content"] == "x"
    assert content[0]["logprob"] == 0.0
    assert all(e["logprob"] == -9999.0 for e in content[0]["top_logprobs"][1:])


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


async def test_tool_choice_returns_tool_calls(oai, llm):
    model = llm.engine.model_name
    named = await oai.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER, TIME], max_tokens=40, temperature=0.0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

    required = await oai.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER, TIME], max_tokens=46, temperature=0.0,
        tool_choice="required")  # the server's test engine has a 64-token context
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])

    for tool_choice in ("none", "auto"):  # answered as text (README: no tool-call format)
        text = await oai.chat.completions.create(
            model=model, messages=ASK, tools=[WEATHER], max_tokens=4, temperature=0.0,
            tool_choice=tool_choice)
        assert not text.choices[0].message.tool_calls
        assert isinstance(text.choices[0].message.content, str)


async def test_streamed_tool_call_arrives_whole(oai, llm):
    stream = await oai.chat.completions.create(
        model=llm.engine.model_name, messages=ASK, tools=[WEATHER], max_tokens=40,
        temperature=0.0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    chunks = [c async for c in stream]
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments),
                        WEATHER["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "stop"
