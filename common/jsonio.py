"""JSON on the hot path: orjson where it gives what the standard library gives, the standard
library where it does not.

orjson parses and writes several times faster than `json`, but it differs on a few inputs:
it reads an integer outside [-2**63, 2**64) as a float (json keeps it exact), and it refuses
NaN/Infinity, a byte-order mark, lone surrogates and numbers beyond a double (json takes them,
or raises its own error that callers report). Those inputs go to `json`, so what a caller or a
provider sends reads exactly as before. On the way out, what orjson cannot write (an integer
beyond 64 bits, a key that is not a string) is written by `json`; a non-finite float, which
JSON does not have, is written as null.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web

#: A run of digits that may not fit in 64 bits (-2**63 - 1 has 19 digits), looked for in the
#: text with every digit made a "0" (`bytes.translate` and a substring search cost a few tenths
#: of a microsecond on an SSE chunk; the regex `\d{19}` cost 3-4 us, more than the parse).
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONG_DIGITS = b"0" * 19
_COMPACT = json.JSONEncoder(separators=(",", ":"))


def loads(data: bytes, **stdlib: Any) -> Any:
    """`json.loads(data, **stdlib)`, the same value and the same errors, faster; but the text must
    be UTF-8 (RFC 8259 for JSON between systems; a UTF-8 byte-order mark is taken), where
    `json.loads` also reads UTF-16 and UTF-32: such a body is not JSON here (UnicodeDecodeError,
    or the parser's error at the NUL bytes)."""
    if _LONG_DIGITS not in data.translate(_DIGITS_AS_ZERO):
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
    return json.loads(data.decode("utf-8-sig"), **stdlib)


def dumps(obj: Any) -> bytes:
    """Compact JSON (no spaces), UTF-8."""
    try:
        return orjson.dumps(obj)
    except TypeError:
        return _COMPACT.encode(obj).encode()


def json_response(obj: Any, *, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    """`web.json_response`, written with `dumps`."""
    return web.Response(body=dumps(obj), status=status, headers=headers, content_type="application/json",
                        charset="utf-8")
