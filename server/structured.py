"""Structured-output fields of a request body -> one `StructuredOutputsParams`.

Four ways to ask, as vLLM takes them: OpenAI's `response_format` (`json_object`,
`json_schema`), vLLM's `structured_outputs` object, and the legacy `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`. A request uses one of them; every error
names the field the client wrote. Whether the constraint compiles is checked later, off the
event loop (`server.generate`), and reported under the same field.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from metrale_jax.grammar.params import FIELD, KINDS, StructuredOutputsParams
from metrale_jax.request import RequestError

from server.protocol import APIError, bad

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
FIELDS = ("response_format", FIELD, *GUIDED)


@dataclasses.dataclass(frozen=True)
class Constraint:
    params: StructuredOutputsParams
    field: str          # the body field it came from (errors name it)


def parse_constraint(body: dict) -> Constraint | None:
    given = [f for f in FIELDS if body.get(f) is not None
             and not (f == "response_format" and _is_text(body[f]))]
    if len(given) > 1:
        raise bad(given[1], f"only one structured-output field per request; {given[0]} is "
                            f"set too")
    if not given:
        return None
    field = given[0]
    value = body[field]
    if field == "response_format":
        spec = _response_format(value)
    elif field == FIELD:
        if not isinstance(value, dict):
            raise bad(field, "expected an object with one of " + ", ".join(KINDS))
        unknown = sorted(set(value) - set(KINDS))
        if unknown:
            raise bad(field, f"unknown key {unknown[0]!r}; the keys are {list(KINDS)}")
        spec = value
    else:
        spec = {GUIDED[field]: value}
    try:
        return Constraint(StructuredOutputsParams(**spec), field)
    except RequestError as err:
        raise _error(field, err) from None


def _is_text(value: Any) -> bool:
    return isinstance(value, dict) and value.get("type") == "text" and len(value) == 1


def _response_format(value: Any) -> dict:
    if not isinstance(value, dict):
        raise bad("response_format", "expected an object with a type")
    kind = value.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        inner = value.get("json_schema")
        if not isinstance(inner, dict) or not isinstance(inner.get("schema"), (dict, bool)):
            raise bad("response_format", "json_schema needs {\"name\": ..., \"schema\": "
                                         "{a JSON schema}}")
        return {"json": inner["schema"]}
    raise bad("response_format", f"type must be text, json_object or json_schema, got "
                                 f"{json.dumps(kind)}")


def _error(field: str, err: RequestError) -> APIError:
    """The engine's error under the field the client wrote: "structured_outputs.regex: x"
    stays as it is; for guided_regex it reads "guided_regex: x"."""
    message = str(err)
    if field == FIELD or not message.startswith(FIELD):
        return APIError(400, message, param=field)
    return bad(field, message.split(":", 1)[1].strip())


def compile_error(constraint: Constraint, err: RequestError) -> APIError:
    return _error(constraint.field, err)
