"""What a streamed OpenAI chunk carries, for the worker (what counts as output) and the gateway
(time to first token)."""

from __future__ import annotations

from typing import Any

#: Fields of a chunk's `delta` that carry generated output (`audio`: a chunk of spoken output, with
#: `modalities: ["text", "audio"]`, carries its transcript and sound there, and no `content`).
OUTPUT_FIELDS = ("content", "reasoning_content", "reasoning", "tool_calls", "function_call", "refusal", "audio")


def carries_output(chunk: Any) -> bool:
    """Generated text, reasoning or a tool call (the opening `role` delta carries none)."""
    if not isinstance(chunk, dict):
        return False
    for choice in chunk.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if choice.get("text"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict):
            for field in OUTPUT_FIELDS:  # (a loop, not any() of a generator: every streamed chunk is counted)
                if delta.get(field):
                    return True
    return False


def choices_usable(obj: dict[str, Any]) -> bool:
    """An answer or a chunk whose `choices`, if it has them, are a list of objects, each one's
    `delta` or `message`, if it has one, an object (or null): what a caller's client indexes
    (`choices[0].delta.content`). A provider's `"choices": {…}`, `[5, null]` or `null` is not, nor
    `"delta": "x"` (the `openai` client raised AttributeError on it)."""
    if "choices" not in obj:
        return True
    choices = obj["choices"]
    if not isinstance(choices, list):
        return False
    # (a loop, not all() of a generator, and the test inline: every streamed chunk passes here, ~0.15 us less)
    for c in choices:
        if not (isinstance(c, dict) and ((delta := c.get("delta")) is None or isinstance(delta, dict))
                and ((message := c.get("message")) is None or isinstance(message, dict))):
            return False
    return True


def finishes(chunk: Any) -> bool:
    """A choice of the chunk ends with a `finish_reason`."""
    return bool(choice_indices(chunk, finished=True))


def choice_indices(chunk: Any, finished: bool = False) -> list[int]:
    """The `index` of each choice of the chunk (its place in the list when it has no integer one);
    `finished`: of each that ends with a `finish_reason`."""
    if not isinstance(chunk, dict):
        return []
    return [c["index"] if type(c.get("index")) is int else i for i, c in enumerate(chunk.get("choices") or ())
            if isinstance(c, dict) and (not finished or _is_reason(c.get("finish_reason")))]


def choice_marks(chunk: Any) -> tuple[list[int], list[int]]:
    """`choice_indices` of the chunk, and of those of its choices that finish, in one pass (a
    stream's every chunk is read so)."""
    every: list[int] = []
    ended: list[int] = []
    if isinstance(chunk, dict):
        for i, c in enumerate(chunk.get("choices") or ()):
            if isinstance(c, dict):
                index = c["index"] if type(c.get("index")) is int else i
                every.append(index)
                if _is_reason(c.get("finish_reason")):
                    ended.append(index)
    return every, ended


def _is_reason(value: Any) -> bool:
    """A finish_reason that ends a choice: text (`{"type": "stop"}` from a broken server does not)."""
    return isinstance(value, str) and bool(value)


def is_preamble(chunk: Any) -> bool:
    """Nothing but an opening: no output, no finish. A stream cut short after such chunks has
    shown the caller nothing, so it may still be tried again. Usage alone is no output: vLLM and
    SGLang with `continuous_usage_stats` put it on their opening chunk (counted as output, a
    stream cut after it was not tried again, and every Responses stream asks for usage)."""
    return not (carries_output(chunk) or finishes(chunk))


def wants_usage(body: dict[str, Any]) -> bool:
    """`stream_options.include_usage`: the stream ends with a chunk carrying only usage."""
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def usage_in(chunks: list[Any]) -> dict[str, Any] | None:
    """The last `usage` object the chunks carry, if any; each chunk's usage made what OpenAI's
    schema allows (`fixed_usage`)."""
    found = None
    for chunk in chunks:
        if isinstance(chunk, dict) and chunk.get("usage") is not None:
            found = fixed_usage(chunk) or found
    return found


def fixed_usage(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The `usage` of an answer or chunk as OpenAI's schema has it, changed in place, for the
    caller's client: a count that is not a whole number of at least 0 becomes 0 (`total_tokens`:
    the sum of the other two, also when the provider sent none: OpenAI's schema requires it, and
    the `openai` client's `usage.total_tokens` would be None), and so does a `*_tokens` one of its
    `*_details` objects that is not null; a null one goes from those OpenAI's schema has
    (`SCHEMA_DETAILS`: it has a count there), and stays in another's (their other fields, a cost
    say, stay as they came); a `*_details` that is not an object goes; a usage that is not an
    object goes (None)."""
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        obj.pop("usage", None)
        return None
    for name, value in list(usage.items()):
        if name.endswith("_details"):
            if isinstance(value, dict):  # (its `*_tokens` counts; a cost, or another's null, as it came)
                for inner, n in list(value.items()):
                    if not inner.endswith("_tokens"):
                        continue
                    if n is None and name in SCHEMA_DETAILS:
                        del value[inner]  # (OpenAI's schema has a count there, never null)
                    elif n is not None and not _is_count(n):
                        value[inner] = _count(n)
            elif value is not None:
                del usage[name]
        elif name in USAGE_PARTS and not _is_count(value):
            usage[name] = _count(value)
    if not _is_count(usage.get("total_tokens")):  # (once the other two are numbers; a missing one too)
        usage["total_tokens"] = sum(token_counts(usage))
    return usage


#: The most tokens of either kind a run counts (for its key, and in a Response's usage): a
#: provider's usage numbers are its own, and counters are 64-bit (Redis's, and many clients'
#: integers: a count beyond them breaks the run's end, or the client reading it).
MAX_COUNTED_TOKENS = 10**9

#: the `*_details` of a usage that OpenAI's schema has: their `*_tokens` are counts, never null (SGLang's
#: and others' null ones failed the schema); another's (OpenRouter's `cost_details`) is the provider's own
SCHEMA_DETAILS = frozenset({"prompt_tokens_details", "completion_tokens_details"})

#: the counts of a usage object that its `total_tokens` sums
USAGE_PARTS = ("prompt_tokens", "completion_tokens")


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _count(value: Any) -> int:
    """A count given as a whole float (`3.0`) as the integer; anything else 0."""
    return int(value) if type(value) is float and value.is_integer() and 0 <= value < 2 ** 63 else 0


def without_usage(chunks: list[Any]) -> list[Any]:
    """The chunks as a caller that did not ask for usage gets them: no `usage` field, and no
    usage chunk (`choices: []` with a usage). The chunks are changed in place (a provider asked
    for usage puts `"usage": null` in every chunk: no copy of each); one with no choices and a
    null usage is kept (Azure's first chunk carries its `prompt_filter_results` so)."""
    out = []
    for chunk in chunks:
        if isinstance(chunk, dict) and "usage" in chunk:
            if chunk.get("choices") == [] and chunk["usage"] is not None:
                continue
            del chunk["usage"]
        out.append(chunk)
    return out


def token_counts(usage: Any) -> tuple[int, int]:
    """(prompt tokens, completion tokens) of a `usage` object; 0 for what it lacks."""
    if not isinstance(usage, dict):
        return 0, 0

    def count(name: str) -> int:
        value = usage.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0

    return count("prompt_tokens"), count("completion_tokens")
