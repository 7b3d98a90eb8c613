"""Operator endpoints: the scheduler snapshot and the runtime levers."""

from __future__ import annotations

from aiohttp import web

from metrale_jax.scheduler.levers import LeverError

from server.openai_routes import STATE, read_body
from server.protocol import APIError


async def snapshot(request: web.Request) -> web.Response:
    """The latest published snapshot, plus the pool and request counts read right now (the
    snapshot is published per tick, and an idle engine does not tick)."""
    llm = request.app[STATE].llm
    core = llm.core
    snap = core.tel.snapshot
    pool = core.pool
    return web.json_response({
        "snapshot": snap.as_dict() if snap is not None else None,
        "now": {"kv_blocks_free": pool.num_free, "kv_blocks_cached": pool.num_cached,
                "kv_blocks_used": pool.num_used, "kv_blocks_usable": pool.num_usable,
                "requests_in_engine": len(core.requests)},
        "counters": core.tel.counters(),
        "compiled_variants": llm.engine.runner.counter.count,
    })


async def get_levers(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE].llm.engine.levers.as_dict())


async def set_levers(request: web.Request) -> web.Response:
    body = await read_body(request)
    levers = request.app[STATE].llm.engine.levers
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
