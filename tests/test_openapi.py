"""/openapi.json: valid OpenAPI 3, one entry per route the app registers (a route added
without a document entry fails here), and the bounds it states are the parser's bounds."""

from __future__ import annotations

import json
import math
import types

import pytest
from aiohttp.test_utils import make_mocked_request
from openapi_spec_validator import validate

from metrale_jax.async_engine import EngineLimits
from server import openapi
from server import protocol as P
from server.app import create_app
from server.state import ServerConfig

LIMITS = EngineLimits(model_name="tiny", max_seq_len=64, max_logprobs=2, vocab_size=100,
                      max_batch_size=4)


def make_app(**config):
    # The document reads only the engine's limits: no model is loaded for it.
    return create_app(types.SimpleNamespace(limits=LIMITS), ServerConfig(**config))


@pytest.fixture(scope="module")
def document():
    from server.openai_routes import STATE
    return openapi.build(make_app(api_key="k")[STATE])


def test_the_document_validates_as_openapi_3(document):
    assert document["openapi"].startswith("3.")
    validate(document)


def test_every_registered_route_is_documented_and_nothing_else():
    from server.openai_routes import STATE
    app = make_app()
    routes = {(r.method.lower(), r.resource.canonical) for r in app.router.routes()}
    doc = openapi.build(app[STATE])
    documented = {(m, path) for path, item in doc["paths"].items() for m in item}
    assert routes == documented


def test_the_key_requirement_follows_the_config(document):
    from server.openai_routes import STATE
    assert document["security"] == [{"bearer": []}]
    assert document["paths"]["/health"]["get"]["security"] == []
    assert openapi.build(make_app()[STATE])["security"] == []


def _numeric_bounds(schema: dict):
    inner = next((s for s in schema.get("anyOf", [schema]) if s.get("type") in
                  ("integer", "number")), None)
    if inner is None:
        return None
    return inner


def _bound_cases(document):
    """(field, good value, bad value) at every stated numeric bound of the sampling fields."""
    props = document["components"]["schemas"]["CompletionRequest"]["properties"]
    cases = []
    for name, schema in props.items():
        s = _numeric_bounds(schema)
        if s is None or name in ("max_tokens", "priority"):
            continue
        step = 1 if s["type"] == "integer" else 1e-6
        if "minimum" in s:
            cases.append((name, s["minimum"], s["minimum"] - step))
        if "exclusiveMinimum" in s:
            cases.append((name, s["exclusiveMinimum"] + step, s["exclusiveMinimum"]))
        if "maximum" in s:
            cases.append((name, s["maximum"], s["maximum"] + step))
    return cases


def test_stated_bounds_are_the_parsers_bounds(document):
    limits = P.Limits(model_names=("tiny",), max_seq_len=64, max_logprobs=2, vocab_size=100)
    cases = _bound_cases(document)
    names = {c[0] for c in cases}
    assert {"n", "temperature", "top_p", "seed", "logprobs", "presence_penalty"} <= names
    for name, good, bad in cases:
        base = {"prompt": "hi", "max_tokens": 1}
        if name == "min_tokens":
            base["max_tokens"] = max(good, 1)
        P.parse_completion({**base, name: good}, limits)  # accepted at the bound
        with pytest.raises(P.APIError) as err:
            P.parse_completion({**base, name: bad}, limits)
        assert err.value.status == 400, (name, bad)


def test_stop_and_prompt_limits_match_the_parser(document):
    limits = P.Limits(model_names=("tiny",), max_seq_len=64, max_logprobs=2, vocab_size=100)
    props = document["components"]["schemas"]["CompletionRequest"]["properties"]
    stop = props["stop"]["anyOf"][0]["anyOf"][1]
    assert stop["maxItems"] == P.MAX_STOP_STRINGS
    assert stop["items"]["maxLength"] == P.MAX_STOP_LENGTH
    P.parse_completion({"prompt": "hi", "stop": ["a"] * P.MAX_STOP_STRINGS}, limits)
    with pytest.raises(P.APIError):
        P.parse_completion({"prompt": "hi", "stop": ["a"] * (P.MAX_STOP_STRINGS + 1)}, limits)


async def test_the_route_serves_it():
    app = make_app()
    handler = next(r.handler for r in app.router.routes()
                   if r.resource.canonical == "/openapi.json")
    resp = await handler(make_mocked_request("GET", "/openapi.json", app=app))
    assert resp.status == 200
    validate(json.loads(resp.body))


# ---- every bound of both generation bodies, types, and the fields not built yet -------------

PARSERS = {"CompletionRequest": lambda body, limits: P.parse_completion(
               {"prompt": "hi", "echo": True, **body}, limits),
           "ChatCompletionRequest": lambda body, limits: P.parse_chat(
               {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, **body},
               limits)}
# Their maximum (the context) is checked where the request enters the engine, once the
# prompt is tokenized: test_answers_match_the_documented_response_schemas sends it.
CONTEXT_BOUNDED = ("max_tokens", "max_completion_tokens")
PARSER_LIMITS = P.Limits(model_names=("tiny",), max_seq_len=64, max_logprobs=2, vocab_size=100)


def _refused(schema: str, field: str, value) -> bool:
    """Whether the parser refuses `value` for `field`, naming that field."""
    try:
        PARSERS[schema]({field: value}, PARSER_LIMITS)
    except P.APIError as err:
        assert err.param == field, (field, value, err.message)
        return True
    return False


@pytest.mark.parametrize("schema", sorted(PARSERS))
def test_every_numeric_bound_and_type_is_the_parsers(document, schema):
    checked = 0
    for field, spec in document["components"]["schemas"][schema]["properties"].items():
        s = _numeric_bounds(spec)
        if s is None:
            continue
        checked += 1
        if field in CONTEXT_BOUNDED:  # checked where the request enters the engine: below
            s = {k: v for k, v in s.items() if k != "maximum"}
        if "minimum" in s:
            step = 1 if s["type"] == "integer" else 1e-6
            assert not _refused(schema, field, s["minimum"]), field
            assert _refused(schema, field, s["minimum"] - step), field
        if "exclusiveMinimum" in s:
            assert _refused(schema, field, s["exclusiveMinimum"]), field
            assert not _refused(schema, field, math.nextafter(s["exclusiveMinimum"], 1)), field
        if "maximum" in s:
            step = 1 if s["type"] == "integer" else 1e-6
            assert not _refused(schema, field, s["maximum"]), field
            assert _refused(schema, field, s["maximum"] + step), field
        if s["type"] == "integer":
            assert _refused(schema, field, 1.5), field
        assert _refused(schema, field, "1"), field
    assert checked >= 14


@pytest.mark.parametrize("schema", sorted(PARSERS))
def test_fields_not_built_yet_take_only_the_listed_values(document, schema):
    props = document["components"]["schemas"][schema]["properties"]
    for field in P.NOT_YET:
        allowed = props[field]["enum"]
        for value in allowed:
            assert not _refused(schema, field, value), (field, value)
        for value in ({"type": "json_object"}, [{"type": "function"}], "auto", 0, False, {}):
            if not any(type(a) is type(value) and a == value for a in allowed):
                assert _refused(schema, field, value), (field, value)


def test_names_and_template_keys_are_the_parsers(document):
    assert not _refused("CompletionRequest", "model", "tiny")
    assert _refused("CompletionRequest", "model", "other")
    chat = document["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    owned = chat["chat_template_kwargs"]["anyOf"][0]["propertyNames"]["not"]["enum"]
    for key in owned:
        assert _refused("ChatCompletionRequest", "chat_template_kwargs", {key: 1}), key
    assert not _refused("ChatCompletionRequest", "chat_template_kwargs", {"x": 1})


# ---- answers match the response schemas -------------------------------------------------------

@pytest.fixture(scope="module")
def llm():
    from tests.server_fixtures import running_engine
    yield from running_engine()


async def test_answers_match_the_documented_response_schemas(llm, aiohttp_client):
    from tests.reliability.http_harness import Checker, Reply

    client = await aiohttp_client(create_app(llm))
    doc = await (await client.get("/openapi.json")).json()
    check = Checker(doc)
    gen = {"max_tokens": 2, "logprobs": 1, "temperature": 0.0, "prompt_logprobs": 1}
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "logprobs": True, "top_logprobs": 1, "prompt_logprobs": 1}
    calls = [("GET", path, None) for path, item in doc["paths"].items() if "get" in item]
    calls += [("POST", "/v1/completions", {"prompt": ["Hello", "Hi"], "echo": True, **gen}),
              ("POST", "/v1/completions", {"prompt": "Hello", "stream": True, **gen,
                                           "stream_options": {"include_usage": True}}),
              ("POST", "/v1/chat/completions", chat),
              ("POST", "/v1/chat/completions", {**chat, "stream": True}),
              ("POST", "/tokenize", {"prompt": "Hello"}),
              ("POST", "/tokenize", {"messages": chat["messages"]}),
              ("POST", "/detokenize", {"tokens": [1, 2]}),
              ("POST", "/v1/admin/levers", {}),
              ("POST", "/v1/completions", {"prompt": 5})]
    for method, path, body in calls:
        resp = await client.request(method, path, json=body)
        check(Reply(method, path, resp.status, resp.content_type, await resp.read(), body))

    # The context bound of max_tokens, with a one-token prompt: the maximum fits, one more not.
    most = doc["components"]["schemas"]["CompletionRequest"]["properties"]["max_tokens"]
    most = _numeric_bounds(most)["maximum"]
    for max_tokens, status in ((most, 200), (most + 1, 400)):
        resp = await client.post("/v1/completions", json={"prompt": [7], "ignore_eos": True,
                                                          "max_tokens": max_tokens})
        assert resp.status == status, await resp.text()
