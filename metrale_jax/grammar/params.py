"""`StructuredOutputsParams`: what a request asks its output to match, shaped like vLLM's.

Exactly one kind per request: a JSON schema (`json`, a dict or its JSON text), any JSON object
(`json_object`), a regular expression (`regex`), one of a list of strings (`choice`) or a
context-free grammar in Lark syntax, or GBNF that llguidance converts (`grammar`). `key()` is
the canonical (kind, text) pair compiled grammars are cached by. Host only; no llguidance
import here, so a request is checked for shape before any grammar engine loads.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from metrale_jax.request import RequestError

KINDS = ("json", "regex", "choice", "grammar", "json_object")
FIELD = "structured_outputs"


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | None = None          # a JSON schema, as a dict or its JSON text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None              # Lark (llguidance's syntax) or GBNF
    json_object: bool | None = None         # any JSON object

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise RequestError(f"{FIELD}: exactly one of {', '.join(KINDS)} must be set, got "
                               f"{', '.join(given) if given else 'none'}")
        self._check(given[0])

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def _check(self, kind: str) -> None:
        value = getattr(self, kind)
        where = f"{FIELD}.{kind}"
        if kind == "json":
            if not isinstance(value, (str, dict)):
                raise RequestError(f"{where}: expected a JSON schema (an object or its JSON "
                                   f"text), got {type(value).__name__}")
            if isinstance(value, str):
                _parse_schema_text(value, where)
        elif kind == "json_object":
            if value is not True:
                raise RequestError(f"{where}: expected true, got {value!r}")
        elif kind == "choice":
            if not isinstance(value, (list, tuple)) or not value \
                    or not all(isinstance(c, str) for c in value):
                raise RequestError(f"{where}: expected a non-empty list of strings")
        elif not isinstance(value, str) or not value.strip():
            raise RequestError(f"{where}: expected a non-empty string")

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal keys compile to the same grammar."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            schema = value if isinstance(value, dict) else _parse_schema_text(value, "")
            # Key order kept: it is the order the properties come out in.
            return kind, json.dumps(schema, separators=(",", ":"))
        if kind == "choice":
            return kind, json.dumps(list(value))
        if kind == "json_object":
            return kind, ""
        return kind, value


def _parse_schema_text(text: str, where: str) -> Any:
    try:
        schema = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as err:
        raise RequestError(f"{where}: is not valid JSON ({err})") from None
    if not isinstance(schema, (dict, bool)):
        raise RequestError(f"{where}: a JSON schema is an object, got "
                           f"{type(schema).__name__}")
    return schema
