"""The fuzzer's harness: the app served on its own event loop in a thread (so hypothesis'
synchronous tests can call it, and a failing body shrinks), and the checker every answer
goes through."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading

import jsonschema
from aiohttp.test_utils import TestClient, TestServer
from aiohttp import web

SSE_CHUNKS = {"/v1/completions": "CompletionChunk",
              "/v1/chat/completions": "ChatCompletionChunk"}
REQUEST_TIMEOUT_S = 30


@dataclasses.dataclass
class Reply:
    method: str
    path: str
    status: int
    content_type: str
    body: bytes
    sent: object  # what was sent, for the failure message

    def fail(self, why: str) -> str:
        return (f"{self.method} {self.path} -> {self.status}: {why}\n"
                f"sent: {self.sent!r:.600}\nanswer: {self.body[:600]!r}")


class ServerThread:
    def __init__(self, app: web.Application):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-http",
                                       daemon=True)
        self.thread.start()
        self.client: TestClient = self.call(self._start(app))

    @staticmethod
    async def _start(app: web.Application) -> TestClient:
        client = TestClient(TestServer(app))
        await client.start_server()
        return client

    def call(self, coro, timeout: float = REQUEST_TIMEOUT_S):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def request(self, method: str, path: str, sent: object = None, **kwargs) -> Reply:
        async def go() -> Reply:
            async with self.client.request(method, path, **kwargs) as resp:
                return Reply(method, path, resp.status, resp.content_type, await resp.read(),
                             sent)
        return self.call(go())

    def close(self) -> None:
        self.call(self.client.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def strict_json(raw: bytes):
    """JSON as a strict client reads it: NaN and Infinity are not JSON."""
    def refuse(name: str):
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(raw, parse_constant=refuse)


class Checker:
    """Every answer is 2xx or 4xx; a 4xx is an OpenAI error object; a 2xx matches the
    response schema the server's own /openapi.json gives for it."""

    def __init__(self, doc: dict):
        self.doc = doc
        self._validators: dict[str, jsonschema.Draft202012Validator] = {}

    def validator(self, schema: dict) -> jsonschema.Draft202012Validator:
        key = json.dumps(schema, sort_keys=True)
        if key not in self._validators:
            # The document's components ride along so "#/components/..." refs resolve.
            root = {**schema, "components": self.doc["components"]}
            self._validators[key] = jsonschema.Draft202012Validator(root)
        return self._validators[key]

    def matches(self, reply: Reply, value, schema: dict) -> None:
        errors = sorted(self.validator(schema).iter_errors(value), key=str)
        assert not errors, reply.fail(f"does not match {schema}: {errors[0].message}")

    def __call__(self, reply: Reply) -> None:
        assert reply.status < 500, reply.fail("a 5xx")
        assert 200 <= reply.status < 300 or 400 <= reply.status < 500, reply.fail("status")
        if reply.method == "HEAD":
            return
        if reply.status >= 400:
            assert reply.content_type == "application/json", reply.fail("error not JSON")
            self.matches(reply, strict_json(reply.body), {"$ref": "#/components/schemas/Error"})
        elif reply.content_type == "text/event-stream":
            self._events(reply)
        else:
            self._whole(reply)

    def _whole(self, reply: Reply) -> None:
        op = self.doc["paths"][reply.path][reply.method.lower()]
        content = op["responses"]["200"]["content"]
        assert reply.content_type in content, reply.fail("undocumented content type")
        if reply.content_type == "application/json":
            try:
                value = strict_json(reply.body)
            except ValueError as err:
                raise AssertionError(reply.fail(str(err))) from None
            self.matches(reply, value, content["application/json"]["schema"])

    def _events(self, reply: Reply) -> None:
        blocks = [b for b in reply.body.decode().split("\n\n") if b.strip()]
        assert blocks and blocks[-1] == "data: [DONE]", reply.fail("no [DONE]")
        chunk = {"$ref": f"#/components/schemas/{SSE_CHUNKS[reply.path]}"}
        for block in blocks[:-1]:
            assert block.startswith("data: "), reply.fail(f"not an SSE data line: {block!r}")
            event = strict_json(block[len("data: "):].encode())
            assert "error" not in event, reply.fail("an error inside the stream")
            self.matches(reply, event, chunk)
