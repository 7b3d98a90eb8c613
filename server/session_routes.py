"""Multi-turn sessions: `DELETE /v1/sessions/{session_id}` ends one at once, releasing the
KV blocks and SSM state its latest turn pins (metrale_jax/scheduler/sessions.py).

Requests name a session with the extra body field `session_id` on /v1/completions and
/v1/chat/completions; an unknown id opens one (why: the scheduler module's docstring).
The answer comes once the engine thread has closed it: OpenAI's deletion object, or a 404
when no such session is open (never opened, or ended by its TTL or by eviction).
"""

from __future__ import annotations

from aiohttp import web

from metrale_jax.request import RequestError
from metrale_jax.scheduler.faults import EngineFailed

from server.openai_routes import STATE
from server.protocol import APIError, bad


async def delete_session(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.require_serving()
    session_id = request.match_info["session_id"]
    try:
        found = await state.llm.close_session(session_id)
    except RequestError as err:
        raise bad("session_id", str(err).removeprefix("session_id: ")) from None
    except EngineFailed as err:
        raise APIError(503, f"the engine failed: {err}") from None
    if not found:
        raise APIError(404, f"session_id: no open session {session_id!r}",
                       param="session_id", code="not_found")
    return web.json_response({"id": session_id, "object": "session", "deleted": True})


def add_routes(app: web.Application) -> None:
    app.router.add_delete("/v1/sessions/{session_id}", delete_session)
