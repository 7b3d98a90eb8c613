"""The OpenAPI 3.1 document of this server, served at `/openapi.json`.

It is built per app from what validation itself reads, so it cannot drift silently:
the limits of protocol.py (`MAX_N`, `MAX_PROMPTS`, stop strings, seeds, logit bias, JSON
depth, the fields refused until they are built), the engine's `Limits` (context length,
vocabulary, logprob cap, served names), the body cap of `ServerConfig`, and the fields of the
snapshot and lever dataclasses. The sampling ranges that `SamplingParams` checks are written
here; tests/test_openapi.py sends each bound and the value just past it through the parser,
and asserts that the document lists exactly the routes the app registers.
"""

from __future__ import annotations

import dataclasses
import typing

from aiohttp import web

from metrale_jax import __version__
from metrale_jax.scheduler.levers import ZERO_ALLOWED, LeverValues
from metrale_jax.scheduler.snapshot import SchedulerSnapshot

from server import protocol as P
from server.openai_routes import STATE
from server.state import ServerState

OPENAPI_VERSION = "3.1.0"
NULL = {"type": "null"}
FINISH_REASONS = ["stop", "length", "tool_calls", "abort", "error", None]


# ---- schema helpers ---------------------------------------------------------------------------

def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _null(schema: dict) -> dict:
    return {"anyOf": [schema, NULL]}


def _int(lo: int | None = None, hi: int | None = None, desc: str | None = None) -> dict:
    bounds = {"minimum": lo, "maximum": hi, "description": desc}
    return {"type": "integer", **{k: v for k, v in bounds.items() if v is not None}}


def _num(lo: float, hi: float, *, open_lo: bool = False, desc: str | None = None) -> dict:
    low = {"exclusiveMinimum": lo} if open_lo else {"minimum": lo}
    return {"type": "number", **low, "maximum": hi, **({"description": desc} if desc else {})}


def _arr(items: dict, **kw) -> dict:
    return {"type": "array", "items": items, **kw}


def _obj(props: dict, required: tuple[str, ...] = (), **kw) -> dict:
    out = {"type": "object", "properties": props, **kw}
    if required:
        out["required"] = list(required)
    return out


BOOL, STR, INT, NUM = {"type": "boolean"}, {"type": "string"}, {"type": "integer"}, \
    {"type": "number"}
_JSON_TYPES = {int: INT, float: NUM, str: STR, bool: BOOL}


def _dataclass_schema(cls: type) -> dict:
    """The JSON object `dataclasses.asdict` makes of `cls`, typed from its annotations."""
    hints = typing.get_type_hints(cls)
    fields = [f.name for f in dataclasses.fields(cls)]
    return _obj({name: _type_schema(hints[name]) for name in fields}, tuple(fields))


def _type_schema(hint) -> dict:
    """A field's JSON type: tuples (the snapshot's LoRA fields) become arrays."""
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return _arr(_type_schema(args[0]))
        return _arr({"anyOf": [_type_schema(a) for a in dict.fromkeys(args)]},
                    minItems=len(args), maxItems=len(args))
    return dict(_JSON_TYPES[hint])


# ---- request bodies -------------------------------------------------------------------------

def _stop_schema() -> dict:
    one = {"type": "string", "minLength": 1, "maxLength": P.MAX_STOP_LENGTH}
    return _null({"anyOf": [one, _arr(one, maxItems=P.MAX_STOP_STRINGS)]})


def _unbuilt_fields() -> dict:
    """Fields accepted only when they ask for nothing (protocol.NOT_YET)."""
    return {name: {"enum": [None, *allowed], "description": "not supported yet: only null "
                   "or a value that asks for nothing is accepted (400 otherwise)"}
            for name, allowed in P.NOT_YET.items()}


def _chat_only_fields() -> dict:
    """On /v1/completions, the chat's tool fields pass only when they ask for nothing."""
    return {name: {"enum": [None, *allowed], "description": "only /v1/chat/completions takes "
                   "tools: only null or a value that asks for nothing is accepted here"}
            for name, allowed in P.CHAT_ONLY.items()}


def _tool_fields() -> dict:
    """Chat tool calls (server/tools.py): "required" or a named function constrains the
    reply to the tool's parameters schema; "auto" is answered as text."""
    function = _obj({"name": {"type": "string", "minLength": 1}, "description": STR,
                     "parameters": {"type": "object"}}, ("name",))
    tool = _obj({"type": {"const": "function"}, "function": function}, ("type", "function"))
    named = _obj({"type": {"const": "function"}, "function": _obj({"name": STR}, ("name",))},
                 ("type", "function"))
    return {"tools": _null(_arr(tool)),
            "tool_choice": _null({"anyOf": [{"enum": ["none", "auto", "required"]}, named]})}


def _structured_fields() -> dict:
    """Structured outputs (server/structured.py): one of these fields per request; whether
    the schema, regex or grammar compiles is checked by the server (400 naming the field)."""
    schema = {"anyOf": [{"type": "object"}, BOOL], "description": "a JSON schema"}
    choice = _arr(STR, minItems=1)
    grammar = {"type": "string", "pattern": r"\S",
               "description": "Lark (llguidance's syntax) or GBNF"}
    regex = {"type": "string", "pattern": r"\S"}
    fmt = {"anyOf": [
        _obj({"type": {"const": "text"}}, ("type",)),
        _obj({"type": {"const": "json_object"}}, ("type",)),
        _obj({"type": {"const": "json_schema"},
              "json_schema": _obj({"name": STR, "schema": schema, "strict": _null(BOOL),
                                   "description": STR}, ("schema",))},
             ("type", "json_schema"))]}
    one_of = {"json": {"anyOf": [schema, STR]}, "regex": regex, "choice": choice,
              "grammar": grammar, "json_object": {"const": True}}
    return {
        "response_format": _null(fmt),
        "structured_outputs": _null(_obj(one_of, additionalProperties=False, minProperties=1,
                                         maxProperties=1,
                                         description="exactly one of its keys")),
        "guided_json": _null({"anyOf": [schema, STR]}), "guided_regex": _null(regex),
        "guided_choice": _null(choice), "guided_grammar": _null(grammar),
    }


def _sampling_fields(limits: P.Limits) -> dict:
    """The fields /v1/completions and /v1/chat/completions share (protocol.sampling_params)."""
    token = _int(0, limits.vocab_size - 1)
    return {
        "model": _null({"enum": list(limits.model_names)} if limits.has_adapter is None else
                       {**STR, "description": f"{list(limits.model_names)} or a loaded LoRA "
                                              "adapter (GET /v1/models)"}),
        "n": _null(_int(1, P.MAX_N)),
        "temperature": _null(_num(0.0, 2.0)),
        "top_p": _null(_num(0.0, 1.0, open_lo=True)),
        "top_k": _null(_int(-1, desc="-1 or 0: off; a value past the vocabulary keeps "
                                      "every token, as the vocabulary size does")),
        "min_p": _null(_num(0.0, 1.0)),
        "seed": _null(_int(*P.SEED_RANGE)),
        "presence_penalty": _null(_num(-2.0, 2.0)),
        "frequency_penalty": _null(_num(-2.0, 2.0)),
        # float32's smallest normal: below it the device would compute with 0.
        "repetition_penalty": _null(_num(1.1754943508222875e-38, 10.0)),
        "logit_bias": _null({"type": "object", "propertyNames": {"pattern": r"^\s*[0-9]+\s*$"},
                             "additionalProperties": _num(-P.MAX_LOGIT_BIAS, P.MAX_LOGIT_BIAS),
                             "description": f"token id -> bias; ids below {limits.vocab_size}; "
                                            "at most the engine's max_logit_bias entries"}),
        "min_tokens": _null(_int(0, desc="at most max_tokens")),
        "stop": _stop_schema(),
        "stop_token_ids": _null(_arr(token)),
        "ignore_eos": _null(BOOL), "skip_special_tokens": _null(BOOL),
        "prompt_logprobs": _null(_int(0, limits.max_logprobs)),
        "stream": _null(BOOL),
        "stream_options": _null(_obj({"include_usage": _null(BOOL),
                                      "continuous_usage_stats": _null(BOOL)},
                                     description="only with stream: true; "
                                                 "continuous_usage_stats needs include_usage")),
        "priority": _null(INT), "user": _null(STR),
        "session_id": _null({**STR, "minLength": 1, "maxLength": P.MAX_SESSION_ID_LEN,
                             "description": "the multi-turn session: its latest turn stays "
                                            "cached for the next; an unknown id opens one"}),
        **_structured_fields(),
        **_unbuilt_fields(),
    }


def _completion_request(limits: P.Limits) -> dict:
    token = _int(0, limits.vocab_size - 1)
    ids = _arr(token, minItems=1, maxItems=limits.max_seq_len - 1)
    prompt = {"anyOf": [{"type": "string", "minLength": 1},
                        _arr(STR, minItems=1, maxItems=P.MAX_PROMPTS), ids,
                        _arr(ids, minItems=1, maxItems=P.MAX_PROMPTS)],
              "description": "a prompt fits the context (max_model_len) with room for "
                             "max_tokens"}
    return _obj({
        "prompt": prompt,
        **_sampling_fields(limits),
        "max_tokens": _null(_int(0, limits.max_seq_len - 1,
                                 f"default {P.COMPLETION_DEFAULT_MAX_TOKENS}; 0 only with "
                                 "echo: true (scores the prompt, generates nothing)")),
        "echo": _null(BOOL),
        "logprobs": _null(_int(0, limits.max_logprobs)),
        **_chat_only_fields(),
    }, ("prompt",))


def _message_schema() -> dict:
    part = _obj({"type": {"const": "text"}, "text": STR}, ("type", "text"))
    return _obj({"role": {"enum": list(P.CHAT_ROLES)},
                 "content": {"anyOf": [STR, _arr(part), NULL],
                             "description": "null only for the assistant"}},
                ("role",))


def _chat_request(limits: P.Limits) -> dict:
    max_tokens = _null(_int(1, limits.max_seq_len - 1))
    return _obj({
        "messages": _arr(_ref("ChatMessage"), minItems=1),
        **_sampling_fields(limits),
        "max_completion_tokens": max_tokens, "max_tokens": max_tokens,
        "logprobs": _null(BOOL),
        "top_logprobs": _null(_int(0, min(20, limits.max_logprobs),
                                   "needs logprobs: true")),
        "add_generation_prompt": _null(BOOL),
        **_tool_fields(),
        "chat_template_kwargs": _null({"type": "object", "propertyNames": {
            "not": {"enum": list(P.TEMPLATE_OWNED)}}}),
    }, ("messages",))


def _tokenize_request() -> dict:
    return {"anyOf": [
        _obj({"prompt": STR, "add_special_tokens": _null(BOOL)}, ("prompt",)),
        _obj({"messages": _arr(_ref("ChatMessage"), minItems=1),
              "add_generation_prompt": _null(BOOL)}, ("messages",))]}


# ---- response bodies ---------------------------------------------------------------------------

def _response_schemas() -> dict:
    usage = _obj({k: _int(0) for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
                 ("prompt_tokens", "completion_tokens", "total_tokens"))
    position = _obj({"logprob": NUM, "rank": _int(1), "decoded_token": _null(STR)},
                    ("logprob", "rank"))
    legacy = _obj({"tokens": _arr(STR), "token_logprobs": _arr(_null(NUM)),
                   "top_logprobs": _arr(_null({"type": "object",
                                               "additionalProperties": NUM})),
                   "text_offset": _arr(_int(0))},
                  ("tokens", "token_logprobs", "top_logprobs", "text_offset"))
    top = _obj({"token": STR, "logprob": NUM, "bytes": _arr(_int(0, 255))})
    chat_lp = _obj({"content": _arr(_obj({"token": STR, "logprob": _null(NUM),
                                          "bytes": _arr(_int(0, 255)),
                                          "top_logprobs": _arr(top)}))})
    finish = {"enum": FINISH_REASONS}
    tool_call = _obj({"id": STR, "type": {"const": "function"},
                      "function": _obj({"name": STR, "arguments": STR},
                                       ("name", "arguments"))}, ("id", "type", "function"))
    stop_reason = {"anyOf": [STR, INT, NULL]}
    head = {"id": STR, "created": INT, "model": STR}
    keys = ("id", "object", "created", "model", "choices")
    choice = {"index": _int(0), "finish_reason": finish, "stop_reason": stop_reason}
    return {
        "Error": _obj({"error": _obj({"message": STR, "type": STR, "param": _null(STR),
                                      "code": _null(STR)},
                                     ("message", "type", "param", "code"))}, ("error",)),
        "Usage": usage,
        "PromptLogprobs": _null(_arr(_null({"type": "object",
                                            "additionalProperties": position}))),
        "Completion": _obj({**head, "object": {"const": "text_completion"},
                            "choices": _arr(_obj({**choice, "text": STR,
                                                  "logprobs": _null(legacy),
                                                  "prompt_logprobs": _ref("PromptLogprobs")},
                                                 ("index", "text", "finish_reason"))),
                            "usage": _ref("Usage")}, (*keys, "usage")),
        "CompletionChunk": _obj({**head, "object": {"const": "text_completion"},
                                 "choices": _arr(_obj({**choice, "text": STR,
                                                       "logprobs": _null(legacy)},
                                                      ("index", "text"))),
                                 "usage": _null(_ref("Usage"))}, keys),
        "ChatCompletion": _obj({**head, "object": {"const": "chat.completion"},
                                "choices": _arr(_obj({
                                    **choice, "logprobs": _null(chat_lp),
                                    "message": _obj({"role": {"const": "assistant"},
                                                     "content": _null(STR),
                                                     "tool_calls": _arr(tool_call)},
                                                    ("role", "content"))},
                                    ("index", "message", "finish_reason"))),
                                "usage": _ref("Usage"),
                                "prompt_logprobs": _ref("PromptLogprobs")}, (*keys, "usage")),
        "ChatCompletionChunk": _obj({**head, "object": {"const": "chat.completion.chunk"},
                                     "choices": _arr(_obj({
                                         **choice, "logprobs": _null(chat_lp),
                                         "delta": _obj({"role": {"const": "assistant"},
                                                        "content": STR,
                                                        "tool_calls": _arr(_obj({
                                                            "index": _int(0),
                                                            **tool_call["properties"]}))})},
                                         ("index", "delta"))),
                                     "usage": _null(_ref("Usage"))}, keys),
        "ChatMessage": _message_schema(),
    }


def _endpoint_schemas(limits: P.Limits) -> dict:
    snapshot = _dataclass_schema(SchedulerSnapshot)
    now = _obj({k: _int(0) for k in ("kv_blocks_free", "kv_blocks_cached", "kv_blocks_used",
                                     "kv_blocks_usable", "requests_in_engine")})
    one_engine = {"snapshot": _null(snapshot), "now": _null(now),
                  "counters": {"type": "object"}, "compiled_variants": _int(0),
                  "compiling_variants": _int(0)}
    required = ("snapshot", "now", "counters", "compiled_variants", "compiling_variants")
    levers = _dataclass_schema(LeverValues)
    for name, spec in levers["properties"].items():  # the checks of Levers._validated
        if spec["type"] == "integer":
            spec["minimum"] = 0 if name in ZERO_ALLOWED else 1
    levers["properties"]["admit_watermark"].update(minimum=0.0, exclusiveMaximum=1.0)
    model = _obj({"id": STR, "object": {"const": "model"}, "created": INT, "owned_by": STR,
                  "root": STR, "parent": _null(STR), "max_model_len": INT}, ("id", "object"))
    return {
        "CompletionRequest": _completion_request(limits),
        "ChatCompletionRequest": _chat_request(limits),
        "TokenizeRequest": _tokenize_request(),
        "TokenizeResponse": _obj({"count": _int(0), "max_model_len": INT,
                                  "tokens": _arr(_int(0)), "token_strs": NULL},
                                 ("count", "tokens")),
        "DetokenizeRequest": _obj({"tokens": _arr(_int(0, limits.vocab_size - 1))},
                                  ("tokens",)),
        "DetokenizeResponse": _obj({"prompt": STR}, ("prompt",)),
        "Health": _obj({"status": {"enum": ["ok", "starting", "draining", "unhealthy"]},
                        "error": STR, "compiling_variants": _int(0)}, ("status",),
                       description="compiling_variants: step shapes still compiling beside "
                                   "serving (batches run padded in covering shapes meanwhile)"),
        "ModelList": _obj({"object": {"const": "list"}, "data": _arr(model)},
                          ("object", "data")),
        "AdminSnapshot": _obj({**one_engine, "engines": _arr(_obj(one_engine, required)),
                               "router_loads": _arr(_int(0))}, required,
                              description="data parallel: the totals, and each engine's own "
                                          "under engines"),
        "Levers": levers,
        "LoadLoraAdapterRequest": _obj(
            {"lora_name": {"type": "string", "minLength": 1},
             "lora_path": {"type": "string", "minLength": 1, "description": "a PEFT adapter "
                           "directory inside the server's --lora-dir (absolute or relative "
                           "to it)"},
             "load_inplace": {**BOOL, "description": "replace the weights of a loaded name"}},
            ("lora_name", "lora_path")),
        "UnloadLoraAdapterRequest": _obj({"lora_name": {"type": "string", "minLength": 1}},
                                         ("lora_name",)),
        "LeverChanges": {**levers, "required": [], "additionalProperties": False,
                         "description": "any subset of the levers; integers at most the "
                                        "limits the step buckets were compiled for"},
    }


# ---- operations ---------------------------------------------------------------------------------

ERRORS = {"400": "invalid request (the message and param name the field)",
          "401": "missing or wrong API key", "404": "unknown model or path",
          "405": "method not allowed", "413": "body over the size limit",
          "415": "body not sent as application/json", "429": "waiting queue full (Retry-After)",
          "500": "the engine failed", "503": "starting, draining or unhealthy"}


def _json(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


def _op(summary: str, ok: dict, *, body: str | None = None, errors: tuple = ()) -> dict:
    responses = {"200": {"description": "OK", "content": ok}}
    for code in ("401", "404", "405", *errors):
        responses[code] = {"description": ERRORS[code], "content": _json(_ref("Error"))}
    op = {"summary": summary, "responses": responses}
    if body:
        op["requestBody"] = {"required": True, "content": _json(_ref(body))}
    return op


def _generation(summary: str, body: str, whole: str, chunk: str) -> dict:
    events = {"type": "string", "description": f"with stream: true, server-sent events: "
              f"`data: <{chunk}>` per chunk, then `data: [DONE]`"}
    return {"post": _op(summary, {**_json(_ref(whole)), "text/event-stream": {"schema": events}},
                        body=body, errors=("400", "413", "415", "429", "500", "503"))}


def _paths() -> dict:
    post_errors = ("400", "413", "415")
    paths = {
        "/health": {"get": {**_op("liveness and readiness", _json(_ref("Health"))),
                            "security": []}},
        "/v1/models": {"get": _op("the served model names", _json(_ref("ModelList")))},
        "/metrics": {"get": _op("Prometheus metrics",
                                {"text/plain": {"schema": STR}})},
        "/openapi.json": {"get": _op("this document", _json({"type": "object"}))},
        "/v1/completions": _generation("text completion (legacy)", "CompletionRequest",
                                       "Completion", "CompletionChunk"),
        "/v1/chat/completions": _generation("chat completion", "ChatCompletionRequest",
                                            "ChatCompletion", "ChatCompletionChunk"),
        "/tokenize": {"post": _op("a prompt or chat messages -> token ids",
                                  _json(_ref("TokenizeResponse")), body="TokenizeRequest",
                                  errors=post_errors)},
        "/detokenize": {"post": _op("token ids -> text", _json(_ref("DetokenizeResponse")),
                                    body="DetokenizeRequest", errors=post_errors)},
        "/v1/admin/snapshot": {"get": _op("the scheduler snapshot and counters",
                                          _json(_ref("AdminSnapshot")))},
        "/v1/load_lora_adapter": {"post": _op(
            "load a LoRA adapter (answered once the engine applied it)",
            {"text/plain": {"schema": STR}}, body="LoadLoraAdapterRequest",
            errors=(*post_errors, "503"))},
        "/v1/unload_lora_adapter": {"post": _op(
            "unload a LoRA adapter (answered once the engine applied it)",
            {"text/plain": {"schema": STR}}, body="UnloadLoraAdapterRequest",
            errors=(*post_errors, "503"))},
        "/v1/sessions/{session_id}": {"delete": {
            **_op("end a session, releasing the KV blocks and SSM state it pins (404: no "
                  "such session open)",
                  _json(_obj({"id": STR, "object": {"enum": ["session"]}, "deleted": BOOL},
                             ("id", "object", "deleted"))), errors=("400", "503")),
            "parameters": [{"name": "session_id", "in": "path", "required": True,
                            "schema": {**STR, "minLength": 1,
                                       "maxLength": P.MAX_SESSION_ID_LEN}}]}},
        "/v1/admin/levers": {
            "get": _op("the runtime levers", _json(_ref("Levers"))),
            "post": _op("change levers; answers all of them", _json(_ref("Levers")),
                        body="LeverChanges", errors=post_errors)},
    }
    for item in paths.values():  # aiohttp answers HEAD on every GET route
        if "get" in item:
            item["head"] = {**item["get"], "summary": item["get"]["summary"] + " (no body)"}
    return paths


def build(state: ServerState) -> dict:
    """The document for one server: its limits, names and body cap."""
    limits, config = state.limits, state.config
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": "metrale_jax OpenAI-compatible server", "version": __version__,
                 "description": f"Bodies are JSON objects of at most {config.max_body_bytes} "
                                f"bytes (413 beyond), nested at most {P.MAX_JSON_DEPTH} deep, "
                                "UTF-8 without lone surrogates. Every 4xx/5xx answer is an "
                                "Error object. Unknown fields are ignored."},
        "paths": _paths(),
        "components": {"schemas": {**_response_schemas(), **_endpoint_schemas(limits)},
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}] if config.api_key else [],
    }


async def openapi_json(request: web.Request) -> web.Response:
    return web.json_response(build(request.app[STATE]))
