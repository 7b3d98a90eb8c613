"""`/v1/completions` and `/v1/chat/completions`, streaming (SSE) and not.

Both endpoints fold the engine's deltas into `Choice`s; the non-streaming answer is the
folded choices, the streaming one sends each fold step, so the two carry the same text.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import jinja2
from aiohttp import web

from server.generate import Generation
from server.protocol import (END_OF_TURN_TOKENS, APIError, ParsedRequest, parse_chat,
                             parse_completion, parse_json_body)
from server.responses import (Choice, CompletionLogprobs, chat_logprob_entries,
                              finish_fields, new_id, now, prompt_logprobs_json, usage)
from server.sse import SSEStream
from server.state import EngineDead, ServerState

logger = logging.getLogger("metrale.server")
STATE: web.AppKey[ServerState] = web.AppKey("state", ServerState)


async def read_body(request: web.Request) -> dict:
    # A body sent as another type (curl -d sends a form) is refused rather than guessed at;
    # a request that names no type is read as JSON.
    if request.headers.get("Content-Type") and request.content_type != "application/json" \
            and not request.content_type.endswith("+json"):
        raise APIError(415, f"Content-Type: expected application/json, got "
                            f"{request.content_type}", param="Content-Type")
    return parse_json_body(await request.read())


class Fold:
    """The choices of one response, as deltas arrive: (prompt index, sequence index)."""

    def __init__(self, gen: Generation):
        self.gen, self.n = gen, gen.parsed.params.n
        self.choices: dict[tuple[int, int], Choice] = {}
        self.prompt_logprobs: dict[int, list] = {}

    def apply(self, prompt: int, delta) -> Choice:
        key = (prompt, delta.index)
        choice = self.choices.get(key)
        if choice is None:
            choice = self.choices[key] = Choice(index=prompt * self.n + delta.index)
        choice.text += delta.text
        choice.token_ids += delta.token_ids
        choice.logprobs += delta.logprobs or []
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs[prompt] = delta.prompt_logprobs
        if delta.finish_reason is not None:
            choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
        if delta.error:
            raise APIError(500, f"the engine failed this request: {delta.error}",
                           code="engine_error")
        return choice

    def ordered(self) -> list[tuple[int, Choice]]:
        return [(p, c) for (p, _), c in sorted(self.choices.items())]

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices.values())

    def usage(self) -> dict:
        return usage(self.gen.prompt_tokens, self.completion_tokens)


async def _run(request: web.Request, parsed: ParsedRequest, prefix: str, respond, stream):
    state = request.app[STATE]
    gen = Generation(state, parsed, new_id(prefix))
    await gen.submit()
    fold = Fold(gen)
    async with contextlib.aclosing(gen.deltas()) as deltas:
        if not parsed.stream:
            async for prompt, delta in deltas:
                fold.apply(prompt, delta)
            return web.json_response(respond(state, gen, fold))
        sse = SSEStream(request)
        await sse.open()
        try:
            await stream(state, gen, fold, deltas, sse)
        except (APIError, EngineDead) as err:
            error = err if isinstance(err, APIError) else APIError(
                500, f"the engine failed: {err}", code="engine_dead")
            with contextlib.suppress(ConnectionResetError):
                await sse.send(error.body())
        except ConnectionResetError:
            return sse.response  # the client went away; the finally aborts its requests
        except Exception as exc:  # noqa: BLE001 - a bug mid-stream: the client is told
            # The headers are gone, so no error status can be sent: end the stream with an
            # error event and [DONE] instead of leaving the client waiting.
            logger.exception("unhandled error while streaming %s", gen.request_id)
            with contextlib.suppress(ConnectionResetError):
                await sse.send(APIError(500, f"internal error: {type(exc).__name__}: "
                                             f"{exc}").body())
        with contextlib.suppress(ConnectionResetError):
            await sse.done()
        return sse.response


# ---- /v1/completions ------------------------------------------------------------------------

def _completion_logprobs(state, gen: Generation, fold: Fold, prompt: int, choice: Choice,
                         ) -> CompletionLogprobs:
    tok = state.llm.token_text
    lp = CompletionLogprobs()
    if gen.parsed.echo:
        prompt_lp = fold.prompt_logprobs.get(prompt)
        for pos, token in enumerate(gen.prompt_ids[prompt]):
            lp.add(token, prompt_lp[pos] if prompt_lp else None, tok)
    for token, entries in zip(choice.token_ids, choice.logprobs):
        lp.add(token, entries, tok)
    return lp


def _completion_body(state, gen: Generation, fold: Fold) -> dict:
    p = gen.parsed
    choices = []
    for prompt, c in fold.ordered():
        finish, stop_reason = finish_fields(c, ())
        choices.append({
            "index": c.index,
            "text": (gen.prompt_texts[prompt] if p.echo else "") + c.text,
            "logprobs": _completion_logprobs(state, gen, fold, prompt, c).as_dict()
            if p.params.logprobs is not None else None,
            "finish_reason": finish, "stop_reason": stop_reason,
            "prompt_logprobs": prompt_logprobs_json(fold.prompt_logprobs.get(prompt))
            if p.params.prompt_logprobs is not None else None})
    return {"id": gen.request_id, "object": "text_completion", "created": now(),
            "model": gen.model, "choices": choices, "usage": fold.usage(),
            "system_fingerprint": None}


async def _stream_completion(state, gen: Generation, fold: Fold, deltas, sse: SSEStream):
    p, created = gen.parsed, now()
    logs: dict[int, CompletionLogprobs] = {}
    async for prompt, delta in deltas:
        choice = fold.apply(prompt, delta)
        text = delta.text
        first = not choice.started
        if first and p.echo:
            text = gen.prompt_texts[prompt] + text
        logprobs = None
        if p.params.logprobs is not None:
            if first:
                logs[choice.index] = _completion_logprobs(state, gen, fold, prompt, choice)
            else:
                for token, entries in zip(delta.token_ids, delta.logprobs or []):
                    logs[choice.index].add(token, entries, state.llm.token_text)
            logprobs = logs[choice.index].as_dict(choice.sent_tokens)
        if not text and delta.finish_reason is None and not first:
            continue  # nothing to show yet: its logprob entries go with the next chunk
        if logprobs is not None:
            choice.sent_tokens = len(logs[choice.index].tokens)
        choice.started = True
        finish, stop_reason = finish_fields(choice, ()) if delta.finish_reason else (None, None)
        body = {"id": gen.request_id, "object": "text_completion", "created": created,
                "model": gen.model,
                "choices": [{"index": choice.index, "text": text, "logprobs": logprobs,
                             "finish_reason": finish, "stop_reason": stop_reason}]}
        if p.continuous_usage:
            body["usage"] = fold.usage()
        await sse.send(body)
    if p.include_usage:
        await sse.send({"id": gen.request_id, "object": "text_completion", "created": created,
                        "model": gen.model, "choices": [], "usage": fold.usage()})


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    state.require_serving()
    parsed = parse_completion(await read_body(request), state.limits)
    return await _run(request, parsed, "cmpl", _completion_body, _stream_completion)


# ---- /v1/chat/completions -----------------------------------------------------------------

# What a jinja template raises on values it cannot handle (an int where it adds strings, a
# missing key, raise_exception(...)).
TEMPLATE_ERRORS = (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError)


def render_chat(state: ServerState, messages: list[dict], options: dict) -> tuple[str, list[int]]:
    try:
        text = state.llm.apply_chat_template(messages, **options)
    except TEMPLATE_ERRORS as err:
        # The template is the model's code run on the client's messages and
        # chat_template_kwargs: what it cannot render is the client's to change.
        raise APIError(400, f"messages: the chat template rejected them: "
                            f"{type(err).__name__}: {err}", param="messages") from None
    return text, state.llm.tokenize(text, add_special_tokens=False)


def end_of_turn_ids(state: ServerState) -> tuple[int, ...]:
    return state.llm.special_token_ids(END_OF_TURN_TOKENS)


def _chat_logprobs(state, parsed: ParsedRequest, tokens, logprobs) -> dict | None:
    if parsed.top_logprobs is None:
        return None
    return {"content": chat_logprob_entries(tokens, logprobs, parsed.top_logprobs,
                                            state.llm.token_text)}


def _chat_message(p: ParsedRequest, c: Choice, finish: str | None) -> tuple[dict, str | None]:
    """The assistant message and its finish reason: text, or tool calls (server.tools)."""
    if p.tool_calling is None:
        return {"role": "assistant", "content": c.text, "tool_calls": []}, finish
    calls = p.tool_calling.calls(c.text) if finish is not None else []
    if calls and finish == "stop":
        finish = p.tool_calling.finish_reason
    return {"role": "assistant", "content": None if calls else c.text,
            "tool_calls": calls}, finish


def _chat_body(state, gen: Generation, fold: Fold) -> dict:
    p = gen.parsed
    choices = []
    for _, c in fold.ordered():
        finish, stop_reason = finish_fields(c, p.end_of_turn_ids)
        message, finish = _chat_message(p, c, finish)
        choices.append({"index": c.index,
                        "message": message,
                        "logprobs": _chat_logprobs(state, p, c.token_ids, c.logprobs),
                        "finish_reason": finish, "stop_reason": stop_reason})
    return {"id": gen.request_id, "object": "chat.completion", "created": now(),
            "model": gen.model, "choices": choices, "usage": fold.usage(),
            "prompt_logprobs": prompt_logprobs_json(fold.prompt_logprobs.get(0))
            if p.params.prompt_logprobs is not None else None,
            "system_fingerprint": None}


async def _stream_chat(state, gen: Generation, fold: Fold, deltas, sse: SSEStream):
    p, created = gen.parsed, now()

    def chunk(index: int, delta: dict, logprobs=None, finish=None, stop_reason=None) -> dict:
        body = {"id": gen.request_id, "object": "chat.completion.chunk", "created": created,
                "model": gen.model,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                             "finish_reason": finish, "stop_reason": stop_reason}]}
        if p.continuous_usage:
            body["usage"] = fold.usage()
        return body

    async for prompt, delta in deltas:
        choice = fold.apply(prompt, delta)
        if not choice.started:
            choice.started = True
            await sse.send(chunk(choice.index, {"role": "assistant", "content": ""}))
        finish, stop_reason = finish_fields(choice, p.end_of_turn_ids) \
            if delta.finish_reason else (None, None)
        if not delta.text and finish is None and not delta.token_ids:
            continue
        content = {"content": delta.text} if delta.text else {}
        if p.tool_calling is not None:  # the calls go out whole, once the reply is complete
            message, finish = _chat_message(p, choice, finish)
            content = {} if finish is None else (
                {"tool_calls": [{"index": i, **call}
                                for i, call in enumerate(message["tool_calls"])]}
                if message["tool_calls"] else {"content": choice.text})
        await sse.send(chunk(choice.index, content,
                             _chat_logprobs(state, p, delta.token_ids, delta.logprobs or []),
                             finish, stop_reason))
    if p.include_usage:
        await sse.send({"id": gen.request_id, "object": "chat.completion.chunk",
                        "created": created, "model": gen.model, "choices": [],
                        "usage": fold.usage()})


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    state.require_serving()
    parsed, messages, options = parse_chat(await read_body(request), state.limits)
    text, ids = render_chat(state, messages, options)
    params = parsed.params
    eot = end_of_turn_ids(state) if not params.ignore_eos else ()
    if eot:
        params = dataclasses.replace(params, stop_token_ids=[*params.stop_token_ids, *eot])
    parsed = dataclasses.replace(parsed, prompts=[{"prompt_token_ids": ids, "prompt": text}],
                                 params=params, end_of_turn_ids=eot)
    return await _run(request, parsed, "chatcmpl", _chat_body, _stream_chat)
