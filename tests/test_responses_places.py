"""A field of a Responses request's chat completion run named as the caller wrote it
(`gateway.responses_places`): pure."""

from __future__ import annotations

import pytest

from gateway.responses_places import caller_param
from gateway.responses_request import to_chat

CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
CALL_2 = {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"}
OUTPUT = {"type": "function_call_output", "call_id": "c1", "output": "r"}
#: instructions, then: input[0] a user's, input[1] a reasoning item (left out), input[2] an assistant's
#: text, input[3] and input[4] its calls, input[5] an assistant's text that joins their message, input[6]
#: a call's output, input[7] a user's with an image
BODY = {"model": "m", "instructions": "be brief", "input": [
    {"role": "user", "content": "q"}, {"type": "reasoning", "summary": []},
    {"role": "assistant", "content": "let me look"}, CALL, CALL_2, {"role": "assistant", "content": "and more"},
    OUTPUT, {"type": "function_call_output", "call_id": "c2", "output": "s"},
    {"role": "user", "content": [{"type": "input_text", "text": "this"},
                                 {"type": "input_image", "image_url": "https://x/a.png"}]}]}


@pytest.mark.parametrize(("chat_param", "param"), [
    ("messages[0].content", "instructions"),
    ("messages[1].content", "input[0].content"),
    ("messages[2].content", "input[2].content"),
    ("messages[2].tool_calls", "input[3]"),
    ("messages[2].tool_calls[1].function.arguments", "input[4].arguments"),
    ("messages[2].tool_calls[0].id", "input[3].call_id"),
    ("messages[2].tool_calls[9]", "input[3]"),
    ("messages[3].content", "input[6].output"),
    ("messages[3].tool_call_id", "input[6].call_id"),
    ("messages[4]", "input[7]"),
    ("messages[5].content[1].image_url", "input[8].content[1].image_url"),
    ("messages[40]", "input"),
    ("response_format", "text.format"),
    ("tools[1].function.parameters", "tools[1].parameters"),
    ("n", "n"), ("stop", "stop"), ("model", "model"),
])
def test_a_field_of_the_chat_run_is_named_as_the_request_wrote_it(chat_param: str, param: str) -> None:
    translated = to_chat(BODY, False)
    assert [m["role"] for m in translated.chat["messages"]] == ["system", "user", "assistant", "tool", "tool", "user"]
    assert caller_param(chat_param, translated.origins) == param


def test_a_string_input_is_named_input() -> None:
    assert caller_param("messages[0].content", to_chat({"model": "m", "input": "hi"}, False).origins) == "input"
    origins = to_chat({"model": "m", "input": [CALL, OUTPUT, {"role": "user", "content": "go"}]}, False).origins
    assert caller_param("messages[0].tool_calls", origins) == "input[0]"
    assert caller_param("messages[2].content", origins) == "input[2].content"


def test_a_refusal_that_ends_a_stream_names_the_field_as_the_request_wrote_it() -> None:
    """A worker's refusal names its chat completion run's field; a Response's stream ends with it
    named as the caller wrote it (a whole answer's, by the same `own_names`)."""
    import json

    from common.api_error import ApiError
    from common.wire import ErrorCode
    from gateway.responses_output import ResponseShape

    translated = to_chat(BODY, True)
    shape = ResponseShape("run_" + "0" * 32, "m", translated.echo, origins=translated.origins)
    error = ApiError(ErrorCode.INVALID_REQUEST, "too deep", status=400, detail={
        "message": "too deep", "type": "invalid_request_error",
        "param": "messages[2].tool_calls[1].function.arguments", "code": None})
    events = [json.loads(line.removeprefix(b"data: ")) for line in shape.failed(error).splitlines()
              if line.startswith(b"data: ")]
    assert [e["param"] for e in events if e["type"] == "error"] == ["input[4].arguments"]
