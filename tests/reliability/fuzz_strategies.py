"""Hypothesis strategies for the HTTP fuzzer: well-formed bodies drawn from the server's own
OpenAPI document, the same bodies with fields broken, and raw bytes that are not JSON at all.

Conforming bodies keep generation short (a few tokens, n <= 3, short prompts) so thousands
of requests fit in a CI minute; the broken ones are where the extremes live (huge and
negative integers, NaN, lone surrogates, nesting, empty and very long strings, wrong types).
"""

from __future__ import annotations

import json

from hypothesis import strategies as st

# ---- junk: any JSON value, and the values that broke servers before -------------------------

EXTREME_NUMBERS = [0, -1, 1, 2, -0.0, 0.5, 1.5, 2 ** 31, -(2 ** 31) - 1, 2 ** 53 + 1,
                   2 ** 63, -(2 ** 63) - 1, 2 ** 64, 2 ** 80, -(2 ** 80), 10 ** 300,
                   10 ** 400, 1e308, -1e308, 5e-324, float("nan"), float("inf"),
                   float("-inf")]
ODD_STRINGS = ["", " ", "\ud800", "a\udfffb", "\ud83d", "\x00", "\u202e", "\ufeff",
               "\U0001f642" * 3, "<|im_end|>", "<|endoftext|>", "{{ raise_exception('x') }}",
               "{% for x in y %}", "NaN", "1e5", "-1", "\u0663", "null", "true", "\n" * 40,
               "a" * 5000, "\u00e9" * 2000]
FIELD_NAMES = ["prompt", "messages", "max_tokens", "n", "stream", "logprobs", "echo",
               "stop", "seed", "temperature", "tokens", "role", "content", "type", "text",
               "include_usage", "max_batch_size", "", "__proto__", "\ud800"]

# The values that broke servers before come first: one_of draws its early branches more.
nasty = st.sampled_from(EXTREME_NUMBERS + ODD_STRINGS + [[], {}, [[]], {"": None}, [None]])
junk_scalar = st.one_of(
    nasty, st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=12))
keys = st.sampled_from(FIELD_NAMES) | st.text(max_size=6)
junk = st.recursive(
    junk_scalar,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
    max_leaves=10)


# ---- bodies from the OpenAPI document ---------------------------------------------------------

class SchemaStrategies:
    """`from_schema(schema)`: values that satisfy a (3.1, JSON Schema 2020-12) schema of the
    document, for the keywords the document uses. Strings and lists are kept short."""

    def __init__(self, doc: dict):
        self.schemas = doc["components"]["schemas"]

    def from_schema(self, schema: dict, overrides: dict | None = None) -> st.SearchStrategy:
        if "$ref" in schema:
            return self.from_schema(self.schemas[schema["$ref"].rsplit("/", 1)[1]], overrides)
        if "anyOf" in schema:
            return st.one_of([self.from_schema(s) for s in schema["anyOf"]])
        if "enum" in schema:
            return st.sampled_from(schema["enum"])
        if "const" in schema:
            return st.just(schema["const"])
        kind = schema.get("type")
        if kind == "object":
            return self._object(schema, overrides or {})
        if kind == "array":
            return st.lists(self.from_schema(schema["items"]),
                            min_size=schema.get("minItems", 0),
                            max_size=min(schema.get("maxItems", 4), 4))
        return self._scalar(schema, kind)

    def _scalar(self, schema: dict, kind: str | None) -> st.SearchStrategy:
        if kind == "null":
            return st.none()
        if kind == "boolean":
            return st.booleans()
        if kind == "string":
            return st.text(min_size=schema.get("minLength", 0),
                           max_size=min(schema.get("maxLength", 16), 16))
        lo = schema.get("minimum", schema.get("exclusiveMinimum"))
        hi = schema.get("maximum", schema.get("exclusiveMaximum"))
        if kind == "integer":
            return st.integers(lo, hi)
        if kind == "number":
            floats = st.floats(lo, hi, exclude_min="exclusiveMinimum" in schema,
                               exclude_max="exclusiveMaximum" in schema,
                               allow_nan=False, allow_infinity=False)
            return floats | st.integers(
                None if lo is None else int(lo) + ("exclusiveMinimum" in schema),
                None if hi is None else int(hi) - ("exclusiveMaximum" in schema))
        return junk  # a schema with no type: anything

    def _object(self, schema: dict, overrides: dict) -> st.SearchStrategy:
        props = schema.get("properties")
        if props is None:
            if "additionalProperties" in schema:  # logit_bias: token id -> value
                return st.dictionaries(st.integers(0, 10 ** 6).map(str),
                                       self.from_schema(schema["additionalProperties"]),
                                       max_size=3)
            return st.dictionaries(keys, junk_scalar, max_size=3)
        required = [name for name in props if name in schema.get("required", ())]
        optional = [name for name in props if name not in required]
        fields = {name: overrides[name] if name in overrides else self.from_schema(props[name])
                  for name in props}
        return _some_fields(fields, required, optional)


@st.composite
def _some_fields(draw, fields: dict, required: list, optional: list) -> dict:
    """The required fields and a few optional ones (each optional field drawn at even odds
    would fill every body with ~40 fields, and their combinations would refuse nearly all
    of them)."""
    names = required + draw(st.lists(st.sampled_from(optional), max_size=6, unique=True)) \
        if optional else required
    return {name: draw(fields[name]) for name in names}


@st.composite
def broken(draw, valid: st.SearchStrategy, fields: list[str]) -> dict | object:
    """A valid body with 1-3 faults: a field set to junk, a required field dropped, an
    unknown field added, or the whole body replaced."""
    body = draw(valid)
    for _ in range(draw(st.integers(1, 3))):
        fault = draw(st.sampled_from(["junk-field", "drop", "extra", "junk-field", "whole"]))
        if fault == "whole":
            return draw(junk)
        if fault == "drop" and body:
            body.pop(draw(st.sampled_from(sorted(body))))
        elif fault == "extra":
            body[draw(st.text(max_size=10))] = draw(junk)
        else:
            body[draw(st.sampled_from(fields))] = draw(junk)
    return body


# ---- raw bodies: bytes, content types ---------------------------------------------------------

JSON_TYPES = ["application/json", "application/json; charset=utf-8", "application/vnd.api+json"]
CONTENT_TYPES = [None, "application/json", "application/json; charset=utf-8",
                 "application/json; charset=latin-1", "application/vnd.api+json", "text/plain",
                 "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                 "application/octet-stream", "", "garbage", "application/json;;;", "*/*"]


BAD_JSON = [b"", b"null", b"[]", b"1", b'"x"', b"NaN", b"-Infinity", b"{}", b'{"prompt": NaN}',
            b'{"a": 1, "a": [}', b"{" * 3 + b"}" * 3, b"{" * 100_000,
            b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
            b'{"prompt": "x", "max_tokens": 1' + b"0" * 400 + b".5}",
            b'{"prompt": "x", "temperature": 1e999}', b'{"prompt": "x", "top_p": -1e999}',
            b'{"tokens": [' + b"1" * 4301 + b"]}", b'{"max_batch_size": 1e400}',
            b'{"prompt": "\\ud800\\udc00\\udc00"}', b'{"prompt": "\\u0000"}',
            b'{"prompt": "x"}\x00', b'{"prompt": "x"} {"prompt": "y"}']


def _corrupt(data: bytes, cut: int, byte: int) -> bytes:
    cut %= max(1, len(data))
    return data[:cut] + bytes([byte]) + data[cut + 1:]


def raw_bodies(valid: st.SearchStrategy, limit: int) -> st.SearchStrategy:
    """Bytes a JSON parser must refuse cleanly, and a few near or over the body cap."""
    encoded = valid.map(lambda b: json.dumps(b).encode())
    depth = st.integers(1, 200_000)
    return st.one_of(
        st.sampled_from(BAD_JSON),
        st.builds(_corrupt, encoded, st.integers(0, 10 ** 6), st.integers(0, 255)),
        st.builds(lambda d, n: d[:n], encoded, st.integers(0, 40)),       # truncated
        encoded.map(lambda d: b"\xef\xbb\xbf" + d),                        # a BOM
        encoded.map(lambda d: d.decode().encode("utf-16")),
        st.binary(max_size=64),
        depth.map(lambda k: b'{"prompt": ' + b"[" * k + b"]" * k + b"}"),
        depth.map(lambda k: b'{"x": ' + b'{"x": ' * k + b"1" + b"}" * (k + 1)),
        st.integers(limit - 64, limit + 64).map(
            lambda k: b'{"prompt": "' + b"a" * max(0, k - 14) + b'"}'),      # around the cap
    )
