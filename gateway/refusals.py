"""Which providers of a model would refuse a run, told from its request before it is queued.

The adapters of Ollama and of CLI tools write a request in their own terms, and refuse what they
cannot write (`n` > 1, an image by URL, tools given to a tool, ...): a 400 for the caller unless
another provider of the model takes the run. Both writings are pure (`ollama_wire.request`,
`prompt_text`), so the gateway makes them too, once a provider type, and a run goes only to the
providers that would take it (the `refuse` field of its queue entry and record; `common.scripts`):
in a model served by Ollama and vLLM, a request for two choices goes to vLLM at its first attempt,
not after each Ollama provider used up one of its `max_attempts` refusing it. When every provider
of the model would refuse it, the caller gets that 400 at once, not after a wait in the queue.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from common.wire import RunKind
from workers.adapters.ollama_wire import UnsupportedRequest
from workers.adapters.ollama_wire import request as ollama_request
from workers.adapters.prompt_text import NotForCli, prompt_text

#: the provider types whose adapter may refuse a run
MAY_REFUSE = frozenset({"ollama", "cli"})
#: provider type -> its adapter's writing of a run (raises `UnsupportedRequest` or `NotForCli`
#: for what it refuses); types missing here take every request
_WRITERS: dict[str, Callable[[RunKind, dict[str, Any], bool], object]] = {
    # (not the arguments of earlier tool calls: JSON text, which the body's limits on depth and
    # containers do not reach; one nested too deep is left to the worker to refuse)
    "ollama": lambda kind, body, stream: ollama_request(kind, body, stream, parse_arguments=False),
    "cli": lambda kind, body, stream: prompt_text(kind, body),
}


class Refusal(ValueError):
    """Every provider of the model would refuse the run: the first one's reason."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def refusing(kind: RunKind, body: dict[str, Any], stream: bool, types: Mapping[str, str]) -> tuple[str, ...]:
    """The ids of the providers (`types`: id -> type) whose adapter would refuse the run; raises
    `Refusal` when all would."""
    refused: dict[str, UnsupportedRequest | NotForCli | None] = {}
    for ptype in set(types.values()):
        writer = _WRITERS.get(ptype)
        try:
            if writer is not None:
                writer(kind, body, stream)
            refused[ptype] = None
        except (UnsupportedRequest, NotForCli) as exc:
            refused[ptype] = exc
    ids = tuple(p for p, t in types.items() if refused[t] is not None)
    if len(ids) == len(types):
        first = refused[types[ids[0]]]
        assert first is not None
        raise Refusal(str(first), first.param)
    return ids
