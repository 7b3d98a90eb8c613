"""The aiohttp application: routes, middlewares (errors, auth), health, models, metrics,
tokenize/detokenize. The generation routes are in openai_routes.py, admin in admin.py.

`create_app(llm, config)` wires a started `AsyncLLM` into an app; `serve.py` owns the process
(warm-up, binding, signals).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from metrale_jax.async_engine import AsyncLLM

from server import admin, lora_routes, openapi, session_routes
from server.openai_routes import (STATE, chat_completions, completions, read_body,
                                  render_chat)
from server.protocol import APIError, chat_messages, get_bool, get_str
from server.responses import now
from server.state import EngineDead, ServerConfig, ServerState

logger = logging.getLogger("metrale.server")
OPEN_PATHS = ("/health",)


def error_response(err: APIError) -> web.Response:
    headers = {"Retry-After": str(err.retry_after_s)} if err.retry_after_s is not None else None
    return web.json_response(err.body(), status=err.status, headers=headers)


def _from_http(exc: web.HTTPException, request: web.Request, limit: int) -> APIError:
    if exc.status == 413:
        return APIError(413, f"body: larger than this server's limit of {limit} bytes",
                        param="body", code="request_too_large")
    if exc.status == 404:
        return APIError(404, f"{request.path}: no such endpoint", code="not_found")
    if exc.status == 405:
        return APIError(405, f"{request.method} {request.path}: method not allowed",
                        code="method_not_allowed")
    return APIError(exc.status, exc.reason or "error")


@web.middleware
async def errors_middleware(request: web.Request, handler):
    """Every failure leaves as an OpenAI error object; the server keeps serving."""
    state = request.app[STATE]
    try:
        return await handler(request)
    except APIError as err:
        error = err
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error = _from_http(exc, request, state.config.max_body_bytes)
    except EngineDead as exc:
        error = APIError(500, f"the engine failed: {exc}", code="engine_dead")
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:  # noqa: BLE001 - a bug must not take the server down
        logger.exception("unhandled error on %s %s", request.method, request.path)
        error = APIError(500, f"internal error: {type(exc).__name__}: {exc}")
    state.metrics.rejected.labels(state.model_name, str(error.status)).inc()
    return error_response(error)


@web.middleware
async def auth_middleware(request: web.Request, handler):
    key = request.app[STATE].config.api_key
    if key and request.path not in OPEN_PATHS:
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode("utf-8"), key.encode("utf-8"))
        if not ok:
            raise APIError(401, "Authorization: a valid 'Bearer <api key>' header is required",
                           param="Authorization", code="invalid_api_key")
    return await handler(request)


# ---- small endpoints ----------------------------------------------------------------------

async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.llm.error is not None:
        state.engine_died()
    body = {"status": state.status}
    if state.status == "ok":  # step variants still compiling beside serving
        body["compiling_variants"] = state.llm.stats()["compiling_variants"]
    if state.status == "unhealthy":
        body["error"] = repr(state.llm.error)
    return web.json_response(body, status=200 if state.status == "ok" else 503)


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({"object": "list", "data": [
        {"id": name, "object": "model", "created": now(), "owned_by": "metrale",
         "root": state.llm.limits.model_name, "parent": None,
         "max_model_len": state.limits.max_seq_len}
        for name in state.limits.model_names] + lora_routes.adapter_models(state)})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_body(request)
    if "messages" in body:
        _, ids = render_chat(state, chat_messages(body), {
            "add_generation_prompt": get_bool(body, "add_generation_prompt", True)})
    else:
        prompt = get_str(body, "prompt")
        if prompt is None:
            raise APIError(400, "prompt: is required (or messages)", param="prompt")
        ids = state.llm.tokenize(prompt, get_bool(body, "add_special_tokens", True))
    return web.json_response({"count": len(ids), "max_model_len": state.limits.max_seq_len,
                              "tokens": ids, "token_strs": None})


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    tokens = (await read_body(request)).get("tokens")
    vocab = state.limits.vocab_size
    if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens):
        raise APIError(400, f"tokens: expected a list of token ids in [0, {vocab})",
                       param="tokens")
    return web.json_response({"prompt": state.llm.detokenize(tokens)})


# ---- the app ------------------------------------------------------------------------------

def create_app(llm: AsyncLLM, config: ServerConfig | None = None, *,
               status: str = "ok") -> web.Application:
    """An app over a started engine (status "starting" while serve.py still warms it up)."""
    config = config or ServerConfig()
    app = web.Application(client_max_size=config.max_body_bytes,
                          middlewares=[errors_middleware, auth_middleware])
    state = ServerState(llm, config, status=status)
    app[STATE] = state
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    admin.add_routes(app)
    lora_routes.add_routes(app)
    session_routes.add_routes(app)
    app.router.add_get("/openapi.json", openapi.openapi_json)
    app.cleanup_ctx.append(_watchdog)
    return app


async def _watchdog(app: web.Application):
    state = app[STATE]
    state.dead = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(state.watchdog())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
