"""OpenAI's Responses API (`POST /v1/responses`) as a chat completion run. Pure: a request body
in, the chat completion body every provider type takes and the fields the answer repeats out,
or the caller's 400 naming the field at fault.

iop keeps no conversation state, so what needs it is refused (`previous_response_id`,
`conversation`, `item_reference` items, stored `prompt` templates, `background`); the caller sends
the whole conversation in `input`, as it does to a chat completion. Only function tools are taken
(the built-in ones, web search and the like, run inside OpenAI). Reasoning items a caller sends
back are left out (a chat completion has no place for them). Any field this module does not know
goes to the provider as it came, as on every other route (`extra_body={"top_k": 20}`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.choices import whole_within
from common.shown import quoted
from gateway.errors import invalid
from gateway.responses_places import Origin

#: Fields of a Responses request turned into chat completion fields (or refused, or only repeated
#: in the answer); every other field goes to the provider as it came.
_TRANSLATED = frozenset({
    "input", "instructions", "tools", "tool_choice", "max_output_tokens", "text", "reasoning", "stream",
    "stream_options", "previous_response_id", "conversation", "prompt", "background", "store", "include",
    "metadata", "truncation", "top_logprobs", "service_tier", "max_tool_calls", "prompt_cache_key",
    "safety_identifier", "context_management", "prompt_cache_retention",
})
#: Fields that need state iop does not keep, and what to do instead.
_STATEFUL = {
    "previous_response_id": "iop keeps no responses: send the whole conversation in 'input'",
    "conversation": "iop keeps no conversations: send the whole conversation in 'input'",
    "prompt": "iop keeps no prompt templates: send the prompt in 'instructions' and 'input'",
}
#: fields a Response always has, null or not (OpenAI's schema); the others only when given
_ALWAYS_SAID = frozenset({"instructions", "temperature", "top_p"})
#: text fields that are only repeated in the Response, as given (never sent: not every server takes them)
_REPEATED_TEXT = ("user", "safety_identifier", "prompt_cache_key")
#: the longest of them OpenAI takes (and its schema holds a Response to), in characters
_TEXT_LIMITS = {"safety_identifier": 64}
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TOOL_CHOICES = ("none", "auto", "required")
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_SUMMARIES = ("auto", "concise", "detailed")
_VERBOSITY = ("low", "medium", "high")
#: the `include` item that asks for the output's log probabilities (refused, as `top_logprobs` is)
_LOGPROBS = "message.output_text.logprobs"


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A Responses request as iop runs it."""

    #: the chat completion body the run carries (the model, `stream` and every field passed through)
    chat: dict[str, Any]
    #: the request's fields that the Response repeats (`instructions`, `tools`, `metadata`…)
    echo: dict[str, Any]
    #: where each of the chat's messages came from (an error about one names the caller's field)
    origins: tuple[Origin, ...] = ()


def _text(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise invalid(f"'{path}' must be a string", path)
    return value


def _object(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise invalid(f"'{path}' must be an object", path)
    return value


def _part(part: Any, path: str) -> dict[str, Any]:
    """A content part of a message as a chat completion's content part."""
    part = _object(part, path)
    kind = part.get("type")
    if kind in ("input_text", "output_text"):
        return {"type": "text", "text": _text(part.get("text"), f"{path}.text")}
    if kind == "refusal":
        return {"type": "text", "text": _text(part.get("refusal"), f"{path}.refusal")}
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str) or not url:
            raise invalid(f"'{path}.image_url' must be the image's URL or data URL (iop keeps no files, so "
                          "'file_id' cannot name one)", f"{path}.image_url")
        image: dict[str, Any] = {"url": url}
        if isinstance(part.get("detail"), str):
            image["detail"] = part["detail"]
        return {"type": "image_url", "image_url": image}
    if kind == "input_file":
        data = part.get("file_data")
        if not isinstance(data, str) or not data:
            raise invalid(f"'{path}.file_data' must hold the file (iop keeps no files and fetches none, so "
                          "'file_id' and 'file_url' cannot name one)", f"{path}.file_data")
        file = {"file_data": data}
        if isinstance(part.get("filename"), str):
            file["filename"] = part["filename"]
        return {"type": "file", "file": file}
    if kind == "input_audio":
        return {"type": "input_audio", "input_audio": _object(part.get("input_audio"), f"{path}.input_audio")}
    raise invalid(f"'{path}.type' must be one of input_text, output_text, refusal, input_image, input_file or "
                  f"input_audio", f"{path}.type")


def _content(content: Any, path: str) -> str | list[dict[str, Any]]:
    """A message's content as a chat message's: text as text (what every server takes), else parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"'{path}' must be a string or an array of content parts", path)
    parts = [_part(p, f"{path}[{i}]") for i, p in enumerate(content)]
    if all(p["type"] == "text" for p in parts):
        # (a line break where neither part has a space at the join, as vLLM joins them: "Summarize
        # this:" and "The quick brown fox" reached the model as "...this:The quick...")
        return joined_all([p["text"] for p in parts], "\n")
    return parts


def _output_text(output: Any, path: str) -> str:
    """A function call's output (text, or text parts) as a tool message's text."""
    if isinstance(output, str):
        return output
    content = _content(output, path)
    if not isinstance(content, str):
        raise invalid(f"'{path}' must be text (a tool's result reaches the model as text)", path)
    return content


def _tool_call(item: dict[str, Any], path: str) -> dict[str, Any]:
    return {"id": _text(item.get("call_id"), f"{path}.call_id"), "type": "function",
            "function": {"name": _text(item.get("name"), f"{path}.name"),
                         "arguments": _text(item.get("arguments"), f"{path}.arguments")}}


def joined_all(texts: list[str], between: str) -> str:
    """Texts as one: `between` (a line break, a blank line) between two where neither has a space at
    the join (two messages' texts, "I'll look." and "One moment.", were "I'll look.One moment."); as
    they are where one has (iop's own Responses stream splits one answer's text at its calls, "Let me
    check. " and "One moment.": its text is sent back as the model wrote it). In one pass: joined pair
    by pair, each text copied all the text before it again (19,000 parts of a 7.9 MiB body held the
    gateway's thread for 10.7 s)."""
    pieces: list[str] = []
    last = ""  # (the last text that was not empty: the text so far ends with it)
    for text in texts:
        if not text:
            continue
        if last and not last[-1].isspace() and not text[0].isspace():
            pieces.append(between)
        pieces.append(text)
        last = text
    return "".join(pieces)


def _messages(value: Any) -> tuple[list[dict[str, Any]], list[Origin]]:
    """`input` as chat messages: a string is one user message; items become messages, a function
    call joins the assistant message before it (or starts one), its output a tool message. An
    assistant's text after its function calls joins their message (a Response's output may hold a
    call before the text of the same answer: sent back, a message then stood between the calls
    and their results, a conversation that chat servers refuse), as `joined_all` joins them. With
    the messages, where each came from."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}], [Origin("input")]
    if value is None:  # (OpenAI's may come from a stored prompt or conversation; iop keeps none)
        raise invalid("'input' is required: iop keeps no prompts, conversations or responses, so the request "
                      "carries what the model answers", "input")
    if not isinstance(value, list) or not value:
        raise invalid("'input' must be a string or a non-empty array of items", "input")
    messages: list[dict[str, Any]] = []
    origins: list[Origin] = []
    calls: set[str] = set()  # (the call ids of the function calls so far)
    #: an assistant message's texts after its calls, by the message's place: joined once at the end
    texts: dict[int, list[str]] = {}
    for i, raw in enumerate(value):
        path = f"input[{i}]"
        item = _object(raw, path)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in _ROLES:
                raise invalid(f"'{path}.role' must be one of user, assistant, system or developer", f"{path}.role")
            message = {"role": _ROLES[role], "content": _content(item.get("content"), f"{path}.content")}
            last = messages[-1] if messages else None
            if (message["role"] == "assistant" and last is not None and last.get("tool_calls")
                    and isinstance(last["content"], str) and isinstance(message["content"], str)):
                # (its calls' results come after it, not after this; two texts stay apart: `joined_all`)
                texts.setdefault(len(messages) - 1, [last["content"]]).append(message["content"])
            else:
                messages.append(message)
                origins.append(Origin(path))
        elif kind == "function_call":
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}  # (text: llama-cpp-python refuses a null)
                messages.append(last)
                origins.append(Origin(path))
            origins[-1].calls.append(path)
            call = _tool_call(item, path)
            calls.add(call["id"])
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id = _text(item.get("call_id"), f"{path}.call_id")
            if call_id not in calls:  # (OpenAI's 400 too; a server's own would name no item)
                raise invalid(f"'{path}': no function call before it has the call_id {quoted(call_id)}: send the "
                              "function_call item with its output", f"{path}.call_id")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": _output_text(item.get("output"), f"{path}.output")})
            origins.append(Origin(path, output=True))
        elif kind == "reasoning":
            continue  # (a chat completion has no place for it; the model reasons anew)
        elif kind == "item_reference":
            raise invalid(f"'{path}': iop keeps no items, so none can be referred to: send the item itself", path)
        else:
            shown = quoted(kind) if isinstance(kind, str) else "missing" if kind is None else "not text"
            raise invalid(f"'{path}.type' ({shown}) is not taken: iop takes message, function_call, "
                          "function_call_output and reasoning items", f"{path}.type")
    for place, said in texts.items():
        messages[place]["content"] = joined_all(said, "\n\n")
    if not any(m["role"] != "system" for m in messages):
        raise invalid("'input' holds no message for the model to answer", "input")
    return messages, origins


def _tools(value: Any) -> list[dict[str, Any]]:
    """The function tools, as the Response repeats them (`parameters` and `strict` always said)."""
    if not isinstance(value, list):
        raise invalid("'tools' must be an array", "tools")
    tools = []
    for i, raw in enumerate(value):
        tool = _object(raw, f"tools[{i}]")
        if tool.get("type") != "function":
            raise invalid(f"'tools[{i}].type' must be 'function': iop takes function tools only, not custom "
                          "(free-form) tools, nor the tools OpenAI runs itself (web search and the like)",
                          f"tools[{i}].type")
        parameters = tool.get("parameters")
        if parameters is not None:
            _object(parameters, f"tools[{i}].parameters")
        function = {"type": "function", "name": _text(tool.get("name"), f"tools[{i}].name"),
                    "parameters": parameters, "strict": _flag(tool.get("strict"), f"tools[{i}].strict")}
        if tool.get("description") is not None:
            function["description"] = _text(tool["description"], f"tools[{i}].description")
        tools.append(function)
    return tools


def _flag(value: Any, path: str) -> bool | None:
    """A field that is a boolean or null (a Response repeats it: OpenAI's schema says so)."""
    if value is not None and not isinstance(value, bool):
        raise invalid(f"'{path}' must be a boolean", path)
    return value


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type" and v is not None}}


def _tool_choice(value: Any) -> str | dict[str, Any]:
    """The tool choice as the Response repeats it: a mode, one function, or the functions the model
    may call (`allowed_tools`: their names, with a mode)."""
    if value in _TOOL_CHOICES:
        return str(value)
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "name": _text(value.get("name"), "tool_choice.name")}
    if isinstance(value, dict) and value.get("type") == "allowed_tools":
        mode = value.get("mode")
        if mode not in ("auto", "required"):
            raise invalid("'tool_choice.mode' must be auto or required", "tool_choice.mode")
        listed = value.get("tools")
        if not isinstance(listed, list):
            raise invalid("'tool_choice.tools' must be a list of tools", "tool_choice.tools")
        named = []
        for i, tool in enumerate(listed):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                raise invalid("only function tools are supported", f"tool_choice.tools[{i}]")
            named.append({"type": "function", "name": _text(tool.get("name"), f"tool_choice.tools[{i}].name")})
        return {"type": "allowed_tools", "mode": mode, "tools": named}
    raise invalid("'tool_choice' must be none, auto, required, {\"type\": \"function\", \"name\": …} or "
                  "{\"type\": \"allowed_tools\", …}", "tool_choice")


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    """A Response's tool choice (`_tool_choice`) as a chat completion's."""
    if isinstance(choice, str):
        return choice
    if choice["type"] == "function":
        return {"type": "function", "function": {"name": choice["name"]}}
    return {"type": "allowed_tools", "allowed_tools": {"mode": choice["mode"], "tools": [
        {"type": "function", "function": {"name": t["name"]}} for t in choice["tools"]]}}


def _one_of(value: Any, choices: tuple[str, ...], path: str) -> Any:
    """`value` if it is null or one of `choices`; else the caller's 400."""
    if value is not None and value not in choices:
        raise invalid(f"'{path}' must be one of {', '.join(choices)}", path)
    return value


def _text_options(text: Any, chat: dict[str, Any]) -> dict[str, Any]:
    """`text`: its `format` as the chat completion's `response_format` (none for plain text), and
    the `text` the Response repeats."""
    text = _object(text, "text")
    fmt = {"type": "text"} if text.get("format") is None else text["format"]
    kind = _object(fmt, "text.format").get("type")
    if kind == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif kind == "json_schema":
        schema: dict[str, Any] = {"name": _text(fmt.get("name"), "text.format.name"),
                  "schema": _object(fmt.get("schema"), "text.format.schema")}
        if fmt.get("description") is not None:
            schema["description"] = _text(fmt["description"], "text.format.description")
        if fmt.get("strict") is not None:
            schema["strict"] = _flag(fmt["strict"], "text.format.strict")
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
        fmt = {"type": "json_schema", **schema}
    elif kind != "text":
        raise invalid("'text.format.type' must be text, json_object or json_schema", "text.format.type")
    said = {"format": fmt if kind == "json_schema" else {"type": kind}}
    verbosity = _one_of(text.get("verbosity"), _VERBOSITY, "text.verbosity")  # (a hint: not sent)
    if verbosity is not None:
        said["verbosity"] = verbosity
    return said


def _reasoning(reasoning: Any, chat: dict[str, Any]) -> dict[str, Any]:
    """`reasoning.effort` as the chat completion's `reasoning_effort`; the `reasoning` repeated."""
    reasoning = _object(reasoning, "reasoning")
    effort = _one_of(reasoning.get("effort"), _EFFORTS, "reasoning.effort")
    if effort is not None:
        chat["reasoning_effort"] = effort
    return {"effort": effort, "summary": _one_of(reasoning.get("summary"), _SUMMARIES, "reasoning.summary")}


def _metadata(value: Any) -> dict[str, str]:
    """OpenAI's limits: at most 16 pairs of text, keys of at most 64 characters, values 512."""
    metadata = _object(value, "metadata")
    if len(metadata) > 16 or not all(isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                                     for k, v in metadata.items()):
        raise invalid("'metadata' must hold at most 16 pairs of text, keys of at most 64 characters and values "
                      "of at most 512", "metadata")
    return metadata


#: the range of each sampling number a Response repeats (OpenAI's; its schema holds a Response to them)
_RANGES = {"temperature": (0, 2), "top_p": (0, 1)}


def _number(body: dict[str, Any], name: str) -> Any:
    value = body.get(name)
    low, high = _RANGES[name]
    if value is not None and (type(value) not in (int, float) or not low <= value <= high):
        raise invalid(f"'{name}' must be a number from {low} to {high}", name)
    return value


def _refuse_unservable(body: dict[str, Any]) -> None:
    """The caller's 400 for what needs state iop does not keep, what a Response cannot hold, and
    the flags that are not what OpenAI takes."""
    for name, why in _STATEFUL.items():
        if body.get(name) is not None:
            raise invalid(f"'{name}' is not supported: {why}", name)
    if body.get("background") is True:
        raise invalid("'background' is not supported: iop answers while the caller waits (its runs API "
                      "follows a run that outlives a connection)", "background")
    for name in ("background", "store"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise invalid(f"'{name}' must be a boolean", name)
    include = body.get("include")
    if include is not None and not (isinstance(include, list) and all(isinstance(i, str) for i in include)):
        raise invalid("'include' must be an array of strings", "include")
    for name in ("n", "best_of"):  # (`true` and `1.0` equal 1 in Python, not to every server)
        if (value := body.get(name)) is not None and not whole_within(value, 1):
            raise invalid(f"'{name}' is not a field of the Responses API: a Response has one output (several "
                          "choices are served on /v1/chat/completions)", name)
    if include is not None and _LOGPROBS in include:
        raise invalid(f"'include' item {quoted(_LOGPROBS)} is not supported on /v1/responses (log probabilities "
                      "are on /v1/chat/completions)", "include")
    for name in _REPEATED_TEXT:  # (only repeated: one of another type went unsaid)
        if (value := body.get(name)) is not None and not isinstance(value, str):
            raise invalid(f"'{name}' must be a string", name)
    for name, most in _TEXT_LIMITS.items():
        if isinstance(value := body.get(name), str) and len(value) > most:
            raise invalid(f"'{name}' must be a string of at most {most} characters, got {len(value)}", name)
    top = body.get("top_logprobs")
    if top is not None and type(top) is not int:  # (`false` and `0.0` equal 0 in Python; OpenAI refuses them)
        raise invalid("'top_logprobs' must be an integer", "top_logprobs")
    if top is not None and top != 0:
        raise invalid("'top_logprobs' is not supported on /v1/responses (it is on /v1/chat/completions)",
                      "top_logprobs")


def to_chat(body: dict[str, Any], stream: bool) -> ResponsesRequest:
    """The chat completion run of a Responses request (its `model` already checked, `stream` read)."""
    _refuse_unservable(body)
    messages, origins = _messages(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None:
        messages.insert(0, {"role": "system", "content": _text(instructions, "instructions")})
        origins.insert(0, Origin("instructions"))
    chat = {k: v for k, v in body.items() if k not in _TRANSLATED}
    chat["messages"] = messages
    tools = [] if body.get("tools") is None else _tools(body["tools"])
    if tools:
        chat["tools"] = [_chat_tool(t) for t in tools]
    tool_choice = "auto" if body.get("tool_choice") is None else _tool_choice(body["tool_choice"])
    allowed = tool_choice if isinstance(tool_choice, dict) and tool_choice["type"] == "allowed_tools" else None
    if (tool_choice == "required" or (allowed is not None and allowed["mode"] == "required")) and not tools:
        raise invalid("'tool_choice' asks for a call of a tool ('required'), but 'tools' names no tool", "tool_choice")
    if allowed is not None and allowed["mode"] == "required" and not allowed["tools"]:
        raise invalid("'tool_choice' requires a call of one of its allowed tools, but it allows no tool",
                      "tool_choice.tools")
    held = {t["name"] for t in tools}
    chosen = [] if isinstance(tool_choice, str) else [(tool_choice, "tool_choice.name")] if (
        tool_choice["type"] == "function") else [(t, f"tool_choice.tools[{i}].name")
                                                 for i, t in enumerate(tool_choice["tools"])]
    for function, path in chosen:
        if function["name"] not in held:
            raise invalid(f"'tool_choice' names the function {quoted(function['name'])}, which 'tools' does not "
                          "hold", path)
    if body.get("tool_choice") is not None and tools:
        chat["tool_choice"] = _chat_tool_choice(tool_choice)
    limit = body.get("max_output_tokens")
    if limit is not None:
        if type(limit) is not int or limit < 1:
            raise invalid("'max_output_tokens' must be a whole number of at least 1", "max_output_tokens")
        chat["max_tokens"] = limit
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if not tools:  # (a Response takes it and `tool_choice` without tools, a chat completion neither: OpenAI's
        chat.pop("parallel_tool_calls", None)  # "only allowed when 'tools' are specified"; without, they mean nothing)
    truncation = "disabled" if body.get("truncation") is None else body["truncation"]
    _one_of(truncation, ("auto", "disabled"), "truncation")
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}  # (the Response ends with its usage)
    echo = {
        "instructions": instructions,
        "tools": tools,
        "tool_choice": tool_choice,
        "parallel_tool_calls": True if parallel is None else parallel,
        "temperature": _number(body, "temperature"),
        "top_p": _number(body, "top_p"),
        "max_output_tokens": limit,
        "metadata": {} if body.get("metadata") is None else _metadata(body["metadata"]),
        "text": _text_options({} if body.get("text") is None else body["text"], chat),
        "reasoning": None if body.get("reasoning") is None else _reasoning(body["reasoning"], chat),
        "truncation": truncation,
        **{name: body[name] for name in _REPEATED_TEXT if isinstance(body.get(name), str)},
    }
    return ResponsesRequest(chat=chat, echo={k: v for k, v in echo.items() if v is not None or k in _ALWAYS_SAID},
                            origins=tuple(origins))

