"""How much one request may ask a provider to make: its choices and its inputs. Pure.

Nothing else bounds them: a chat's `n` of 100,000 fits in a few bytes, and a legacy completion's
or an embeddings request's list of 100,000 short prompts in a few hundred KiB, each a whole
generation (or embedding) for the provider. The gateway refuses more than the runtime's limits
(`runtime.max_choices`, OpenAI's own limit on `n` by default; `runtime.max_inputs`, OpenAI's on
an embeddings list), with a 400 naming the field. A legacy completion's choices are a prompt's,
so one request may ask for `max_choices` times `max_inputs` of them.
"""

from __future__ import annotations

from typing import Any

from common.wire import RunKind

#: the field a kind's list of inputs is in (a chat has one conversation)
INPUT_FIELD = {RunKind.COMPLETION: "prompt", RunKind.EMBEDDING: "input"}
#: the fields that ask for several choices a prompt, for each kind that has them (vLLM generates
#: `best_of` sequences a prompt and returns `n` of them: its chat completions take it too)
CHOICE_FIELDS = {RunKind.CHAT: ("n", "best_of"), RunKind.COMPLETION: ("n", "best_of")}


def whole_within(value: Any, most: int) -> bool:
    """Whether `value` is a whole number from 1 to `most` as JSON gives it (an int, not a bool:
    servers read `2.0`, `"2"`, `true` or `0` their own ways)."""
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= most


def only(values: list[Any], *kinds: type) -> bool:
    """Whether every item of `values` is of one of `kinds` exactly (as JSON gives them: a boolean is
    no int), typed at once in C (`map(type)`): an `isinstance` an item, a prompt of 4 million token
    ids held the gateway's thread 0.3 s on top of its parse."""
    return set(map(type, values)) <= set(kinds)


def inputs(value: Any) -> int:
    """How many inputs a request's `input` (or legacy `prompt`) holds: a list of texts or of token
    lists is that many; a text, or one list of tokens, is one."""
    if isinstance(value, list) and value and only(value, str, list):
        return len(value)
    return 1


def problem(kind: RunKind, body: dict[str, Any], max_choices: int, max_inputs: int) -> tuple[str, str] | None:
    """What asks for too much, as (message, the field at fault); None when nothing does. A choice
    field must be null or a whole number from 1 to `max_choices`, as `n` is in OpenAI's API (a
    server reads `2.0`, `"2"` or `0` its own way); a list of inputs holds at most `max_inputs`."""
    field = INPUT_FIELD.get(kind)
    if field is not None and (count := inputs(body.get(field))) > max_inputs:
        return f"'{field}' holds {count} inputs; at most {max_inputs} are served a request (runtime.max_inputs)", field
    for name in CHOICE_FIELDS.get(kind, ()):
        value = body.get(name)
        if value is not None and not whole_within(value, max_choices):
            return f"'{name}' must be a whole number from 1 to {max_choices} (runtime.max_choices)", name
    return None
