"""What a provider type cannot be asked, told from the request alone. Pure.

Ollama's API and a CLI tool return one answer a request; a CLI tool calls no tools, makes no
embeddings, and cannot be held to a JSON format (`response_format`). Their adapters refuse such a
run, and it goes to another provider of its model. When no provider of the model could take it,
the gateway refuses it at once with the caller's 400 naming the field (`refused_everywhere`),
where it would otherwise have waited its turn in the queue only to get the same 400 from the worker.
"""

from __future__ import annotations

from typing import Any

from common.shown import quoted
from common.wire import RunKind

#: provider types that return one choice a request (Ollama's API has no `n`; a tool prints one answer)
ONE_CHOICE = frozenset({"ollama", "cli"})
#: provider types that call no tools, and that make no embeddings
NO_TOOLS = frozenset({"cli"})
NO_EMBEDDINGS = frozenset({"cli"})
#: provider types whose answer cannot be held to a JSON format (a tool prints what it prints)
NO_STRUCTURED_OUTPUT = frozenset({"cli"})
#: the fields that offer tools to call
TOOL_FIELDS = ("tools", "functions")


def asks_several_choices(body: dict[str, Any]) -> bool:
    """Whether a request asks for more than one choice: `n` a number above 1 (`2`, `2.0`; a
    server that takes `n` reads both alike)."""
    n = body.get("n")
    return isinstance(n, int | float) and not isinstance(n, bool) and n > 1


def asks_structured_output(body: dict[str, Any]) -> bool:
    """Whether a request asks for its answer in a JSON format (`response_format` of type
    `json_object` or `json_schema`; `text` is plain text, as none)."""
    fmt = body.get("response_format")
    return isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema")


def refused_everywhere(kind: RunKind, body: dict[str, Any], model_id: str,
                       types: frozenset[str]) -> tuple[str, str] | None:
    """(the caller's message, the field at fault) when every provider of the model (its `types`)
    would refuse the request; None when one may take it."""
    if not types:
        return None
    if kind is RunKind.EMBEDDING:
        if types <= NO_EMBEDDINGS:
            return f"the model {quoted(model_id)} makes no embeddings: its providers are {_listed(types)}", "model"
        return None
    if asks_several_choices(body) and types <= ONE_CHOICE:
        return (f"'n' must be 1 for the model {quoted(model_id)}: its providers ({_listed(types)}) return one "
                "choice a request"), "n"
    if types <= NO_TOOLS:  # (a legacy completion's too: a CLI tool refuses them on any kind)
        for name in TOOL_FIELDS:
            if body.get(name):
                return f"the model {quoted(model_id)} calls no tools: its providers are {_listed(types)}", name
    if types <= NO_STRUCTURED_OUTPUT and asks_structured_output(body):
        return (f"the model {quoted(model_id)} cannot answer in a JSON format: its providers are {_listed(types)}, "
                "whose answer is the text a command prints"), "response_format"
    return None


def _listed(types: frozenset[str]) -> str:
    return ", ".join(sorted(types))
