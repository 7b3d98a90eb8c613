"""The OpenAI protocol as vLLM serves it: request bodies -> engine inputs, OpenAI error objects.

Every check names the field it rejects (`param`), so a client sees what to fix; nothing here
touches the engine beyond reading its limits and its tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from metrale_jax.outputs import StreamDelta
from metrale_jax.request import RequestError, SamplingParams

MAX_N = 32                   # completions per prompt
MAX_PROMPTS = 64             # prompts in one /v1/completions request
MAX_LOGIT_BIAS = 100.0
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Template variables the request sets from its own fields; chat_template_kwargs may not.
TEMPLATE_OWNED = ("messages", "add_generation_prompt")
CHAT_ROLES = ("system", "developer", "user", "assistant")
# End-of-turn tokens chat templates emit; a chat reply stops at them as at EOS (vLLM reads
# the same ids from generation_config.json).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")


class APIError(Exception):
    """An error answered to the client as `{"error": {message, type, param, code}}`."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error",
             404: "not_found_error", 405: "invalid_request_error",
             413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
             503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or str(status)
        self.retry_after_s = retry_after_s  # sent as Retry-After (429, 503)

    def body(self) -> dict:
        return {"error": {"message": self.message,
                          "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


def from_request_error(err: RequestError) -> APIError:
    """The engine's validation errors start with the field name: "max_tokens: ..."."""
    text = str(err)
    param = text.split(":", 1)[0].split("/")[0].strip() if ":" in text else None
    return APIError(400, text, param=param if param and " " not in param else None)


def parse_json_body(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise APIError(400, f"body: is not valid UTF-8 ({err.reason} at byte {err.start})",
                       param="body") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as err:
        raise APIError(400, f"body: malformed JSON ({err.msg} at line {err.lineno} "
                            f"column {err.colno})", param="body") from None
    except RecursionError:
        raise APIError(400, f"body: JSON nested deeper than {MAX_JSON_DEPTH} levels",
                       param="body") from None
    except ValueError as err:  # an integer past Python's digit limit (4300)
        raise APIError(400, f"body: a JSON number is too long to read ({err})",
                       param="body") from None
    if not isinstance(body, dict):
        raise APIError(400, f"body: expected a JSON object, got {type(body).__name__}",
                       param="body")
    _check_json_values(body)
    return body


# No OpenAI request nests deeper than this; a deeper body is refused before anyone walks it.
MAX_JSON_DEPTH = 64


def _check_json_values(body: dict) -> None:
    """Every string is text that can be encoded (JSON's "\\ud800" escape yields a lone
    UTF-16 surrogate, which no tokenizer takes), and nothing nests past MAX_JSON_DEPTH.
    Iterative, so no body can exhaust the stack here."""
    stack: list[tuple[Any, int]] = [(body, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"body: JSON nested deeper than {MAX_JSON_DEPTH} levels",
                           param="body")
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as err:
                raise APIError(400, f"body: a string holds a lone UTF-16 surrogate "
                                    f"(\\u{ord(value[err.start]):04x} at character "
                                    f"{err.start})", param="body") from None
        elif isinstance(value, dict):
            stack.extend((v, depth + 1) for kv in value.items() for v in kv)
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)


# ---- typed field readers ------------------------------------------------------------------

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def get_int(body: dict, name: str, default: Any = None, lo: int | None = None,
            hi: int | None = None) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise bad(name, f"expected an integer, got {json.dumps(v)}")
    if lo is not None and v < lo or hi is not None and v > hi:
        raise bad(name, f"must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}")
    return v


def get_float(body: dict, name: str, default: Any = None, lo: float | None = None,
              hi: float | None = None) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if not _is_num(v) or v != v:
        raise bad(name, f"expected a number, got {json.dumps(v)}")
    if lo is not None and v < lo or hi is not None and v > hi:
        raise bad(name, f"must be in [{lo}, {hi}], got {v}")
    try:
        return float(v)
    except OverflowError:  # an integer beyond any float
        raise bad(name, "is out of range") from None


def _get_typed(body: dict, name: str, default: Any, kind: type, expected: str) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, kind):
        raise bad(name, f"expected {expected}, got {json.dumps(v)}")
    return v


def get_bool(body: dict, name: str, default: bool = False) -> bool:
    return _get_typed(body, name, default, bool, "true or false")


def get_str(body: dict, name: str, default: Any = None) -> Any:
    return _get_typed(body, name, default, str, "a string")


# ---- the parsed request ------------------------------------------------------------------

@dataclasses.dataclass
class ParsedRequest:
    prompts: list           # engine prompt inputs: str or {"prompt_token_ids": [...]}
    params: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool
    priority: int
    top_logprobs: int | None   # chat: top entries per position (None: no logprobs)
    end_of_turn_ids: tuple[int, ...] = ()
    default_max_tokens: int | None = None  # used when the body names no max_tokens
    # vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far, so
    # a client can count the tokens of a chunk that holds several (MTP, held-back text).
    continuous_usage: bool = False
    # max_tokens 0 with echo (prompt scoring): the engine samples its one token, which the
    # server drops (see `score_only_delta`), so the answer is the prompt and its logprobs.
    score_only: bool = False
    # The structured-output constraint and the body field it came from (server.structured).
    constraint: Any = None
    # Chat tool calls: how the constrained reply becomes `tool_calls` (server.tools).
    tool_calling: Any = None
    # The LoRA adapter the body's `model` names (None: the base model).
    lora_name: str | None = None
    # The multi-turn session the request belongs to (extra body field `session_id`).
    session_id: str | None = None

    def params_for(self, prompt_len: int, limits: "Limits") -> SamplingParams:
        """The sampling parameters for one prompt (the engine checks them against the
        context where the request enters: `metrale_jax.request.check_context`)."""
        params = self.params
        if params.max_tokens is None and self.default_max_tokens is not None:
            room = max(1, limits.max_seq_len - prompt_len)
            params = dataclasses.replace(params, max_tokens=min(self.default_max_tokens, room))
        return params


@dataclasses.dataclass(frozen=True)
class Limits:
    """What validation needs to know about the engine."""
    model_names: tuple[str, ...]
    max_seq_len: int
    max_logprobs: int
    vocab_size: int
    # LoRA on: whether a name is a loaded adapter (the set changes while serving); None: off.
    has_adapter: Callable[[str], bool] | None = None


def check_model(body: dict, limits: Limits) -> str | None:
    """The adapter the body's `model` names, or None for the base model (or no model:
    vLLM's leniency). An unknown name is a 404 `model_not_found`, as OpenAI and vLLM."""
    model = body.get("model")
    if model is None:
        return None  # vLLM's leniency: the one served model
    if not isinstance(model, str):
        raise bad("model", f"expected a string, got {json.dumps(model)}")
    if model in limits.model_names:
        return None
    if limits.has_adapter is not None and limits.has_adapter(model):
        return model
    adapters = " or a loaded LoRA adapter (GET /v1/models)" if limits.has_adapter else ""
    raise APIError(404, f"model: the model `{model}` does not exist; this server "
                        f"serves {list(limits.model_names)}{adapters}", param="model",
                   code="model_not_found")


def _stream_options(body: dict, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats)."""
    opts = body.get("stream_options")
    if opts is None:
        return False, False
    if not isinstance(opts, dict):
        raise bad("stream_options", "expected an object")
    if not stream:
        raise bad("stream_options", "is only allowed when stream is true")
    include = get_bool(opts, "include_usage", False)
    continuous = get_bool(opts, "continuous_usage_stats", False)
    if continuous and not include:
        raise bad("stream_options", "continuous_usage_stats needs include_usage: true")
    return include, continuous


def _logit_bias(body: dict, vocab_size: int) -> dict[int, float] | None:
    raw = body.get("logit_bias")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise bad("logit_bias", "expected an object mapping token ids to biases")
    bias = {}
    for key, value in raw.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise bad("logit_bias", f"key {key!r} is not a token id") from None
        if not 0 <= token < vocab_size:
            raise bad("logit_bias", f"token id {token} is outside the vocabulary "
                                    f"(size {vocab_size})")
        if not _is_num(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise bad("logit_bias", f"bias for {key} must be a number in [-100, 100]")
        bias[token] = float(value)
    return bias


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop", "expected a non-empty string or a list of non-empty strings")
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LENGTH for s in stop):
        raise bad("stop", f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_LENGTH} "
                          f"characters each, got {len(stop)} (longest "
                          f"{max(map(len, stop))})")
    return stop


# Stop strings are matched against the tail of the text after every token: bounded here.
MAX_STOP_STRINGS, MAX_STOP_LENGTH = 64, 1024
# Seeds are 64-bit, signed or not, as vLLM's (an int64 on its side).
SEED_RANGE = (-(2 ** 63), 2 ** 64 - 1)

# Fields whose meaning the server does not implement yet. Accepting them would quietly
# return something other than what was asked for (free text for a JSON schema, no tool
# call), so each is refused with a 400 that says so. Only null or one of the values listed
# (each asks for nothing) passes; the OpenAPI document is built from the same table.
NOT_YET: dict[str, tuple] = {
    "functions": ([],),
    "function_call": ("none",),
}
# Tool calling is a chat feature (server/tools.py): /v1/completions refuses these the same way.
CHAT_ONLY: dict[str, tuple] = {
    "tools": ([],),
    "tool_choice": ("none",),
}


def _asks_nothing(value: Any, allowed: tuple) -> bool:
    # `type(a) is type(value)` keeps JSON's 0/false and 1/true apart, which == does not.
    return value is None or any(type(a) is type(value) and a == value for a in allowed)


def refuse_unbuilt(body: dict) -> None:
    for name, allowed in NOT_YET.items():
        if name in body and not _asks_nothing(body[name], allowed):
            raise bad(name, "is not supported by this server (the legacy function calling; "
                            "use tools and tool_choice on /v1/chat/completions)")


def refuse_chat_only(body: dict) -> None:
    for name, allowed in CHAT_ONLY.items():
        if name in body and not _asks_nothing(body[name], allowed):
            raise bad(name, "is only taken by /v1/chat/completions")


def parse_constraint(body: dict):
    from server.structured import parse_constraint as parse  # it builds on this module

    return parse(body)


def _chat_constraint(body: dict):
    """A chat's constraint: a structured-output field, or the one its tool choice makes."""
    from server.structured import Constraint
    from server.tools import parse_tools  # both build on this module

    constraint, tool_calling = parse_constraint(body), parse_tools(body)
    if tool_calling is None:
        return constraint, None
    if constraint is not None:
        raise bad("tool_choice", f"a required or named tool call cannot be combined with "
                                 f"{constraint.field}")
    return Constraint(tool_calling.constraint, "tools"), tool_calling


def _stop_token_ids(body: dict, vocab_size: int) -> list[int]:
    ids = body.get("stop_token_ids")
    if ids is None:
        return []
    if not isinstance(ids, list) or not all(_is_int(t) and 0 <= t < vocab_size for t in ids):
        raise bad("stop_token_ids", f"expected a list of token ids in [0, {vocab_size})")
    return ids


def sampling_params(body: dict, limits: Limits, *, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None, constraint=None) -> SamplingParams:
    """The fields both endpoints share, each type-checked before SamplingParams sees it."""
    # A top_k past the vocabulary keeps every token, as the vocabulary size does; cut to it,
    # the value also fits the device's int32 (2**31 and up failed the whole step).
    top_k = min(get_int(body, "top_k", 0, lo=-1), limits.vocab_size)
    try:
        return SamplingParams(
            n=get_int(body, "n", 1, lo=1, hi=MAX_N),
            temperature=get_float(body, "temperature", 1.0, lo=0.0, hi=2.0),
            top_p=get_float(body, "top_p", 1.0),
            top_k=top_k,
            min_p=get_float(body, "min_p", 0.0),
            seed=get_int(body, "seed", lo=SEED_RANGE[0], hi=SEED_RANGE[1]),
            presence_penalty=get_float(body, "presence_penalty", 0.0),
            frequency_penalty=get_float(body, "frequency_penalty", 0.0),
            repetition_penalty=get_float(body, "repetition_penalty", 1.0),
            logit_bias=_logit_bias(body, limits.vocab_size),
            max_tokens=max_tokens,
            min_tokens=get_int(body, "min_tokens", 0, lo=0),
            stop=_stop(body),
            stop_token_ids=_stop_token_ids(body, limits.vocab_size),
            ignore_eos=get_bool(body, "ignore_eos"),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=get_bool(body, "skip_special_tokens", True),
            structured_outputs=constraint.params if constraint is not None else None,
        )
    except RequestError as err:
        raise from_request_error(err) from None


def _max_tokens(body: dict, *names: str) -> int | None:
    for name in names:
        value = get_int(body, name, lo=1)
        if value is not None:
            return value
    return None


def _logprob_count(body: dict, name: str, limits: Limits) -> int | None:
    return get_int(body, name, lo=0, hi=limits.max_logprobs)


def _prompts(body: dict, limits: Limits) -> list:
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("prompt", "is required")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            prompts = list(prompt)
        elif all(_is_int(t) for t in prompt):
            prompts = [{"prompt_token_ids": prompt}]
        elif all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
            prompts = [{"prompt_token_ids": p} for p in prompt]
        else:
            raise bad("prompt", "expected a string, a list of strings, a list of token ids "
                                "or a list of token-id lists")
        if len(prompts) > MAX_PROMPTS:
            raise bad("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}")
        for p in prompts:
            ids = p["prompt_token_ids"] if isinstance(p, dict) else []
            if any(not 0 <= t < limits.vocab_size for t in ids):
                raise bad("prompt", f"token ids must be in [0, {limits.vocab_size})")
        return prompts
    raise bad("prompt", "expected a non-empty string, list of strings, list of token ids "
                        "or list of token-id lists")


MAX_SESSION_ID_LEN = 256


def _session_id(body: dict) -> str | None:
    """The extra body field `session_id`: a non-empty string of at most 256 characters."""
    session_id = get_str(body, "session_id")
    if session_id is not None and not 0 < len(session_id) <= MAX_SESSION_ID_LEN:
        raise bad("session_id", f"must be 1 to {MAX_SESSION_ID_LEN} characters long")
    return session_id


def parse_completion(body: dict, limits: Limits) -> ParsedRequest:
    lora_name = check_model(body, limits)
    refuse_unbuilt(body)
    refuse_chat_only(body)
    prompts = _prompts(body, limits)
    stream = get_bool(body, "stream")
    echo = get_bool(body, "echo")
    logprobs = _logprob_count(body, "logprobs", limits)
    prompt_logprobs = _logprob_count(body, "prompt_logprobs", limits)
    if echo and logprobs is not None and prompt_logprobs is None:
        prompt_logprobs = logprobs  # echo with logprobs reports the prompt's too, as vLLM
    max_tokens = get_int(body, "max_tokens", lo=0)
    score_only = max_tokens == 0
    if score_only and not echo:
        raise bad("max_tokens", "0 generates nothing: it only scores the prompt, which needs "
                                "echo: true; ask for at least 1 token otherwise")
    constraint = parse_constraint(body)
    # No max_tokens: 16 as OpenAI, cut to the room left after each prompt (params_for).
    params = sampling_params(body, limits, max_tokens=1 if score_only else max_tokens,
                             logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                             constraint=constraint)
    if score_only and params.min_tokens:
        raise bad("min_tokens", f"must be in [0, max_tokens], got {params.min_tokens}")
    get_str(body, "user")
    include_usage, continuous = _stream_options(body, stream)
    return ParsedRequest(prompts, params, stream, include_usage, echo,
                         get_int(body, "priority", 0), None,
                         default_max_tokens=COMPLETION_DEFAULT_MAX_TOKENS,
                         continuous_usage=continuous, score_only=score_only,
                         constraint=constraint, lora_name=lora_name,
                         session_id=_session_id(body))


def score_only_delta(delta: StreamDelta) -> StreamDelta:
    """A scoring request's delta without the token the engine sampled past the prompt: no
    text, tokens or logprobs, and it ends by length (the 0 tokens asked for), whatever
    stopped the engine's one token. Prompt logprobs do not depend on that token."""
    finish = delta.finish_reason
    if finish in ("stop", "length"):
        finish = "length"
    logprobs = None if delta.logprobs is None else []
    return dataclasses.replace(delta, text="", token_ids=[], logprobs=logprobs,
                               finish_reason=finish, stop_reason=None)


def _message_text(message: dict, i: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if content is None and message.get("role") == "assistant":
        return ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content",
                          "only text parts ({\"type\": \"text\", \"text\": ...}) are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"messages[{i}].content", "expected a string or a list of text parts")


def chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "expected a non-empty list of messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad(f"messages[{i}]", "expected an object with role and content")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise bad(f"messages[{i}].role",
                      f"must be one of {list(CHAT_ROLES)}, got {json.dumps(role)}")
        out.append({"role": "system" if role == "developer" else role,
                    "content": _message_text(message, i)})
    return out


def parse_chat(body: dict, limits: Limits) -> tuple[ParsedRequest, list[dict], dict]:
    """The parsed request (its prompt still to render), the messages, template options."""
    lora_name = check_model(body, limits)
    refuse_unbuilt(body)
    messages = chat_messages(body)
    stream = get_bool(body, "stream")
    want = get_bool(body, "logprobs")
    top = get_int(body, "top_logprobs", lo=0, hi=min(20, limits.max_logprobs))
    if top is not None and not want:
        raise bad("top_logprobs", "requires logprobs to be true")
    logprobs = (top or 0) if want else None
    prompt_logprobs = _logprob_count(body, "prompt_logprobs", limits)
    constraint, tool_calling = _chat_constraint(body)
    params = sampling_params(body, limits,
                             max_tokens=_max_tokens(body, "max_completion_tokens", "max_tokens"),
                             logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                             constraint=constraint)
    get_str(body, "user")
    template_kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(template_kwargs, dict):
        raise bad("chat_template_kwargs", "expected an object")
    owned = sorted(set(template_kwargs) & set(TEMPLATE_OWNED))
    if owned:
        raise bad("chat_template_kwargs", f"{owned[0]!r} is set by the request itself, "
                                          f"not here (keys it cannot take: {TEMPLATE_OWNED})")
    options = {"add_generation_prompt": get_bool(body, "add_generation_prompt", True),
               **template_kwargs}
    if body.get("tools") and body.get("tool_choice") != "none":
        options.setdefault("tools", body["tools"])  # as transformers passes them
    include_usage, continuous = _stream_options(body, stream)
    parsed = ParsedRequest([], params, stream, include_usage, False,
                           get_int(body, "priority", 0), logprobs, continuous_usage=continuous,
                           constraint=constraint, tool_calling=tool_calling,
                           lora_name=lora_name, session_id=_session_id(body))
    return parsed, messages, options
