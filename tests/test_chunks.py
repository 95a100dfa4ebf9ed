"""What a provider's chunks and answers carry, made what a caller's client can take: the usage
counts of a provider that sends them of the wrong type."""

from __future__ import annotations

from typing import Any

import pytest

from common.chunks import (
    OUTPUT_FIELDS,
    choice_indices,
    choice_marks,
    choices_usable,
    fixed_usage,
    token_counts,
    usage_in,
    without_usage,
)
from workers.stream_pump import shows_output


def counts(prompt: Any, completion: Any, total: Any) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": total}


@pytest.mark.parametrize(("usage", "fixed"), [
    (counts(3, 2, 5), counts(3, 2, 5)),
    (counts("3", -1, None), counts(0, 0, 0)),
    (counts(3.0, True, "x"), counts(3, 0, 3)),
    ({"prompt_tokens": 4, "total_tokens": 4}, {"prompt_tokens": 4, "total_tokens": 4}),  # embeddings: no completion
    ({"prompt_tokens": 3, "completion_tokens": 2}, counts(3, 2, 5)),  # (the `openai` client: total_tokens None)
    (counts(1e300, float("nan"), [1]), counts(0, 0, 0)),
    ({**counts(2, 1, 3), "prompt_tokens_details": {"cached_tokens": "many", "audio_tokens": 0},
      "completion_tokens_details": "lots", "other_details": None, "extra": "kept"},
     {**counts(2, 1, 3), "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0}, "other_details": None,
      "extra": "kept"}),
    ({"total_tokens": None, "prompt_tokens": 3.0, "completion_tokens": 2}, counts(3, 2, 5)),  # (in any order)
    ({**counts(1, 1, 2), "cost_details": {"upstream_inference_cost": 0.00012, "cached_tokens": None}},
     {**counts(1, 1, 2), "cost_details": {"upstream_inference_cost": 0.00012, "cached_tokens": None}}),
], ids=["well-formed", "wrong-types", "whole-float-and-bool", "no-completion", "no-total", "huge-nan-list", "details",
        "total-first", "a-cost"])
def test_usage_counts_are_whole_numbers_of_at_least_zero(usage: dict[str, Any], fixed: dict[str, Any]) -> None:
    answer = {"object": "chat.completion", "usage": usage}
    assert fixed_usage(answer) == fixed and answer["usage"] == fixed


@pytest.mark.parametrize("usage", ["12 tokens", 5, [1, 2]])
def test_a_usage_that_is_not_an_object_goes(usage: Any) -> None:
    answer = {"object": "chat.completion", "usage": usage}
    assert fixed_usage(answer) is None and "usage" not in answer
    assert fixed_usage({"object": "chat.completion"}) is None


def test_usage_in_a_stream_is_fixed_in_every_chunk_and_the_last_one_counts() -> None:
    chunks: list[Any] = [{"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": "1", "total_tokens": 2}},
                         {"choices": [], "usage": None}, "not a chunk",
                         {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7.0}},
                         {"choices": [], "usage": "later"}]
    usage = usage_in(chunks)
    assert usage == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12} and token_counts(usage) == (5, 7)
    assert chunks[0]["usage"] == {"prompt_tokens": 1, "completion_tokens": 0, "total_tokens": 2}
    assert chunks[1] == {"choices": [], "usage": None} and chunks[4] == {"choices": []}


def test_a_caller_that_did_not_ask_for_usage_gets_no_usage_but_every_other_chunk() -> None:
    filters = {"choices": [], "prompt_filter_results": [{"prompt_index": 0}], "usage": None}  # as Azure's first
    text = {"choices": [{"index": 0, "delta": {"content": "a"}}], "usage": None}
    usage = {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
    assert without_usage([filters, text, usage]) == [
        {"choices": [], "prompt_filter_results": [{"prompt_index": 0}]},
        {"choices": [{"index": 0, "delta": {"content": "a"}}]}]


def test_choices_that_are_null_are_not_usable_and_a_finish_reason_is_text() -> None:
    assert choices_usable({"choices": []}) and choices_usable({"usage": {}})  # (Azure's, a usage chunk)
    assert not choices_usable({"choices": None}) and not choices_usable({"choices": [None]})
    # (a caller's client reads `choices[0].delta.content` and `choices[0].message.content`)
    for bad in ("x", 5, ["x"], True):
        assert not choices_usable({"choices": [{"index": 0, "delta": bad}]})
        assert not choices_usable({"choices": [{"index": 0, "message": bad}]})
    assert choices_usable({"choices": [{"index": 0, "delta": {}}, {"index": 1, "delta": None}, {"index": 2}]})
    chunk = {"choices": [{"index": 0, "finish_reason": {"type": "stop"}}, {"index": 1, "finish_reason": "stop"},
                         {"index": 2, "finish_reason": ""}]}
    assert choice_indices(chunk) == [0, 1, 2] and choice_indices(chunk, finished=True) == [1]
    odd = {"choices": [None, {"finish_reason": "length"}, {"index": True, "finish_reason": "stop"}, {"index": 7}]}
    each: Any
    for each in (chunk, odd, {"choices": None}, {}, None, []):
        assert choice_marks(each) == (choice_indices(each), choice_indices(each, finished=True))
    assert choice_marks(odd) == ([1, 2, 7], [1, 2])


OPENING = {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}
SPOKEN = {"choices": [{"index": 0, "delta": {"audio": {"id": "audio_1", "data": "UklGR", "transcript": "Hel"}},
                       "finish_reason": None}]}


@pytest.mark.parametrize("field", OUTPUT_FIELDS)
def test_a_chunk_of_any_output_goes_out_at_once_and_an_opening_waits(field: str) -> None:
    """A worker holds a stream's openings (a bare `role`) until output comes, so a stream cut
    before any may be tried again."""
    said = {"choices": [{"index": 0, "delta": {field: "x"}, "finish_reason": None}]}
    assert not shows_output([OPENING], 64)
    assert shows_output([OPENING, said], 64)


def test_a_chunk_of_spoken_output_is_output() -> None:
    """`delta.audio` (with `modalities` asking for audio) and no `content`: it was held as an
    opening, up to 64 chunks (seconds of sound) before the caller heard any."""
    assert shows_output([OPENING, SPOKEN], 64)
