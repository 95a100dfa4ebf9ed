"""A `delta` event's chunks: written once as the caller's SSE lines by the worker, read back as
objects by the runs API and `iop runs` (`common.chunks`)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from common.chunks import JSON_DEPTH, as_sse, delta_chunks, delta_data, delta_sse
from common.codec import Unpackable, pack, unpack


def chunk(content: str, **extra: Any) -> dict[str, Any]:
    return {"id": "c1", "object": "chat.completion.chunk", "model": "served/name",
            "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}], **extra}


def deep(n: int) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for _ in range(n):
        d = {"a": d}
    return d


def test_the_sse_lines_say_the_callers_model_and_read_back_as_the_same_chunks() -> None:
    chunks = [chunk("tok0 "), chunk("ünï \n \"q\" \u2028"), {"choices": [], "usage": {"prompt_tokens": 3}}, [1, 2]]
    data = unpack(pack(delta_data([dict(c) if isinstance(c, dict) else c for c in chunks], "public-id", False)))
    sse = delta_sse(data, "ignored")
    lines = sse.split(b"\n\n")
    assert lines[-1] == b"" and all(line.startswith(b"data: ") for line in lines[:-1])
    assert [json.loads(line[6:]) for line in lines[:-1]] == delta_chunks(data, "ignored")
    read = delta_chunks(data, "ignored")
    assert [c["model"] for c in read[:3]] == ["public-id"] * 3 and read[3] == [1, 2]
    assert read[1]["choices"][0]["delta"]["content"] == "ünï \n \"q\" \u2028"


def test_only_the_first_delta_holding_output_is_marked() -> None:
    assert "text" not in delta_data([{"choices": [{"index": 0, "delta": {"role": "assistant"}}]}], "m", False)
    assert delta_data([chunk("x")], "m", False)["text"] is True
    assert "text" not in delta_data([chunk("y")], "m", True)


def test_a_delta_written_the_earlier_way_reads_the_same() -> None:
    """Events of a worker of an earlier version (an upgrade under way): the chunks as objects."""
    old = {"chunks": [chunk("a"), chunk("b")]}
    assert delta_sse(old, "public-id") == as_sse([chunk("a"), chunk("b")], "public-id")
    assert [c["model"] for c in delta_chunks(old, "public-id")] == ["public-id", "public-id"]


@pytest.mark.parametrize("value, phrase", [
    (2**64, "an integer beyond 64 bits"),
    (-(2**63) - 1, "an integer beyond 64 bits"),
    ("a \ud800", "lone UTF-16 surrogate"),
    (deep(JSON_DEPTH + 1), f"nested deeper than {JSON_DEPTH} levels"),
], ids=["above", "below", "surrogate", "deep"])
def test_a_chunk_json_cannot_carry_exactly_is_named_in_plain_words(value: Any, phrase: str) -> None:
    with pytest.raises(Unpackable) as caught:
        as_sse([chunk("x", extra=value)], "m")
    assert phrase in str(caught.value) and "\n" not in str(caught.value)


def test_the_edges_json_carries_are_written_exactly() -> None:
    edges = [2**64 - 1, -(2**63), deep(JSON_DEPTH - 3)]  # (the chunk, the list, and deep's own: 254 in all)
    assert delta_chunks(delta_data([chunk("x", extra=edges)], "m", False), "m")[0]["extra"] == edges
