"""Where each field of a Responses request's chat completion run came from, so that an error
about the run names the field its caller wrote (`input[0].content[1]`, `text.format`), not the
chat completion's (`messages[1].content[1]`, `response_format`), which the caller never sent.
Pure."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

#: a chat completion's field -> the Responses request's field it came from
_FIELDS = {"response_format": "text.format"}
_MESSAGE = re.compile(r"messages\[(\d+)\](.*)", re.S)
_CALL = re.compile(r"\.tool_calls(?:\[(\d+)\](?:\.function)?(.*))?", re.S)
_TOOL = re.compile(r"tools\[(\d+)\]\.function(.*)", re.S)
#: a field of a chat tool call -> the function_call item's
_CALL_FIELDS = {".id": ".call_id"}


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a chat message of the run came from."""

    #: the request's field or input item: `instructions`, `input` (a string), `input[3]`
    path: str
    #: the function_call items its `tool_calls` came from, in order
    calls: list[str] = field(default_factory=list)
    #: a tool message: its content is the item's `output`, its `tool_call_id` the item's `call_id`
    output: bool = False


def caller_param(param: str, origins: Sequence[Origin]) -> str:
    """`param`, a field of the chat completion run (an adapter's or a capability's refusal names
    it), as the Responses request named it; `origins`: each chat message's."""
    if param in _FIELDS:
        return _FIELDS[param]
    tool = _TOOL.fullmatch(param)
    if tool is not None:  # (a Response's function tool is flat: no `function` object)
        return f"tools[{tool[1]}]{tool[2]}"
    message = _MESSAGE.fullmatch(param)
    if message is None:
        return param
    k, rest = int(message[1]), message[2]
    if k >= len(origins):
        return "input"
    origin = origins[k]
    call = _CALL.fullmatch(rest)
    if call is not None and origin.calls:
        j = int(call[1]) if call[1] is not None else 0
        if call[1] is None or j >= len(origin.calls):
            return origin.calls[0]
        return origin.calls[j] + _CALL_FIELDS.get(call[2], call[2])
    if origin.output and rest.startswith(".content"):
        return f"{origin.path}.output{rest.removeprefix('.content')}"
    if origin.output and rest == ".tool_call_id":
        return f"{origin.path}.call_id"
    if origin.path in ("instructions", "input"):  # (a string: its message has no other field)
        return origin.path
    return origin.path + rest
