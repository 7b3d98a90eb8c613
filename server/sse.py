"""Server-sent events as OpenAI streams them: `data: {json}` chunks, then `data: [DONE]`."""

from __future__ import annotations

import json

from aiohttp import web


class SSEStream:
    def __init__(self, request: web.Request):
        self.request = request
        self.response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def open(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, payload: dict) -> None:
        """Raises ConnectionResetError once the client has gone away."""
        data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
        await self.response.write(f"data: {data}\n\n".encode("utf-8"))

    async def done(self) -> None:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
