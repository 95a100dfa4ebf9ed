"""A chat completion run's answer as OpenAI's Responses API has it: one Response object, or the
stream of Response events (`response.created` … `response.completed`). Pure: no I/O.

What the chat answer's first choice holds becomes output items, in this order: its reasoning
(`reasoning_content` or `reasoning`) a `reasoning` item, its text and refusal one `message`
item, each tool call a `function_call` item. A `finish_reason` of `length` or `content_filter`
makes the Response `incomplete`. Usage is renamed (`input_tokens`, `output_tokens`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from common.chunks import MAX_COUNTED_TOKENS, token_counts
from common.jsonio import dumps, loads
from common.wire import ErrorCode
from gateway.errors import ApiError
from gateway.responses_places import Origin, caller_param

#: How many times a streamed call's arguments are parsed at most to see whether they are whole
#: (`ResponseShape._close_whole_calls`): each look parses them all, so a server that sends a call in
#: many pieces with a new call between each (a hostile one) costs a few parses of each, not one a piece.
_LOOKS = 4

#: The most output items a Response holds. A provider whose every chunk had reasoning and text
#: opened two new items a chunk, each with its events: 14 MB from the provider reached the caller
#: as 287 MB of events, and the gateway held 170 MB more for the Response (four such runs at once:
#: 680 MB). Past it the run ends with `output_too_large` (`TooManyItems`).
MAX_OUTPUT_ITEMS = 1024


class TooManyItems(Exception):
    """The answer would make a Response of more than `MAX_OUTPUT_ITEMS` output items. `before`: a
    stream's events made before it, of the items the Response holds."""

    def __init__(self) -> None:
        # (another try would only make as many again: the official clients are told so, as for the worker's
        # own output_too_large, `common.api_error.NOT_WORTH_RETRYING`)
        self.error = ApiError(ErrorCode.OUTPUT_TOO_LARGE, f"the provider's answer would make a Response of more "
                              f"than {MAX_OUTPUT_ITEMS} output items (reasoning, message and function_call items)",
                              headers={"x-should-retry": "false"})
        self.before = b""
        super().__init__(self.error.message)


#: a chat `finish_reason` that leaves the Response incomplete, and the reason it says
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def response_id(run_id: str) -> str:
    """The Response's id: the run's own, as OpenAI spells a Response's (`resp_…`)."""
    return "resp_" + run_id.removeprefix("run_")


def _usage(usage: Any) -> dict[str, Any] | None:
    if not isinstance(usage, dict):
        return None
    prompt, completion = (min(n, MAX_COUNTED_TOKENS) for n in token_counts(usage))
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": _detail(usage, "prompt_tokens_details", "cached_tokens",
                                                              prompt),
                                     "cache_write_tokens": 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": _detail(usage, "completion_tokens_details",
                                                                  "reasoning_tokens", completion)},
            "total_tokens": prompt + completion}


def _detail(usage: dict[str, Any], details: str, name: str, most: int) -> int:
    """A count of the usage's details, at most the count it is a part of (`most`)."""
    value = _obj(usage.get(details)).get(name)
    return min(value, most) if type(value) is int and value >= 0 else 0


def _obj(value: Any) -> dict[str, Any]:
    """An object of a provider's answer, or an empty one for anything else."""
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    """An array of a provider's answer, or an empty one for anything else (a `tool_calls` of `5`)."""
    return value if isinstance(value, list) else []


def _text_of(value: Any) -> str:
    """A chat message's text: a string, or the text of its parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(p["text"] for p in value if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _arguments(value: Any) -> str:
    """A tool call's arguments as the JSON text a Response holds: as they came when text; as JSON
    text when a server sent them as JSON (an object, say), not lost; none for null."""
    if value is None or isinstance(value, str):
        return value or ""
    return dumps(value).decode()


def _whole_json(text: str) -> bool:
    """Whether a streamed call's arguments so far are one whole JSON value (its last piece came:
    more would make it JSON no more)."""
    try:
        loads(text.encode())
    except (ValueError, RecursionError):  # (UnicodeError too: a lone surrogate in what a server sent)
        return False
    return True


def _error_code(error: ApiError) -> str:
    """A failed Response's `error.code` (OpenAI's schema has a fixed list; iop's own code is in the
    `error` event before it)."""
    return "rate_limit_exceeded" if error.code is ErrorCode.RATE_LIMIT_EXCEEDED else "server_error"


#: what tells a streamed tool call from the others: its `index`, its place in a delta, or its id
CallKey = int | tuple[str, str]

#: the delta event of each kind of text
_DELTA_EVENT = {"output_text": "response.output_text.delta", "refusal": "response.refusal.delta",
                "reasoning_text": "response.reasoning_text.delta"}


@dataclass(slots=True)
class _Writing:
    """An output item of a stream that is still being written."""

    item: dict[str, Any]
    #: its place in the output
    index: int
    #: the kind of its part being written (`output_text`, `refusal`, `reasoning_text`; None: none)
    part: str | None = None
    #: that part's text (a function call's: its arguments) as it came, joined once when it ends
    pieces: list[str] = field(default_factory=list)
    #: a function call's id as the provider gave it (None: it gave none yet), and its `index`
    given_id: str | None = None
    call_index: int | None = None
    #: a function call done (its `output_item.done` sent) before the stream's end
    closed: bool = False
    #: pieces of its arguments that came after that, joined to them once at the end (added one by one,
    #: each copied all the arguments before it again: 60,000 pieces held the gateway's thread 15 s)
    late: list[str] = field(default_factory=list)
    #: its arguments grew since they were last looked at, and how many more looks they get
    looks_left: int = _LOOKS


class ResponseShape:
    """One run's answer in the Responses API's shape. For a stream, it keeps the output items
    its events opened, and numbers the events."""

    def __init__(self, run_id: str, model_id: str, echo: dict[str, Any], created_at: float | None = None,
                 origins: Sequence[Origin] = ()) -> None:
        self.id = response_id(run_id)
        self._hex = run_id.removeprefix("run_")
        self.model_id = model_id
        self.echo = echo
        #: where each message of the chat completion run came from (`own_names`)
        self.origins = tuple(origins)
        self.created_at = int(created_at if created_at is not None else time.time())
        # (a stream's state)
        self._seq = 0
        self._started = False
        self._items: list[dict[str, Any]] = []
        #: the reasoning or message item being written
        self._open: _Writing | None = None
        #: each chat tool call (`_call_key`) -> its function_call item (open until the end)
        self._calls: dict[CallKey, _Writing] = {}
        #: the open calls whose arguments grew since `_close_whole_calls` last looked (only those are
        #: looked at: a look at every call each time a new one began cost quadratic time, 30 s of the
        #: gateway's CPU for a provider's 60,000 calls)
        self._grown: dict[CallKey, _Writing] = {}
        #: the ids the provider gave its tool calls -> the call's key; each `index` -> the key of the
        #: call that took it last; the key of the call last written
        self._call_ids: dict[str, CallKey] = {}
        self._by_index: dict[int, CallKey] = {}
        self._last_call: CallKey | None = None
        self._finish: str | None = None
        self._usage: Any = None
        #: the `index` of the chat choice the Response is made of: the first a chunk gave (0 from a server
        #: as OpenAI numbers them; a server that numbers its one choice 5 had its text dropped, the
        #: Response completed empty)
        self._index: Any = None

    # -- the Response object

    def _response(self, status: str, output: list[dict[str, Any]], usage: Any = None,
                  error: dict[str, Any] | None = None, finish: str | None = None) -> dict[str, Any]:
        incomplete = _INCOMPLETE.get(finish or "")
        if status == "completed" and incomplete is not None:
            status = "incomplete"
        body = {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None, "error": error,
                "incomplete_details": {"reason": incomplete} if status == "incomplete" else None,
                "model": self.model_id, "output": output, "previous_response_id": None, "store": False,
                "background": False, "service_tier": "default", **self.echo}
        shaped = _usage(usage)
        if shaped is not None:
            body["usage"] = shaped
        return body

    def whole(self, completion: Any) -> dict[str, Any]:
        """The Response of a whole chat completion."""
        choices = completion.get("choices") if isinstance(completion, dict) else None
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        message = _obj(choice.get("message"))
        finish = choice.get("finish_reason") if isinstance(choice.get("finish_reason"), str) else None
        status = "incomplete" if finish in _INCOMPLETE else "completed"
        output: list[dict[str, Any]] = []
        reasoning = _text_of(message.get("reasoning_content") or message.get("reasoning"))
        if reasoning:
            output.append(self._reasoning_item(reasoning, status, len(output)))
        text, refusal = _text_of(message.get("content")), message.get("refusal")
        calls = [c for c in _list(message.get("tool_calls")) if isinstance(c, dict)]
        if not calls and isinstance(message.get("function_call"), dict):  # (the legacy form, alone: a
            calls.append({"function": message["function_call"]})         # server may send both)
        parts = []
        if text or not (calls or refusal):
            parts.append(self._part_body("output_text", text))
        if isinstance(refusal, str) and refusal:
            parts.append(self._part_body("refusal", refusal))
        if len(output) + bool(parts) + len(calls) > MAX_OUTPUT_ITEMS:
            raise TooManyItems()
        if parts:
            output.append({**self._message_item(status, len(output)), "content": parts})
        given: set[Any] = set()
        for call in calls:
            function = _obj(call.get("function"))
            # (an id another call has already: this one gets an id of its own, as a Response's calls must)
            call_id = call.get("id") if isinstance(call.get("id"), str) and call["id"] not in given else None
            if call_id is not None:
                given.add(call_id)
            arguments = _arguments(function.get("arguments"))
            output.append(self._call_item(len(output), call_id, _text_of(function.get("name")), arguments, status))
        if status == "incomplete":  # (as a stream's items end: the one being written when it was cut, and a
            for item in output[:-1]:  # call whose arguments are not whole, are incomplete; those before, whole)
                if item["type"] != "function_call" or _whole_json(item["arguments"]):
                    item["status"] = "completed"
        usage = completion.get("usage") if isinstance(completion, dict) else None
        return self._response("completed", output, usage, finish=finish)

    # (an item's id: the run's, and the item's place in the output)
    def _reasoning_item(self, text: str, status: str, n: int) -> dict[str, Any]:
        return {"type": "reasoning", "id": f"rs_{self._hex}_{n}", "summary": [],
                "content": [{"type": "reasoning_text", "text": text}] if text else [], "status": status}

    def _message_item(self, status: str, n: int) -> dict[str, Any]:
        return {"type": "message", "id": f"msg_{self._hex}_{n}", "role": "assistant", "status": status,
                "content": []}

    def _call_item(self, n: int, call_id: Any, name: str, arguments: str, status: str) -> dict[str, Any]:
        return {"type": "function_call", "id": f"fc_{self._hex}_{n}",
                "call_id": call_id if isinstance(call_id, str) and call_id else f"call_{self._hex}_{n}",
                "name": name, "arguments": arguments, "status": status}

    @staticmethod
    def _part_body(kind: str, text: str) -> dict[str, Any]:
        if kind == "refusal":
            return {"type": "refusal", "refusal": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    # -- the stream of events

    def _event(self, kind: str, **fields: Any) -> bytes:
        fields["type"] = kind
        fields["sequence_number"] = self._seq
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + dumps(fields) + b"\n\n"

    def _start(self, out: list[bytes]) -> None:
        if not self._started:
            self._started = True
            opening = self._response("in_progress", [])
            out.append(self._event("response.created", response=opening))
            out.append(self._event("response.in_progress", response=opening))

    def opening(self) -> bytes:
        """`response.created` and `response.in_progress`, if they have not gone out (the stream's
        first bytes: with its first output, or its first keep-alive)."""
        out: list[bytes] = []
        self._start(out)
        return b"".join(out)

    def events(self, chunks: list[Any]) -> bytes:
        """The events of a delta's chat chunks (the opening events first, with the first output)."""
        out: list[bytes] = []
        self._start(out)
        try:
            for chunk in chunks:
                if not isinstance(chunk, dict):
                    continue
                if isinstance(chunk.get("usage"), dict):
                    self._usage = chunk["usage"]
                for choice in _list(chunk.get("choices")):
                    if not isinstance(choice, dict):
                        continue
                    if self._index is None:
                        self._index = choice.get("index", 0)
                    if choice.get("index", 0) == self._index:
                        self._choice(choice, out)
        except TooManyItems as exc:  # (the events of the items it holds go out before the error)
            exc.before = b"".join(out)
            raise
        return b"".join(out)

    def _choice(self, choice: dict[str, Any], out: list[bytes]) -> None:
        delta = _obj(choice.get("delta"))
        # (text as a string or as text parts, as in a whole answer)
        reasoning = _text_of(delta.get("reasoning_content") or delta.get("reasoning"))
        if reasoning:
            self._write("reasoning", "reasoning_text", reasoning, out)
        content = _text_of(delta.get("content"))
        if content:
            self._write("message", "output_text", content, out)
        refusal = delta.get("refusal")
        if isinstance(refusal, str) and refusal:
            self._write("message", "refusal", refusal, out)
        calls = _list(delta.get("tool_calls"))
        if not calls and isinstance(delta.get("function_call"), dict):  # (the legacy form, alone)
            calls = [{"index": 0, "function": delta["function_call"]}]
        for position, call in enumerate(calls):
            if isinstance(call, dict):
                self._call(call, position, out)
        if isinstance(choice.get("finish_reason"), str):
            self._finish = choice["finish_reason"]

    def _write(self, item_kind: str, part_kind: str, text: str, out: list[bytes]) -> None:
        """Text of a reasoning or message item: opens the item and its part when they are not open."""
        if self._open is None or self._open.item["type"] != item_kind:
            self._close(out, "completed")
            self._close_whole_calls(out)
            n = len(self._items)
            item = (self._reasoning_item("", "in_progress", n) if item_kind == "reasoning"
                    else self._message_item("in_progress", n))
            self._open = self._add(item, out)
        open_ = self._open
        item = open_.item
        if open_.part != part_kind:
            self._close_part(open_, out)
            open_.part, open_.pieces = part_kind, []
            if item_kind == "message":
                out.append(self._event("response.content_part.added", item_id=item["id"], output_index=open_.index,
                                       content_index=len(item["content"]), part=self._part_body(part_kind, "")))
        if not text:  # (an empty answer's message: opened, no delta)
            return
        open_.pieces.append(text)
        extra: dict[str, Any] = {"logprobs": []} if part_kind == "output_text" else {}
        out.append(self._event(_DELTA_EVENT[part_kind], item_id=item["id"], output_index=open_.index,
                               content_index=len(item["content"]), delta=text, **extra))

    def _add(self, item: dict[str, Any], out: list[bytes]) -> _Writing:
        """A new output item, announced."""
        if len(self._items) >= MAX_OUTPUT_ITEMS:
            raise TooManyItems()
        writing = _Writing(item, len(self._items))
        out.append(self._event("response.output_item.added", output_index=writing.index, item=dict(item)))
        self._items.append(item)
        return writing

    def _close_part(self, open_: _Writing, out: list[bytes]) -> None:
        """End the open item's part being written (its text joined once, here)."""
        kind, open_.part = open_.part, None
        if kind is None:
            return
        text, open_.pieces = "".join(open_.pieces), []
        item = open_.item
        where = {"item_id": item["id"], "output_index": open_.index, "content_index": len(item["content"])}
        if kind == "reasoning_text":
            item["content"].append({"type": "reasoning_text", "text": text})
            out.append(self._event("response.reasoning_text.done", **where, text=text))
            return
        part = self._part_body(kind, text)
        item["content"].append(part)
        if kind == "refusal":
            out.append(self._event("response.refusal.done", **where, refusal=text))
        else:
            out.append(self._event("response.output_text.done", **where, text=text, logprobs=[]))
        out.append(self._event("response.content_part.done", **where, part=part))

    def _close(self, out: list[bytes], status: str) -> None:
        """End the reasoning or message item being written."""
        if self._open is None:
            return
        open_, self._open = self._open, None
        self._close_part(open_, out)
        open_.item["status"] = status
        out.append(self._event("response.output_item.done", output_index=open_.index, item=open_.item))

    def _call_key(self, call: dict[str, Any], position: int, call_id: str | None, names_function: bool) -> CallKey:
        """Which tool call a streamed piece of one belongs to. OpenAI's chunks number each call
        (`index`) and give its `id` with its first piece; some servers send no `index` (Ollama's,
        Gemini's) or the same one for every call, each call whole with its function's name: an id
        not seen before that names a function is a call of its own. (Other servers give each piece
        of one call an id of its own, the function named once: such a piece goes on with its
        index's call.) An `index` alone names the call that took it last. A piece with neither
        continues the call written last (the first of a delta's pieces; the others are told apart
        by their place in it)."""
        index: int | None = call["index"] if type(call.get("index")) is int else None
        if call_id is not None:
            known = self._call_ids.get(call_id)
            if known is not None and (index is None or self._calls[known].call_index in (None, index)):
                return known
            if index is not None:
                current = self._by_index.get(index)
                if current is None:
                    return index if index not in self._calls else ("id", call_id)
                if self._calls[current].given_id in (None, call_id) or not names_function:
                    return current
            return ("id", call_id)  # a call of its own
        if index is not None:
            return self._by_index.get(index, index)
        return self._last_call if position == 0 and self._last_call is not None else position

    def _call(self, call: dict[str, Any], position: int, out: list[bytes]) -> None:
        function = _obj(call.get("function"))
        call_id = call["id"] if isinstance(call.get("id"), str) and call["id"] else None
        name = _text_of(function.get("name"))
        key = self._call_key(call, position, call_id, bool(name))
        writing = self._calls.get(key)
        if writing is None:
            self._close(out, "completed")
            self._close_whole_calls(out)
            # (an id another call has already: this one gets an id of its own, as a Response's calls must)
            given = None if call_id in self._call_ids else call_id
            item = self._call_item(len(self._items), given, name, "", "in_progress")
            writing = self._calls[key] = self._add(item, out)
            if type(call.get("index")) is int:
                self._by_index[call["index"]] = key
                writing.call_index = call["index"]
        elif isinstance(function.get("name"), str) and not writing.item["name"]:
            writing.item["name"] = function["name"]
        if call_id is not None and writing.given_id is None:
            writing.given_id = call_id
            self._call_ids.setdefault(call_id, key)
        self._last_call = key
        arguments = _arguments(function.get("arguments"))  # (JSON, an object say: as its text, not lost)
        if arguments and writing.closed:  # (after its arguments were whole: kept in the Response, not lost)
            writing.late.append(arguments)
        elif arguments:
            writing.pieces.append(arguments)
            if writing.looks_left:
                self._grown[key] = writing
            out.append(self._event("response.function_call_arguments.delta", item_id=writing.item["id"],
                                   output_index=writing.index, delta=arguments))

    def _close_call(self, writing: _Writing, out: list[bytes], status: str) -> None:
        item = writing.item
        item["arguments"], item["status"] = "".join(writing.pieces), status
        writing.closed, writing.pieces = True, []
        out.append(self._event("response.function_call_arguments.done", item_id=item["id"], name=item["name"],
                               output_index=writing.index, arguments=item["arguments"]))
        out.append(self._event("response.output_item.done", output_index=writing.index, item=item))

    def _close_whole_calls(self, out: list[bytes]) -> None:
        """Before a new item is added: the calls whose arguments are whole are done, as OpenAI's
        stream ends each item before it adds the next (servers send a call's pieces in a row; one
        whose arguments are not whole yet may get more after the next call begins, as from a
        server that interleaves them: it stays open until the end). A call's arguments are looked at
        when they grew since the last look, `_LOOKS` times at most."""
        grown, self._grown = self._grown, {}
        for writing in sorted(grown.values(), key=lambda w: w.index):  # (in the order the calls began)
            if writing.closed:
                continue
            writing.looks_left -= 1
            if _whole_json("".join(writing.pieces)):
                self._close_call(writing, out, "completed")

    def _close_all(self, out: list[bytes], status: str) -> None:
        self._close(out, status)
        for writing in self._calls.values():
            if not writing.closed:
                self._close_call(writing, out, status)
            elif writing.late:
                writing.item["arguments"] += "".join(writing.late)
                writing.late = []
        self._calls.clear()
        self._grown.clear()

    def completed(self) -> bytes:
        """The end of a stream whose run completed: every item done, then `response.completed`
        (`response.incomplete` when the output was cut at its limit)."""
        out: list[bytes] = []
        self._start(out)
        if not (self._calls or any(item["type"] == "message" for item in self._items)):
            self._write("message", "output_text", "", out)  # (no text and no call: an empty one, as `whole` has)
        incomplete = self._finish in _INCOMPLETE
        self._close_all(out, "incomplete" if incomplete else "completed")
        response = self._response("completed", self._items, self._usage, finish=self._finish)
        out.append(self._event("response.incomplete" if incomplete else "response.completed", response=response))
        return b"".join(out)

    def own_names(self, error: ApiError) -> ApiError:
        """`error` naming the field at fault as the Responses request wrote it: a worker's refusal
        names its chat completion run's (`messages[1].tool_calls[0].function.arguments`, where the
        caller wrote `input[1].arguments`). Names of no chat field are left as they are."""
        if error.detail is not None and isinstance(error.detail.get("param"), str):
            error.detail = {**error.detail, "param": caller_param(error.detail["param"], self.origins)}
        if error.param is not None:
            error.param = caller_param(error.param, self.origins)
        return error

    def failed(self, error: ApiError) -> bytes:
        """The end of a stream whose run failed: its items end incomplete, then an `error` event
        (iop's code and message) and `response.failed`."""
        out: list[bytes] = []
        self._start(out)
        self._close_all(out, "incomplete")
        told = self.own_names(error).body()["error"]  # (a provider's own 4xx as it came)
        out.append(self._event("error", code=told["code"], message=told["message"], param=told["param"]))
        failure = {"code": _error_code(error), "message": told["message"]}
        out.append(self._event("response.failed", response=self._response("failed", self._items, self._usage,
                                                                           error=failure)))
        return b"".join(out)
