"""Runtime LoRA adapters, as vLLM serves them: `POST /v1/load_lora_adapter`
`{"lora_name", "lora_path", "load_inplace"?}` and `POST /v1/unload_lora_adapter`
`{"lora_name"}`, plus the adapter entries of `/v1/models`.

Both commands answer only once the engine thread has applied them (at a quiescent tick)
and acknowledged: 200 with vLLM's text, or an OpenAI error. Runtime loading is refused
unless the server was started with `--lora-dir`, and a `lora_path` whose real path (symlinks
and `..` resolved) lies outside that directory is refused before anything is read.
"""

from __future__ import annotations

import os

from aiohttp import web

from metrale_jax.lora.weights import LoraError
from metrale_jax.scheduler.faults import EngineFailed

from server.openai_routes import STATE, read_body
from server.protocol import APIError, bad, get_bool, get_str
from server.responses import now


def adapter_models(state) -> list[dict]:
    """`/v1/models` entries for the loaded adapters: vLLM's shape (root: the adapter's
    path, parent: the base model)."""
    if state.limits.has_adapter is None:  # LoRA off
        return []
    return [{"id": name, "object": "model", "created": now(), "owned_by": "metrale",
             "root": path, "parent": state.model_name,
             "max_model_len": state.limits.max_seq_len}
            for name, path in state.llm.adapters()]


def resolve_in(lora_dir: str, path: str) -> str:
    """`path` (absolute, or relative to `lora_dir`) as a real path inside `lora_dir`; a 400
    when it leaves it. Nothing is read but the directory entries realpath follows."""
    root = os.path.realpath(lora_dir)
    full = os.path.realpath(os.path.join(root, path))
    if os.path.commonpath([root, full]) != root:
        raise bad("lora_path", f"{path!r} is outside the server's --lora-dir")
    return full


def _runtime_allowed(state) -> None:
    if state.limits.has_adapter is None:
        raise APIError(400, "LoRA is not enabled on this server (start it with --enable-lora)",
                       code="lora_disabled")
    if state.config.lora_dir is None:
        raise APIError(400, "runtime LoRA loading is off: start the server with --lora-dir "
                            "DIR to load adapters from DIR", code="lora_runtime_disabled")


def _name(body: dict) -> str:
    name = get_str(body, "lora_name")
    if not name:
        raise bad("lora_name", "is required")
    return name


async def load_lora_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.require_serving()
    _runtime_allowed(state)
    body = await read_body(request)
    name, path = _name(body), get_str(body, "lora_path")
    if not path:
        raise bad("lora_path", "is required")
    replace = get_bool(body, "load_inplace", False)
    if name in state.limits.model_names:
        raise bad("lora_name", f"{name!r} is the base model's name")
    if not replace and state.llm.has_adapter(name):
        raise bad("lora_name", f"the adapter {name!r} has already been loaded")
    full = resolve_in(state.config.lora_dir, path)
    try:
        await state.llm.load_adapter(name, full, replace=replace)
    except LoraError as err:
        raise APIError(400, f"lora_path: {err}", param="lora_path") from None
    except EngineFailed as err:
        raise APIError(503, f"the engine failed: {err}") from None
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.require_serving()
    _runtime_allowed(state)
    name = _name(await read_body(request))
    if not state.llm.has_adapter(name):
        raise APIError(404, f"lora_name: the adapter {name!r} cannot be found",
                       param="lora_name", code="not_found")
    try:
        await state.llm.unload_adapter(name)
    except LoraError as err:
        raise APIError(400, f"lora_name: {err}", param="lora_name") from None
    except EngineFailed as err:
        raise APIError(503, f"the engine failed: {err}") from None
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
