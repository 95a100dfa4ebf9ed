"""common.jsonio: the fast path reads exactly what `json` reads, and writes what JSON can hold."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common import jsonio

#: Inputs where orjson on its own would differ from json: it would read the big integer as a
#: float and refuse the rest, each of which json reads.
EDGES = [
    b'{"seed": 123456789012345678901234567890}',
    b'{"n": -18446744073709551616}',
    b'{"n": -9223372036854775809}',
    b'{"x": 1e400}',
    b'{"s": "\\ud800"}',
    b'\xef\xbb\xbf{"a": 1}',
    b'{"a": NaN, "b": -Infinity}',
]


@pytest.mark.parametrize("raw", EDGES)
def test_reads_what_json_reads(raw: bytes) -> None:
    got, want = jsonio.loads(raw), json.loads(raw)
    assert repr(got) == repr(want)  # repr: NaN != NaN, and 1 == 1.0 would hide a float
    assert type(next(iter(got.values()))) is type(next(iter(want.values())))


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le"])
def test_json_in_another_encoding_than_utf8_is_not_read(encoding: str) -> None:
    """`json.loads` would read these (it guesses UTF-16 and UTF-32 from the NUL bytes); JSON between
    systems is UTF-8 (RFC 8259), and so is every body a gateway or a provider sends."""
    raw = '{"model": "m", "a": "\u00e9"}'.encode(encoding)
    assert json.loads(raw)["a"] == "\u00e9"
    with pytest.raises(ValueError):  # (UnicodeDecodeError, or the parser's error at a NUL)
        jsonio.loads(raw)


def test_a_big_integer_stays_exact() -> None:
    assert jsonio.loads(b'{"seed": 12345678901234567890123}') == {"seed": 12345678901234567890123}
    assert jsonio.loads(b'{"seed": 18446744073709551615}')["seed"] == 2**64 - 1
    assert jsonio.loads(b'{"seed": -9223372036854775809}')["seed"] == -(2**63) - 1


@pytest.mark.parametrize("raw", [b"", b"{", b'{"a": 1,}', b"\xff", b'{"a": tru}'])
def test_bad_input_raises_json_s_own_error(raw: bytes) -> None:
    with pytest.raises(ValueError) as got:
        jsonio.loads(raw)
    with pytest.raises(ValueError) as want:
        json.loads(raw)
    assert str(got.value) == str(want.value)


def test_stdlib_options_apply_where_json_decides() -> None:
    def refuse(name: str) -> Any:
        raise ValueError(f"no {name}")

    with pytest.raises(ValueError, match="no NaN"):
        jsonio.loads(b'{"t": NaN}', parse_constant=refuse)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@given(json_values)
def test_round_trip_equals_json(value: Any) -> None:
    assert json.loads(jsonio.dumps(value)) == value
    assert repr(jsonio.loads(json.dumps(value).encode())) == repr(json.loads(json.dumps(value)))


def test_writes_what_orjson_cannot() -> None:
    assert jsonio.dumps({"seed": 2**70}) == b'{"seed":1180591620717411303424}'
    assert jsonio.dumps({1: "a"}) == b'{"1":"a"}'
    assert jsonio.dumps({"x": math.inf, "y": math.nan}) == b'{"x":null,"y":null}'  # JSON has no Infinity
    assert jsonio.dumps({"t": "\u00e9", "a": [1, 2]}) == '{"t":"\u00e9","a":[1,2]}'.encode()


def test_json_response_is_utf8_json() -> None:
    resp = jsonio.json_response({"a": "\u00e9"}, status=201, headers={"X-Run": "r"})
    assert resp.status == 201 and resp.headers["X-Run"] == "r"
    assert resp.content_type == "application/json" and resp.charset == "utf-8"
    assert resp.body == '{"a":"\u00e9"}'.encode()
