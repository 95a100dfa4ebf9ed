"""Ollama through its native API: `/api/chat` and `/api/generate` streaming NDJSON,
`/api/embed`, and `/api/tags` as the health probe (what it lists is what it serves).

`base_url` is the server root (`http://host:11434`); a trailing `/v1` or `/api` is ignored.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import aiohttp

from common import jsonio
from common.choices import inputs
from common.chunks import wants_usage
from common.config import ProviderConfig
from common.policy import Health
from common.runlog import run_fields
from common.wire import RunKind
from workers.adapters import ollama_wire as wire
from workers.adapters import sending
from workers.adapters.base import DEFAULT_LIMITS, LastRead, ProbeResult, ProviderError, ReadLimits, Retry, not_taken
from workers.adapters.credentials import Credentials
from workers.adapters.embeddings import count_problem
from workers.adapters.failures import (
    another_may,
    answered_error,
    one_line,
    probe_answered,
    probe_failure,
    redact,
    redacted,
    transport_error,
)
from workers.adapters.openai_shapes import Shaper
from workers.adapters.proxies import Proxy
from workers.adapters.reading import (
    Breaks,
    LineSplitter,
    NonObjects,
    error_body,
    error_text,
    is_redirect,
    parse_json,
    probe_said,
    read_at_most,
    read_whole,
    redirect_error,
    redirect_probe,
    watched_reads,
    with_line_end,
    without_traceback,
)

Json = dict[str, Any]

log = logging.getLogger("iop.worker")


def server_root(base_url: str) -> str:
    root = base_url.rstrip("/")
    for suffix in ("/v1", "/api"):
        if root.endswith(suffix):
            return root[: -len(suffix)]
    return root


def observed_names(tags: Any) -> list[str] | None:
    """Served names from `/api/tags`; `llama3:latest` is also listed as `llama3`, the name
    Ollama itself accepts for it. None when the answer is not a model list."""
    models = tags.get("models") if isinstance(tags, dict) else None
    if not isinstance(models, list):
        return None
    names: dict[str, None] = {}  # (in order, each once: a list's `in` made 100,000 names quadratic)
    for m in models:
        for key in ("name", "model"):
            name = m.get(key) if isinstance(m, dict) else None
            if isinstance(name, str):
                names.setdefault(name)
    for name in list(names):
        bare = name.removesuffix(":latest")
        if bare != name:
            names.setdefault(bare)
    return list(names)


class NDJSONParser:
    """Splits a byte stream into JSON objects, one a line; keeps partial lines between reads.

    The object with `"done": true` ends the stream: nothing after it is read (`"done": "false"`, a
    string, is not true). A line that is not a JSON object is dropped; one that is not JSON, or
    past its limit, is an error (`breaks`: after output, the objects before it in its read are
    returned first). `began`: an object came."""

    def __init__(self, provider_id: str, limits: ReadLimits, request_id: str = "", model: str | None = None) -> None:
        self.provider_id = provider_id
        self.lines = LineSplitter(provider_id, limits)
        self.non_objects = NonObjects(provider_id, request_id, model)
        self.breaks = Breaks()
        self.done = False
        self.began = False

    def feed(self, data: bytes) -> list[Json]:
        """The objects of a read; an error after some of them is held in `breaks` (`Breaks`)."""
        if self.done or self.breaks.stopped:
            return []
        return self.breaks.read(lambda out: self._read(data, out))

    def _read(self, data: bytes, out: list[Json]) -> None:
        for line in self.lines.feed(data):
            if not line.strip():
                continue
            obj = parse_json(line, self.provider_id)
            if not isinstance(obj, dict):
                self.non_objects.drop(obj)
                continue
            self.began = True
            out.append(obj)
            if obj.get("done") is True and not obj.get("error"):
                self.done = True
                break


class OllamaAdapter:
    def __init__(self, provider: ProviderConfig, session: aiohttp.ClientSession,
                 limits: ReadLimits = DEFAULT_LIMITS, proxy: Proxy | None = None) -> None:
        """`proxy`: the HTTP proxy its requests go through (`workers.adapters.proxies`), or none."""
        assert provider.base_url
        self.provider = provider
        self.session = session
        self.limits = limits
        self.credentials = Credentials(provider, proxy)
        self.root = server_root(provider.base_url)
        self.timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=provider.connect_timeout_ms / 1000,
            sock_read=provider.read_timeout_ms / 1000,
        )
        #: the longest a read of an answer may take (`ReadWatch`: aiohttp's `sock_read` may be dropped)
        self.read_s = provider.read_timeout_ms / 1000

    # ------------------------------------------------------------------ errors
    def _error(self, resp: aiohttp.ClientResponse, text: str, body: Json, kind: RunKind) -> ProviderError:
        status = resp.status
        served = body["model"]
        try:
            payload = json.loads(text)
        except (ValueError, RecursionError):
            payload = None
        error = wire.runner_error(payload.get("error")) if isinstance(payload, dict) else None
        message = error_text(error, self.limits.error_chars) if error else \
            one_line(without_traceback(text) or "no error text", self.limits.error_chars)
        detail = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
        cloud = wire.cloud_refusal(status, payload, message)
        if cloud is not None:
            # (one model's matter on this server, as a 404 naming it is: not iop's credentials, which a 401 or
            # 403 is taken for, a strike each, nor the caller's 400; another provider of the model may serve it.
            # It cannot run that model at all, and lists it still: it answers at once, so it is the least
            # loaded and every run of the model goes there first; `Retry.UNABLE` uses up none of the run's
            # attempts, and never asks it again for that run (`ELSEWHERE` used one: with `max_attempts: 1`
            # every run sent there was a 502 though another provider served the model))
            return ProviderError(f"provider {self.provider.id} answered {status}: {message} ({cloud})",
                                 retry=Retry.UNABLE, strikes=None)
        refused = wire.OPTION_REFUSED.fullmatch(message) if status == 500 and error else None
        if refused is not None:
            # (the request's option of the wrong type, which Ollama answers 500: the caller's 400, naming
            # it as the request wrote it; another provider first, as a server of the OpenAI family may
            # take `"0.5"` for a number)
            detail["param"] = wire.option_field(body, refused[1])
            return another_may(ProviderError(f"provider {self.provider.id} answered 500: {message}", status=400,
                                             detail=detail, strikes=0))
        if kind is RunKind.EMBEDDING and status == 400 and error and wire.EMBED_RUNNER_FAILED.match(message):
            # (its runner failed, which `/api/embed` answers 400 as it answers every error: the server's
            # fault, as its 5xx is, not the caller's 400 passed on at once and shown alive)
            return ProviderError(f"provider {self.provider.id} answered 400: {message} (its runner failed)",
                                 retry=Retry.ELSEWHERE, strikes=None)
        answered = answered_error(self.provider.id, status, message, detail if error or status != 404 else None,
                                  served, resp.headers)
        # (`"m" does not support tools`, or vision, thinking, …: this model's build, not the request;
        # server/routes.go's handleScheduleError answers it 400)
        return another_may(answered) if status == 400 and " does not support " in message else answered

    def _unsupported(self, exc: wire.UnsupportedRequest) -> ProviderError:
        return not_taken(self.provider.id, str(exc), exc.param)

    def _failed(self, exc: BaseException) -> ProviderError:
        return transport_error(self.provider.id, exc, proxy=self.credentials.via.url,
                               connect_ms=self.provider.connect_timeout_ms,
                               read_ms=self.provider.read_timeout_ms)

    def _raise_for_redirect(self, resp: aiohttp.ClientResponse) -> None:
        if is_redirect(resp.status):
            raise redirect_error(self.provider.id, resp)

    def _native(self, kind: RunKind, body: Json, stream: bool) -> tuple[str, Json]:
        try:
            return wire.request(kind, body, stream)
        except wire.UnsupportedRequest as exc:
            raise self._unsupported(exc) from None

    def _post(self, path: str, native: Json, request_id: str) -> Any:
        return sending.post(self.session, self.root + path, data=jsonio.dumps(native),
                            timeout=self.timeout, head_wait_s=self.provider.head_wait_s, allow_redirects=False,
                            **self.credentials.options(request_id, json_body=True))

    def _sent_error(self, error: Any) -> ProviderError:
        """An `error` Ollama sent in a 200 answer or a stream line."""
        said = error_text(wire.runner_error(error), self.limits.error_chars)
        return ProviderError(f"provider {self.provider.id} sent an error: {said}", retry=Retry.ELSEWHERE, strikes=None)

    def _tool_calls(self, kind: RunKind, native: Json, request_id: str, model: str, first_index: int | None = None,
                    warned: bool = False) -> tuple[list[Json], bool]:
        """The tool calls of a chat's answer or stream line (`first_index`: the stream's calls so
        far), OpenAI-shaped, and whether entries that are none were dropped (with a WARNING, once a
        run: unless `warned`). A legacy completion has none (`/api/generate` makes none, and a
        `text_completion` has no `tool_calls` finish_reason)."""
        if kind is not RunKind.CHAT:
            return [], False
        calls, dropped = wire.tool_calls_of(native, request_id, first_index=first_index or 0,
                                            stream=first_index is not None)
        if dropped and not warned:
            log.warning("provider %s sent %d tool call(s) without a name or whose arguments are not a JSON object; "
                        "dropped them, and any more in this run", self.provider.id, dropped,
                        extra=run_fields(request_id, model, provider=self.provider.id))
        return calls, dropped > 0

    # ------------------------------------------------------------------ runs
    def _long_lines(self) -> ReadLimits:
        """The limits with a line held to `runtime.max_response_bytes`, not `max_line_bytes`: the last line
        of `/api/generate` carries `context`, the tokens of the prompt and the whole answer (server/routes.go:
        706-719, unless `raw`), some 6 bytes a token: past 1 MiB at about 170,000 tokens."""
        return replace(self.limits, line_bytes=max(self.limits.line_bytes, self.limits.response_bytes))

    async def _streamed_whole(self, kind: RunKind, body: Json, request_id: str) -> Json:
        """A chat's or a legacy completion's whole answer, asked for as a stream and its lines merged
        (`wire.Merged`). Asked for whole, Ollama sends nothing, its head included, until it is done:
        a generation longer than `read_timeout_ms` (and `load_timeout_ms`) was cut off as a silent
        provider, a strike each, and tried elsewhere for as long again. Streamed, each line shows it at
        work. The answer is held to `runtime.max_response_bytes`, its lines too (a completion's last
        line carries the tokens of its whole text, `context`)."""
        path, native = self._native(kind, body, stream=True)
        parser = NDJSONParser(self.provider.id, self._long_lines(), request_id, body["model"])
        merged = wire.Merged()
        read = 0
        async with self._post(path, native, request_id) as resp:
            self._raise_for_redirect(resp)
            if resp.status >= 400:
                raise self._error(resp, await error_body(resp), body, kind)
            async for data in with_line_end(watched_reads(resp, self.read_s)):
                read += len(data)
                if read > self.limits.response_bytes:
                    resp.close()
                    raise self.limits.too_large(self.provider.id, "an answer", self.limits.response_bytes)
                for line in parser.feed(data):
                    if line.get("error"):  # (its runner's error after the stream began)
                        raise self._sent_error(line["error"])
                    merged.add(line)
                if parser.done:  # (nothing after `done` is read, nor a connection it keeps open waited on)
                    if not resp.content.at_eof():
                        resp.close()
                    break
        return merged.whole() if merged.answer else {}

    async def complete(self, kind: RunKind, body: Json, request_id: str) -> Json:
        if kind is not RunKind.EMBEDDING:
            try:
                answer = await self._streamed_whole(kind, body, request_id)
            except ProviderError as exc:
                raise redacted(exc, self.credentials.secrets()) from None
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                raise self._failed(exc) from None
            if answer.get("done") is not True:  # (no line at all: its answer too, as the same run's stream)
                said = "before it was done" if answer else "with no JSON object"
                raise ProviderError(f"provider {self.provider.id} answered {said}", strikes=0, retry=Retry.ELSEWHERE)
            return self._shaped(kind, body, request_id, answer)
        path, native = self._native(kind, body, stream=False)
        try:
            async with self._post(path, native, request_id) as resp:
                self._raise_for_redirect(resp)
                if resp.status >= 400:
                    raise self._error(resp, await error_body(resp), body, kind)
                # (bytes that are not UTF-8 are not JSON, as in a stream line and the OpenAI family's
                # answers: they were taken as U+FFFD here, where the same bytes streamed were a 502)
                answer = parse_json(await read_whole(resp, self.provider.id, self.limits, self.read_s),
                                    self.provider.id)
                if not isinstance(answer, dict):
                    raise wire.BadAnswer("with JSON that is not an object")
                if answer.get("error"):  # (Ollama may answer 200 with only an error)
                    raise self._sent_error(answer["error"])
                embedded = wire.embeddings_response(body, answer)  # (each vector checked there)
                problem = count_problem(len(embedded["data"]), inputs(body.get("input")))
                if problem:
                    raise ProviderError(f"provider {self.provider.id} answered embeddings {problem}",
                                        retry=Retry.ELSEWHERE, strikes=0)
                return embedded
        except ProviderError as exc:
            raise redacted(exc, self.credentials.secrets()) from None
        except wire.BadAnswer as exc:  # (JSON, but not an answer: it says what is wrong, not "not valid JSON")
            raise ProviderError(f"provider {self.provider.id} answered {exc}", retry=Retry.ELSEWHERE,
                                strikes=0) from None
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise self._failed(exc) from None

    def _shaped(self, kind: RunKind, body: Json, request_id: str, answer: Json) -> Json:
        """The OpenAI-shaped whole answer of Ollama's (done) one."""
        shaper = Shaper(kind, request_id, body["model"])
        calls, _ = self._tool_calls(kind, answer, request_id, body["model"])
        thinking = wire.thinking_of(answer)
        return shaper.response(wire.echoed(kind, body) + wire.text_of(kind, answer),
                               wire.finish_reason(answer, bool(calls)),
                               wire.usage_of(answer), tool_calls=calls,
                               extra={"reasoning_content": thinking} if thinking else None,
                               logprobs=wire.Logprobs(kind, body).of(answer))

    async def stream(self, kind: RunKind, body: Json, request_id: str) -> AsyncIterator[list[Json]]:
        if kind is RunKind.EMBEDDING:
            raise ProviderError("embeddings cannot be streamed", status=400)
        path, native = self._native(kind, body, stream=True)
        shaper = Shaper(kind, request_id, body["model"])
        parser = NDJSONParser(self.provider.id, self._long_lines() if kind is RunKind.COMPLETION else self.limits,
                              request_id, body["model"])
        include_usage = wants_usage(body)
        logprobs = wire.Logprobs(kind, body)
        echo = wire.echoed(kind, body)  # (the prompt, to go out with the first line that is no error)
        tool_calls = 0
        dropped_calls = False  # (some were: warned of once a run)
        done = False
        try:
            async with self._post(path, native, request_id) as resp:
                self._raise_for_redirect(resp)
                if resp.status >= 400:
                    raise self._error(resp, await error_body(resp), body, kind)
                async for data in with_line_end(watched_reads(resp, self.read_s)):
                    chunks: list[Json] = []
                    for line in parser.feed(data):
                        if line.get("error"):
                            if chunks:  # (what came before it, in the same read, reaches the caller first)
                                yield chunks
                            raise self._sent_error(line["error"])
                        calls, dropped = self._tool_calls(kind, line, request_id, body["model"],
                                                          first_index=tool_calls, warned=dropped_calls)
                        dropped_calls = dropped_calls or dropped
                        tool_calls += len(calls)
                        text, thinking = wire.text_of(kind, line), wire.thinking_of(line)
                        if echo:  # (with the first line's text, as vLLM's stream gives it)
                            text, echo = echo + text, ""
                        said = logprobs.of(line)  # (a line may carry only those, while Ollama holds its text)
                        if text or calls or thinking or said:
                            chunks.append(shaper.delta(text, tool_calls=calls, logprobs=said,
                                                       extra={"reasoning_content": thinking} if thinking else None))
                        if line.get("done") is True:
                            done = True
                            chunks.append(shaper.delta(finish_reason=wire.finish_reason(line, tool_calls > 0)))
                            if include_usage:
                                chunks.append(shaper.usage_chunk(wire.usage_of(line)))
                    if chunks:
                        passing = parser.breaks.passing(chunks)
                        yield LastRead(passing) if parser.done else passing
                    if parser.breaks.broken:
                        raise parser.breaks.take()
                    if parser.done:
                        # the answer is whole: nothing after `done` is read, and a connection
                        # the server keeps open is not waited on
                        if not resp.content.at_eof():
                            resp.close()
                        break
        except ProviderError as exc:
            raise redacted(exc, self.credentials.secrets()) from None
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise self._failed(exc) from None
        if not done and not parser.began:
            # a 200 (or a 204) with nothing in it: the provider's answer, which it would give again,
            # as the OpenAI family's stream that ends before any event (it was three attempts there
            # within milliseconds, a strike each, and the provider down)
            raise ProviderError(f"provider {self.provider.id}: the stream ended before any line", strikes=None,
                                retry=Retry.ELSEWHERE)
        if not done:
            # lines, then the end of the body without `"done": true`: Ollama's own answer (its
            # connection was not cut: that is a broken body), as when its guard against a repeating
            # token stops a generation, or its runner's error event is dropped. Whole, the same run
            # is a 200 that is not done: no strike, and tried on another provider only, as here
            raise ProviderError(f"provider {self.provider.id}: the stream ended before it was done",
                                retry=Retry.ELSEWHERE, strikes=0)

    # ------------------------------------------------------------------ health
    async def probe(self) -> ProbeResult:
        timeout = aiohttp.ClientTimeout(total=self.provider.probe_timeout_ms / 1000)
        limit = self.limits.probe_limit
        try:
            async with self.session.get(self.root + "/api/tags", timeout=timeout, allow_redirects=False,
                                        **self.credentials.options(None)) as resp:
                if is_redirect(resp.status):
                    return redirect_probe("/api/tags", resp, self.credentials.secrets())
                if resp.status != 200:
                    return probe_answered("GET /api/tags", resp.status,
                                          redact(await probe_said(resp), self.credentials.secrets()))
                data = await read_at_most(resp, limit)
                if data is None:
                    resp.close()
                    return ProbeResult(Health.UNKNOWN, f"GET /api/tags answered more than {limit} bytes")
            tags = parse_json(data, self.provider.id)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return probe_failure("GET /api/tags", exc, self.provider.probe_timeout_ms, self.credentials.via.url)
        except ValueError:
            return ProbeResult(Health.UNKNOWN, "GET /api/tags answered 200 but not with JSON")
        except ProviderError:
            return ProbeResult(Health.UNKNOWN, "GET /api/tags answered 200 with JSON nested too deep")
        names = observed_names(tags)
        if names is None:
            return ProbeResult(Health.UNKNOWN, "GET /api/tags answered 200 but not with a model list")
        return ProbeResult(Health.AVAILABLE, "", names, strikes=0)

    async def close(self) -> None:
        return None
