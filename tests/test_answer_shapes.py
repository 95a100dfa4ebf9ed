"""A provider's chat and legacy completions and embeddings made what OpenAI's schema has
(`workers.adapters.answer_shapes`): what can be filled honestly is, what cannot is the provider's error."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tests.openapi import validate
from workers.adapters import answer_shapes
from workers.adapters.base import ProviderError, Retry


def whole(answer: dict[str, Any]) -> dict[str, Any]:
    answer_shapes.completion(answer, "run1", 1700000000, "p")
    answer.setdefault("model", "m")  # (the gateway's to write)
    validate("CreateCompletionResponse", answer)
    return answer


def test_a_bare_completion_gets_what_openai_s_has_and_keeps_what_it_said() -> None:
    answer = whole({"choices": [{"text": "hi"}], "timings": {"predicted_ms": 3}})
    assert answer == {"id": "cmpl-run1", "object": "text_completion", "created": 1700000000, "model": "m",
                      "choices": [{"text": "hi", "index": 0, "logprobs": None, "finish_reason": "stop"}],
                      "timings": {"predicted_ms": 3}}


@pytest.mark.parametrize(("said", "made"), [
    ("eos_token", "stop"), ("stop_sequence", "stop"), ("max_tokens", "length"), ("length", "length"),
    ("content_filter", "content_filter"), ("something_new", "stop"), (None, "stop"), ({"type": "stop"}, "stop"),
])
def test_a_finish_reason_is_one_openai_has(said: Any, made: str) -> None:
    answer = whole({"choices": [{"text": "hi", "index": 0, "logprobs": None, "finish_reason": said}]})
    assert answer["choices"][0]["finish_reason"] == made


def test_choices_come_in_the_order_of_their_indices_or_are_given_their_places() -> None:
    answer = whole({"choices": [{"text": "b", "index": 1, "finish_reason": "stop"},
                                {"text": "a", "index": 0, "finish_reason": "length"}]})
    assert [(c["index"], c["text"]) for c in answer["choices"]] == [(0, "a"), (1, "b")]
    answer = whole({"choices": [{"text": "b", "index": 1}, {"text": "a", "index": 1}, {"text": "c"}]})
    assert [(c["index"], c["text"]) for c in answer["choices"]] == [(0, "b"), (1, "a"), (2, "c")]


def test_a_null_text_is_empty_and_other_logprobs_than_an_object_are_none() -> None:
    answer = whole({"choices": [{"text": None, "logprobs": [1, 2], "finish_reason": "stop"}]})
    assert answer["choices"][0]["text"] == "" and answer["choices"][0]["logprobs"] is None
    kept = {"content": [{"token": "a", "logprob": -0.1}]}  # (llama-server's shape: an object, the client's too)
    assert whole({"choices": [{"text": "a", "logprobs": kept}]})["choices"][0]["logprobs"] == kept


@pytest.mark.parametrize(("usage", "made"), [
    ({"prompt_tokens": 2, "total_tokens": 5}, {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}),
    ({"completion_tokens": 3}, {"prompt_tokens": 0, "completion_tokens": 3, "total_tokens": 3}),
    ({"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3, "prompt_tokens_details": None, "cost": 0.5},
     {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3, "cost": 0.5}),
])
def test_a_usage_has_every_count_openai_s_has(usage: dict[str, Any], made: dict[str, Any]) -> None:
    assert whole({"choices": [{"text": "a"}], "usage": usage})["usage"] == made


def test_a_null_usage_is_none() -> None:
    assert "usage" not in whole({"choices": [{"text": "a"}], "usage": None})


@pytest.mark.parametrize("choice", [{"text": 5}, {"text": {"a": 1}}, {"text": "", "finish_reason": "error"}])
def test_what_cannot_be_repaired_is_the_provider_s_error(choice: dict[str, Any]) -> None:
    with pytest.raises(ProviderError) as caught:
        answer_shapes.completion({"choices": [choice]}, "run1", 1, "p")
    assert caught.value.retry is Retry.ELSEWHERE and caught.value.message.startswith("provider p ")


def test_a_chunk_gets_what_openai_s_streams_have() -> None:
    chunk: dict[str, Any] = {"choices": [{"text": "hel"}, {"text": None, "index": 1, "finish_reason": "eos_token"}],
                             "usage": None, "system_fingerprint": None}
    answer_shapes.completion_chunk(chunk, "run1", 1700000000, "p")
    assert chunk == {"id": "cmpl-run1", "object": "text_completion", "created": 1700000000,
                     "choices": [{"text": "hel", "index": 0, "logprobs": None, "finish_reason": None},
                                 {"text": "", "index": 1, "logprobs": None, "finish_reason": "stop"}]}
    usage_only: dict[str, Any] = {"id": "x", "created": 5, "usage": {"prompt_tokens": 1, "total_tokens": 3,
                                                                      "prompt_tokens_details": None}}
    answer_shapes.completion_chunk(usage_only, "run1", 1700000000, "p")
    assert usage_only == {"id": "x", "object": "text_completion", "created": 5, "choices": [],
                          "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}
    validate("CreateCompletionResponse", {**usage_only, "model": "m"})


def test_a_chunk_that_says_the_run_failed_is_the_provider_s_error() -> None:
    with pytest.raises(ProviderError):
        answer_shapes.completion_chunk({"choices": [{"text": "", "finish_reason": "error"}]}, "run1", 1, "p")


def test_embeddings_get_what_openai_s_have() -> None:
    answer: dict[str, Any] = {"data": [{"embedding": [0.5], "index": 1}, {"embedding": [0.25], "index": 0}]}
    answer_shapes.embeddings(answer)
    answer["model"] = "m"
    validate("CreateEmbeddingResponse", answer)
    assert answer == {"object": "list", "model": "m", "usage": {"prompt_tokens": 0, "total_tokens": 0},
                      "data": [{"embedding": [0.25], "index": 0, "object": "embedding"},
                               {"embedding": [0.5], "index": 1, "object": "embedding"}]}
    counted: dict[str, Any] = {"data": [{"embedding": "AAAAAA=="}], "usage": {"total_tokens": 4}}
    answer_shapes.embeddings(counted)
    assert counted["usage"] == {"prompt_tokens": 4, "total_tokens": 4}


def chat(answer: dict[str, Any]) -> dict[str, Any]:
    answer_shapes.chat(answer, "run1", 1700000000, "p")
    answer.setdefault("model", "m")  # (the gateway's to write)
    validate("CreateChatCompletionResponse", answer)
    ChatCompletion.model_validate(answer)
    return answer


def chunk_of(chunk: dict[str, Any]) -> dict[str, Any]:
    answer_shapes.chat_chunks("run1", 1700000000, "p", asked=8)(chunk)
    seen = {**chunk, "model": "m"}
    validate("CreateChatCompletionStreamResponse", seen)
    ChatCompletionChunk.model_validate(seen)
    return chunk


def test_a_bare_chat_completion_gets_what_openai_s_has_and_keeps_what_it_said() -> None:
    answer = chat({"choices": [{"message": {"content": "hi", "reasoning_content": "hm"}}], "timings": {"n": 3}})
    assert answer == {"id": "chatcmpl-run1", "object": "chat.completion", "created": 1700000000, "model": "m",
                      "choices": [{"index": 0, "logprobs": None, "finish_reason": "stop",
                                   "message": {"role": "assistant", "content": "hi", "refusal": None,
                                               "reasoning_content": "hm"}}],
                      "timings": {"n": 3}}


@pytest.mark.parametrize(("said", "made"), [
    ("eos_token", "stop"), ("stop_sequence", "stop"), ("max_tokens", "length"), ("length", "length"),
    ("tool_calls", "tool_calls"), ("tool_call", "tool_calls"), ("function_call", "function_call"),
    ("content_filter", "content_filter"), ("something_new", "stop"), (None, "stop"), ({"type": "stop"}, "stop"),
])
def test_a_chat_finish_reason_is_one_openai_has(said: Any, made: str) -> None:
    answer = chat({"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": said}]})
    assert answer["choices"][0]["finish_reason"] == made
    chunk = chunk_of({"choices": [{"index": 0, "delta": {}, "finish_reason": said}]})
    assert chunk["choices"][0]["finish_reason"] == (None if said is None or isinstance(said, dict) else made)


def test_vllm_s_whole_chat_answer_loses_the_nulls_openai_s_schema_has_not() -> None:
    message: dict[str, Any] = {"role": "assistant", "content": "hi", "refusal": None, "annotations": None,
                               "audio": None, "function_call": None, "tool_calls": [], "reasoning_content": None}
    answer = chat({"id": "chatcmpl-v", "object": "chat.completion", "created": 5, "model": "m",
                   "choices": [{"index": 0, "message": message, "finish_reason": "stop", "stop_reason": None,
                                "logprobs": {"content": [{"token": "hi", "logprob": -0.5, "bytes": [104, 105],
                                                          "top_logprobs": []}]}}],
                   "service_tier": None, "system_fingerprint": None, "prompt_logprobs": None,
                   "usage": {"prompt_tokens": 2, "total_tokens": 3, "completion_tokens": 1,
                             "prompt_tokens_details": None}})
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "hi", "refusal": None, "audio": None,
                                               "tool_calls": [], "reasoning_content": None}
    assert answer["choices"][0]["logprobs"]["refusal"] is None and "system_fingerprint" not in answer
    assert answer["usage"] == {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
    assert (answer["id"], answer["created"]) == ("chatcmpl-v", 5)


def test_a_message_that_calls_tools_keeps_its_calls_and_says_so() -> None:
    """TGI's: no `content`, no `type`, arguments as an object; a finish_reason it lacks is `tool_calls`."""
    answer = chat({"choices": [{"message": {"role": "assistant", "tool_calls": [
        {"id": "0", "function": {"name": "f", "arguments": {"city": "Paris"}, "description": None}},
        {"type": "function", "function": {"name": "g", "arguments": "{}"}}]}}]})
    message = answer["choices"][0]["message"]
    assert message["content"] is None and answer["choices"][0]["finish_reason"] == "tool_calls"
    assert message["tool_calls"] == [
        {"id": "0", "type": "function",
         "function": {"name": "f", "arguments": '{"city":"Paris"}', "description": None}},
        {"id": "call_run1_1", "type": "function", "function": {"name": "g", "arguments": "{}"}}]


def test_chat_choices_come_in_the_order_of_their_indices() -> None:
    answer = chat({"choices": [{"index": 1, "message": {"content": "b"}}, {"index": 0, "message": {"content": "a"}}]})
    assert [(c["index"], c["message"]["content"]) for c in answer["choices"]] == [(0, "a"), (1, "b")]


@pytest.mark.parametrize("choice", [{"message": {"content": ""}, "finish_reason": "error"},
                                    {"delta": {}, "finish_reason": "error"}])
def test_a_chat_run_its_server_says_failed_is_the_provider_s_error(choice: dict[str, Any]) -> None:
    with pytest.raises(ProviderError) as caught:
        if "delta" in choice:
            answer_shapes.chat_chunks("run1", 1, "p")({"choices": [choice]})
        else:
            answer_shapes.chat({"choices": [choice]}, "run1", 1, "p")
    assert caught.value.retry is Retry.ELSEWHERE and caught.value.message.startswith("provider p ")


def test_a_chat_chunk_already_right_is_left_as_it_came() -> None:
    chunk = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 5, "model": "m",
             "system_fingerprint": "fp", "choices": [{"index": 0, "delta": {"content": "hi"}, "logprobs": None,
                                                      "finish_reason": None}]}
    same = json.loads(json.dumps(chunk))
    assert chunk_of(chunk) == same


def test_a_chat_chunk_with_no_tool_calls_in_a_list_goes_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Some servers give each text chunk `"tool_calls": []` (Foundry Local): OpenAI's schema has it, and
    it calls nothing; since tool calls were numbered (`StreamCalls`) every such chunk went the slow path."""
    slow: list[Any] = []
    monkeypatch.setattr(answer_shapes, "_chat_choice", lambda *given: slow.append(given))
    chunk = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 5, "model": "m",
             "choices": [{"index": 0, "delta": {"content": "hi", "tool_calls": []}, "logprobs": None,
                          "finish_reason": None}]}
    same = json.loads(json.dumps(chunk))
    answer_shapes.chat_chunks("run1", 1700000000, "p")(chunk)
    assert chunk == same and slow == []


def test_a_chat_chunk_gets_what_openai_s_streams_have() -> None:
    chunk = chunk_of({"choices": [{"delta": {"content": "hel"}},
                                  {"index": 1, "finish_reason": "eos_token", "logprobs": {"content": []}}],
                      "usage": None, "system_fingerprint": None})
    assert chunk == {"id": "chatcmpl-run1", "object": "chat.completion.chunk", "created": 1700000000,
                     "choices": [{"delta": {"content": "hel"}, "finish_reason": None, "index": 0},
                                 {"index": 1, "finish_reason": "stop", "logprobs": {"content": [], "refusal": None},
                                  "delta": {}}]}
    vllm = chunk_of({"id": "chatcmpl-v", "object": "chat.completion.chunk", "created": 5, "model": "m",
                     "choices": [{"index": 0, "delta": {"content": "x"}, "logprobs": None, "finish_reason": None}],
                     "usage": None})
    assert "usage" not in vllm
    usage_only = chunk_of({"id": "chatcmpl-v", "object": "chat.completion.chunk", "created": 5, "model": "m",
                           "choices": [], "usage": {"prompt_tokens": 1, "total_tokens": 3,
                                                    "prompt_tokens_details": None}})
    assert usage_only["usage"] == {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    assert chunk_of({"usage": {"prompt_tokens": 1, "completion_tokens": 2}})["choices"] == []


@pytest.mark.parametrize("said", [{"content": 5}, {"content": {"a": 1}}, {"content": True},
                                  {"content": None, "refusal": 7}, {"content": "hi", "refusal": ["no"]}])
def test_a_chat_text_that_is_not_text_is_the_provider_s_error(said: dict[str, Any]) -> None:
    """As a legacy completion's `text`: a whole message's or a delta's `content` of 5 reached the
    caller as a 200 OpenAI's schema refuses (the `openai` client's `message.content` was 5); the
    fast path of a chunk already right in its other keys looks at its text too."""
    with pytest.raises(ProviderError) as caught:
        answer_shapes.chat({"choices": [{"index": 0, "message": {"role": "assistant", **said},
                                         "finish_reason": "stop"}]}, "run1", 1, "p")
    assert caught.value.retry is Retry.ELSEWHERE and caught.value.message.startswith("provider p ")
    with pytest.raises(ProviderError) as caught:
        answer_shapes.chat_chunks("run1", 1, "p")({"id": "chatcmpl-x", "object": "chat.completion.chunk",
                                                   "created": 5, "choices": [{"index": 0, "delta": said,
                                                                              "finish_reason": None}]})
    assert caught.value.retry is Retry.ELSEWHERE and caught.value.message.startswith("provider p ")


def test_a_chat_text_of_parts_or_null_is_left_as_it_came() -> None:
    # (text parts, as Mistral's magistral answers: not this change's to refuse)
    parts: list[dict[str, Any]] = [{"type": "text", "text": "hi"}]
    answer: dict[str, Any] = {"choices": [{"index": 0, "message": {"role": "assistant", "content": parts},
                                           "finish_reason": "stop"}]}
    answer_shapes.chat(answer, "run1", 1, "p")
    assert answer["choices"][0]["message"]["content"] == parts
    assert chunk_of({"choices": [{"index": 0, "delta": {"content": None, "refusal": None}}]})["choices"][0][
        "delta"] == {"content": None, "refusal": None}


def test_a_tool_call_s_arguments_that_are_a_number_or_a_boolean_are_json_text() -> None:
    answer = chat({"choices": [{"message": {"role": "assistant", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": 12}},
        {"id": "b", "type": "function", "function": {"name": "g", "arguments": True}}]}}]})
    assert [c["function"]["arguments"] for c in answer["choices"][0]["message"]["tool_calls"]] == ["12", "true"]


def streamed(chunks: list[dict[str, Any]]) -> Any:
    """The chunks of one stream shaped, then read by the `openai` client's stream helper: its whole answer."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    shape = answer_shapes.chat_chunks("run1", 1700000000, "p")
    state = ChatCompletionStreamState()
    for chunk in chunks:
        shape(chunk)
        validate("CreateChatCompletionStreamResponse", {**chunk, "model": "m"})
        state.handle_chunk(ChatCompletionChunk.model_validate({**chunk, "model": "m"}))
    return state.get_final_completion()


def call_chunk(*calls: Any, finish: str | None = None) -> dict[str, Any]:
    return {"id": "c", "object": "chat.completion.chunk", "created": 1,
            "choices": [{"index": 0, "delta": {"tool_calls": list(calls)}, "finish_reason": finish}]}


def test_streamed_tool_calls_without_an_index_are_numbered_as_openai_s_are() -> None:
    """Gemini's OpenAI-compatible endpoint streams each call whole in a chunk, without `index`: through
    iop, the `openai` client's stream helper raised TypeError ("list delta entry `index` value is not
    an integer"), and its chunks' `tool_calls[0].index` was None (a hostile-provider review)."""
    final = streamed([
        call_chunk({"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x":1}'}}),
        call_chunk({"id": "b", "type": "function", "function": {"name": "g", "arguments": {"y": 2}}}),
        call_chunk({"function": {"arguments": ""}}, finish="tool_calls")])  # (no id, no index: the last call's)
    calls = final.choices[0].message.tool_calls
    assert [(c.id, c.function.name, c.function.arguments) for c in calls] == [
        ("a", "f", '{"x":1}'), ("b", "g", '{"y":2}')]


def test_streamed_tool_call_pieces_keep_their_index_and_go_on_with_their_call() -> None:
    final = streamed([
        call_chunk({"index": 0, "id": "a", "type": "function", "function": {"name": "f", "arguments": ""}}),
        call_chunk({"index": 0, "function": {"arguments": '{"x"'}}),
        call_chunk({"id": "b", "type": "function", "function": {"name": "g", "arguments": "{"}}),  # (no index)
        call_chunk({"function": {"arguments": "}"}}, "nope", None),  # (not calls: left out)
        call_chunk({"id": "a", "function": {"arguments": ":1}"}}, finish="tool_calls")])  # (its id's call)
    calls = final.choices[0].message.tool_calls
    assert [(c.id, c.function.name, c.function.arguments) for c in calls] == [
        ("a", "f", '{"x":1}'), ("b", "g", "{}")]


def test_streamed_calls_already_right_are_left_as_they_came() -> None:
    shape = answer_shapes.chat_chunks("run1", 1700000000, "p")
    for chunk in [call_chunk({"index": 0, "id": "a", "type": "function", "function": {"name": "f", "arguments": ""}}),
                  call_chunk({"index": 0, "function": {"arguments": "{}"}},
                             {"index": 1, "id": "b", "type": "function", "function": {"name": "g", "arguments": "{}"}}),
                  call_chunk({"index": 1, "function": {"arguments": ""}}, finish="tool_calls")]:
        same = json.loads(json.dumps(chunk))
        shape(chunk)
        assert chunk == same


def test_streamed_tool_calls_numbered_otherwise_than_openai_s_are_numbered_so() -> None:
    """A call `index` of -1, or one past a gap (1000000), made the `openai` client's stream helper raise
    IndexError; each call keeps its own pieces."""
    final = streamed([
        call_chunk({"index": -1, "id": "a", "type": "function", "function": {"name": "f", "arguments": "{"}}),
        call_chunk({"index": 1000000, "id": "b", "type": "function", "function": {"name": "g", "arguments": "["}}),
        call_chunk({"index": -1, "function": {"arguments": "}"}}, {"index": 1000000, "function": {"arguments": "]"}},
                   finish="tool_calls")])
    calls = final.choices[0].message.tool_calls
    assert [(c.id, c.function.name, c.function.arguments) for c in calls] == [("a", "f", "{}"), ("b", "g", "[]")]


def test_streamed_calls_a_server_gives_the_same_index_are_calls_of_their_own() -> None:
    """As the Responses API's stream tells them apart (`_call_key`): an id not seen that names its
    function is a call of its own; the client had joined them into one call named "fg"."""
    final = streamed([
        call_chunk({"index": 0, "id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}),
        call_chunk({"index": 0, "id": "b", "type": "function", "function": {"name": "g", "arguments": "{"}}),
        call_chunk({"index": 0, "id": "b2", "function": {"arguments": "}"}}, finish="tool_calls")])  # (its own id)
    calls = final.choices[0].message.tool_calls
    assert [(c.id, c.function.name, c.function.arguments) for c in calls] == [("a", "f", "{}"), ("b", "g", "{}")]


def test_a_whole_message_s_entries_that_call_no_function_are_left_out() -> None:
    """A provider's `tool_calls` holding "x" or a call without its function reached the caller as a 200
    OpenAI's schema refuses (a hostile-provider review); one that is not a list too."""
    answer = chat({"choices": [{"message": {"role": "assistant", "tool_calls": [
        "x", None, {"type": "function"},
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}]})
    assert [c["id"] for c in answer["choices"][0]["message"]["tool_calls"]] == ["a"]
    assert answer["choices"][0]["finish_reason"] == "tool_calls"
    answer = chat({"choices": [{"message": {"role": "assistant", "content": "hi", "tool_calls": 5}}]})
    assert "tool_calls" not in answer["choices"][0]["message"] and answer["choices"][0]["finish_reason"] == "stop"


def test_a_whole_tool_call_whose_name_is_not_text_is_the_provider_s_error() -> None:
    with pytest.raises(ProviderError) as caught:
        answer_shapes.chat({"choices": [{"message": {"role": "assistant", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": 7, "arguments": "{}"}}]}}]}, "run1", 1, "p")
    assert caught.value.retry is Retry.ELSEWHERE and caught.value.message.startswith("provider p ")



def piece(name: str | None, arguments: str, **given: Any) -> dict[str, Any]:
    return {**given, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_a_name_a_call_s_pieces_repeat_is_its_name_once() -> None:
    """llama-cpp-python's server (its chatml-function-calling and a named tool_choice) and Fireworks
    give each piece of a call its id, type and function's name again: through iop the ids were made
    right, but the `openai` client's stream helper joined the names ("get_weatherget_weather…"), and a
    caller answering the call named a function it does not have."""
    final = streamed([
        call_chunk(piece("get_weather", "", index=0, id="call_a")),
        *[call_chunk(piece("get_weather", p, index=0, id="call_a")) for p in ('{"city"', ': "Paris"}')],
        call_chunk(piece("get_time", "{}", index=1, id="call_b")),
        call_chunk(piece("get_time", "", index=1, id="call_b"), finish="tool_calls")])
    calls = final.choices[0].message.tool_calls
    assert [(c.id, c.function.name, c.function.arguments) for c in calls] == [
        ("call_a", "get_weather", '{"city": "Paris"}'), ("call_b", "get_time", "{}")]


@pytest.mark.parametrize("chunks", [
    [call_chunk(piece("get_weather", '{"city": "Paris"}', id=""), piece("get_time", '{"tz": "UTC"}', id="")),
     call_chunk(finish="tool_calls")],
    [call_chunk(piece("get_weather", '{"city": "Paris"}')), call_chunk(piece("get_time", '{"tz": "UTC"}')),
     call_chunk({"function": {"arguments": ""}}, finish="tool_calls")],
])
def test_whole_calls_without_an_index_or_an_id_are_calls_of_their_own(chunks: list[dict[str, Any]]) -> None:
    """Gemini's OpenAI-compatible endpoint sends each call whole, without an index, and its ids may be
    empty: two such calls (in one chunk or two) were numbered as one, and the caller got one call
    named "get_weatherget_time" whose arguments were '{"city": "Paris"}{"tz": "UTC"}' (the Responses
    API's stream one function_call item with both arguments)."""
    calls = streamed(chunks).choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "UTC"}')]
    # (and an id each, as a whole answer's calls without one get: the caller answering one had none to give)
    assert [c.id for c in calls] == ["call_run1_0", "call_run1_1"]


def test_a_call_that_came_without_an_id_keeps_the_one_it_was_given() -> None:
    """A server that gives its call's id on a later piece: the client would join the two."""
    final = streamed([
        call_chunk({"index": 0, "type": "function", "function": {"name": "f", "arguments": ""}}),
        call_chunk({"index": 0, "id": "late", "function": {"arguments": "{}"}}, finish="tool_calls")])
    (call,) = final.choices[0].message.tool_calls
    assert (call.id, call.function.name, call.function.arguments) == ("call_run1_0", "f", "{}")


def test_what_a_stream_s_calls_are_numbered_by_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hostile server's million calls (each a new id and index) or million choices are not a million
    entries: past `MAX_CALL_IDS` each choice remembers no more ids, indices or names, the stream no more
    choices, and every call is still numbered."""
    import inspect

    monkeypatch.setattr(answer_shapes, "MAX_CALL_IDS", 4)
    state = answer_shapes.StreamCalls("run1")
    for i in range(10):
        delta = {"tool_calls": [{"index": 100 + i, "id": f"c{i}", "type": "function",
                                 "function": {"name": f"f{i}", "arguments": "{}"}}]}
        state.number(delta)
        assert delta["tool_calls"][0]["index"] == i
    assert (len(state.ids), len(state.indices), len(state.names)) == (4, 4, 4)
    shape = answer_shapes.chat_chunks("run1", 1700000000, "p", asked=10)
    for choice in range(10):
        chunk = call_chunk({"index": 0, "id": "a", "type": "function", "function": {"name": "f", "arguments": ""}})
        chunk["choices"][0]["index"] = choice
        shape(chunk)
        assert chunk["choices"][0]["delta"]["tool_calls"][0]["index"] == 0
    assert len(inspect.getclosurevars(shape).nonlocals["calls"]) == 4


def test_a_stream_s_choices_are_numbered_as_asked_for_and_its_head_is_its_first_chunk_s() -> None:
    """A server's index that is one asked for (0 to n-1) and not yet another's is kept, in whatever order
    choices come (vLLM's `n` > 1); another is the lowest not given, in the order they first come; more
    distinct ones than asked for are the provider's error. A chunk's id and created are the first's."""
    shape = answer_shapes.chat_chunks("run1", 1700000000, "p", asked=3)
    said = [(1, "chatcmpl-a", 5), (0, "chatcmpl-b", 6), (7, "chatcmpl-a", 5), (0, "x", 9), (1, 5, None), (7, "", 5)]
    got = []
    for index, given_id, created in said:
        chunk: dict[str, Any] = {"id": given_id, "object": "chat.completion.chunk", "created": created, "model": "m",
                 "choices": [{"index": index, "delta": {"content": "x"}, "logprobs": None, "finish_reason": None}]}
        shape(chunk)
        validate("CreateChatCompletionStreamResponse", chunk)
        got.append((chunk["choices"][0]["index"], chunk["id"], chunk["created"]))
    assert got == [(1, "chatcmpl-a", 5), (0, "chatcmpl-a", 5), (2, "chatcmpl-a", 5), (0, "chatcmpl-a", 5),
                   (1, "chatcmpl-a", 5), (2, "chatcmpl-a", 5)]
    with pytest.raises(ProviderError, match="provider p answered more choices than the 3 asked for"):
        shape({"choices": [{"index": 2, "delta": {}}]})  # (2 is 7's: a fourth choice)
    text = answer_shapes.completion_chunks("run1", 1700000000, "p")
    first: dict[str, Any] = {"id": "cmpl-a", "choices": [{"index": 5, "text": "a"}]}
    second: dict[str, Any] = {"id": "cmpl-b", "created": 9,
                              "choices": [{"index": 5, "text": "b", "finish_reason": "stop"}]}
    text(first)
    text(second)
    assert [(c["id"], c["created"], c["choices"][0]["index"]) for c in (first, second)] == [
        ("cmpl-a", 1700000000, 0), ("cmpl-a", 1700000000, 0)]
    with pytest.raises(ProviderError, match="more choices than the 1 asked for"):
        text({"choices": [{"index": 0, "text": "c"}]})


def test_a_right_chunk_of_a_choice_its_server_numbers_so_goes_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Index 0 (or any of those asked for, kept as it came) costs a set lookup; a renumbered one goes the slow path."""
    slow: list[Any] = []
    real = answer_shapes._chat_choice

    def counted(*given: Any) -> None:
        slow.append(given)
        real(*given)

    monkeypatch.setattr(answer_shapes, "_chat_choice", counted)
    shape = answer_shapes.chat_chunks("run1", 1700000000, "p", asked=3)
    for index in (0, 1, 0, 1):
        shape({"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 5, "model": "m",
               "choices": [{"index": index, "delta": {"content": "hi"}, "logprobs": None, "finish_reason": None}]})
    assert slow == []
    renumbered = {"choices": [{"index": 9, "delta": {"content": "hi"}, "logprobs": None, "finish_reason": None}]}
    shape(renumbered)
    assert len(slow) == 1 and renumbered["choices"][0]["index"] == 2


def sglang_chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    """A chunk as SGLang's server writes it (its pydantic models dumped with their nulls)."""
    return {"id": "s", "object": "chat.completion.chunk", "created": 5, "model": "m", "usage": None,
            "choices": [{"index": 0, "logprobs": None, "finish_reason": finish_reason, "matched_stop": None,
                         "delta": {"role": None, "content": None, "reasoning_content": None, "tool_calls": None,
                                   **delta}}]}


def test_sglang_s_stream_loses_the_nulls_openai_s_schema_has_not() -> None:
    """SGLang's every chunk has `role` and `tool_calls` null, and a call's pieces after its first an
    `id` and a function `name` of null: each chunk failed OpenAI's schema (and the `openai` client's
    stream helper joined the nulls). What the caller reads is the same text and the same one call."""
    shape = answer_shapes.chat_chunks("run1", 1700000000, "p")
    chunks = [sglang_chunk({"role": "assistant", "content": ""}), sglang_chunk({"content": "hi"}),
              sglang_chunk({"tool_calls": [{"id": "c1", "index": 0, "type": "function",
                                            "function": {"name": "f", "arguments": None}}]}),
              sglang_chunk({"tool_calls": [{"id": None, "index": 0, "type": None,
                                            "function": {"name": None, "arguments": '{"a": 1}'}}]}),
              sglang_chunk({}, "tool_calls")]
    for chunk in chunks:
        shape(chunk)
        validate("CreateChatCompletionStreamResponse", chunk)
        ChatCompletionChunk.model_validate(chunk)
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
    assert deltas[0] == {"role": "assistant", "content": "", "reasoning_content": None}
    assert deltas[1] == {"content": "hi", "reasoning_content": None}
    assert deltas[2]["tool_calls"] == [{"id": "c1", "index": 0, "type": "function", "function": {"name": "f"}}]
    assert deltas[3]["tool_calls"] == [{"index": 0, "function": {"arguments": '{"a": 1}'}}]


def test_llama_cpp_python_s_null_function_call_is_left_out() -> None:
    """llama-cpp-python's server sends `"function_call": null` (and `role` null) beside a delta's calls or text."""
    for delta in ({"role": None, "content": "x", "function_call": None}, {"tool_calls": None},
                  {"role": None, "content": None, "function_call": None,
                   "tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                   "function": {"name": "f", "arguments": ""}}]}):
        chunk = chunk_of({"id": "l", "object": "chat.completion.chunk", "created": 5, "model": "m",
                          "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]})
        assert None not in [chunk["choices"][0]["delta"].get(k, 0) for k in ("role", "function_call", "tool_calls")]


def test_a_whole_call_s_null_type_and_arguments_are_what_openai_s_are() -> None:
    """SGLang's whole tool call of a function given no arguments: `arguments` null, as OpenAI's has `{}`."""
    answer = chat({"choices": [{"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "index": None, "type": None, "function": {"name": "f", "arguments": None}}]},
        "finish_reason": "tool_calls"}]})
    assert answer["choices"][0]["message"]["tool_calls"] == [
        {"id": "c1", "index": None, "type": "function", "function": {"name": "f", "arguments": "{}"}}]


def test_a_usage_s_null_detail_count_is_left_out() -> None:
    answer = chat({"choices": [{"index": 0, "message": {"content": "hi"}, "finish_reason": "stop"}],
                   "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2,
                             "completion_tokens_details": {"reasoning_tokens": None, "audio_tokens": 0}}})
    assert answer["usage"]["completion_tokens_details"] == {"audio_tokens": 0}
