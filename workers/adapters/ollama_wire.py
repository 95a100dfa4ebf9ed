"""Pure conversions between OpenAI-shaped requests/answers and Ollama's native API
(`/api/chat`, `/api/generate`, `/api/embed`). No I/O here; `ollama.py` does the HTTP.

Request fields that have an Ollama equivalent are mapped (`max_tokens` ->
`options.num_predict`, `temperature`, `top_p`, `seed`, `stop`, penalties,
`response_format` -> `format`, `tools` (left out with `tool_choice: "none"`, only the named
ones with a named function or `allowed_tools`), a chat's `reasoning_effort` -> `think`; a `developer`
message goes as `system`; log probabilities: a chat's `logprobs` and `top_logprobs`, a legacy
completion's `logprobs: k` as `logprobs: true, top_logprobs: k`; its `echo` by the adapter, which puts
the prompt before the answer); Ollama's own `options`, `keep_alive`, `think`,
`raw`, `suffix` and `truncate` pass through; other OpenAI fields have no native meaning
and are dropped.
"""

from __future__ import annotations

import json
import re
from typing import Any

from common import jsonio
from common.capabilities import asks_several_choices
from common.shown import shown
from common.wire import RunKind
from workers.adapters.embeddings import are_numbers, base64_vector
from workers.adapters.openai_shapes import usage
from workers.adapters.reading import MAX_DEPTH, deeper_than

Json = dict[str, Any]

#: OpenAI request field -> Ollama `options` field
OPTION_FIELDS = {
    "max_tokens": "num_predict",
    "max_completion_tokens": "num_predict",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repeat_penalty",
}
#: Ollama's refusal of an option of the wrong type (`Options.FromMap`, api/types.go:991-1090), which its
#: handlers answer 500 (`handleScheduleError`'s default, server/routes.go:3117), though it is the request's
OPTION_REFUSED = re.compile(r'option "([a-z_]{1,64})" must be (?:of type [a-z0-9]{1,16}|of an array of strings)')


#: Ollama's refusal of a run of a cloud model (a pulled manifest naming a remote host) that it cannot run,
#: whatever the request: cloud disabled there (`OLLAMA_NO_CLOUD`: 403, server/routes.go:2518-2522), its
#: host not among `OLLAMA_REMOTES` (400, routes.go:2531-2535)
CLOUD_REFUSED = re.compile(r"ollama cloud is disabled\b.*|this server cannot run this remote model")


#: What Ollama's `/api/embed` answers 400 though the request is not at fault: `EmbedHandler` answers 400
#: to every error of an input's embedding that is no status of its runner's (server/routes.go:1000-1014),
#: its runner's own failures among them (`llamaServerRunner.Embedding`, llm/llama_server.go:2338-2433;
#: `getServerStatus`, 1192-1252; `getServerStatusRetry`, 1254-1270; `tokenize`, 2481-2526): a runner that
#: died while it embedded (`do embedding request: Post "…": EOF`), one whose process is gone, that does
#: not answer, that sent what it could not read, or a vector that is not numbers. (Its 400s of the
#: caller's: an input over the context, a field of the wrong type.)
EMBED_RUNNER_FAILED = re.compile(
    r"(?:do embedding request|llama-server process no longer running|server not responding|connection refused"
    r"|health resp|read health response|health unmarshal|llama-server error|unexpected server status"
    r"|no slots available after|error (?:marshaling|creating|reading) embed|unmarshal embedding"
    r"|empty embedding response|embedding contains NaN or Inf values|(?:de)?tokenize error"
    r"|model runner has unexpectedly stopped|Post \"https?://(?:127\.0\.0\.1|localhost|\[::1\]):[0-9]{1,5}/)")


def cloud_refusal(status: int, payload: Any, message: str) -> str | None:
    """Why Ollama cannot run the cloud model a run named, as a few words for its error (None: this is
    no such refusal): `CLOUD_REFUSED`, or ollama.com's 401 to an Ollama not signed in, which it passes
    on with the link to sign it in (`{"error": "unauthorized", "signin_url": …}`, routes.go:2583-2597;
    not iop's credentials, which a server behind a proxy or ollama.com's API refuses without one)."""
    if status == 401 and isinstance(payload, dict) and "signin_url" in payload:
        return "it is not signed in to ollama.com, which runs this cloud model: `ollama signin` there"
    if status in (400, 403) and CLOUD_REFUSED.fullmatch(message):
        return "it does not run this cloud model"
    return None


def runner_error(error: Any) -> Any:
    """The `error` of Ollama's answer, or of a line of its stream, as its runner said it: Ollama passes
    llama-server's error answer on as the text of its own (`llamaServerRunner.statusErrorMessage`,
    llm/llama_server.go:1646-1655, 1782-1794: the body, trimmed), so a prompt over the context is
    `{"error": "{\"error\":{\"code\":400,\"message\":\"request (9000 tokens) exceeds …\"}}"}`:
    the inner error object when the text is one (`{"error": {…, "message": "…"}}`), else `error`."""
    if not (isinstance(error, str) and error.startswith("{") and error.endswith("}")):
        return error
    try:
        inner = json.loads(error)
    except (ValueError, RecursionError):
        return error
    found = inner.get("error") if isinstance(inner, dict) else None
    return found if isinstance(found, dict) and isinstance(found.get("message"), str) and found["message"] else error


def option_field(body: Json, option: str) -> str:
    """Where the request wrote the `option` Ollama refused: in its own `options` (which win), else
    the OpenAI field iop maps to it (`temperature`, `max_tokens` for `num_predict`, `stop`)."""
    options = body.get("options")
    if isinstance(options, dict) and option in options:
        return f"options.{option}"
    fields = [name for name, native in OPTION_FIELDS.items() if native == option] + ["stop"] * (option == "stop")
    return next((name for name in fields if body.get(name) is not None), f"options.{option}")


#: fields of Ollama's own API that a caller may send and that pass through as they are
NATIVE_FIELDS = ("keep_alive", "think", "raw", "suffix", "truncate", "dimensions")


class BadAnswer(ValueError):
    """An answer that is JSON but not what Ollama's API gives: what is wrong with it, as the words
    after "answered" (`embeddings without an 'embeddings' list`); the adapter names the provider."""


class UnsupportedRequest(ValueError):
    """The request asks for something Ollama's API cannot do (a 400 for the caller)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _options(body: Json) -> Json:
    options: Json = {}
    for name, native in OPTION_FIELDS.items():
        if body.get(name) is not None:
            options[native] = body[name]
    stop = body.get("stop")
    if isinstance(stop, str):
        options["stop"] = [stop]
    elif isinstance(stop, list):
        options["stop"] = stop
    if isinstance(body.get("options"), dict):
        options.update(body["options"])  # the caller's native options win
    return options


def _format(body: Json) -> Any:
    fmt = body.get("response_format")
    if not isinstance(fmt, dict):
        return body.get("format")
    if fmt.get("type") == "json_object":
        return "json"
    if fmt.get("type") == "json_schema":
        schema = fmt.get("json_schema")
        return schema.get("schema") if isinstance(schema, dict) else None
    return None


def _logprobs_asked(kind: RunKind, body: Json) -> Json:
    """OpenAI's ask for log probabilities in Ollama's words (Ollama 0.12.11 and later): a chat's
    `logprobs: true` and its `top_logprobs` as they are; a legacy completion's `logprobs: k` (the
    alternatives wanted at each token) as `logprobs: true, top_logprobs: k`."""
    asked = body.get("logprobs")
    if kind is RunKind.CHAT:
        if asked is not True:
            return {}
        top = body.get("top_logprobs")
        return {"logprobs": True} if top is None else {"logprobs": True, "top_logprobs": top}
    if asked is None or asked is False:
        return {}
    if type(asked) is not int:
        raise UnsupportedRequest("'logprobs' of a completion must be a whole number of alternatives from 0 to 20",
                                 "logprobs")
    return {"logprobs": True, "top_logprobs": asked}


def _common(body: Json, kind: RunKind) -> Json:
    if asks_several_choices(body):
        raise UnsupportedRequest("Ollama returns one choice per request; 'n' must be 1", "n")
    native: Json = {"model": body["model"], **_logprobs_asked(kind, body)}
    options = _options(body)
    if options:
        native["options"] = options
    fmt = _format(body)
    if fmt is not None:
        native["format"] = fmt
    native.update({k: body[k] for k in NATIVE_FIELDS if k in body})
    return native


def _content(content: Any, path: str) -> tuple[str, list[str]]:
    """OpenAI message content -> (text, base64 images)."""
    if content is None or isinstance(content, str):
        return content or "", []
    if not isinstance(content, list):
        raise UnsupportedRequest("a message's content must be a string or a list of content parts", path)
    texts, images = [], []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text = part.get("text", "")
            if not isinstance(text, str):  # (it went to the model as a Python repr)
                raise UnsupportedRequest("a text part's text must be a string", f"{path}[{i}].text")
            texts.append(text)
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not (isinstance(url, str) and url.startswith("data:") and ";base64," in url):
                raise UnsupportedRequest("Ollama takes images only as base64 data URLs", f"{path}[{i}].image_url")
            images.append(url.split(";base64,", 1)[1])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):  # (an assistant's, replayed)
            texts.append(part["refusal"])
        elif not isinstance(part, dict):
            raise UnsupportedRequest(f"Ollama takes content parts as objects, not {shown(part)}", f"{path}[{i}]")
        else:  # (audio, a file, a part of a kind to come: the model would not see it)
            what = f"a {shown(kind)} part" if kind is not None else "a part without a type"
            raise UnsupportedRequest(f"Ollama takes text and images, not {what}", f"{path}[{i}]")
    return "\n".join(texts), images


def _arguments(args: Any) -> str:
    """A tool call's arguments as the JSON text OpenAI's clients parse (NaN and Infinity, which
    JSON has not, as null)."""
    try:
        return json.dumps(args, allow_nan=False)
    except ValueError:
        return jsonio.dumps(args).decode()


def _function(call: Any) -> Json:
    """A tool call's `function` object ({} when the call or it is not an object)."""
    fn = call.get("function") if isinstance(call, dict) else None
    return fn if isinstance(fn, dict) else {}


def _native_tool_calls(calls: Any, path: str, parse: bool = True) -> list[Json]:
    """OpenAI's tool calls of an earlier turn (arguments as JSON text) -> Ollama's (as an object).
    Arguments that are not JSON go as {}; JSON nested deeper than `MAX_DEPTH` is the caller's
    error (it was a RecursionError in the worker, and a 502 blamed on the provider). Not `parse`:
    the arguments stay as they came (a check of what would be refused, which leaves them to the
    worker: JSON text escapes the body's limits on depth and containers)."""
    out = []
    for j, call in enumerate(calls if isinstance(calls, list) else []):
        fn = _function(call)
        args = fn.get("arguments")
        if isinstance(args, str) and parse:
            too_deep = False
            try:
                args = json.loads(args) if args else {}
            except ValueError:
                args = {}
            except RecursionError:
                too_deep = True
            if too_deep or deeper_than(args, MAX_DEPTH):
                raise UnsupportedRequest(f"a tool call's arguments nest deeper than {MAX_DEPTH} levels",
                                         f"{path}[{j}].function.arguments")
        native: Json = {"function": {"name": fn.get("name"), "arguments": args or {}}}
        if isinstance(call, dict) and isinstance(call.get("id"), str):  # (its result names it: `_messages`)
            native["id"] = call["id"]
        out.append(native)
    return out


#: OpenAI message roles Ollama's chat templates do not know -> the role they mean
ROLES = {"developer": "system"}


def _replayed_thinking(msg: Json) -> str | None:
    """The reasoning an earlier turn is replayed with, for Ollama's `thinking` (a thinking model's
    template renders it back): its `reasoning`, as Ollama's own OpenAI layer reads it, else its
    `reasoning_content`, the name iop's answers give Ollama's thinking (and vLLM's)."""
    for name in ("reasoning", "reasoning_content"):
        if isinstance(msg.get(name), str):
            return str(msg[name])
    return None


def _messages(messages: Any, parse_arguments: bool = True) -> list[Json]:
    """OpenAI's messages -> Ollama's. A `developer` message (OpenAI's newer name for `system`)
    goes as `system`; a tool result names its tool (`tool_name`): from its `name`, else from the
    earlier assistant call its `tool_call_id` answers. An earlier turn's reasoning goes as its
    `thinking` (`_replayed_thinking`). Call ids go as they came (a call's `id`, a
    result's `tool_call_id`), as Ollama's own OpenAI layer passes them: its chat templates and
    renderers read them to tell the results of several calls of one turn apart."""
    out = []
    called: dict[str, str] = {}  # tool call id -> the function's name
    for i, msg in enumerate(messages if isinstance(messages, list) else []):
        if not isinstance(msg, dict):
            continue
        text, images = _content(msg.get("content"), f"messages[{i}].content")
        role = msg.get("role", "user")
        native: Json = {"role": ROLES.get(role, role) if isinstance(role, str) else role, "content": text}
        if images:
            native["images"] = images
        thinking = _replayed_thinking(msg)
        if thinking:
            native["thinking"] = thinking
        if msg.get("tool_calls"):
            native["tool_calls"] = _native_tool_calls(msg["tool_calls"], f"messages[{i}].tool_calls", parse_arguments)
            for call in msg["tool_calls"] if isinstance(msg["tool_calls"], list) else []:
                name = _function(call).get("name")
                if isinstance(call, dict) and isinstance(call.get("id"), str) and isinstance(name, str):
                    called[call["id"]] = name
        if role == "tool":
            call_id = msg.get("tool_call_id")
            name = msg.get("name") or (called.get(call_id) if isinstance(call_id, str) else None)
            if name:
                native["tool_name"] = name
            if isinstance(call_id, str):
                native["tool_call_id"] = call_id
        out.append(native)
    return out


#: OpenAI's `reasoning_effort` -> Ollama's `think`, as Ollama's own OpenAI layer maps it
#: (openai/openai.go `thinkFromReasoningEffort`): "none" turns thinking off, the efforts past either
#: end of Ollama's scale are its nearest tier. An effort not here is dropped (thinking left at the
#: model's default), as every OpenAI field with no Ollama meaning is.
THINK_OF_EFFORT: dict[str, bool | str] = {"none": False, "minimal": "low", "low": "low", "medium": "medium",
                                          "high": "high", "max": "max", "xhigh": "max", "ultra": "max"}


def _think(body: Json) -> bool | str | None:
    """The `think` a chat's reasoning effort asks for: its `reasoning.effort` first, else its
    `reasoning_effort`, as Ollama's own OpenAI layer reads them (`FromChatRequest`); None: none."""
    reasoning = body.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else body.get("reasoning_effort")
    return THINK_OF_EFFORT.get(effort) if isinstance(effort, str) else None


def chat_request(body: Json, stream: bool, parse_arguments: bool = True) -> Json:
    native = _common(body, RunKind.CHAT)
    think = _think(body)
    if think is not None and "think" not in native:  # (the caller's own `think` wins)
        native["think"] = think
    native["messages"] = _messages(body.get("messages"), parse_arguments)
    if body.get("tools") and body.get("tool_choice") != "none":  # ("none": the model calls no tool)
        native["tools"] = offered_tools(body["tools"], body.get("tool_choice"))
    native["stream"] = stream
    return native


def offered_tools(tools: Any, choice: Any) -> Any:
    """The tools the model may call: those a `tool_choice` names (one function, or OpenAI's
    `allowed_tools`), which is as close as Ollama comes to a choice it cannot be told (it cannot
    be made to call one); all of them when it names none of them, or none at all."""
    if not isinstance(tools, list) or not isinstance(choice, dict):
        return tools
    if choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        named = [choice["function"].get("name")]
    elif choice.get("type") == "allowed_tools" and isinstance(choice.get("allowed_tools"), dict):
        allowed = choice["allowed_tools"].get("tools")
        named = [t["function"].get("name") for t in allowed if _function_of(t) is not None] \
            if isinstance(allowed, list) else []
    else:
        return tools
    kept = [t for t in tools if (f := _function_of(t)) is not None and f.get("name") in named]
    return kept or tools


def _function_of(tool: Any) -> Json | None:
    function = tool.get("function") if isinstance(tool, dict) else None
    return function if isinstance(function, dict) else None


def _prompt(body: Json) -> str:
    """A legacy completion's one text prompt (a list of one is that one)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise UnsupportedRequest("Ollama takes one text prompt per request", "prompt")
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise UnsupportedRequest("Ollama takes a text prompt", "prompt")
    if not prompt:  # (its /api/generate only loads the model for one: `done_reason` "load", no text)
        raise UnsupportedRequest("Ollama generates nothing for an empty prompt (it only loads the model)", "prompt")
    return prompt


def echoed(kind: RunKind, body: Json) -> str:
    """The prompt a legacy completion's `echo: true` asks to have before its answer's text, as OpenAI's
    and vLLM's give it ("" for none): Ollama has no `echo`, and the adapter adds it."""
    return _prompt(body) if kind is RunKind.COMPLETION and body.get("echo") is True else ""


def generate_request(body: Json, stream: bool) -> Json:
    prompt = _prompt(body)
    if body.get("echo") is True and body.get("logprobs") not in (None, False):
        # (echoed, the prompt's tokens come with their log probabilities too, which Ollama cannot give)
        raise UnsupportedRequest("Ollama cannot give the prompt's log probabilities, which 'echo' with 'logprobs' "
                                 "asks for", "echo")
    native = _common(body, RunKind.COMPLETION)
    native["prompt"] = prompt
    native["stream"] = stream
    return native


def embed_request(body: Json) -> Json:
    inputs = body.get("input")
    if not (isinstance(inputs, str) or (isinstance(inputs, list) and all(isinstance(x, str) for x in inputs))):
        raise UnsupportedRequest("Ollama embeds text: 'input' must be a string or a list of strings", "input")
    if inputs == "":  # (its /api/embed takes it for no input: a 200 with no embeddings, routes.go:823-826, 862-865)
        raise UnsupportedRequest("Ollama embeds nothing for an empty input: 'input' must not be empty", "input")
    native: Json = {"model": body["model"], "input": inputs}
    if isinstance(body.get("options"), dict):
        native["options"] = body["options"]
    native.update({k: body[k] for k in NATIVE_FIELDS if k in body})
    return native


def request(kind: RunKind, body: Json, stream: bool, parse_arguments: bool = True) -> tuple[str, Json]:
    """The native path and body for an OpenAI-shaped run (`parse_arguments`: see `_native_tool_calls`)."""
    if kind is RunKind.CHAT:
        return "/api/chat", chat_request(body, stream, parse_arguments)
    if kind is RunKind.COMPLETION:
        return "/api/generate", generate_request(body, stream)
    return "/api/embed", embed_request(body)


# ------------------------------------------------------------------ answers


def _text(value: Any) -> str:
    """Generated text: a string as it is; nothing for anything else (never a Python repr)."""
    return value if isinstance(value, str) else ""


def text_of(kind: RunKind, native: Json) -> str:
    if kind is RunKind.CHAT:
        message = native.get("message")
        return _text(message.get("content")) if isinstance(message, dict) else ""
    return _text(native.get("response"))


def thinking_of(native: Json) -> str:
    message = native.get("message")
    return _text(message.get("thinking")) if isinstance(message, dict) else ""


def tool_calls_of(native: Json, request_id: str, first_index: int = 0,
                  stream: bool = False) -> tuple[list[Json], int]:
    """Ollama's tool calls of a chat (arguments as an object) -> OpenAI's (arguments as a JSON
    object's text), numbered from `first_index`; and how many entries were none (`_call_of`):
    those are dropped, as no caller's client could run them."""
    message = native.get("message")
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    out: list[Json] = []
    dropped = 0
    for call in calls if isinstance(calls, list) else []:
        found = _call_of(call)
        if found is None:
            dropped += 1
            continue
        index = first_index + len(out)
        item: Json = {"id": f"call_{request_id}_{index}", "type": "function",
                      "function": {"name": found[0], "arguments": found[1]}}
        if stream:
            item["index"] = index
        out.append(item)
    return out, dropped


def _call_of(call: Any) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of one of Ollama's tool calls; None when it is none: not an
    object, no `function` object, a name that is not a string or is empty, or arguments that are not
    a JSON object (nor missing or null: `{}`). Arguments given as JSON text (Ollama's are an object)
    are taken if they are an object's, written again."""
    fn = _function(call)
    name, args = fn.get("name"), fn.get("arguments")
    if not isinstance(name, str) or not name:
        return None
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
        if deeper_than(args, MAX_DEPTH):
            return None
    if args is None:
        args = {}
    return (name, _arguments(args)) if isinstance(args, dict) else None


def _token(entry: Any) -> Json | None:
    """One token's log probability as OpenAI writes it (token, logprob, its UTF-8 bytes); None for
    an entry that is not one (never a Python repr)."""
    if not isinstance(entry, dict):
        return None
    token, logprob, raw = entry.get("token"), entry.get("logprob"), entry.get("bytes")
    if not isinstance(token, str) or isinstance(logprob, bool) or not isinstance(logprob, int | float):
        return None
    if not (isinstance(raw, list) and all(type(b) is int and 0 <= b <= 255 for b in raw)):
        raw = list(token.encode("utf-8", "backslashreplace"))
    try:
        value: float | int = float(logprob)
    except OverflowError:  # (an integer beyond any float: carried as it came, which fails the run as
        value = logprob    # the OpenAI family's does, "an integer beyond 64 bits")
    return {"token": token, "logprob": value, "bytes": raw}


class Logprobs:
    """An answer's log probabilities from Ollama's (`logprobs`: token, logprob, bytes, and
    `top_logprobs`, of the tokens of each line), OpenAI-shaped: a chat's `{"content": [...],
    "refusal": null}`; a legacy completion's `tokens`, `token_logprobs`, `top_logprobs` (a token ->
    logprob object a position) and `text_offset` (where each token starts in the prompt and the
    answer's text, counted over a stream's lines)."""

    def __init__(self, kind: RunKind, body: Json) -> None:
        """`body`: the run's request (a legacy completion's offsets count from its prompt's start, as
        OpenAI's and llama.cpp's do: the first token's is the prompt's length)."""
        self.kind = kind
        self.offset = len(_prompt(body)) if kind is RunKind.COMPLETION else 0

    def of(self, native: Json) -> Json | None:
        """Those of one line (None: it has none)."""
        entries = native.get("logprobs")
        if not isinstance(entries, list):
            return None
        content = []
        for entry in entries:
            token = _token(entry)
            if token is not None:
                tops = entry.get("top_logprobs")
                token["top_logprobs"] = [t for t in map(_token, tops) if t] if isinstance(tops, list) else []
                content.append(token)
        if not content:
            return None
        if self.kind is RunKind.CHAT:
            return {"content": content, "refusal": None}
        offsets = []
        for token in content:
            offsets.append(self.offset)
            self.offset += len(token["token"])
        return {"tokens": [t["token"] for t in content], "token_logprobs": [t["logprob"] for t in content],
                "top_logprobs": [{a["token"]: a["logprob"] for a in t["top_logprobs"]} for t in content],
                "text_offset": offsets}


class Merged:
    """A whole answer of Ollama's made of the lines of its stream, as Ollama makes its own (`writeChatResponse`,
    server/routes.go:2387-2433; the generate handler's alike): the texts (a chat's `message.content` and
    `thinking`, a completion's `response` and `thinking`) joined, the tool calls and log probabilities of
    every line in order, the rest as the last line has it (`done`, `done_reason`, the counts)."""

    TEXTS = ("content", "thinking")

    def __init__(self) -> None:
        self.answer: Json = {}
        self.texts: dict[str, list[str]] = {}
        self.calls: list[Any] = []
        self.logprobs: list[Any] = []
        self.messages = False  # (a chat's lines: each with its `message`)

    def add(self, line: Json) -> None:
        message = line.get("message")
        if isinstance(message, dict):
            self.messages = True
            for name in self.TEXTS:
                self.texts.setdefault(name, []).append(_text(message.get(name)))
            if isinstance(message.get("tool_calls"), list):
                self.calls.extend(message["tool_calls"])
        for name in ("response", "thinking"):
            self.texts.setdefault(f"_{name}", []).append(_text(line.get(name)))
        if isinstance(line.get("logprobs"), list):
            self.logprobs.extend(line["logprobs"])
        self.answer = line

    def whole(self) -> Json:
        """The answer (that of no line at all: `{}`, not done)."""
        answer = dict(self.answer)
        if self.messages:
            message = dict(answer["message"]) if isinstance(answer.get("message"), dict) else {"role": "assistant"}
            for name in self.TEXTS:
                message[name] = "".join(self.texts.get(name, []))
            message["tool_calls"] = self.calls
            answer["message"] = message
        for name in ("response", "thinking"):
            answer[name] = "".join(self.texts.get(f"_{name}", []))
        answer["logprobs"] = self.logprobs or None
        return answer


def finish_reason(native: Json, saw_tool_calls: bool) -> str:
    if saw_tool_calls:
        return "tool_calls"
    return "length" if native.get("done_reason") == "length" else "stop"


def usage_of(native: Json) -> Json:
    def count(name: str) -> int:
        value = native.get(name)
        return value if type(value) is int and value >= 0 else 0

    return usage(count("prompt_eval_count"), count("eval_count"))


def _encode(vector: Any, encoding_format: Any) -> list[float] | str:
    if not isinstance(vector, list) or not are_numbers(vector):
        raise BadAnswer("embeddings with an embedding that is not a list of numbers")
    if encoding_format == "base64":
        try:
            return base64_vector(vector)
        except ValueError:
            raise BadAnswer("embeddings with an embedding beyond 32-bit floats (base64's numbers)") from None
    return vector


def embeddings_response(body: Json, native: Json) -> Json:
    """The OpenAI-shaped answer of `/api/embed`'s (BadAnswer: it is not one)."""
    vectors = native.get("embeddings")
    if not isinstance(vectors, list):
        raise BadAnswer("embeddings without an 'embeddings' list")
    data = [{"object": "embedding", "index": i, "embedding": _encode(v, body.get("encoding_format"))}
            for i, v in enumerate(vectors)]
    prompt = native.get("prompt_eval_count")
    prompt = prompt if type(prompt) is int and prompt >= 0 else 0
    return {"object": "list", "data": data, "model": body["model"],
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt}}
