"""Turning an OpenAI-shaped request into the plain text a CLI tool reads on stdin. Pure.

A chat with a single user message is that message's text. Any other chat is one block per
message, `role: text`, separated by blank lines. A text completion is its prompt.
"""

from __future__ import annotations

from typing import Any

from common.wire import RunKind


def message_text(content: Any) -> str:
    """A message's content as text: a string as it is, the text parts of a list joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def flatten_messages(messages: Any) -> str:
    msgs = [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []
    if len(msgs) == 1 and msgs[0].get("role", "user") == "user":
        return message_text(msgs[0].get("content"))
    return "\n\n".join(f"{m.get('role', 'user')}: {message_text(m.get('content'))}" for m in msgs)


class NotForCli(ValueError):
    """What a CLI tool cannot be given; `param`: the request's field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def prompt_text(kind: RunKind, body: dict[str, Any]) -> str:
    """The text for stdin. Raises NotForCli for what a CLI tool cannot be given."""
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
