"""A provider's chat completion and legacy completion (whole, or each streamed chunk) and embeddings
answer as OpenAI's schema has them (`CreateChatCompletionResponse`, `CreateChatCompletionStreamResponse`,
`CreateCompletionResponse`, `CreateEmbeddingResponse`), changed in place, for the OpenAI-compatible
adapter. Pure.

Servers answer them their own ways, and each reached the caller as a 200 that OpenAI's schema and
its client's types refuse: Ollama's `/v1` choices have no `logprobs`; vLLM's usage has
`prompt_tokens_details: null` and, asked for usage, each chunk `"usage": null`; TGI's finish_reason
is `eos_token` or `stop_sequence`; others leave out `object`, `id`, `created`, `index` or usage, send
`text: null`, or embeddings out of order. What can be filled honestly is: `object` (what the endpoint
answers), `id` and `created` (the run's, as iop's own adapters make them), an `index` by place (or
the items put in the order their indices say), a `logprobs` of null, a `text` of null as "", a
finish_reason as OpenAI names it (`FINISH_REASONS`). What cannot is the provider's error, no answer:
a finish_reason that says the run failed (vLLM's `error`), a `text` that is not text.

Chat completions the same ways, and more: Ollama's choices have no `logprobs` and its messages no
`refusal`; vLLM's whole answer has `system_fingerprint`, `annotations` and `function_call` of null,
its logprobs no `refusal`; TGI's messages no `content` when they call a tool. A chat chunk is on the
hot path: one that is already right is checked for the few keys servers get wrong (`chat_chunks`),
and only one that is not is repaired; a message's or a delta's text is the caller's as it came.

The caller's `model` is the gateway's to write (`gateway.responses.with_model`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from common import jsonio
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
    return _named(value, FINISH_REASONS, provider_id, "completion")


def _named(value: str, names: dict[str, str], provider_id: str, what: str) -> str:
    """OpenAI's name (in `names`) of a finish_reason a provider gave; ProviderError for one that says
    the run failed."""
    if value in FAILED_REASONS:
        raise ProviderError(f"provider {provider_id} ended the {what} with finish_reason {value!r}: it "
                            "failed the run", retry=Retry.ELSEWHERE, strikes=None)
    return names.get(value, OTHER_REASON)


def _choice(choice: Json, place: int, provider_id: str, whole: bool, indices: ChoiceIndices | None = None) -> None:
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
    if indices is not None and choice["index"] not in indices.same:  # (one kept as it came: a set lookup)
        choice["index"] = indices.index(choice["index"])


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
    _head(answer, "text_completion", completion_id(run_id), created)
    for place, choice in enumerate(answer["choices"]):
        _choice(choice, place, provider_id, whole=True)
    answer["choices"] = in_order(answer["choices"])
    if "usage" in answer:
        _usage(answer, USAGE_PARTS)


def completion_chunk(chunk: Json, run_id: str, created: int, provider_id: str,
                     indices: ChoiceIndices | None = None) -> None:
    """A streamed legacy completion's chunk (its `choices`, if any, a list of objects), as OpenAI's
    streams have it (its finish_reasons null while a choice goes on; its choices numbered as `indices`
    has them); ProviderError when it cannot be."""
    _head(chunk, "text_completion", completion_id(run_id), created)
    for place, choice in enumerate(chunk.get("choices") or ()):
        _choice(choice, place, provider_id, whole=False, indices=indices)
    if "choices" not in chunk:
        chunk["choices"] = []
    if "usage" in chunk:
        _usage(chunk, USAGE_PARTS)


class ChoiceIndices:
    """A stream's choice indices as the caller's (0 to `asked`-1, as OpenAI numbers the choices asked
    for), from its server's: an index the server gives that is one of those and not yet another's is
    kept (vLLM's choices of `n` > 1, a legacy completion's of a list of prompts, whatever order they
    come in); another (a server that numbers the one choice asked for 5; `-1`) is the lowest not yet
    given, in the order they first come. The `openai` client's stream helper raised IndexError on a
    choice numbered 5 (it reads `choices[choice.index]`). More distinct indices than `asked` is the
    provider's error: a choice no one asked for."""

    __slots__ = ("asked", "given", "taken", "same", "free", "provider_id")

    def __init__(self, asked: int, provider_id: str) -> None:
        self.asked = asked
        self.provider_id = provider_id
        #: the server's index -> the caller's; the caller's given so far; those kept as they came (what a
        #: chunk already right has)
        self.given: dict[int, int] = {}
        self.taken: set[int] = set()
        self.same: set[int] = set()
        #: the lowest index that may be free (every one below it is given)
        self.free = 0

    def index(self, said: int) -> int:
        """The caller's index of the choice its server numbered `said`."""
        ours = self.given.get(said)
        if ours is not None:
            return ours
        if 0 <= said < self.asked and said not in self.taken:
            ours = said
            self.same.add(said)
        else:
            while self.free in self.taken:
                self.free += 1
            if self.free >= self.asked:
                raise too_many_choices(self.provider_id, self.asked)
            ours = self.free
        self.given[said] = ours
        self.taken.add(ours)
        return ours


def too_many_choices(provider_id: str, asked: int) -> ProviderError:
    """A whole answer with more choices than `asked`: the provider's error, as a stream's (`ChoiceIndices`)."""
    return ProviderError(f"provider {provider_id} answered more choices than the {asked} asked for",
                         retry=Retry.ELSEWHERE, strikes=0)


def completion_chunks(run_id: str, created: int, provider_id: str, asked: int = 1) -> Callable[[Json], None]:
    """What makes each streamed legacy completion's chunk what OpenAI's streams have (`completion_chunk`),
    and the stream one: the `id` and `created` of its first chunk in each (some servers change them
    midway, and clients take a stream for one answer), its choices numbered 0 to `asked`-1
    (`ChoiceIndices`)."""
    indices = ChoiceIndices(asked, provider_id)
    head: list[Any] = []

    def shape(chunk: Json) -> None:
        completion_chunk(chunk, run_id, created, provider_id, indices)
        if not head:
            head.extend((chunk["id"], chunk["created"]))
        else:
            chunk["id"], chunk["created"] = head

    return shape


def _head(obj: Json, kind: str, made_id: str, created: int) -> None:
    """An answer's or chunk's `object` (`kind`), its `id` and `created` where it has none that will do
    (`made_id`, the run's `created`; an empty id and a created of 0 will not: a stream's chunks all
    take its first chunk's, and Azure's first, of filter results, has those), and a
    `system_fingerprint` that is not text left out."""
    obj["object"] = kind
    if not isinstance(obj.get("id"), str) or not obj["id"]:  # ("": TGI's; Azure's first chunk, of filter results)
        obj["id"] = made_id
    if not _is_int(obj.get("created")) or obj["created"] <= 0:  # (0: Azure's first chunk's, no time)
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


#: a finish_reason a server gives a chat completion -> OpenAI's (`CHAT_REASONS`): as a legacy
#: completion's, but a tool call ends one as OpenAI says it (and as others name it: `tool_call`,
#: Anthropic's `tool_use`)
CHAT_FINISH_REASONS = {**FINISH_REASONS, "tool_calls": "tool_calls", "function_call": "function_call",
                       "tool_call": "tool_calls", "tool_use": "tool_calls"}
#: the finish_reasons OpenAI's schema has for a chat choice
CHAT_REASONS = frozenset({"stop", "length", "tool_calls", "content_filter", "function_call"})
#: a message's fields that OpenAI's schema has as something, never null: a null one says nothing
#: (vLLM's whole answer sends `annotations` and `function_call` so, and `tool_calls` some others)
NOT_NULL_FIELDS = ("annotations", "function_call", "tool_calls")
#: a streamed delta's fields that OpenAI's schema has as something, never null: SGLang sends `role`
#: and `tool_calls` null in every chunk, llama-cpp-python's server `function_call` (the chunk failed
#: the schema, and the `openai` client's types)
NOT_NULL_DELTA = ("role", "tool_calls", "function_call")
CHAT_OBJECT = "chat.completion"
CHUNK_OBJECT = "chat.completion.chunk"
_MISSING = object()


def chat_id(run_id: str) -> str:
    """A chat completion's `id` when its provider gave none (as `openai_shapes.Shaper` makes it)."""
    return f"chatcmpl-{run_id}"


def _drop_nulls(obj: Json, names: tuple[str, ...]) -> None:
    """`obj` without those of its fields `names` that are null (OpenAI's schema has something there)."""
    for name in names:
        if name in obj and obj[name] is None:
            del obj[name]


def _chat_reason(value: Any, provider_id: str, whole: bool, calls: bool = False) -> str | None:
    """OpenAI's finish_reason for a provider's chat choice, as `_reason`; a whole answer's that gave
    none ends in its tool calls (`calls`) if it has some."""
    if not isinstance(value, str) or not value:
        return ("tool_calls" if calls else OTHER_REASON) if whole else None
    return _named(value, CHAT_FINISH_REASONS, provider_id, "chat completion")


def _chat_logprobs(choice: Json) -> None:
    """A choice's `logprobs` as OpenAI's schema has them: an object with `content` and `refusal`
    (vLLM's and TGI's have no `refusal`), each a list or null, its tokens with their `bytes` (TGI's
    have none: null, as OpenAI's schema says of a token it has none for) and `top_logprobs`; else null."""
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, dict):
        choice["logprobs"] = None
        return
    for name in ("content", "refusal"):
        tokens = logprobs.get(name)
        if not isinstance(tokens, list):
            logprobs[name] = None
            continue
        for token in tokens:
            if isinstance(token, dict):
                token.setdefault("bytes", None)
                if not isinstance(token.setdefault("top_logprobs", []), list):
                    token["top_logprobs"] = []
                for top in token["top_logprobs"]:
                    if isinstance(top, dict):
                        top.setdefault("bytes", None)


def _tool_calls(calls: list[Json], run_id: str, provider_id: str) -> None:
    """A whole message's tool calls (objects, each with its function's), as OpenAI's schema has them,
    where a server left out what can be filled: `type` (a function's), an `id` (the run's and the
    call's place, as a Response's calls are named), arguments as JSON text (TGI gave them as an
    object; a number or a boolean too). ProviderError for a function's name that is not text."""
    for place, call in enumerate(calls):
        function = call["function"]
        if function.get("name") is not None and not isinstance(function["name"], str):
            raise ProviderError(f"provider {provider_id} answered a tool call whose function's name is not text",
                                retry=Retry.ELSEWHERE, strikes=0)
        if call.get("type") is None:
            call["type"] = "function"
        if not isinstance(call.get("id"), str) or not call["id"]:
            call["id"] = f"call_{run_id}_{place}"
        if function.get("arguments") is None:  # (SGLang's, of a function called without any)
            function["arguments"] = "{}"
        _arguments_as_text(function)


def _arguments_as_text(function: Json) -> None:
    """A tool call's function's `arguments` given as JSON (an object, a number, a boolean) as JSON text,
    as OpenAI's schema has them (TGI gave them as an object), whole or streamed."""
    if function.get("arguments") is not None and not isinstance(function["arguments"], str):
        function["arguments"] = jsonio.dumps(function["arguments"]).decode()


def _a_call(call: Any) -> bool:
    """A whole message's tool call: an object with its function's (an object)."""
    return isinstance(call, dict) and isinstance(call.get("function"), dict)


def _texts(said: Json, provider_id: str) -> None:
    """ProviderError for a message or delta whose `content` is not text, null or a list of parts, or
    whose `refusal` is not text or null (`5`, `{"a": 1}`): OpenAI's schema and its client's types
    have text there (the `openai` client handed the caller a `content` of 5), and nothing in it can be
    read as the answer, as a legacy completion's `text` that is not text."""
    content, refusal = said.get("content"), said.get("refusal")
    if not (content is None or isinstance(content, (str, list))) or not (refusal is None or isinstance(refusal, str)):
        raise ProviderError(f"provider {provider_id} answered a chat completion whose content or refusal is not "
                            "text", retry=Retry.ELSEWHERE, strikes=0)


def twice(said: Json, functions: bool) -> None:
    """A message's or delta's `function_call` left out where `tool_calls` beside it has the call, to a
    request that used `tools`, not the legacy `functions` (`functions`): llama-cpp-python's server
    gives a call both ways, whole and in every streamed piece, which OpenAI's answers never do. The
    Node.js `openai` client's stream helper kept `function_call` and dropped `tool_calls` then."""
    if not functions and "function_call" in said and said.get("tool_calls"):
        del said["function_call"]


def _message(choice: Json, run_id: str, provider_id: str, functions: bool = False) -> bool:
    """A whole choice's `message` as OpenAI's schema has it: its `role` the assistant's, `content`
    and `refusal` null when it has none, a null it cannot have left out (ProviderError for text that
    is not text, `_texts`), tool calls that are not objects with a function's left out (a
    `tool_calls` that is not a list too), a `function_call` beside them left out (`twice`). Whether
    it calls tools."""
    message = choice.get("message")
    if not isinstance(message, dict):
        message = choice["message"] = {}
    _texts(message, provider_id)
    message["role"] = "assistant"
    if "content" not in message:
        message["content"] = None
    if "refusal" not in message:
        message["refusal"] = None
    _drop_nulls(message, NOT_NULL_FIELDS)
    calls = message.get("tool_calls")
    if isinstance(calls, list) and not all(map(_a_call, calls)):
        # (what is no call, or calls no function, says nothing a caller could run: left out)
        calls = message["tool_calls"] = [c for c in calls if _a_call(c)]
    elif calls is not None and not isinstance(calls, list):
        del message["tool_calls"]
    if isinstance(calls, list) and calls:
        _tool_calls(calls, run_id, provider_id)
        twice(message, functions)
        return True
    return isinstance(message.get("function_call"), dict)


def chat(answer: Json, run_id: str, created: int, provider_id: str, functions: bool = False) -> None:
    """A whole chat completion (its `choices` a non-empty list of objects), as OpenAI's schema has
    it; ProviderError when it cannot be. `functions`: the request used the legacy `functions`."""
    _head(answer, CHAT_OBJECT, chat_id(run_id), created)
    for choice in answer["choices"]:
        calls = _message(choice, run_id, provider_id, functions)
        _chat_logprobs(choice)
        choice["finish_reason"] = _chat_reason(choice.get("finish_reason"), provider_id, whole=True, calls=calls)
    answer["choices"] = in_order(answer["choices"])
    if "usage" in answer:
        _usage(answer, USAGE_PARTS)


#: the most tool call ids, and server's indices, a stream's choice remembers to number its calls
#: (`StreamCalls`), and the most choices it does so for: a hostile server's million calls are not a
#: million entries (past it, a call's piece is taken for the call written last, or a new one)
MAX_CALL_IDS = 1024


class StreamCalls:
    """The tool calls of one choice of a stream so far, to number each streamed call as OpenAI's
    chunks do (`index` 0, 1, 2, … in the order the calls begin), where its server gives none (Gemini's
    OpenAI-compatible endpoint sends each call whole in a chunk, without one) or another (`-1`, a
    gap: `1000000`): the `openai` client's stream helper raised TypeError ("list delta entry `index`
    value is not an integer") or IndexError on them, and a caller reading deltas could not tell one
    call's pieces from another's."""

    __slots__ = ("ids", "indices", "named", "names", "next", "last", "run_id")

    def __init__(self, run_id: str) -> None:
        #: the run's id, which a call that came without an id is named by (as a whole answer's: `_tool_calls`)
        self.run_id = run_id
        #: each id a call came with, and each `index` the server gave one -> the call's index here;
        #: the index of the next call; that of the call written last
        self.ids: dict[str, int] = {}
        self.indices: dict[int, int] = {}
        #: the calls here that came with an id; the name each call's function was first given
        self.named: set[int] = set()
        self.names: dict[int, str] = {}
        self.next = 0
        self.last: int | None = None

    def number(self, delta: Json) -> None:
        """The delta's tool calls (a list of objects: anything else in it is left out), each with the
        `index` of its call here: that of the call its server's `index` named before (but a piece
        with an id not seen that names its function, where that call had an id, is a call of its
        own: some servers give every call the same index, each whole); without one, its id's call,
        if that came before; else a new call's when it has an index or an id not seen, else the
        call written last's (a piece that goes on with it), but one that names its function after
        that call was named is a call of its own (Gemini's whole calls, their ids empty). An id a
        piece gives after its call's first is left out (the client joins a call's pieces: its id
        read "aa"), and one that is not text (`5`: OpenAI's schema has text); so is the name its
        call's function was given first, given again (llama-cpp-python's server and Fireworks give
        each piece its call's id and name: the client read "ff"); arguments given as JSON (an
        object, a number) are JSON text, as a whole answer's (`_tool_calls`)."""
        calls = delta["tool_calls"]
        if not isinstance(calls, list):
            del delta["tool_calls"]
            return
        if not all(isinstance(call, dict) for call in calls):
            calls = delta["tool_calls"] = [call for call in calls if isinstance(call, dict)]
        for call in calls:
            _without_nulls(call)
            said, given = call.get("index"), call.get("id")
            said = said if _is_int(said) else None
            named = isinstance(given, str) and given != ""
            if said is not None and said in self.indices and not (
                    named and given not in self.ids and self.indices[said] in self.named and _names(call)):
                index = self.indices[said]
            elif said is None and named and given in self.ids:
                index = self.ids[given]
            elif said is not None or named or self.last is None or (self.last in self.names and _names(call)):
                index, self.next = self.next, self.next + 1  # (a call of its own)
                if said is not None and len(self.indices) < MAX_CALL_IDS:
                    self.indices[said] = index  # (the index a server gives every call names the last)
                if not named and given in (None, "") and _names(call):
                    # (Gemini's calls come with an empty id: a caller answering one had no tool_call_id to
                    # give; named as a whole answer's call is, and its pieces' ids after left out)
                    given = call["id"] = f"call_{self.run_id}_{index}"
                    named = True
            else:
                index = self.last
            if said != index:
                call["index"] = index
            if (named and index in self.named) or not (named or given is None or given == ""):
                del call["id"]  # (its call's id given: the client joins its pieces' ids, "aa"; or not text)
            elif named and len(self.ids) < MAX_CALL_IDS:
                self.ids[given] = index
                self.named.add(index)
            self.last = index
            function = call.get("function")
            if not isinstance(function, dict):
                continue
            if _names(call):
                first = self.names.get(index)
                if first == function["name"]:
                    del function["name"]  # (its call's name again: the client joins its pieces' names, "ff")
                elif first is None and len(self.names) < MAX_CALL_IDS:
                    self.names[index] = function["name"]
            _arguments_as_text(function)


def _without_nulls(call: Json) -> None:
    """A streamed call's piece without the nulls OpenAI's schema has not (SGLang gives each piece after
    its call's first an `id`, and its function a `name`, of null; the `openai` client's stream helper
    joins them): its `id`, `type`, `function` and the function's `name` and `arguments`."""
    _drop_nulls(call, ("id", "type", "function"))
    function = call.get("function")
    if isinstance(function, dict):
        _drop_nulls(function, ("name", "arguments"))


def _names(call: Json) -> bool:
    """A streamed call's piece names its function."""
    function = call.get("function")
    return isinstance(function, dict) and isinstance(function.get("name"), str) and function["name"] != ""


def _chat_choice(choice: Json, place: int, provider_id: str, calls: dict[int, StreamCalls], run_id: str,
                 indices: ChoiceIndices, functions: bool) -> None:
    """The slow path of a chunk's choice (`chat_chunks`): what is wrong with it repaired. `calls`: the
    stream's tool calls so far of each choice (`StreamCalls`), of the run `run_id`; `indices`: its
    choices' numbers; `functions`: the request used the legacy `functions` (`twice`)."""
    reason = choice.get("finish_reason")
    if reason is not None and not (type(reason) is str and reason in CHAT_REASONS):
        choice["finish_reason"] = _chat_reason(reason, provider_id, whole=False)
    elif "finish_reason" not in choice:
        choice["finish_reason"] = None
    said = choice.get("index")
    choice["index"] = indices.index(said if type(said) is int else place)  # (no integer: its place in the chunk)
    if not isinstance(choice.get("delta"), dict):
        choice["delta"] = {}
    _texts(choice["delta"], provider_id)
    _drop_nulls(choice["delta"], NOT_NULL_DELTA)
    if choice["delta"].get("tool_calls") is not None:
        # (a hostile server's million choice indices are not a million entries: past `MAX_CALL_IDS`, one more)
        state = calls.get(choice["index"]) or (calls.setdefault(choice["index"], StreamCalls(run_id))
                                               if len(calls) < MAX_CALL_IDS else StreamCalls(run_id))
        state.number(choice["delta"])
        twice(choice["delta"], functions)
    if choice.get("logprobs") is not None:
        _chat_logprobs(choice)


def chat_chunks(run_id: str, created: int, provider_id: str, asked: int = 1,
                functions: bool = False) -> Callable[[Json], None]:
    """What makes a streamed chat completion's chunk (its `choices`, if any, a list of objects) what
    OpenAI's streams have, in place: `object`, `id` and `created` where it has none that will do (the
    run's), and after the first chunk those of the first (some servers change them midway; clients
    take a stream for one answer), each choice's `finish_reason` (null while it goes on), `index` (0
    to `asked`-1, `ChoiceIndices`) and `delta`, its tool calls' `index` (`StreamCalls`) and a
    `function_call` beside them left out unless the request used `functions` (`twice`), its logprobs
    as in `_chat_logprobs`;
    a usage as `_usage` has it, and a `"usage": null` (vLLM's on each chunk when usage is asked for)
    left out. ProviderError when it cannot be (`_chat_reason`, `_texts`).

    Every chunk of every stream passes here: one that is already right costs a few lookups (no copy,
    nothing made), and only a wrong one goes the slow way. A delta of one field is not searched for a
    null (`None in delta.values()` cost ~130 ns a chunk, ~3 times the rest of the look at a delta;
    a lone `tool_calls` is looked at anyway): SGLang's and llama-cpp-python's nulls come beside
    others (`NOT_NULL_DELTA`)."""

    # (what the closure reads held in its cells, not looked up as globals and builtins each chunk; a
    # value's `__class__` read, not `type()` called: every value here came from JSON)
    kind, reasons, missing = CHUNK_OBJECT, CHAT_REASONS, _MISSING
    text, number, obj, array, size = str, int, dict, list, len
    #: the stream's tool calls so far, of each choice (a chunk that has some goes the slow way; an empty
    #: list of them, as some servers give every text chunk, says none)
    calls: dict[int, StreamCalls] = {}
    indices = ChoiceIndices(asked, provider_id)
    #: the server's indices kept as they came (a chunk's choice with one of them is already right)
    same = indices.same
    #: the stream's `id` and `created`: its first chunk's (None until it came)
    head_id: str | None = None
    head_created = 0

    def shape(chunk: Json) -> None:
        nonlocal head_id, head_created
        if chunk.get("object") != kind or chunk.get("id") != head_id \
                or (stamp := chunk.get("created")).__class__ is not number or stamp != head_created:
            if head_id is None:
                _head(chunk, kind, chat_id(run_id), created)
                head_id, head_created = chunk["id"], chunk["created"]
            else:
                chunk["object"], chunk["id"], chunk["created"] = kind, head_id, head_created
        if "usage" in chunk:
            if chunk["usage"] is None:
                del chunk["usage"]
            else:
                _usage(chunk, USAGE_PARTS)
        if "system_fingerprint" in chunk and chunk["system_fingerprint"].__class__ is not text:
            del chunk["system_fingerprint"]
        choices = chunk.get("choices")
        if choices is None:
            chunk["choices"] = []
            return
        place = 0
        for choice in choices:
            reason = choice.get("finish_reason", missing)
            if (reason is not None and (reason.__class__ is not text or reason not in reasons)) \
                    or (index := choice.get("index")).__class__ is not number \
                    or (index not in same and indices.index(index) != index) \
                    or (delta := choice.get("delta")).__class__ is not obj \
                    or (size(delta) > 1 and None in delta.values()) \
                    or ((content := delta.get("content")) is not None and content.__class__ is not text) \
                    or ((refusal := delta.get("refusal")) is not None and refusal.__class__ is not text) \
                    or ((tools := delta.get("tool_calls", missing)) is not missing
                        and (tools.__class__ is not array or tools)) \
                    or ((logprobs := choice.get("logprobs")) is not None
                        and (logprobs.__class__ is not obj or "refusal" not in logprobs or "content" not in logprobs)):
                _chat_choice(choice, place, provider_id, calls, run_id, indices, functions)
            place += 1

    return shape
