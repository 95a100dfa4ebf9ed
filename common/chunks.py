"""What a streamed OpenAI chunk carries, for the worker (what counts as output) and the gateway
(time to first token)."""

from __future__ import annotations

from typing import Any

#: Fields of a chunk's `delta` that carry generated output.
OUTPUT_FIELDS = ("content", "reasoning_content", "reasoning", "tool_calls", "function_call", "refusal")


def carries_output(chunk: Any) -> bool:
    """Generated text, reasoning or a tool call (the opening `role` delta carries none)."""
    if not isinstance(chunk, dict):
        return False
    for choice in chunk.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if choice.get("text") or (isinstance(delta, dict) and any(delta.get(f) for f in OUTPUT_FIELDS)):
            return True
    return False


def finishes(chunk: Any) -> bool:
    """A choice of the chunk ends with a `finish_reason`."""
    return isinstance(chunk, dict) and any(
        isinstance(c, dict) and c.get("finish_reason") for c in chunk.get("choices") or ())


def is_preamble(chunk: Any) -> bool:
    """Nothing but an opening: no output, no finish, no usage. A stream cut short after such
    chunks has shown the caller nothing, so it may still be tried again."""
    return not (carries_output(chunk) or finishes(chunk) or (isinstance(chunk, dict) and chunk.get("usage")))
