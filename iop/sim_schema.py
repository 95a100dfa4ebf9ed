"""The simulator's structured output: a JSON value that a JSON Schema takes, for a chat request's
`response_format` and for the arguments of the tool call it makes.

The `openai` client's parse helpers (`chat.completions.parse` and its `stream`,
`pydantic_function_tool`, `responses.parse`) validate the answer against the caller's pydantic
model; text, or `{}` for every tool, made each of them raise. The value is the simplest one the
schema allows: every property of an object, one item of an array (or `minItems`), the first of an
`enum` or `anyOf`, a number at its bounds, text of the allowed length. `$ref`s are followed within
the schema (pydantic's `$defs`); a schema that refers to itself ends at a bounded depth.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

JsonObject = dict[str, Any]

#: from this depth on, what may be empty or null is (a schema that refers to itself ends)
_SHALLOW = 6
#: the deepest a value goes (a schema that cannot end otherwise gets a null there)
_DEEPEST = 24
#: the most items an array gets, whatever its `minItems`
_MOST_ITEMS = 64
#: the most values one answer gets in all (64 characters of text count as one), and the longest
#: text one holds: past them, what is left is null and text is cut (a schema of arrays of 64 items
#: 5 deep asked for 10⁹ values, a `minLength` of 10⁹ for a GB: the simulator hung on them), so a
#: caller's schema costs it bounded work
MOST_VALUES = 10_000
MOST_TEXT = 4096
#: the text of a string, before its length bounds
_TEXT = "tok0"
_FORMATS = {"date-time": "2026-01-01T00:00:00Z", "date": "2026-01-01", "time": "00:00:00Z",
            "email": "tok0@example.com", "uri": "https://example.com/", "url": "https://example.com/",
            "uuid": "00000000-0000-4000-8000-000000000000", "hostname": "example.com",
            "ipv4": "127.0.0.1", "ipv6": "::1"}
#: one output token of JSON text: a word or a mark, with the spaces before it
_TOKEN = re.compile(r"\s*(?:\w+|[^\w\s])")


def example(schema: object, root: object = None, depth: int = 0, left: list[int] | None = None) -> Any:
    """A value that `schema` takes (see the module's docstring), within `MOST_VALUES` (`left`: the
    values still to give, shared by the whole answer)."""
    root = schema if root is None else root
    left = [MOST_VALUES] if left is None else left
    left[0] -= 1
    if left[0] < 0:
        return None
    if not isinstance(schema, dict) or depth > _DEEPEST:
        return None if depth > _DEEPEST else _TEXT
    ref = schema.get("$ref")
    if isinstance(ref, str):
        return example(_resolve(root, ref), root, depth + 1, left)
    if "const" in schema:
        return schema["const"]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[0]
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            return example(_pick(options, depth), root, depth + 1, left)
    parts = schema.get("allOf")
    if isinstance(parts, list) and parts:
        return example(_merged(schema, parts, root), root, depth + 1, left)
    kind = _kind(schema, depth)
    if kind == "object":
        properties = schema.get("properties")
        if not isinstance(properties, dict):
            return {}
        return {str(name): example(sub, root, depth + 1, left) for name, sub in list(properties.items())[:MOST_VALUES]}
    if kind == "array":
        return [example(schema.get("items", {}), root, depth + 1, left)
                for _ in range(min(_items(schema, depth), max(left[0], 0)))]
    if kind in ("integer", "number"):
        return _number(schema, kind == "integer")
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    text = _string(schema)
    left[0] -= len(text) // 64  # (a long text counts as many values: the answer's size stays bounded)
    return text


def response_format_text(body: JsonObject, tokens: int) -> str | None:
    """The JSON text a chat request's `response_format` asks for, or None (text is asked for): JSON
    its `json_schema` takes, or for `json_object` an object of `tokens` words."""
    fmt = body.get("response_format")
    if not isinstance(fmt, dict):
        return None
    kind = fmt.get("type")
    if kind == "json_object":
        return json.dumps({"text": " ".join(f"tok{index}" for index in range(tokens))})
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        return json.dumps(example(schema if isinstance(schema, dict) else {"type": "object"}))
    return None


def tool_arguments(body: JsonObject, name: str) -> str:
    """The arguments of a call of the function `name` among the request's `tools`: an object its
    `parameters` take (`{}` without them)."""
    tools = body.get("tools")
    for tool in tools if isinstance(tools, list) else []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("name") == name:
            value = example(function.get("parameters") or {"type": "object"})
            return json.dumps(value) if isinstance(value, dict) else "{}"
    return "{}"


def tokens_of(text: str) -> list[str]:
    """JSON text cut into the pieces a stream carries, one a token; together they are the text."""
    pieces = _TOKEN.findall(text)
    tail = text[sum(len(piece) for piece in pieces):]
    return pieces + [tail] if tail else pieces


def _resolve(root: object, ref: str) -> object:
    if not ref.startswith("#"):
        return {}
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        key = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or key not in node:
            return {}
        node = node[key]
    return node


def _pick(options: list[Any], depth: int) -> object:
    """The option taken: the first that is not null, or from `_SHALLOW` on a null one (an end)."""
    nulls = [o for o in options if isinstance(o, dict) and o.get("type") == "null"]
    if depth >= _SHALLOW and nulls:
        return nulls[0]
    return next((o for o in options if o not in nulls), options[0])


def _merged(schema: JsonObject, parts: list[Any], root: object) -> JsonObject:
    merged: JsonObject = {k: v for k, v in schema.items() if k != "allOf"}
    for part in parts:
        for _ in range(_DEEPEST):  # (a `$ref` to itself, or a ring of them, ends)
            if not (isinstance(part, dict) and isinstance(part.get("$ref"), str)):
                break
            part = _resolve(root, part["$ref"])
        if isinstance(part, dict):
            properties = {**(merged.get("properties") or {}), **(part.get("properties") or {})}
            merged = {**part, **merged, "properties": properties} if properties else {**part, **merged}
    return merged


def _kind(schema: JsonObject, depth: int) -> str:
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if isinstance(k, str)]
        if depth >= _SHALLOW and "null" in kinds:
            return "null"
        return next((k for k in kinds if k != "null"), "null")
    if isinstance(kind, str):
        return kind
    if "properties" in schema:
        return "object"
    return "array" if "items" in schema else "string"


def _items(schema: JsonObject, depth: int) -> int:
    least = schema.get("minItems")
    least = least if isinstance(least, int) and not isinstance(least, bool) and least > 0 else 0
    if depth >= _SHALLOW or schema.get("maxItems") == 0:
        return min(least, _MOST_ITEMS)
    return min(max(least, 1), _MOST_ITEMS)


def _number(schema: JsonObject, integer: bool) -> int | float:
    value: int | float = 0
    low, high = _bound(schema, "minimum"), _bound(schema, "maximum")
    above, below = _bound(schema, "exclusiveMinimum"), _bound(schema, "exclusiveMaximum")
    if low is not None and value < low:
        value = low
    if above is not None and value <= above:
        value = above + 1
    if high is not None and value > high:
        value = high
    if below is not None and value >= below:
        value = below - 1
    if not integer:
        return value
    up = math.ceil(value)  # (the bound below met; else the one above)
    return up if (high is None or up <= high) and (below is None or up < below) else math.floor(value)


def _bound(schema: JsonObject, key: str) -> int | float | None:
    value = schema.get(key)
    return value if _is_number(value) else None


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _string(schema: JsonObject) -> str:
    fmt = schema.get("format")
    text = _FORMATS.get(fmt, _TEXT) if isinstance(fmt, str) else _TEXT
    least, most = schema.get("minLength"), schema.get("maxLength")
    if isinstance(least, int) and not isinstance(least, bool) and len(text) < least:
        text += "x" * (min(least, MOST_TEXT) - len(text))
    if isinstance(most, int) and not isinstance(most, bool) and 0 <= most < len(text):
        text = text[:most]
    return text
