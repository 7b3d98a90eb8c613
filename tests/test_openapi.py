"""/openapi.json: valid OpenAPI 3, one entry per route the app registers (a route added
without a document entry fails here), and the bounds it states are the parser's bounds."""

from __future__ import annotations

import json
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
