"""Operator endpoints: the scheduler snapshot and the runtime levers."""

from __future__ import annotations

from aiohttp import web

from metrale_jax.scheduler.levers import LeverError

from server.openai_routes import STATE, read_body
from server.protocol import APIError


async def snapshot(request: web.Request) -> web.Response:
    """The latest snapshot the engine thread published (every tick, and again before it
    waits idle, so it is current while the engine idles), with its derived counts. Data
    parallel: the engines' totals, then each engine's own under `engines` and the router's
    in-flight count per engine under `router_loads`."""
    llm = request.app[STATE].llm
    body = _snapshot_body(llm)
    if llm.data_parallel_size > 1:
        body["engines"] = [_snapshot_body(e) for e in llm.engines]
        body["router_loads"] = llm.router.loads
    return web.json_response(body)


def _snapshot_body(llm) -> dict:
    snap = llm.snapshot()
    stats = llm.stats()
    now = None
    if snap is not None:
        now = {"kv_blocks_free": snap.kv_blocks_free, "kv_blocks_cached": snap.kv_blocks_cached,
               "kv_blocks_used": snap.kv_blocks_used, "kv_blocks_usable": snap.kv_blocks_total,
               "requests_in_engine": snap.requests_len}
    return {
        "snapshot": snap.as_dict() if snap is not None else None,
        "now": now,
        "counters": stats["counters"],
        "compiled_variants": stats["compiled_variants"],
        "compiling_variants": stats["compiling_variants"],
    }


async def get_levers(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE].llm.levers.as_dict())


async def set_levers(request: web.Request) -> web.Response:
    body = await read_body(request)
    levers = request.app[STATE].llm.levers
    try:
        levers.set(**body)
    except LeverError as err:
        name = str(err).split(":", 1)[0]
        raise APIError(400, str(err), param=name) from None
    return web.json_response(levers.as_dict())


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/admin/snapshot", snapshot)
    app.router.add_get("/v1/admin/levers", get_levers)
    app.router.add_post("/v1/admin/levers", set_levers)
