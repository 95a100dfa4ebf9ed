"""Turning an OpenAI-shaped request into the plain text a CLI tool reads on stdin. Pure.

A chat with a single user message is that message's text. Any other chat is one block per
message, `role: text`, separated by blank lines. A text completion is its prompt. What the text
cannot carry (tools to call, an image or audio part, several choices, several prompts,
embeddings, a JSON format to hold the answer to) is refused, not dropped: the run goes to another
provider of the model if one is available (`NotForCli`).
"""

from __future__ import annotations

from typing import Any

from common.capabilities import TOOL_FIELDS, asks_several_choices, asks_structured_output
from common.shown import shown
from common.wire import RunKind

#: the stop strings a CLI tool's output is cut at (`text_limits`): as many as OpenAI's API takes,
#: and of a length a caller means (the last characters that could begin one are held back)
MAX_STOPS = 4
MAX_STOP_CHARS = 1024


class NotForCli(ValueError):
    """What a CLI tool cannot be given; `param`: the request's field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def message_text(content: Any, place: str = "content") -> str:
    """A message's content as text: a string as it is, the text parts of a list joined. A part
    that is not text (an image, audio, a file) raises NotForCli naming it (`place[j]`)."""
    if isinstance(content, str):
        return content
    if content is None:  # (an assistant message's, beside its tool calls: refused with them)
        return ""
    if not isinstance(content, list):  # (a part not in a list, a number: it was dropped, the tool given "")
        raise NotForCli("a cli provider takes a message's content as text or a list of text parts", place)
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type", "text") != "text":
            raise NotForCli(f"a cli provider takes text only, not a {shown(part.get('type'))} part",
                            f"{place}[{j}]")
        if not isinstance(part, dict) or "text" not in part:  # (`{"image_url": …}` without its type: dropped)
            raise NotForCli("a cli provider takes text parts only: each an object with its text", f"{place}[{j}]")
        text = part["text"]
        if not isinstance(text, str):
            raise NotForCli("a text part's text must be a string", f"{place}[{j}].text")
        texts.append(text)
    return "\n".join(texts)


def flatten_messages(messages: Any) -> str:
    msgs = [(i, m) for i, m in enumerate(messages) if isinstance(m, dict)] if isinstance(messages, list) else []
    for i, m in msgs:
        if m.get("tool_calls") or m.get("function_call"):  # (they were dropped from the text)
            raise NotForCli("a cli provider does not call tools, nor read calls made before",
                            f"messages[{i}].{'tool_calls' if m.get('tool_calls') else 'function_call'}")
    texts = [message_text(m.get("content"), f"messages[{i}].content") for i, m in msgs]
    if len(msgs) == 1 and msgs[0][1].get("role", "user") == "user":
        return texts[0]
    return "\n\n".join(f"{m.get('role', 'user')}: {text}" for (_, m), text in zip(msgs, texts, strict=True))


def _one_answer(body: dict[str, Any]) -> None:
    """Refuse what asks for anything but one plain-text answer: tools to call, `n` > 1, or an
    answer in a JSON format."""
    for name in TOOL_FIELDS:
        if body.get(name):
            raise NotForCli("a cli provider does not call tools", name)
    if asks_several_choices(body):
        raise NotForCli("a cli provider gives one answer a request", "n")
    if asks_structured_output(body):
        raise NotForCli("a cli provider's answer is the text its command prints: it cannot be held to a JSON format",
                        "response_format")
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    if (stop is not None and not isinstance(stop, str | list)) or not all(isinstance(s, str) for s in stops):
        # (ignored, the tool's answer was not cut where the caller asked: a server answers it 400, as OpenAI)
        raise NotForCli("'stop' must be a string or an array of strings", "stop")
    if len(stops) > MAX_STOPS:  # (a fifth was ignored)
        raise NotForCli(f"a cli provider applies at most {MAX_STOPS} stop strings, as OpenAI's API", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):  # (held back whole: a tool's
        # answer was cut as "a word over max_line_bytes")
        raise NotForCli(f"a cli provider applies stop strings of at most {MAX_STOP_CHARS} characters", "stop")


def prompt_text(kind: RunKind, body: dict[str, Any]) -> str:
    """The text for stdin. Raises NotForCli for what a CLI tool cannot be given."""
    if kind is not RunKind.EMBEDDING:
        _one_answer(body)
    if kind is RunKind.CHAT:
        return flatten_messages(body.get("messages"))
    if kind is RunKind.COMPLETION:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise NotForCli("a cli provider takes one text prompt", "prompt")
        return prompt
    raise NotForCli("a cli provider does not serve embeddings", "model")
