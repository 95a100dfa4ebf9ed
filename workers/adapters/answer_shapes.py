"""A provider's legacy completion (whole, or each streamed chunk) and embeddings answer as OpenAI's
schema has them (`CreateCompletionResponse`, `CreateEmbeddingResponse`), changed in place, for the
OpenAI-compatible adapter. Pure.

Servers answer them their own ways, and each reached the caller as a 200 that OpenAI's schema and
its client's types refuse: Ollama's `/v1` choices have no `logprobs`; vLLM's usage has
`prompt_tokens_details: null` and, asked for usage, each chunk `"usage": null`; TGI's finish_reason
is `eos_token` or `stop_sequence`; others leave out `object`, `id`, `created`, `index` or usage, send
`text: null`, or embeddings out of order. What can be filled honestly is: `object` (what the endpoint
answers), `id` and `created` (the run's, as iop's own adapters make them), an `index` by place (or
the items put in the order their indices say), a `logprobs` of null, a `text` of null as "", a
finish_reason as OpenAI names it (`FINISH_REASONS`). What cannot is the provider's error, no answer:
a finish_reason that says the run failed (vLLM's `error`), a `text` that is not text.

The caller's `model` is the gateway's to write (`gateway.responses.with_model`).
"""

from __future__ import annotations

from typing import Any

from common.chunks import USAGE_PARTS, fixed_usage
from workers.adapters.base import ProviderError, Retry

Json = dict[str, Any]

#: a finish_reason a server gives a legacy completion -> OpenAI's (`stop`, `length`, `content_filter`):
#: TGI's `eos_token` and `stop_sequence`, and other servers' names for the same ends
FINISH_REASONS = {
    "stop": "stop", "length": "length", "content_filter": "content_filter",
    "eos_token": "stop", "stop_sequence": "stop", "eos": "stop", "end_turn": "stop", "end_of_turn": "stop",
    "stop_token": "stop", "tool_calls": "stop", "function_call": "stop",
    "max_tokens": "length", "max_length": "length", "model_length": "length", "out_of_tokens": "length",
    "safety": "content_filter",
}
#: what a finish_reason none of `FINISH_REASONS` names becomes: the generation ended, the server says why
#: in words of its own
OTHER_REASON = "stop"
#: finish_reasons that say the run failed (vLLM's engine: `FinishReason.ERROR`): no answer. (`abort` is
#: every kind's, `openai_compat.aborted`.)
FAILED_REASONS = frozenset({"error"})


def _is_int(value: Any) -> bool:
    return type(value) is int


def completion_id(run_id: str) -> str:
    """A legacy completion's `id` when its provider gave none (as `openai_shapes.Shaper` makes it)."""
    return f"cmpl-{run_id}"


def _reason(value: Any, provider_id: str, whole: bool) -> str | None:
    """OpenAI's finish_reason for a provider's: None (a stream's choice that goes on) when it gave no
    text; a whole answer's choice ends, so none there is `OTHER_REASON`."""
    if not isinstance(value, str) or not value:
        return OTHER_REASON if whole else None
    if value in FAILED_REASONS:
        raise ProviderError(f"provider {provider_id} ended the completion with finish_reason {value!r}: it "
                            "failed the run", retry=Retry.ELSEWHERE, strikes=None)
    return FINISH_REASONS.get(value, OTHER_REASON)


def _choice(choice: Json, place: int, provider_id: str, whole: bool) -> None:
    text = choice.get("text")
    if text is None:
        choice["text"] = ""
    elif not isinstance(text, str):
        raise ProviderError(f"provider {provider_id} answered a completion whose text is not text",
                            retry=Retry.ELSEWHERE, strikes=0)
    if not isinstance(choice.get("logprobs"), dict):
        choice["logprobs"] = None
    choice["finish_reason"] = _reason(choice.get("finish_reason"), provider_id, whole)
    if not whole and not _is_int(choice.get("index")):  # (its place in the chunk, as `choice_marks` counts it)
        choice["index"] = place


def in_order(items: list[Json]) -> list[Json]:
    """Items (choices, embeddings) in the order their `index` says, when their indices are 0 to n-1
    each once; else as they came, each given its place as its `index`."""
    indices: list[int] = [index for item in items if type(index := item.get("index")) is int]
    if len(indices) == len(items) and sorted(indices) == list(range(len(items))):
        return sorted(items, key=lambda item: item["index"])
    for place, item in enumerate(items):
        item["index"] = place
    return items


def _usage(obj: Json, parts: tuple[str, ...]) -> None:
    """The `usage` of an answer or chunk as OpenAI's schema has it: none for a null one; a count of
    `parts` it lacks from its total and the other's, else 0 (`fixed_usage` makes the rest whole
    numbers, and the total their sum); `*_details` that are null left out."""
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        obj.pop("usage", None)
        return
    total = usage.get("total_tokens")
    for name in parts:
        if name not in usage:
            others = sum(v for n in parts if n != name and type(v := usage.get(n)) is int)
            usage[name] = total - others if type(total) is int and total >= others else 0
    for name in [n for n, v in usage.items() if n.endswith("_details") and v is None]:
        del usage[name]
    fixed_usage(obj)


def completion(answer: Json, run_id: str, created: int, provider_id: str) -> None:
    """A whole legacy completion (its `choices` a non-empty list of objects), as OpenAI's schema has it;
    ProviderError when it cannot be."""
    _head(answer, run_id, created)
    for place, choice in enumerate(answer["choices"]):
        _choice(choice, place, provider_id, whole=True)
    answer["choices"] = in_order(answer["choices"])
    if "usage" in answer:
        _usage(answer, USAGE_PARTS)


def completion_chunk(chunk: Json, run_id: str, created: int, provider_id: str) -> None:
    """A streamed legacy completion's chunk (its `choices`, if any, a list of objects), as OpenAI's
    streams have it (its finish_reasons null while a choice goes on); ProviderError when it cannot be."""
    _head(chunk, run_id, created)
    for place, choice in enumerate(chunk.get("choices") or ()):
        _choice(choice, place, provider_id, whole=False)
    if "choices" not in chunk:
        chunk["choices"] = []
    if "usage" in chunk:
        _usage(chunk, USAGE_PARTS)


def _head(obj: Json, run_id: str, created: int) -> None:
    obj["object"] = "text_completion"
    if not isinstance(obj.get("id"), str):
        obj["id"] = completion_id(run_id)
    if not _is_int(obj.get("created")) or obj["created"] < 0:
        obj["created"] = created
    if "system_fingerprint" in obj and not isinstance(obj["system_fingerprint"], str):
        del obj["system_fingerprint"]


def embeddings(answer: Json) -> None:
    """A checked embeddings answer (`embeddings.embeddings_problem`: `data` a list of objects, one an
    input), as OpenAI's schema has it. A usage it lacks is counted 0, as iop counts the run's tokens
    for its key (OpenAI's schema requires one: the client's `usage.prompt_tokens` was None)."""
    answer["object"] = "list"
    for item in answer["data"]:
        item["object"] = "embedding"
    answer["data"] = in_order(answer["data"])
    if not isinstance(answer.get("usage"), dict):
        answer["usage"] = {}
    _usage(answer, ("prompt_tokens",))
