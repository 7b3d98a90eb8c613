"""The HTTP fuzzer: thousands of generated requests against the in-process server on the
built-in model (the small engine the server tests share, so its programs are compiled once).

Bodies come from the server's own /openapi.json (`fuzz_strategies.SchemaStrategies`), broken
on purpose, plus raw bytes, content types, methods, paths, queries and API keys. Every answer
must be 2xx or 4xx, a 4xx an OpenAI error object, a 2xx (SSE included) what the document
says; afterwards the server answers a greedy completion exactly as before and holds no
request or KV block.

Each test is bounded by its example count and by a time budget (past it, examples are drawn
but not sent: CI on a slow runner still ends); seeds are fixed (derandomize).
"""

from __future__ import annotations

import collections
import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.app import create_app
from server.openai_routes import STATE
from server.state import ServerConfig
from tests.reliability import fuzz_strategies as fs
from tests.reliability.http_harness import Checker, ServerThread
from tests.server_fixtures import running_engine

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 64 * 1024
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
GREEDY = {"prompt": "To be, or not to be", "max_tokens": 6, "temperature": 0.0,
          "ignore_eos": True}

SENT: collections.Counter = collections.Counter()     # "METHOD path" -> requests answered
UNSENT: collections.Counter = collections.Counter()   # drawn past a test's time budget
SECONDS: collections.Counter = collections.Counter()  # time spent answering them
_DEADLINES: dict[str, float] = {}


def fuzz_settings(examples: int):
    return settings(max_examples=examples, derandomize=True, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=False)


_FAILING: set[str] = set()


def in_budget(test: str, seconds: float) -> bool:
    """False once `test` has run `seconds` (its first example starts the clock), unless it
    failed: then hypothesis' shrinking must see the server answer, or the failure would
    look flaky."""
    deadline = _DEADLINES.setdefault(test, time.monotonic() + seconds)
    return test in _FAILING or time.monotonic() < deadline


# ---- fixtures ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm():
    yield from running_engine()


@pytest.fixture(scope="module")
def server(llm):
    srv = ServerThread(create_app(llm, ServerConfig(api_key=KEY, max_body_bytes=BODY_LIMIT)))
    reply = srv.request("POST", CMPL, json=GREEDY, headers=AUTH)
    assert reply.status == 200, reply.body
    srv.baseline = json.loads(reply.body)   # what a normal request answers before fuzzing
    srv.doc = json.loads(srv.request("GET", "/openapi.json", headers=AUTH).body)
    srv.check = Checker(srv.doc)
    srv.schemas = fs.SchemaStrategies(srv.doc)
    srv.strategy_cache = {}
    yield srv
    srv.close()


def send(server, test: str, budget_s: float, method: str, path: str, *, body=None,
         raw: bytes | None = None, content_type: str | None = "application/json",
         headers: dict | None = None, params=None) -> None:
    """One request through the checker (or counted unsent past the test's budget)."""
    key = f"{method} {path if path in server.doc['paths'] else '<other path>'}"
    if not in_budget(test, budget_s):
        UNSENT[key] += 1
        return
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    headers = dict(AUTH if headers is None else headers)
    skip = ()
    if content_type is None:
        skip = ("Content-Type",)
    elif data is not None:
        headers["Content-Type"] = content_type
    t0 = time.monotonic()
    reply = server.request(method, path, sent=raw if raw is not None else body, data=data,
                           headers=headers, params=params, skip_auto_headers=skip)
    try:
        server.check(reply)
    except AssertionError:
        _FAILING.add(test)
        raise
    SENT[key] += 1
    SECONDS[key] += time.monotonic() - t0


# ---- strategies over the document -------------------------------------------------------------

def cached(build):
    """Strategies are built once per server, not once per example."""
    def get(server, *args):
        key = (build.__name__, *args)
        if key not in server.strategy_cache:
            server.strategy_cache[key] = build(server, *args)
        return server.strategy_cache[key]
    return get


def _schema(server, name: str) -> dict:
    return server.doc["components"]["schemas"][name]


def _bound(server, schema: str, field: str, key: str) -> int:
    spec = _schema(server, schema)["properties"][field]
    return next(s for s in spec.get("anyOf", [spec]) if key in s)[key]


def _short_prompts(vocab: int) -> st.SearchStrategy:
    ids = st.lists(st.integers(0, vocab - 1), min_size=1, max_size=10)
    return st.one_of(st.text(min_size=1, max_size=30),
                     st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=3), ids,
                     st.lists(ids, min_size=1, max_size=2),
                     st.sampled_from(["word " * 200, "x" * (BODY_LIMIT - 100)]))


def _with_max_tokens(server, schema: str, valid: st.SearchStrategy, names: tuple[str, ...],
                     omit_one_in: int) -> st.SearchStrategy:
    """Generation stays short: max_tokens 0-3 mostly, now and then past the context (the
    length check refuses it: a 400, nothing generated), and one body in `omit_one_in` names
    none (the endpoint's default: 16 or the whole context)."""
    too_long = _bound(server, schema, names[0], "maximum") + 1
    small = st.integers(0, 3) | st.integers(too_long, 2 ** 70)

    def body(base: dict, name: str, n: int, omit: int) -> dict:
        return base if omit == 0 else {name: n, **base}

    return st.builds(body, valid, st.sampled_from(names), small,
                     st.integers(0, omit_one_in - 1))


def _bodies(server, schema: str, valid: st.SearchStrategy, names: tuple[str, ...],
            omit_one_in: int) -> st.SearchStrategy:
    """Valid bodies and broken ones."""
    valid = _with_max_tokens(server, schema, valid, names, omit_one_in)
    return valid | fs.broken(valid, list(_schema(server, schema)["properties"]))


@cached
def completion_bodies(server) -> st.SearchStrategy:
    vocab = _schema(server, "DetokenizeRequest")["properties"]["tokens"]["items"]["maximum"] + 1
    valid = server.schemas.from_schema(_schema(server, "CompletionRequest"), {
        "prompt": _short_prompts(vocab), "n": st.integers(1, 3),
        "min_tokens": st.integers(0, 2) | st.integers(0), "max_tokens": st.integers(0, 3)})
    return _bodies(server, "CompletionRequest", valid, ("max_tokens",), omit_one_in=5)


@cached
def chat_bodies(server) -> st.SearchStrategy:
    valid = server.schemas.from_schema(_schema(server, "ChatCompletionRequest"), {
        "n": st.integers(1, 3), "min_tokens": st.integers(0, 2) | st.integers(0),
        "max_tokens": st.integers(1, 3), "max_completion_tokens": st.integers(1, 3)})
    # Chat's default is the whole context (~50 tokens here): rarely left to it.
    return _bodies(server, "ChatCompletionRequest", valid,
                   ("max_completion_tokens", "max_tokens"), omit_one_in=20)


@cached
def plain_bodies(server, name: str) -> st.SearchStrategy:
    schema = _schema(server, name)
    valid = server.schemas.from_schema(schema)
    fields = sorted({f for s in schema.get("anyOf", [schema]) for f in s["properties"]})
    return valid | fs.broken(valid, fields)


@cached
def raw_bodies(server, path: str) -> st.SearchStrategy:
    valid = {CMPL: completion_bodies, CHAT: chat_bodies}.get(path)
    valid = valid(server) if valid else plain_bodies(server, {
        "/tokenize": "TokenizeRequest", "/detokenize": "DetokenizeRequest",
        "/v1/admin/levers": "LeverChanges"}[path])
    return fs.raw_bodies(valid, BODY_LIMIT)


# ---- the fuzz tests ---------------------------------------------------------------------------

@fuzz_settings(1000)
@given(data=st.data())
def test_fuzz_completions(server, data):
    send(server, "completions", 30, "POST", CMPL, body=data.draw(completion_bodies(server)))


@fuzz_settings(600)
@given(data=st.data())
def test_fuzz_chat_completions(server, data):
    send(server, "chat", 20, "POST", CHAT, body=data.draw(chat_bodies(server)))


@fuzz_settings(500)
@given(data=st.data())
def test_fuzz_tokenize(server, data):
    send(server, "tokenize", 6, "POST", "/tokenize",
         body=data.draw(plain_bodies(server, "TokenizeRequest")))


@fuzz_settings(400)
@given(data=st.data())
def test_fuzz_detokenize(server, data):
    send(server, "detokenize", 5, "POST", "/detokenize",
         body=data.draw(plain_bodies(server, "DetokenizeRequest")))


@fuzz_settings(300)
@given(data=st.data())
def test_fuzz_levers(server, data):
    """Accepted changes are undone at once, so the fuzzing of the rest runs as configured."""
    before = json.loads(server.request("GET", "/v1/admin/levers", headers=AUTH).body)
    try:
        send(server, "levers", 5, "POST", "/v1/admin/levers",
             body=data.draw(plain_bodies(server, "LeverChanges")))
    finally:
        restored = server.request("POST", "/v1/admin/levers", json=before, headers=AUTH)
        assert restored.status == 200 and json.loads(restored.body) == before


POSTS = [CMPL, CHAT, "/tokenize", "/detokenize", "/v1/admin/levers"]


@fuzz_settings(600)
@given(data=st.data())
def test_fuzz_raw_bodies_and_content_types(server, data):
    path = data.draw(st.sampled_from(POSTS))
    raw = data.draw(raw_bodies(server, path))
    content_type = data.draw(st.sampled_from(fs.JSON_TYPES) | st.sampled_from(fs.CONTENT_TYPES))
    levers = server.request("GET", "/v1/admin/levers", headers=AUTH).body
    send(server, "raw", 12, "POST", path, raw=raw, content_type=content_type)
    if path == "/v1/admin/levers":
        server.request("POST", path, json=json.loads(levers), headers=AUTH)


METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]
AUTHS = [AUTH, {}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
         {"Authorization": "Basic " + KEY}, {"Authorization": "Bearer"}]


@fuzz_settings(800)
@given(data=st.data())
def test_fuzz_methods_paths_queries_and_keys(server, data):
    known = sorted(server.doc["paths"])
    path = data.draw(st.sampled_from(known) | st.text(
        st.characters(min_codepoint=33, max_codepoint=0x2fff, exclude_characters="?#%"),
        max_size=20).map(lambda s: "/v1/" + s))
    method = data.draw(st.sampled_from(METHODS))
    if method == "POST" and path == "/v1/admin/levers":
        method = "GET"  # lever changes are fuzzed (and undone) above
    params = data.draw(st.dictionaries(st.text(max_size=6), st.text(max_size=12), max_size=3))
    send(server, "methods", 5, method, path, params=params, content_type=None,
         headers=data.draw(st.sampled_from(AUTHS)))


# ---- afterwards -------------------------------------------------------------------------------

def test_the_server_serves_as_before_after_fuzzing(server, llm):
    reply = server.request("POST", CMPL, json=GREEDY, headers=AUTH)
    assert reply.status == 200, reply.body
    after = json.loads(reply.body)
    assert after["choices"][0]["text"] == server.baseline["choices"][0]["text"]
    assert after["usage"] == server.baseline["usage"]
    # No waiting needed: every fuzz request was answered (or its client gone) before this
    # completion was sent, so the engine drained their aborts before admitting it, and it
    # publishes its snapshot after releasing it.
    admin = json.loads(server.request("GET", "/v1/admin/snapshot", headers=AUTH).body)
    now, snap = admin["now"], admin["snapshot"]
    assert now["requests_in_engine"] == 0, now
    # Fuzzed bodies may name a `session_id`: a session keeps its last turn's blocks for the
    # next turn. Those are the only blocks still in use (shared ones are counted per session).
    assert now["kv_blocks_used"] <= snap["session_pinned_blocks"], admin
    assert now["kv_blocks_used"] == 0 or snap["sessions_open"] > 0, admin
    state = server.client.app[STATE]
    assert state.open_seqs == 0 and state.open_requests == 0

    rows = sorted(set(SENT) | set(UNSENT))
    print("\nfuzz cases per endpoint (answered / drawn past the time budget):")
    for key in rows:
        print(f"  {key:32s} {SENT[key]:6d} {UNSENT[key]:6d} {SECONDS[key]:7.2f}s")
    print(f"  {'total':32s} {sum(SENT.values()):6d} {sum(UNSENT.values()):6d}")
    for path in POSTS:  # every POST endpoint was really exercised
        assert SENT[f"POST {path}"] >= 100, SENT
