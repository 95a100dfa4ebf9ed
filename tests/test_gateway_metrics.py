"""The gateway's time to first token counts the first chunk that carries output, once."""

from __future__ import annotations

import time
from typing import Any, cast

from aiohttp.test_utils import make_mocked_request
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from common.config import RuntimeConfig
from gateway import metrics
from gateway.admission import ConnectionGuard, ConnectionLimits
from gateway.take_back import TakeBack


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


def exposed() -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """The registry's exposition, parsed; each family and each series once (Prometheus refuses a
    scrape with a series twice)."""
    text = generate_latest(metrics.REGISTRY).decode()
    typed = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(typed) == len(set(typed)), sorted(n for n in typed if typed.count(n) > 1)
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series = (sample.name, frozenset(sample.labels.items()))
            assert series not in samples, series
            samples[series] = sample.value
    return samples


def test_a_gateway_served_again_in_one_process_keeps_one_family_each_and_its_counters_go_on() -> None:
    """`gateway.service.serve` run a second time in a process (a restart within it) registered a
    second collector of the connections: each of their series was exposed twice, the second from 0;
    and the kept cancels given up were read from the new gateway's alone, from 0: a counter that went
    back."""
    limits = ConnectionLimits.from_runtime(RuntimeConfig())
    refused = ("iop_gateway_connections_closed_total", frozenset({("reason", "refused")}))
    given_up = ("iop_gateway_cancels_abandoned_total", frozenset({("reason", "deadline")}))
    before = exposed()
    first, kept = ConnectionGuard(limits), TakeBack(cast(Any, None), cast(Any, None))
    metrics.watch_connections(first)
    metrics.TAKE_BACK.source = lambda: kept
    first.closed["refused"] += 3
    kept.given_up += 2
    assert exposed()[refused] == before.get(refused, 0) + 3
    assert exposed()[given_up] == before.get(given_up, 0) + 2
    kept.given_up += 1  # (after the last scrape: counted all the same)
    second, kept_again = ConnectionGuard(limits), TakeBack(cast(Any, None), cast(Any, None))
    metrics.watch_connections(second)
    metrics.TAKE_BACK.source = lambda: kept_again
    second.closed["refused"] += 1
    kept_again.given_up += 1
    after = exposed()
    assert after[refused] == before.get(refused, 0) + 4 and after[given_up] == before.get(given_up, 0) + 4
