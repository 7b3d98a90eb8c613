"""Constraints for the structured-output tests, each with its own validity check: JSON
schemas (checked with `jsonschema`), regexes (`re.fullmatch`), choice lists (membership) and
a Lark grammar (its own regex). Every case is bounded (maxLength, maxItems, ranges), so a
model that never chooses to stop still completes within the tests' max_tokens."""

from __future__ import annotations

import json
import re

import jsonschema

S = {"type": "string", "maxLength": 6}
SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": -999,
                                            "maximum": 999}}, "required": ["a"],
     "additionalProperties": False},
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0,
                                                         "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "boolean"},
    {"type": "integer", "minimum": -5, "maximum": 5},
    {"enum": ["red", "green", "blue"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
     "minItems": 2, "maxItems": 4},
    {"type": "string", "pattern": "^[A-Z][a-z]{1,4}$"},
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "tags": {"type": "array", "items": {"enum": ["x", "y"]},
                                               "maxItems": 3}},
     "required": ["ok", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "y": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["x", "y"], "additionalProperties": False}},
     "required": ["point"], "additionalProperties": False},
    {"type": "array", "items": S, "maxItems": 2},
    {"type": "null"},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 3}, {"type": "boolean"}]},
    {"type": "object", "properties": {"kind": {"const": "circle"},
                                      "r": {"type": "integer", "minimum": 1, "maximum": 9}},
     "required": ["kind", "r"], "additionalProperties": False},
    {"type": "string", "enum": ["a\"b", "c\\d", "é"]},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[0-9]{3}$"},
                                      "level": {"enum": [1, 2, 3]}},
     "required": ["id", "level"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"a": {"type": "array", "items": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 1},
        "maxItems": 2}, "maxItems": 2}}, "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"s": S, "n": {"type": ["integer", "null"],
                                                     "minimum": 0, "maximum": 50}},
     "required": ["s", "n"], "additionalProperties": False},
    {"type": "string", "maxLength": 3},
    {"$defs": {"leaf": {"type": "integer", "minimum": 0, "maximum": 9}},
     "type": "object", "properties": {"l": {"$ref": "#/$defs/leaf"},
                                      "r": {"$ref": "#/$defs/leaf"}},
     "required": ["l", "r"], "additionalProperties": False},
    {"type": "object", "properties": {"when": {"type": "string",
                                               "pattern": "^20[0-9]{2}-[01][0-9]$"}},
     "required": ["when"], "additionalProperties": False},
]
REGEXES = [r"[0-9]{3}-[a-z]{2}", r"(cat|dog)s?", r"[A-Z]{2,4}", r"-?[1-9][0-9]{0,2}",
           r"(ab|cd){1,3}!", r"0x[0-9a-f]{4}", r"[a-z]{1,8}@[a-z]{2,5}\.(com|org)"]
CHOICES = [["yes", "no"], ["red", "green", "blue"], ["A long answer", "short", "mid one"],
           ["x"], ["négatif", "positif"]]
LARK = 'start: "(" NUM (OP NUM){0,3} ")"\nOP: "+" | "*"\nNUM: /[0-9]{1,3}/'
LARK_RE = r"\([0-9]{1,3}([+*][0-9]{1,3}){0,3}\)"


def cases() -> list[tuple[dict, object]]:
    """(StructuredOutputsParams fields, check(text) -> bool) for every constraint."""
    out = []
    for schema in SCHEMAS:
        out.append(({"json": schema}, _json_check(schema)))
    out += [({"regex": r}, _regex_check(r)) for r in REGEXES]
    out += [({"choice": c}, c.__contains__) for c in CHOICES]
    out.append(({"grammar": LARK}, _regex_check(LARK_RE)))
    return out


def _regex_check(pattern: str):
    return lambda text: re.fullmatch(pattern, text) is not None


def _json_check(schema: dict):
    def check(text: str) -> bool:
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    return check
