"""The gateway's time to first token counts the first chunk that carries output, once (the worker
marks the `delta` event that first holds one: `common.chunks.delta_data`)."""

from __future__ import annotations

import time
from typing import Any

from aiohttp.test_utils import make_mocked_request

from common.chunks import delta_data
from gateway import metrics


def ttft_count(model: str) -> float:
    value = metrics.REGISTRY.get_sample_value("iop_gateway_time_to_first_token_seconds_count", {"model": model})
    return value or 0.0


def chunk(**delta: Any) -> dict[str, Any]:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]}


def delta(chunks: list[Any]) -> dict[str, Any]:
    """A `delta` event's data as a worker writes it whose run sent no text yet."""
    return delta_data(chunks, "m", text_sent=False)


def request_for(model: str) -> Any:
    request = make_mocked_request("POST", "/v1/chat/completions")
    request[metrics._STARTED] = time.monotonic()
    request[metrics.MODEL] = model
    return request


def test_the_role_chunk_is_not_a_token_and_only_the_first_output_counts() -> None:
    request = request_for("ttft-a")
    metrics.streamed(request, delta([chunk(role="assistant", content="")]))
    assert ttft_count("ttft-a") == 0
    metrics.streamed(request, delta([chunk(content="tok0 ")]))
    metrics.streamed(request, delta([chunk(content="tok1 ")]))
    assert ttft_count("ttft-a") == 1


def test_text_reasoning_and_tool_calls_are_output() -> None:
    for i, first in enumerate([{"choices": [{"index": 0, "text": "x"}]}, chunk(reasoning_content="hm"),
                               chunk(tool_calls=[{"index": 0, "function": {"name": "f"}}])]):
        metrics.streamed(request_for(f"ttft-b{i}"), delta([first]))
        assert ttft_count(f"ttft-b{i}") == 1


def test_chunks_without_choices_are_not_output() -> None:
    request = request_for("ttft-c")
    metrics.streamed(request, delta([{"choices": [], "usage": {"completion_tokens": 3}}, "garbage"]))
    assert ttft_count("ttft-c") == 0


def test_a_delta_written_the_earlier_way_counts_too() -> None:
    """A worker of an earlier version (during an upgrade) wrote the chunks as objects, unmarked."""
    request = request_for("ttft-d")
    metrics.streamed(request, {"chunks": [chunk(role="assistant")]})
    assert ttft_count("ttft-d") == 0
    metrics.streamed(request, {"chunks": [chunk(content="x")]})
    assert ttft_count("ttft-d") == 1
