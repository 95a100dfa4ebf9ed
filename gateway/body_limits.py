"""What a parsed request body must be, beyond valid JSON, before it may be queued. Pure.

Python's `json` module accepts more than a run can carry: nesting up to its recursion limit,
integers of any size, lone UTF-16 surrogates (`"\\ud800"`) and numbers too large for a float
(`1e400` becomes `inf`). A queued body travels as msgpack (integers in [-2**63, 2**64), UTF-8
text only) and is sent on as JSON by a worker, so each of these is refused here, naming where:

- `depth_problem`: nesting deeper than `runtime.max_json_depth`, or a non-finite number. It runs
  on every body, so it looks at each container once and checks its scalars in bulk (C-speed
  builtins), never item by item in Python unless something is wrong.
- `too_many_containers`: more JSON arrays and objects than `runtime.max_json_containers`, counted
  on the raw text (C-speed counts) before it is parsed: parsing and walking cost a few
  microseconds a container, so a body of millions of empty arrays held the gateway's one thread
  for seconds.
- `wire_problem`: why msgpack would refuse a body (surrogate, integer range). It looks at each
  container once and checks its keys and scalars in bulk, as `depth_problem` does (a Responses
  request is checked before it is translated, and a caller may send a faulty body on purpose).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

#: msgpack's integer range.
INT_MIN = -(2**63)
INT_MAX = 2**64 - 1

#: A place in the body: None for the body itself, else (parent place, key or index).
Place = tuple[Any, str | int] | None


@dataclass(frozen=True, slots=True)
class Problem:
    """Why a body cannot be queued; `param` is the place at fault (`messages[0].content`)."""

    param: str | None
    message: str


def place_text(place: Place) -> str | None:
    parts: list[str | int] = []
    while place is not None:
        place, part = place
        parts.append(part)
    out = ""
    for part in reversed(parts):
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            shown = part.encode("utf-8", "backslashreplace").decode("utf-8")
            out += f".{shown}" if out else shown
    return out or None


def _children(value: dict[str, Any] | list[Any]) -> tuple[list[str] | None, list[Any]]:
    """(keys, values) of an object; (None, items) of an array, whose places are the indexes."""
    if isinstance(value, dict):
        return list(value), list(value.values())
    return None, value


def _name(names: list[str] | None, i: int) -> str | int:
    return i if names is None else names[i]


def depth_problem(body: Any, max_depth: int) -> Problem | None:
    """Nesting deeper than `max_depth` (the body itself is level 1), or a number that is not finite."""
    stack: list[tuple[Any, int, Place]] = [(body, 1, None)]
    while stack:
        value, depth, place = stack.pop()
        if type(value) is not dict and type(value) is not list:
            continue
        if depth > max_depth:
            return Problem(place_text(place), f"the request body is nested deeper than {max_depth} levels "
                                              "(runtime.max_json_depth)")
        names, items = _children(value)
        kinds = set(map(type, items))
        if float in kinds:
            floats = items if kinds == {float} else [v for v in items if type(v) is float]
            if not all(map(math.isfinite, floats)):
                at = next(i for i, v in enumerate(items) if type(v) is float and not math.isfinite(v))
                return Problem(place_text((place, _name(names, at))), "a number is too large to be represented "
                                                               "as a 64-bit float")
        if dict in kinds or list in kinds:
            stack.extend((v, depth + 1, (place, _name(names, i))) for i, v in enumerate(items)
                         if type(v) is dict or type(v) is list)
    return None


#: every byte but a quote, `[` and `{` (deleted by `bytes.translate`)
_NOT_STRUCTURE = bytes(range(256)).translate(None, b'"[{')


def too_many_containers(raw: bytes, most: int) -> bool:
    """Whether a JSON text holds more than `most` arrays and objects: its `[` and `{` outside
    strings (those inside are only looked for when all of them together are too many). Each
    step is a C-speed pass over the bytes, whatever they hold (an earlier regex paid ~200 ns a
    string: 0.8 s for 8 MiB of empty strings): escapes are dropped (`\\` first, so that what
    is left of `\"` is an escaped quote), then all but quotes and brackets, then each pair of
    adjacent quotes (an empty string, or one's end and the next's start: neither changes which
    brackets are inside a string); what lies between the quotes left is inside a string."""
    if raw.count(b"[") + raw.count(b"{") <= most:
        return False
    bare = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE).replace(b'""', b"")
    return sum(map(len, bare.split(b'"')[::2])) > most


def _text_ok(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _scalar_problem(value: Any, place: Place) -> Problem | None:
    if type(value) is str and not _text_ok(value):
        return Problem(place_text(place), "a string holds a lone UTF-16 surrogate (such as \\ud800), "
                                          "which is not valid Unicode text")
    if type(value) is int and not INT_MIN <= value <= INT_MAX:
        return Problem(place_text(place), f"an integer is out of range: it must lie between {INT_MIN} "
                                          f"and {INT_MAX}")
    return None


def _items_ok(items: list[Any], kinds: set[type]) -> bool:
    """Whether every string of `items` (of the types `kinds`) is valid Unicode and every integer
    within msgpack's range, checked in bulk (C-speed builtins: the strings joined, encoded at once;
    the integers' min and max), as `depth_problem` does: item by item in Python, 4 million numbers
    took 4-6 s."""
    # (`filter` with a type's own check runs no Python code an item: a comprehension took twice as long)
    if str in kinds and not _text_ok("".join(items if kinds == {str} else filter(str.__instancecheck__, items))):
        return False  # (joined, two halves of a pair stay two lone surrogates: Python never pairs them)
    if int in kinds:  # (booleans pass the check of int too: as 0 and 1 they change neither bound)
        ints: list[int] = items if kinds == {int} else list(filter(int.__instancecheck__, items))
        return INT_MIN <= min(ints) and max(ints) <= INT_MAX
    return True


def _first_fault(items: list[Any]) -> int:
    """The index of the first item of `items` that `_items_ok` faults (there is one), halving the
    range in bulk checks (item by item in Python, a fault behind 4 million numbers took most of a second
    to find)."""
    lo, hi = 0, len(items)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        left = items[lo:mid]
        if _items_ok(left, set(map(type, left))):
            lo = mid
        else:
            hi = mid
    return lo


def wire_problem(body: Any) -> Problem | None:
    """The first string that is not valid Unicode or integer that msgpack cannot hold. Each
    container's keys and scalars are checked in bulk (`_items_ok`), one by one only where that
    found a fault."""
    if type(body) is not dict and type(body) is not list:
        return _scalar_problem(body, None)
    stack: list[tuple[dict[str, Any] | list[Any], Place]] = [(body, None)]
    while stack:
        value, place = stack.pop()
        names, items = _children(value)
        if names is not None and not _text_ok("".join(names)):
            name = names[_first_fault(names)]
            return Problem(place_text((place, name)), "an object key holds a lone UTF-16 surrogate "
                                                      "(such as \\ud800), which is not valid Unicode text")
        kinds = set(map(type, items))
        if not _items_ok(items, kinds):
            at = _first_fault(items)
            return _scalar_problem(items[at], (place, _name(names, at)))
        if dict in kinds or list in kinds:
            stack.extend((v, (place, _name(names, i))) for i, v in enumerate(items)
                         if type(v) is dict or type(v) is list)
    return None
