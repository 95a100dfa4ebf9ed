"""The gateway's time to first token counts the first chunk that carries output, once."""

from __future__ import annotations

import time
from typing import Any

from aiohttp.test_utils import make_mocked_request

from gateway import metrics


def ttft_count(model: str) -> float:
    value = metrics.REGISTRY.get_sample_value("iop_gateway_time_to_first_token_seconds_count", {"model": model})
    return value or 0.0


def chunk(**delta: Any) -> dict[str, Any]:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]}


def request_for(model: str) -> Any:
    request = make_mocked_request("POST", "/v1/chat/completions")
    request[metrics._STARTED] = time.monotonic()
    request[metrics.MODEL] = model
    return request


def test_the_role_chunk_is_not_a_token_and_only_the_first_output_counts() -> None:
    request = request_for("ttft-a")
    metrics.streamed(request, [chunk(role="assistant", content="")])
    assert ttft_count("ttft-a") == 0
    metrics.streamed(request, [chunk(content="tok0 ")])
    metrics.streamed(request, [chunk(content="tok1 ")])
    assert ttft_count("ttft-a") == 1


def test_text_reasoning_and_tool_calls_are_output() -> None:
    for i, first in enumerate([{"choices": [{"index": 0, "text": "x"}]}, chunk(reasoning_content="hm"),
                               chunk(tool_calls=[{"index": 0, "function": {"name": "f"}}])]):
        metrics.streamed(request_for(f"ttft-b{i}"), [first])
        assert ttft_count(f"ttft-b{i}") == 1


def test_chunks_without_choices_are_not_output() -> None:
    request = request_for("ttft-c")
    metrics.streamed(request, [{"choices": [], "usage": {"completion_tokens": 3}}, "garbage"])
    assert ttft_count("ttft-c") == 0
