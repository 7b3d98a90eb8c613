"""Chat tool calls by constrained decoding: `tools` + `tool_choice` -> a JSON constraint,
and the constrained text -> OpenAI `tool_calls`.

- `tool_choice` "none" (or no tools): tools are ignored; the reply is text.
- "auto" (the default with tools): answered as text. Telling a call from text needs a model's
  own tool-call format, which the models served here do not have (README).
- a named function: the output is that function's `parameters` JSON; the reply is one call
  to it (finish_reason "stop", as vLLM).
- "required": the output is a JSON array of at least one `{"name", "parameters"}` object,
  each naming a tool and matching its parameters; one call per element (finish_reason
  "tool_calls").

Streaming sends a call's arguments once the call is complete (one chunk), not token by token.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from metrale_jax.grammar.params import StructuredOutputsParams

from server.protocol import bad

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclasses.dataclass(frozen=True)
class ToolCalling:
    """How a chat reply becomes tool calls: one named function, or any of the tools."""

    constraint: StructuredOutputsParams
    name: str | None            # the named function; None: "required" (a list of calls)

    @property
    def finish_reason(self) -> str:
        return "stop" if self.name is not None else "tool_calls"

    def calls(self, text: str) -> list[dict]:
        """OpenAI `tool_calls` from the constrained output (arguments as JSON text)."""
        if self.name is not None:
            return [_call(self.name, text)]
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return []  # cut short by max_tokens: no complete call to report
        return [_call(item["name"], json.dumps(item["parameters"])) for item in items]


def _call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse_tools(body: dict) -> ToolCalling | None:
    """The tool-calling plan of a chat body; None when the reply is plain text."""
    tools = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    if choice is None or choice in ("none", "auto"):
        return None
    if not tools:
        raise bad("tool_choice", "needs tools")
    if choice == "required":
        return ToolCalling(StructuredOutputsParams(json=_any_of_calls(tools)), None)
    name = _named(choice)
    if name not in tools:
        raise bad("tool_choice", f"names {name!r}, which is not among the tools "
                                 f"{sorted(tools)}")
    return ToolCalling(StructuredOutputsParams(json=tools[name]), name)


def _tools(value: Any) -> dict[str, dict]:
    """name -> parameters schema, for each function tool."""
    if value is None:
        return {}
    if not isinstance(value, list):
        raise bad("tools", "expected a list of {\"type\": \"function\", \"function\": {...}}")
    out = {}
    for i, tool in enumerate(value):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" \
                or not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not fn["name"]:
            raise bad("tools", f"tools[{i}]: expected {{\"type\": \"function\", \"function\": "
                               f"{{\"name\": ..., \"parameters\": {{...}}}}}}")
        params = fn.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(params, dict):
            raise bad("tools", f"tools[{i}].function.parameters: expected a JSON schema object")
        if fn["name"] in out:
            raise bad("tools", f"tools[{i}]: a second function named {fn['name']!r}")
        out[fn["name"]] = params
    return out


def _named(choice: Any) -> str:
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" \
            or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad("tool_choice", "expected \"none\", \"auto\", \"required\" or "
                                 "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    return fn["name"]


def _any_of_calls(tools: dict[str, dict]) -> dict:
    return {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"const": name}, "parameters": params},
         "required": ["name", "parameters"], "additionalProperties": False}
        for name, params in tools.items()]}}
