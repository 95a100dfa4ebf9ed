"""OpenAI's Responses API as iop runs it (pure parts): the request as a chat completion
(`gateway.responses_request`), the chat answer as a Response and its events
(`gateway.responses_output`). Every Response and event is checked against OpenAI's schemas, and
streams are fed to the official client's own event accumulator."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai import omit
from openai.lib.streaming.responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from common.codec import unpack
from common.wire import ErrorCode, RunKind
from gateway import responses_output
from gateway.errors import ApiError
from gateway.requests import parse_responses
from gateway.responses_output import ResponseShape
from gateway.responses_request import to_chat
from tests.openapi import validate
from tests.test_request_fuzz import ANY_JSON, ODD_VALUES, SAFE_INTS, SAFE_JSON, SAFE_TEXT, _splice, parsed_or_400

RUN = "run_0123456789abcdef0123456789abcdef"
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def chat_of(body: dict[str, Any], stream: bool = False) -> dict[str, Any]:
    return to_chat({"model": "m", **body}, stream).chat


def refused(body: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as err:
        to_chat({"model": "m", **body}, False)
    assert err.value.status == 400 and err.value.code is ErrorCode.INVALID_REQUEST
    return err.value


# ---------------------------------------------------------------------------- the request
def test_a_string_input_with_instructions_is_a_system_and_a_user_message() -> None:
    chat = chat_of({"input": "hi", "instructions": "be brief", "max_output_tokens": 5, "temperature": 0.2})
    assert chat == {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                               {"role": "user", "content": "hi"}],
                    "max_tokens": 5, "temperature": 0.2}


def test_an_answer_s_text_after_its_calls_stays_before_their_results() -> None:
    """A Response's output may hold a function call before the text of the same answer (its
    stream's order); sent back with the call's output, the text became a message of its own
    between the calls and their results."""
    call = {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"}
    text = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]}
    chat = chat_of({"input": [{"role": "user", "content": "weather?"}, call, text,
                              {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                              {"role": "assistant", "content": "It is sunny."}]})
    assert chat["messages"] == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
    ]


def test_two_assistant_texts_around_calls_stay_apart_in_their_message() -> None:
    """Texts of two messages that join the calls' message are not glued into one sentence."""
    call = {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"}
    chat = chat_of({"input": [{"role": "user", "content": "weather?"},
                              {"role": "assistant", "content": "I'll look."}, call,
                              {"role": "assistant", "content": "One moment."},
                              {"role": "assistant", "content": ""},
                              {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]})
    assert chat["messages"][1] == {"role": "assistant", "content": "I'll look.\n\nOne moment.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]}
    assert [m["role"] for m in chat["messages"]] == ["user", "assistant", "tool"]
    # iop's own stream split one answer's text at its call: sent back, it is the model's text again
    split = chat_of({"input": [{"role": "user", "content": "weather?"},
                               {"role": "assistant", "content": "Let me check. "}, call,
                               {"role": "assistant", "content": "One moment."},
                               {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]})
    assert split["messages"][1]["content"] == "Let me check. One moment."


def test_text_parts_of_a_message_are_one_text_their_words_apart() -> None:
    """Parts joined with nothing glued words ("Summarize this:The quick brown fox", and a tool's
    output "line oneline two": a new user's walk through the README); a line break goes where
    neither part has a space at the join, as vLLM joins text parts."""
    chat = chat_of({"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Summarize this:"},
                                     {"type": "input_text", "text": "The quick brown fox"}]},
        {"type": "function_call", "call_id": "c1", "name": "read", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1",
         "output": [{"type": "input_text", "text": "line one"}, {"type": "input_text", "text": "line two"}]}]})
    assert chat["messages"][0]["content"] == "Summarize this:\nThe quick brown fox"
    assert chat["messages"][2]["content"] == "line one\nline two"


def test_items_become_the_chat_conversation() -> None:
    chat = chat_of({"input": [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "what is "}, {"type": "input_text", "text": "this?"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "and"}, {
            "type": "input_image", "image_url": "data:image/png;base64,AA", "detail": "low"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "let me look"}]},
        {"type": "function_call", "call_id": "c1", "name": "look", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "look", "arguments": "{\"x\":1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "a cat"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "a dog"}]},
        {"type": "function_call", "call_id": "c3", "name": "more", "arguments": "{}"},
    ]})
    assert chat["messages"] == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "what is this?"},
        {"role": "user", "content": [{"type": "text", "text": "and"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA",
                                                                         "detail": "low"}}]},
        {"role": "assistant", "content": "let me look", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "look", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "look", "arguments": "{\"x\":1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a cat"},
        {"role": "tool", "tool_call_id": "c2", "content": "a dog"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "more", "arguments": "{}"}}]},
    ]


def test_tools_formats_and_fields_are_translated_and_the_rest_passed_through() -> None:
    translated = to_chat({
        "model": "m", "input": "x", "top_k": 20, "store": True, "include": ["reasoning.encrypted_content"],
        "metadata": {"a": "b"}, "parallel_tool_calls": False, "reasoning": {"effort": "low"},
        "safety_identifier": "u-1f3a", "prompt_cache_key": "k-7", "user": "alice",
        "tools": [{"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"},
        "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}, "strict": True}},
    }, True)
    chat = translated.chat
    assert chat["top_k"] == 20 and chat["parallel_tool_calls"] is False  # (what it does not know: as it came)
    assert not {"store", "include", "metadata", "text", "reasoning", "input"} & chat.keys()
    assert chat["tools"] == [{"type": "function", "function": {"name": "f", "description": "d",
                                                                "parameters": {"type": "object"}}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "object"}, "strict": True}}
    assert chat["reasoning_effort"] == "low"
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    echo = translated.echo
    assert echo["metadata"] == {"a": "b"} and echo["parallel_tool_calls"] is False
    assert (echo["safety_identifier"], echo["prompt_cache_key"], echo["user"]) == ("u-1f3a", "k-7", "alice")
    assert not {"safety_identifier", "prompt_cache_key"} & chat.keys()
    validate("Response", ResponseShape(RUN, "m", echo).whole({}))
    assert echo["tools"] == [{"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"},
                              "strict": None}]
    assert chat_of({"input": "x", "text": {"format": {"type": "json_object"}}})["response_format"] == {
        "type": "json_object"}
    assert "response_format" not in chat_of({"input": "x", "text": {"format": {"type": "text"}}})


def test_without_tools_no_tool_choice_nor_parallel_tool_calls_goes_to_the_provider() -> None:
    """A Response takes `tool_choice` and `parallel_tool_calls` without tools (the Agents SDK sends
    `parallel_tool_calls: false` to an agent that has none); a chat completion does not: OpenAI's
    answers "'parallel_tool_calls' is only allowed when 'tools' are specified" (and the same of
    `tool_choice`), a 400 the caller of an `openai_api` provider got. Without tools they mean
    nothing, so neither is sent; the Response still repeats them."""
    for body in ({"parallel_tool_calls": False, "tool_choice": "auto"}, {"parallel_tool_calls": True, "tools": [],
                                                                        "tool_choice": "none"}):
        translated = to_chat({"model": "m", "input": "x", **body}, False)
        assert not {"tools", "tool_choice", "parallel_tool_calls"} & translated.chat.keys(), translated.chat
        assert translated.echo["parallel_tool_calls"] is body["parallel_tool_calls"]
        assert translated.echo["tool_choice"] == body["tool_choice"]
        validate("Response", ResponseShape(RUN, "m", translated.echo).whole(completion({"content": "hi"})))
    with_tools = chat_of({"input": "x", "parallel_tool_calls": False, "tool_choice": "none",
                          "tools": [{"type": "function", "name": "f"}]})
    assert with_tools["parallel_tool_calls"] is False and with_tools["tool_choice"] == "none"


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "send the whole conversation"),
    ({"input": "x", "conversation": "conv_1"}, "conversation", "iop keeps no conversations"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt", "no prompt templates"),
    ({"input": "x", "background": True}, "background", "runs API"),
    ({"input": "x", "top_logprobs": 2}, "top_logprobs", "/v1/chat/completions"),
    ({"input": "x", "include": ["reasoning.encrypted_content", "message.output_text.logprobs"]}, "include",
     "log probabilities are on /v1/chat/completions"),
    ({"input": [{"role": "user", "content": "a"}, {"type": "function_call_output", "call_id": "zzz", "output": "r"}]},
     "input[1].call_id", 'no function call before it has the call_id "zzz"'),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "r"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]},
     "input[0].call_id", "send the function_call item with its output"),
    ({}, "input", "'input' is required: iop keeps no prompts, conversations or responses"),
    ({"input": None, "instructions": "rules"}, "input", "'input' is required"),
    ({"input": []}, "input", "a string or a non-empty array"),
    ({"input": [{"role": "system", "content": "only rules"}]}, "input", "no message for the model"),
    ({"input": [{"role": "user", "content": "a"}, {"type": "item_reference", "id": "msg_1"}]}, "input[1]",
     "iop keeps no items"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type", '("web_search_call") is not taken'),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "user, assistant, system or developer"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                             {"type": "input_image", "file_id": "file_1"}]}]},
     "input[0].content[1].image_url", "iop keeps no files"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_url": "https://x/y.pdf"}]}]},
     "input[0].content[0].file_data", "fetches none"),
    ({"input": [{"role": "user", "content": [{"type": "input_video"}]}]}, "input[0].content[0].type", "one of"),
    ({"input": [{"role": "user", "content": 5}]}, "input[0].content", "a string or an array"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments", "a string"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c",
                 "output": [{"type": "input_image", "image_url": "data:,"}]}]}, "input[1].output", "must be text"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", "nor the tools OpenAI runs itself"),
    ({"input": "x", "tools": [{"type": "custom", "name": "sql"}]}, "tools[0].type", "not custom (free-form) tools"),
    ({"input": "x", "tools": {"type": "function"}}, "tools", "an array"),
    ({"input": "x", "tool_choice": {"type": "web_search"}}, "tool_choice", "none, auto, required"),
    ({"input": "x", "tool_choice": {"type": "allowed_tools"}}, "tool_choice.mode", "auto or required"),
    ({"input": "x", "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": {}}}, "tool_choice.tools",
     "a list of tools"),
    ({"input": "x", "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "mcp"}]}},
     "tool_choice.tools[0]", "only function tools"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {
        "type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "f"},
                                                               {"type": "function", "name": "g"}]}},
     "tool_choice.tools[1].name", '"g", which'),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "at least 1"),
    ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format.type", "json_schema"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s"}}}, "text.format.schema", "an object"),
    ({"input": "x", "truncation": "sometimes"}, "truncation", "one of auto, disabled"),
    ({"input": "x", "metadata": ["a"]}, "metadata", "an object"),
    ({"input": "x", "metadata": {"n": 1}}, "metadata", "pairs of text"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata", "at most 16"),
    ({"input": [{"role": ["user"], "content": "x"}]}, "input[0].role", "user, assistant"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort", "one of none, minimal"),
    ({"input": "x", "reasoning": {"summary": 1}}, "reasoning.summary", "one of auto"),
    ({"input": "x", "text": {"verbosity": "loud"}}, "text.verbosity", "one of low"),
    ({"input": "x", "parallel_tool_calls": "yes"}, "parallel_tool_calls", "a boolean"),
    ({"input": "x", "temperature": "hot"}, "temperature", "a number"),
    ({"input": "x", "background": "yes"}, "background", "a boolean"),
    ({"input": "x", "store": "no"}, "store", "a boolean"),
    ({"input": "x", "include": "x"}, "include", "an array of strings"),
    ({"input": "x", "n": 3}, "n", "one output"),
    ({"input": "x", "n": True}, "n", "one output"),  # (equal to 1 in Python, not to every server)
    ({"input": "x", "n": 1.0}, "n", "one output"),
    ({"input": "x", "best_of": 100000}, "best_of", "one output"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": "x"}]}, "tools[0].parameters",
     "an object"),
    # (it said "'tool_choice' is required", read as "the field is missing")
    ({"input": "x", "tool_choice": "required"}, "tool_choice", "asks for a call of a tool ('required'), but 'tools'"),
    # (a call of one of the allowed tools required, and none to call: as `required` without tools, not
    # dropped with the tool choice and answered with text)
    ({"input": "x", "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": []}}, "tool_choice",
     "names no tool"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {
        "type": "allowed_tools", "mode": "required", "tools": []}}, "tool_choice.tools", "allows no tool"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice.name", '"g", which'),
    ({"input": [{"content": "hi"}]}, "input[0].type", "(missing) is not taken"),
    # what a Response repeats must be what OpenAI's schema holds (found by a hostile review: a 200
    # whose Response the schema and the `openai` client refused)
    ({"input": "x", "tools": [{"type": "function", "name": "f", "strict": "yes"}]}, "tools[0].strict", "a boolean"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "description": {"a": 1}}]}, "tools[0].description",
     "a string"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": {}, "strict": "x"}}},
     "text.format.strict", "a boolean"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": {}, "description": 5}}},
     "text.format.description", "a string"),
    ({"input": "x", "temperature": 5}, "temperature", "from 0 to 2"),
    ({"input": "x", "top_p": -1}, "top_p", "from 0 to 1"),
    ({"input": "x", "top_p": 1e308}, "top_p", "from 0 to 1"),
    # a value that is false is not left out as if unset
    ({"input": "x", "text": False}, "text", "an object"),
    ({"input": "x", "text": ""}, "text", "an object"),
    ({"input": "x", "text": {"format": 0}}, "text.format", "an object"),
    ({"input": "x", "truncation": 0}, "truncation", "one of auto, disabled"),
    ({"input": "x", "truncation": []}, "truncation", "one of auto, disabled"),
    ({"input": [{"type": "x" * 3000}]}, "input[0].type", "…"),
    # repeated in the Response, whose schema holds `safety_identifier` to 64 characters (OpenAI refuses
    # a longer one): a 200 whose Response the schema refused
    ({"input": "x", "safety_identifier": "u" * 65}, "safety_identifier", "at most 64 characters"),
    # fields the Response repeats and never sends: one of the wrong type was dropped without a word (a 200
    # whose Response lacked it), and `false` passed for a `top_logprobs` of 0 (told it is no integer, not that
    # `top_logprobs` is not supported: 0 is)
    ({"input": "x", "safety_identifier": 5}, "safety_identifier", "a string"),
    ({"input": "x", "prompt_cache_key": {"k": "v"}}, "prompt_cache_key", "a string"),
    ({"input": "x", "user": ["u-1"]}, "user", "a string"),  # (repeated as they are: it was dropped too)
    ({"input": "x", "top_logprobs": False}, "top_logprobs", "must be an integer"),
    ({"input": "x", "top_logprobs": 0.0}, "top_logprobs", "must be an integer"),
])
def test_what_cannot_be_run_is_the_callers_400_naming_the_field(body: dict[str, Any], param: str,
                                                                 words: str) -> None:
    err = refused(body)
    assert err.param == param and words in err.message, err.message


def test_text_that_is_not_unicode_is_named_where_the_caller_wrote_it() -> None:
    for body, param in ((b'{"model": "m", "input": "x", "instructions": "\\ud800"}', "instructions"),
                        (b'{"model": "m", "input": "x", "metadata": {"a": "\\udfff"}}', "metadata.a"),
                        (b'{"model": "m", "input": [{"type": "function_call", "call_id": "c", "name": "f", '
                         b'"arguments": "\\ud800"}]}', "input[0].arguments")):
        with pytest.raises(ApiError) as err:
            parse_responses(body)
        assert err.value.param == param and "surrogate" in err.value.message


def test_a_parsed_responses_request_is_a_chat_run_queued_as_translated() -> None:
    req = parse_responses(json.dumps({"model": "m", "input": "hi", "stream": True, "metadata": {"k": "v"}}).encode())
    assert req.kind is RunKind.CHAT and req.model == "m" and req.stream
    assert req.packed is not None and unpack(req.packed) == req.body
    assert req.body["messages"] == [{"role": "user", "content": "hi"}]
    assert req.echo is not None and req.echo["metadata"] == {"k": "v"}
    with pytest.raises(ApiError) as err:
        parse_responses(b'{"model": "m", "input": "hi", "stream": "yes"}')
    assert err.value.param == "stream"


def test_allowed_tools_are_the_chat_completion_s_allowed_tools_and_the_response_repeats_them() -> None:
    """`tool_choice` of type `allowed_tools` (OpenAI's `ToolChoiceAllowed`): the functions the model
    may call of those `tools` holds, with a mode; as a chat completion's `allowed_tools` choice."""
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "g"}]}
    translated = to_chat({"model": "m", "input": "x", "tool_choice": choice, "tools": [
        {"type": "function", "name": "f"}, {"type": "function", "name": "g"}]}, False)
    assert translated.chat["tool_choice"] == {"type": "allowed_tools", "allowed_tools": {
        "mode": "required", "tools": [{"type": "function", "function": {"name": "g"}}]}}
    response = ResponseShape(RUN, "m", translated.echo).whole(completion({"content": "hi"}))
    validate("Response", response)
    assert response["tool_choice"] == choice


# ---------------------------------------------------------------------------- the whole answer
def shape(**echo: Any) -> ResponseShape:
    base = to_chat({"model": "m", "input": "x", **echo}, False).echo
    return ResponseShape(RUN, "my-model", base, created_at=1_700_000_000)


def completion(message: dict[str, Any], finish: str = "stop") -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "served",
            "choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12,
                      "prompt_tokens_details": {"cached_tokens": 3}}}


def test_a_chat_completion_is_a_response() -> None:
    response = shape(metadata={"t": "1"}).whole(completion({"content": "hello"}))
    validate("Response", response)
    assert response["id"] == "resp_0123456789abcdef0123456789abcdef" and response["model"] == "my-model"
    assert response["status"] == "completed" and response["incomplete_details"] is None
    assert response["output"] == [{"type": "message", "id": f"msg_{RUN[4:]}_0", "role": "assistant",
                                   "status": "completed", "content": [
                                       {"type": "output_text", "text": "hello", "annotations": [], "logprobs": []}]}]
    assert response["usage"] == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 3,
                                                                             "cache_write_tokens": 0},
                                 "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 0},
                                 "total_tokens": 12}
    assert response["metadata"] == {"t": "1"} and response["store"] is False


def test_reasoning_text_and_tool_calls_are_items_in_order_and_a_cut_answer_is_incomplete() -> None:
    response = shape().whole(completion({
        "content": "calling", "reasoning_content": "think",
        "tool_calls": [{"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                       {"type": "function", "function": {"name": "g", "arguments": "{\"a\":1}"}}],
        "function_call": {"name": "f", "arguments": "{}"}}, finish="length"))
    validate("Response", response)
    assert [i["type"] for i in response["output"]] == ["reasoning", "message", "function_call", "function_call"]
    assert response["output"][0]["content"] == [{"type": "reasoning_text", "text": "think"}]
    assert [(c["call_id"], c["name"], c["arguments"]) for c in response["output"][2:]] == [
        ("call_a", "f", "{}"), (f"call_{RUN[4:]}_3", "g", "{\"a\":1}")]
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [i["status"] for i in response["output"]] == ["completed", "completed", "completed", "incomplete"]


def test_two_calls_of_a_whole_answer_with_the_same_id_get_an_id_each() -> None:
    """A caller answers each call by its `call_id`: two calls that share one could not be told
    apart (a stream's second call got an id of its own; a whole answer's kept the provider's)."""
    call = {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    response = shape().whole(completion({"tool_calls": [call, call, {**call, "id": "call_1"}, {**call, "id": {}},
                                                         {**call, "id": ["x"]}]}, "tool_calls"))
    validate("Response", response)
    assert [c["call_id"] for c in response["output"]] == ["call_0", f"call_{RUN[4:]}_1", "call_1",
                                                          f"call_{RUN[4:]}_3", f"call_{RUN[4:]}_4"]


def test_a_cut_answer_s_tool_call_is_incomplete_and_arguments_sent_as_json_are_kept_as_text() -> None:
    """(Found by a hostile review: a whole answer cut at its limit said its tool call `completed`,
    and arguments a server sent as a JSON object were lost.)"""
    response = shape().whole(completion({"tool_calls": [
        {"id": "c1", "function": {"name": "f", "arguments": "{\"a"}},
        {"id": "c2", "function": {"name": "g", "arguments": {"b": [1, 2]}}}]}, finish="length"))
    validate("Response", response)
    assert [(c["status"], c["arguments"]) for c in response["output"]] == [
        ("incomplete", "{\"a"), ("incomplete", '{"b":[1,2]}')]


def test_a_response_s_usage_counts_stay_within_64_bits() -> None:
    """(A hostile review: counts of 2**62 from a provider made a `total_tokens` one past what a 64-bit
    integer holds, which Go's and Java's clients cannot read.)"""
    huge = {"prompt_tokens": 2**62, "completion_tokens": 2**62, "total_tokens": 2**63,
            "prompt_tokens_details": {"cached_tokens": 2**64 - 1}, "completion_tokens_details": {"reasoning_tokens": 7}}
    usage = shape().whole({**completion({"content": "x"}), "usage": huge})["usage"]
    assert usage["input_tokens"] == usage["output_tokens"] == 10**9 and usage["total_tokens"] == 2 * 10**9
    assert usage["input_tokens_details"]["cached_tokens"] == 10**9  # (a part, at most its whole)
    assert usage["output_tokens_details"]["reasoning_tokens"] == 7
    small = shape().whole({**completion({"content": "x"}), "usage": {
        "prompt_tokens": 3, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 9},
        "completion_tokens_details": {"reasoning_tokens": 5}}})["usage"]
    assert small["input_tokens_details"]["cached_tokens"] == 3
    assert small["output_tokens_details"]["reasoning_tokens"] == 2


def test_odd_chat_answers_still_make_a_valid_response() -> None:
    odds: list[Any] = [{}, {"choices": []}, {"choices": [None]}, completion({"content": None, "refusal": "no"}),
                       completion({"content": [{"type": "text", "text": "parts"}]}), {"choices": "x", "usage": 5},
                       *(completion({"content": "x", "tool_calls": odd}) for odd in (5, True, 1.5, "c", {"id": 1}))]
    for odd in odds:
        response = shape().whole(odd)
        validate("Response", response)
        assert response["status"] == "completed"
    refusal = shape().whole(completion({"content": None, "refusal": "no"}))
    assert refusal["output"][0]["content"] == [{"type": "refusal", "refusal": "no"}]


# ---------------------------------------------------------------------------- the stream
def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, usage: dict[str, Any] | None = None,
          ) -> dict[str, Any]:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "served", "choices": choices,
            **({"usage": usage} if usage else {})}


TOOL_STREAM = [
    chunk({"role": "assistant", "content": ""}),
    chunk({"reasoning_content": "hm"}), chunk({"reasoning_content": "m"}),
    chunk({"content": "Let "}), chunk({"content": "me."}),
    chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                           "function": {"name": "f", "arguments": ""}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\":"}}]}),
    chunk({"tool_calls": [{"index": 1, "id": "call_2", "type": "function",
                           "function": {"name": "g", "arguments": "{}"}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),
    chunk({}, finish="tool_calls"),
    chunk(usage={"prompt_tokens": 4, "completion_tokens": 9, "total_tokens": 13}),
]


def parse_sse(data: bytes) -> list[dict[str, Any]]:
    """The events of an SSE text, each checked: its `event:` line names its `type`."""
    events = []
    for block in data.decode().split("\n\n"):
        if not block:
            continue
        kind, payload = block.split("\n")
        event = json.loads(payload.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        events.append(event)
    return events


def play(batches: list[list[Any]], end: ApiError | None = None) -> list[dict[str, Any]]:
    """The events of a stream whose deltas came in `batches`, ended by completion or `end`."""
    out = shape()
    data = b"".join(out.events(batch) for batch in batches) + (out.completed() if end is None else out.failed(end))
    return parse_sse(data)


def accumulated(events: list[dict[str, Any]]) -> Any:
    """The official client's own accumulator fed with the events (it raises on an order it does not
    accept); the Response it built from `response.completed`, if any."""
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=omit, text_format=omit)
    for event in events:
        validate("ResponseStreamEvent", event)
        state.handle_event(EVENTS.validate_python(event))
    return state._completed_response


def test_a_stream_with_reasoning_text_and_two_tool_calls() -> None:
    events = play([TOOL_STREAM])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    final = accumulated(events)
    assert final is not None and final.status == "completed"
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call", "function_call"]
    response = events[-1]["response"]
    assert response["output"][0]["content"] == [{"type": "reasoning_text", "text": "hmm"}]
    assert final.output_text == "Let me."
    assert [(c["call_id"], c["name"], c["arguments"]) for c in response["output"][2:]] == [
        ("call_1", "f", "{\"a\":1}"), ("call_2", "g", "{}")]
    assert response["usage"]["output_tokens"] == 9 and response["usage"]["total_tokens"] == 13
    added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["item"]["id"] for e in events if e["type"] == "response.output_item.done"]
    assert sorted(added) == sorted(done) and len(set(added)) == 4


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(TOOL_STREAM)), max_size=6))
def test_how_the_deltas_are_batched_changes_no_event(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(TOOL_STREAM)]
    batches = [TOOL_STREAM[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]

    def steady(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for e in events:
            e.get("response", {}).pop("completed_at", None)
        return events

    assert steady(play(batches)) == steady(play([TOOL_STREAM]))


def calls_of(events: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    final = accumulated(events)
    assert final is not None
    return [(i.call_id, i.name, i.arguments) for i in final.output if i.type == "function_call"]


def tool(index: int | None = None, call_id: str | None = None, name: str | None = None,
         arguments: Any = None) -> dict[str, Any]:
    call: dict[str, Any] = {"function": {k: v for k, v in (("name", name), ("arguments", arguments)) if v is not None}}
    if index is not None:
        call["index"] = index
    if call_id is not None:
        call["id"] = call_id
    return chunk({"tool_calls": [call]})


def test_tool_calls_without_an_index_are_told_apart_by_their_ids() -> None:
    """Some servers send no `index` (Ollama's, Gemini's), or the same one for every call: two calls
    with ids of their own stay two (a hostile review found them merged, the second call lost)."""
    end = [chunk({}, finish="tool_calls")]
    assert calls_of(play([[tool(None, "c1", "get_weather", '{"city": "Paris"}'),
                           tool(None, "c2", "get_time", '{"tz": "CET"}'), *end]])) == [
        ("c1", "get_weather", '{"city": "Paris"}'), ("c2", "get_time", '{"tz": "CET"}')]
    assert calls_of(play([[tool(0, "c1", "f", '{"a"'), tool(0, "c2", "g", "{}"), tool(0, None, None, ": 1}"),
                           *end]])) == [("c1", "f", '{"a"'), ("c2", "g", "{}: 1}")]  # (the same index: by id)
    # a call's later pieces: by its index, by its id, or with neither, the call written last
    assert calls_of(play([[tool(0, "c1", "f", '{"a"'), tool(None, "c1", None, ": "), tool(0, None, None, "1"),
                           tool(None, None, None, "}"), *end]])) == [("c1", "f", '{"a": 1}')]
    two = chunk({"tool_calls": [{"function": {"name": "f", "arguments": "{}"}},
                                {"function": {"name": "g", "arguments": "{}"}}]})
    assert [c[1:] for c in calls_of(play([[two, *end]]))] == [("f", "{}"), ("g", "{}")]  # (told apart by place)
    # (a review of the change:) a server that gives each piece of one call an id of its own (Poolside's
    # API, an older mlx-openai-server), the function named once: one call, as before
    assert calls_of(play([[tool(0, "x1", "f", '{"a":'), tool(0, "x2", None, "1}"), *end]])) == [("x1", "f", '{"a":1}')]
    # the same id at two indexes: two calls, the second with an id of its own (the client refuses a
    # Response whose two calls share one)
    assert calls_of(play([[tool(0, "c", "f", '{"a":1}'), tool(1, "c", "g", '{"b":2}'), *end]])) == [
        ("c", "f", '{"a":1}'), (f"call_{RUN[4:]}_1", "g", '{"b":2}')]


def open_at_each_add(events: list[dict[str, Any]]) -> list[list[int]]:
    """For each `output_item.added`, the output indexes of the items still open (added, not done)."""
    opened: list[int] = []
    seen = []
    for e in events:
        if e["type"] == "response.output_item.added":
            seen.append(list(opened))
            opened.append(e["output_index"])
        elif e["type"] == "response.output_item.done":
            opened.remove(e["output_index"])
    return seen


def test_each_streamed_call_is_done_before_the_next_item_is_added() -> None:
    """As OpenAI's stream has it (found by a caller's audit: every call stayed open until the end,
    so a reader of the events that takes an item added for the one before it done was wrong)."""
    end = [chunk({}, finish="tool_calls")]
    calls = [tool(0, "c1", "f", ""), tool(0, None, None, '{"a":'), tool(0, None, None, " 1}"),
             tool(1, "c2", "g", '{"b"'), tool(1, None, None, ": 2}"), chunk({"content": "done"})]
    events = play([calls + end])
    assert open_at_each_add(events) == [[], [], []]
    assert calls_of(events) == [("c1", "f", '{"a": 1}'), ("c2", "g", '{"b": 2}')]
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [(e["output_index"], e["item"]["status"]) for e in done] == [(0, "completed"), (1, "completed"),
                                                                        (2, "completed")]
    # a call whose arguments are not whole when the next begins (a server that interleaves them)
    # stays open to the end, and gets the rest
    assert open_at_each_add(play([TOOL_STREAM])) == [[], [], [], [2]]
    # what comes for a call after its arguments were whole is kept in the Response, not lost
    late = play([[tool(0, "c1", "f", "{}"), tool(1, "c2", "g", "{}"), tool(0, None, None, " "), *end]])
    assert open_at_each_add(late) == [[], []]
    assert calls_of(late) == [("c1", "f", "{} "), ("c2", "g", "{}")]


def test_a_call_s_arguments_are_parsed_a_few_times_at_most(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that sends a call a byte at a time with a new call between each (a hostile one):
    the first call's arguments are looked at `_LOOKS` times, not once a piece (each look parses
    them all: that was quadratic)."""
    looked: list[str] = []
    whole = responses_output._whole_json

    def counted(text: str) -> bool:
        looked.append(text)
        return whole(text)

    monkeypatch.setattr(responses_output, "_whole_json", counted)
    pieces = [p for i in range(200) for p in (tool(0, None, None, "{" if i == 0 else " "), tool(i + 1, f"c{i}", "g"))]
    events = play([[tool(0, "c", "f"), *pieces, chunk({}, finish="tool_calls")]])
    assert len(calls_of(events)) == 201
    assert sum(text.startswith("{") for text in looked) == responses_output._LOOKS


class CountedCalls(dict[Any, Any]):
    """A ResponseShape's calls, counting each call a walk over them passes."""

    passed = 0

    def values(self) -> Any:
        for value in super().values():
            CountedCalls.passed += 1
            yield value


def test_a_new_call_does_not_walk_every_call_before_it() -> None:
    """Each new call walked every call before it, to close those whose arguments were whole: a
    provider's 60,000 calls (9 MB) took 30 s of the gateway's CPU, every caller waiting (a hostile
    provider). Only the calls that grew since the last new one are looked at now."""
    out = shape()
    out._calls = CountedCalls()
    n = responses_output.MAX_OUTPUT_ITEMS  # (a Response's most)
    calls = [tool(i, f"c{i}", "f", "{") for i in range(n)]  # (never whole: each stays open to the end)
    data = out.events(calls) + out.completed()
    assert len(calls_of(parse_sse(data))) == n
    assert CountedCalls.passed <= 2 * n  # (the end walks them once; each new call walked all: n * n / 2)


def test_odd_streamed_chunks_still_make_valid_events_and_keep_what_they_hold() -> None:
    """(Found by a hostile review: a `tool_calls` of `5` made the gateway fail mid-stream, arguments
    sent as JSON were lost, content sent as text parts was lost, and an empty answer had no message
    where a whole one has one.)"""
    events = play([[chunk({"content": "first ", "tool_calls": 5}), chunk({"tool_calls": True}),
                    chunk({"content": [{"type": "text", "text": "second"}], "reasoning_content": [{"text": "r"}]}),
                    tool(0, "c1", "f", {"a": 1}), chunk({}, finish="tool_calls")]])
    final = accumulated(events)
    assert final is not None and final.output_text == "first second"
    assert calls_of(events) == [("c1", "f", '{"a":1}')]
    assert [i.type for i in final.output] == ["message", "reasoning", "message", "function_call"]
    empty = play([[chunk({"role": "assistant", "content": ""}), chunk({}, finish="stop")]])
    whole = shape().whole(completion({"content": ""}))
    assert accumulated(empty) is not None
    assert empty[-1]["response"]["output"] == whole["output"]


CHUNK_VALUE: st.SearchStrategy[Any] = SAFE_JSON | st.sampled_from([5, True, "x", [], {}, None])
TOOL_PIECE = st.fixed_dictionaries({}, optional={
    "index": st.integers(-1, 3) | CHUNK_VALUE, "id": st.sampled_from(["c1", "c2", ""]) | CHUNK_VALUE,
    "function": st.fixed_dictionaries({}, optional={"name": st.sampled_from(["f", "g"]) | CHUNK_VALUE,
                                                    "arguments": SAFE_TEXT | CHUNK_VALUE}) | CHUNK_VALUE})
DELTA = st.fixed_dictionaries({}, optional={
    "content": SAFE_TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": SAFE_TEXT}), max_size=2)
    | CHUNK_VALUE, "reasoning_content": SAFE_TEXT | CHUNK_VALUE, "refusal": SAFE_TEXT | CHUNK_VALUE,
    "tool_calls": st.lists(TOOL_PIECE | CHUNK_VALUE, max_size=3) | CHUNK_VALUE,
    "function_call": st.fixed_dictionaries({"name": SAFE_TEXT, "arguments": SAFE_TEXT}) | CHUNK_VALUE})
CHUNK = st.builds(lambda delta, finish: chunk(delta, finish), DELTA,
                  st.none() | st.sampled_from(["stop", "length", "tool_calls", "content_filter", "other"]))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(CHUNK, max_size=4), max_size=4), st.booleans())
def test_any_stream_of_chunks_makes_events_the_schema_and_the_client_take(batches: list[list[Any]],
                                                                          fails: bool) -> None:
    end = ApiError(ErrorCode.PROVIDER_ERROR, "provider a answered 500: boom") if fails else None
    events = play(batches, end)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    accumulated(events)  # (each event checked against the schema, and taken by the client's accumulator)
    validate("Response", events[-1]["response"])


def test_a_stream_cut_at_its_limit_ends_incomplete() -> None:
    events = play([[chunk({"content": "a"}), chunk({"content": "b"}, finish="length")]])
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    for event in events:
        validate("ResponseStreamEvent", event)


def test_a_failed_run_ends_the_stream_with_error_and_response_failed() -> None:
    broke = ApiError(ErrorCode.PROVIDER_ERROR, "provider a answered 500: boom")
    events = play([[chunk({"content": "par"})], [chunk({"content": "tial"})]], end=broke)
    assert [e["type"] for e in events[-4:]] == ["response.content_part.done", "response.output_item.done", "error",
                                                "response.failed"]
    assert events[-2] == {"type": "error", "code": "provider_error", "message": "provider a answered 500: boom",
                          "param": None, "sequence_number": events[-2]["sequence_number"]}
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {"code": "server_error",
                                                                "message": "provider a answered 500: boom"}
    assert failed["output"][0]["status"] == "incomplete" and failed["output"][0]["content"][0]["text"] == "partial"
    assert accumulated(events) is None  # (no response.completed: the client's helper says so)

    # before any output (the gateway gave up on a queued run whose stream had sent keep-alives)
    early = play([], end=ApiError(ErrorCode.RATE_LIMIT_EXCEEDED, "slow down"))
    assert [e["type"] for e in early] == ["response.created", "response.in_progress", "error", "response.failed"]
    assert early[-1]["response"]["error"]["code"] == "rate_limit_exceeded"
    accumulated(early)


# ---------------------------------------------------------------------------- any body
PART = st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "refusal", "input_image",
                                                       "input_file", "input_audio", "other"])},
                             optional={"text": SAFE_TEXT | ANY_JSON, "refusal": SAFE_TEXT, "image_url": SAFE_TEXT,
                                       "file_data": SAFE_TEXT, "file_id": SAFE_TEXT, "input_audio": SAFE_JSON})
ITEM = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "item_reference",
                             "web_search_call"]) | ANY_JSON,
    "role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]) | ANY_JSON,
    "content": SAFE_TEXT | st.lists(PART, max_size=3) | ANY_JSON, "call_id": SAFE_TEXT | ANY_JSON,
    "name": SAFE_TEXT, "arguments": SAFE_TEXT, "output": SAFE_TEXT | st.lists(PART, max_size=2)})
TOOL = st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search"]) | ANY_JSON},
                             optional={"name": SAFE_TEXT | ANY_JSON, "parameters": SAFE_JSON, "strict": ANY_JSON})
RESPONSES_BODY = st.fixed_dictionaries(
    {"model": st.just("m"), "input": SAFE_TEXT | st.lists(ITEM, max_size=4) | ANY_JSON},
    optional={"instructions": SAFE_TEXT | ANY_JSON, "tools": st.lists(TOOL, max_size=2) | ANY_JSON,
              "tool_choice": st.sampled_from(["auto", "none", "required"]) | ANY_JSON,
              "max_output_tokens": SAFE_INTS | ANY_JSON, "text": SAFE_JSON, "reasoning": SAFE_JSON,
              "stream": st.booleans() | ANY_JSON, "metadata": SAFE_JSON, "truncation": ANY_JSON,
              "previous_response_id": ANY_JSON, "background": ANY_JSON, "top_logprobs": ANY_JSON,
              "temperature": st.floats(0, 2), "safety_identifier": SAFE_TEXT | ANY_JSON})


def test_a_safety_identifier_of_64_characters_is_repeated_in_a_response_the_schema_holds() -> None:
    echo = to_chat({"model": "m", "input": "x", "safety_identifier": "u" * 64}, False).echo
    assert echo["safety_identifier"] == "u" * 64
    validate("Response", ResponseShape(RUN, "m", echo).whole({}))


@given(RESPONSES_BODY | st.builds(_splice, RESPONSES_BODY, ODD_VALUES).map(lambda raw: raw.decode("utf-8", "replace")))
@settings(max_examples=400)
def test_any_responses_body_is_a_chat_run_or_a_400(drawn: dict[str, Any] | str) -> None:
    raw = drawn.encode("utf-8", "surrogatepass") if isinstance(drawn, str) else json.dumps(drawn).encode()
    parsed = parsed_or_400(lambda: parse_responses(raw))
    if parsed is None:
        return
    assert parsed.kind is RunKind.CHAT and parsed.packed is not None and unpack(parsed.packed) == parsed.body
    assert parsed.body["messages"] and all(isinstance(m, dict) for m in parsed.body["messages"])
    assert parsed.echo is not None
    validate("Response", ResponseShape(RUN, "m", parsed.echo).whole({}))


@pytest.mark.parametrize("arguments", ['{"a": 1}', '{"a": '])
def test_a_response_cut_at_its_limit_has_the_same_item_statuses_whole_or_streamed(arguments: str) -> None:
    """The item being written when the output was cut is incomplete, and so is a call whose
    arguments are not whole; those before it are whole (a stream ended them `completed` as the next
    began; a whole Response made every item incomplete, so a caller that runs only completed calls
    acted on a streamed answer and not on the same answer whole)."""
    calls = [{"id": "call_a", "type": "function", "function": {"name": "f", "arguments": arguments}},
             {"id": "call_b", "type": "function", "function": {"name": "g", "arguments": '{"b": '}}]
    whole = shape().whole(completion({"reasoning_content": "think", "content": "calling", "tool_calls": calls},
                                     finish="length"))
    validate("Response", whole)
    streamed = play([[chunk({"reasoning_content": "think"}), chunk({"content": "calling"}),
                      chunk({"tool_calls": [{"index": 0, **calls[0]}]}),
                      chunk({"tool_calls": [{"index": 1, **calls[1]}]}, finish="length")]])[-1]["response"]
    statuses = [(i["type"], i["status"]) for i in whole["output"]]
    assert statuses == [(i["type"], i["status"]) for i in streamed["output"]]
    assert statuses == [("reasoning", "completed"), ("message", "completed"),
                        ("function_call", "completed" if arguments == '{"a": 1}' else "incomplete"),
                        ("function_call", "incomplete")]


# ---------------------------------------------------------------------------- joins stay linear
def _pairwise(before: str, after: str, between: str = "\n\n") -> str:
    """Two texts joined as iop joins them (`between` where neither has a space at the join)."""
    if before and after and not before[-1].isspace() and not after[0].isspace():
        return before + between + after
    return before + after


def _copied(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The characters each pairwise join of texts copied, had they been joined pair by pair (the
    gateway's `_joined`, before `joined_all`, made a new string of all the text so far each time)."""
    from gateway import responses_request
    copied: list[int] = []

    def counting(before: str, after: str, between: str = "\n\n") -> str:
        copied.append(len(before) + len(after))
        return _pairwise(before, after, between)

    monkeypatch.setattr(responses_request, "_joined", counting, raising=False)
    return copied


def test_a_message_of_many_text_parts_is_joined_once_not_part_by_part(monkeypatch: pytest.MonkeyPatch) -> None:
    """19,000 text parts of 400 characters (a 7.9 MiB body, within every limit) held the gateway's one
    thread for 10.7 s: each part was joined to all the text before it, copying it again (quadratic),
    while every other caller, /healthz too, waited. The text is the same, copied a bounded number of times."""
    copied = _copied(monkeypatch)
    parts = [{"type": "input_text", "text": t} for t in ["a", " b", "c", "", "d ", "e", "x" * 400] * 300]
    content = chat_of({"input": [{"role": "user", "content": parts}]})["messages"][0]["content"]
    expected = ""
    for p in parts:
        expected = (expected + "\n" + p["text"] if expected and p["text"] and not expected[-1].isspace()
                    and not p["text"][0].isspace() else expected + p["text"])
    assert content == expected
    assert sum(copied) <= 4 * len(expected), f"{sum(copied)} characters copied for {len(expected)}"


def test_an_assistants_many_texts_after_its_calls_are_joined_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same for an assistant's texts after its function calls, which join their message."""
    copied = _copied(monkeypatch)
    texts = ["I'll look.", " ok", "One moment.", "x" * 400] * 300
    items: list[dict[str, Any]] = [{"role": "user", "content": "hi"},
                                   {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]
    items += [{"role": "assistant", "content": t} for t in texts]
    items.append({"type": "function_call_output", "call_id": "c", "output": "done"})
    messages = chat_of({"input": items})["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    expected = ""
    for t in texts:
        expected = (expected + "\n\n" + t if expected and t and not expected[-1].isspace() and not t[0].isspace()
                    else expected + t)
    assert messages[1]["content"] == expected
    assert sum(copied) <= 4 * len(expected), f"{sum(copied)} characters copied for {len(expected)}"


@given(st.lists(st.text(alphabet=" \nab", max_size=4), max_size=8), st.sampled_from(["\n", "\n\n"]))
def test_joining_all_texts_at_once_is_joining_them_pair_by_pair(texts: list[str], between: str) -> None:
    from gateway.responses_request import joined_all
    pairwise = ""
    for t in texts:
        pairwise = _pairwise(pairwise, t, between)
    assert joined_all(texts, between) == pairwise


def test_pieces_of_a_call_after_it_was_done_are_joined_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call done before the stream's end (its arguments whole when the next call began) that gets
    more pieces keeps them in the Response; each piece was added to all the arguments before it
    (a copy of them all each time): 60,000 pieces of 100 bytes from a provider held the gateway's
    thread 15.5 s in all, 30,000 3.4 s. They are the same, and the arguments are written once."""
    rewrites: list[int] = []

    class Counting(dict[str, Any]):
        def __setitem__(self, key: str, value: Any) -> None:
            if key == "arguments":
                rewrites.append(len(value))
            super().__setitem__(key, value)

    made = ResponseShape._call_item
    monkeypatch.setattr(ResponseShape, "_call_item", lambda self, *a, **k: Counting(made(self, *a, **k)))
    first = {"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    second = {"index": 1, "id": "call_b", "type": "function", "function": {"name": "g", "arguments": "{}"}}
    late = [chunk({"tool_calls": [{"index": 0, "function": {"arguments": f"x{i}"}}]}) for i in range(500)]
    events = play([[chunk({"tool_calls": [first]}), chunk({"tool_calls": [second]}), *late]])
    final = events[-1]["response"]
    validate("Response", final)
    assert final["output"][0]["arguments"] == "{}" + "".join(f"x{i}" for i in range(500))
    assert final["output"][1]["arguments"] == "{}"
    assert len(rewrites) <= 6, f"the arguments were written {len(rewrites)} times"


def test_a_response_holds_at_most_max_output_items(monkeypatch: pytest.MonkeyPatch) -> None:
    """A provider's answer of many items (every chunk reasoning and text, each a new item; 150,000 tool
    calls) grew the Response and its events without a bound: it is the provider's output_too_large
    past `MAX_OUTPUT_ITEMS`. A stream's events of the items it holds come before the error."""
    monkeypatch.setattr(responses_output, "MAX_OUTPUT_ITEMS", 4)
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in range(4)]
    assert len(shape().whole(completion({"content": None, "tool_calls": calls}))["output"]) == 4
    with pytest.raises(responses_output.TooManyItems) as whole:
        shape().whole(completion({"content": "x", "tool_calls": calls}))
    error = whole.value.error
    assert error.code is ErrorCode.OUTPUT_TOO_LARGE and "more than 4 output items" in error.message
    assert error.headers == {"x-should-retry": "false"}  # (as the worker's own output_too_large says it)
    streamed = shape(stream=True)
    alternating = [chunk({"reasoning_content": "a", "content": "b"}) for _ in range(3)]
    with pytest.raises(responses_output.TooManyItems) as cut:
        streamed.events(alternating)
    events = [json.loads(block.split(b"data: ", 1)[1]) for block in cut.value.before.split(b"\n\n") if block]
    assert sum(e["type"] == "response.output_item.added" for e in events) == 4
    ended = [json.loads(block.split(b"data: ", 1)[1])
             for block in streamed.failed(cut.value.error).split(b"\n\n") if block]
    assert [e["type"] for e in ended][-2:] == ["error", "response.failed"]
    for event in events + ended:
        EVENTS.validate_python(event)
    assert len(ended[-1]["response"]["output"]) == 4


@pytest.mark.parametrize("index", [5, -1, 2**63 + 1])
def test_a_stream_whose_one_choice_is_not_numbered_0_keeps_its_text(index: int) -> None:
    """A provider that streamed its one choice as index 5 had its text dropped: the Response completed
    with an empty message (a hostile-provider review, real processes). The first choice a chunk gives is
    the Response's; another after it is not."""
    def at(delta: dict[str, Any], said: int, finish: str | None = None) -> dict[str, Any]:
        made = chunk(delta, finish)
        made["choices"][0]["index"] = said
        return made

    events = play([[at({"role": "assistant", "content": "he"}, index), at({"content": "llo"}, index),
                    at({"content": "other"}, index + 1), at({}, index, finish="stop")]])
    final = accumulated(events)
    assert final is not None and final.output_text == "hello"
