"""A model's `max_tokens` (config): the most tokens a run of it may generate. Pure.

The gateway refuses a request that asks for more (`over_cap`), as OpenAI refuses a `max_tokens`
past a model's output limit; the worker gives a request that asks for no limit the model's own
(`with_cap`), so no caller makes a server generate to the end of its context (llama-cpp-python
does so without one). Embeddings have no such limit.
"""

from __future__ import annotations

from typing import Any

#: the fields a request names its limit in, the one that wins first (as vLLM reads the two)
LIMIT_FIELDS = ("max_completion_tokens", "max_tokens")


def asked(body: dict[str, Any]) -> tuple[str, Any] | None:
    """The limit the request asks for and the field it is in; None when it asks for none (absent, or
    `null`: an unset one, as clients send it)."""
    for field in LIMIT_FIELDS:
        value = body.get(field)
        if value is not None:
            return field, value
    return None


def over_cap(body: dict[str, Any], cap: int) -> str | None:
    """The field asking for more than `cap` tokens, if one does. A limit that is not a number is the
    provider's to judge, as every field iop does not read."""
    found = asked(body)
    if found is None:
        return None
    field, value = found
    return field if isinstance(value, int | float) and not isinstance(value, bool) and value > cap else None


def with_cap(body: dict[str, Any], cap: int) -> None:
    """Give a request that asks for no limit the model's: as `max_tokens`, which every server takes."""
    if asked(body) is None:
        body["max_tokens"] = cap
