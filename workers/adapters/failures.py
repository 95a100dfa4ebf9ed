"""What went wrong talking to a provider, as one line a person can read.

Error texts reach callers, the catalog and the logs, so they follow one rule: one line, what
failed and where (the provider id, or the probed path), never a Python repr, never an
address, never empty after a colon. Each failure also says what it means for the provider's
health (`strikes`, see `workers.health`) and whether another attempt could help (`Retry`).
"""

from __future__ import annotations

import base64
import codecs
import contextlib
import datetime
import email.utils
import errno
import json
import math
import os
import re
import ssl
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, quote_plus, unquote, urlsplit

import aiohttp

from common.policy import Health
from common.wire import (
    CREDENTIALS_REFUSED,
    FORBIDDEN,
    KEY_LIMIT,
    MAX_RETRY_AFTER_S,
    NOT_THERE,
    PAYMENT_REQUIRED,
    ErrorCode,
    busy,
    callers_fault,
)
from workers.adapters.base import DOWN, ProbeResult, ProviderError, Retry
from workers.adapters.sending import NoHead, NotRead

#: The longest provider-supplied text (an error message, a stderr tail) passed on, in characters.
MAX_ERROR_TEXT = 500
#: The longest `type`, `param` or `code` of a provider's error object passed on, in characters.
MAX_FIELD_CHARS = 200

_SPACE = re.compile(r"\s+")
_UNPRINTABLE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ufffd]+")


def one_line(text: str, limit: int = MAX_ERROR_TEXT, *, tail: bool = False) -> str:
    """`text` on one line: whitespace runs (newlines too) become one space, control characters
    and undecodable bytes one `?`; cut to `limit` characters with an ellipsis (keeping the end
    with `tail`, as for the last lines a tool wrote)."""
    flat = _SPACE.sub(" ", _UNPRINTABLE.sub("?", text)).strip()
    if len(flat) <= limit:
        return flat
    return "…" + flat[1 - limit:].lstrip() if tail else flat[: limit - 1].rstrip() + "…"


#: What an error answer whose body is binary data says, in place of its mojibake.
NOT_TEXT = "a body that is not text"


def body_text(data: bytes) -> str:
    """An error answer's body as text; `NOT_TEXT` for one that is not UTF-8, or is more than a
    tenth control characters (binary data). A character cut off at the end of what was read is
    left out, not taken for binary."""
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(data)
    except UnicodeDecodeError:
        return NOT_TEXT
    if sum(map(len, _UNPRINTABLE.findall(text))) * 10 > len(text):
        return NOT_TEXT
    return text


REDACTED = "[redacted]"


def url_secrets(url: str | None) -> list[str]:
    """Every form in which the credentials of a provider URL's userinfo (`https://user:pass@host`)
    may come back in a provider's answer, longest first: the user and the password each as
    written (percent-encoded), decoded and encoded again (so the whole userinfo, in any of these
    forms, reads `[redacted]:[redacted]`), and the value of the `Authorization: Basic …` header
    aiohttp sends for them (the base64 of `user:password`, percent-decoded, in latin-1 as aiohttp
    encodes it, or in UTF-8; with and without its padding)."""
    parts = urlsplit(url or "")
    if parts.username is None and parts.password is None:
        return []
    written = [parts.username or "", parts.password or ""]
    found = {form for text in written for form in (text, unquote(text), quote(unquote(text), safe=""))}
    credentials = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
    for encoding in ("latin-1", "utf-8"):
        with contextlib.suppress(UnicodeEncodeError):
            token = base64.b64encode(credentials.encode(encoding)).decode("ascii")
            found.update((token, token.rstrip("=")))  # also as echoed without its padding
    return sorted((form for form in found if form), key=len, reverse=True)


#: The fewest base64 characters taken for a key's (`in_base64`): a shorter run would be found in
#: texts that never held the key.
MIN_BASE64_CHARS = 16


def in_base64(secret: str) -> set[str]:
    """The base64 characters (standard and URL-safe alphabets) that `secret` makes wherever it
    stands in a longer base64 text (a header echoed in base64, `Bearer <key>` among others): at
    each of the three offsets it may start at, the characters made of its bytes alone. None
    shorter than `MIN_BASE64_CHARS`."""
    data = secret.encode("utf-8")
    found: set[str] = set()
    for offset in range(3):
        text = base64.b64encode(b"\0" * offset + data).decode("ascii")
        core = text[-(-8 * offset // 6):8 * (offset + len(data)) // 6]
        if len(core) >= MIN_BASE64_CHARS:
            found.update((core, core.replace("+", "-").replace("/", "_")))
    return found


def key_secrets(key: str | None) -> list[str]:
    """Every form in which an API key may come back in a provider's answer: as it is, and
    percent-encoded as a URL or a form writes it (`/` kept or not, a space as `+`), with its
    escapes in upper or lower case, as JSON writes it in a text that is not read as JSON (a `/`
    as `\\/`, as PHP's `json_encode` writes it), and within base64 (`in_base64`)."""
    if not key:
        return []
    encoded = {quote(key, safe=""), quote(key), quote_plus(key)}
    in_json = json.dumps(key)[1:-1]
    found = ({key, in_json, in_json.replace("/", "\\/")} | encoded | in_base64(key)
             | {re.sub(r"%[0-9A-F]{2}", lambda m: m.group().lower(), form) for form in encoded})
    return sorted(found, key=len, reverse=True)


#: The shortest start (or end) of a secret taken for it where a text was cut (`one_line`).
MIN_CUT_SECRET = 4


def _redact_cut(text: str, secret: str) -> str:
    """`text` with the part of `secret` that a cut (an ellipsis at either end) left redacted."""
    if text.endswith("…"):
        for size in range(len(secret) - 1, MIN_CUT_SECRET - 1, -1):
            if text[:-1].endswith(secret[:size]):
                return text[: -1 - size] + REDACTED + "…"
    if text.startswith("…"):
        for size in range(len(secret) - 1, MIN_CUT_SECRET - 1, -1):
            if text[1:].startswith(secret[-size:]):
                return "…" + REDACTED + text[1 + size:]
    return text


def redact(text: str, secrets: list[str]) -> str:
    """`text` with every secret in it replaced by `[redacted]`, the longest first (one secret
    may hold another), as well as what is left of one where the text was cut."""
    ordered = sorted((secret for secret in secrets if secret), key=len, reverse=True)
    for secret in ordered:  # the cut ones first: a longer secret may end where a shorter one is cut
        text = _redact_cut(text, secret)
    for secret in ordered:
        text = text.replace(secret, REDACTED)
    return text


def _redact_json(value: Any, secrets: list[str]) -> Any:
    """A JSON value with every string in it (keys too) redacted. Not through its JSON text:
    a secret with a quote, a backslash or a non-ASCII character is escaped there."""
    if isinstance(value, str):
        return redact(value, secrets)
    if isinstance(value, list):
        return [_redact_json(item, secrets) for item in value]
    if isinstance(value, dict):
        return {redact(str(key), secrets): _redact_json(item, secrets) for key, item in value.items()}
    return value


def redacted(exc: ProviderError, secrets: list[str]) -> ProviderError:
    """The same error with every echo of a secret removed (its message and the provider's detail)."""
    if not any(secrets):
        return exc
    message = redact(exc.message, secrets)
    detail = _redact_json(exc.detail, secrets) if exc.detail else exc.detail
    if message == exc.message and detail == exc.detail:
        return exc
    return ProviderError(message, status=exc.status, detail=detail, retry=exc.retry, strikes=exc.strikes,
                         code=exc.code, retry_after_s=exc.retry_after_s, repeats=exc.repeats)


def _os_text(code: int | None) -> str:
    return os.strerror(code).lower() if code else "a network error"


#: `describe`'s strikes for a failure that says nothing about the provider's health
NO_STRIKE = -1


#: A proxy's answer that it wants credentials (407), and what to do about it.
PROXY_AUTH = 407
PROXY_CREDENTIALS = (" (a proxy on the way wants credentials: user:password@ in the worker's https_proxy or "
                     "http_proxy)")


def describe(exc: BaseException, *, connect_ms: int | None = None, read_ms: int | None = None,
             total_ms: int | None = None, proxy: str | None = None) -> tuple[str, int]:
    """(what happened, strikes against the provider's health: 0 it answered, `NO_STRIKE` no
    evidence either way) for a failed HTTP exchange.

    The timeouts in effect are passed so that a timeout says how long was waited; `total_ms`
    (a probe's whole deadline) names every timeout when given. `proxy`: the proxy the exchange
    went through (`workers.adapters.proxies`), named when the fault was its own."""
    if proxy is not None:
        at_proxy = _proxy_fault(exc, proxy)
        if at_proxy is not None:
            return at_proxy, DOWN
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        return "its host name did not resolve", DOWN
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        cert = exc.certificate_error
        why = getattr(cert, "verify_message", None) or getattr(cert, "reason", None) or "no reason given"
        return f"its TLS certificate did not verify ({why})", DOWN
    if isinstance(exc, (aiohttp.ClientSSLError, ssl.SSLError)):
        return "the TLS handshake failed (certificate or protocol)", DOWN
    if isinstance(exc, aiohttp.ClientConnectorError):
        if exc.os_error.errno == errno.ECONNREFUSED:
            return "connection refused", DOWN
        return f"could not connect ({_os_text(exc.os_error.errno)})", DOWN
    if total_ms is not None and isinstance(exc, (aiohttp.ServerTimeoutError, TimeoutError)):
        return f"no answer within {total_ms} ms", 1
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return f"no connection within {connect_ms} ms" if connect_ms else "no connection in time", 1
    if isinstance(exc, (NotRead, NoHead)):
        return str(exc), 1
    if isinstance(exc, aiohttp.SocketTimeoutError):
        return f"sent nothing for {read_ms} ms" if read_ms else "went silent", 1
    if isinstance(exc, (aiohttp.ServerTimeoutError, TimeoutError)):
        return "no answer in time", 1
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the server closed the connection", 1
    if isinstance(exc, aiohttp.ClientPayloadError):
        encoding = _undecodable(exc)
        if encoding is not None:  # the same answer would not decode again: garbage, as invalid JSON
            return f"its answer did not decode as its Content-Encoding ({encoding}) says", 0
        # it was answering: alive, whatever cut the response (llama-cpp-python cuts a stream
        # this way when another request arrives), so no strike and no sign of life either
        return "the response broke off before it was complete", NO_STRIKE
    if isinstance(exc, (aiohttp.ClientConnectionResetError, ConnectionResetError)):
        return "the connection was reset", 1
    if isinstance(exc, aiohttp.ClientResponseError):
        return "the answer was not valid HTTP", 1
    if isinstance(exc, aiohttp.InvalidURL):
        return "its URL is not valid", DOWN
    if isinstance(exc, OSError):
        return f"connection error ({_os_text(exc.errno)})", 1
    if isinstance(exc, ValueError):
        return "the answer was not valid JSON", 0
    return "the HTTP exchange failed", 1


def _undecodable(exc: aiohttp.ClientPayloadError) -> str | None:
    """The Content-Encoding a body did not decode as (aiohttp's `ContentEncodingError`, this
    payload error's cause: `gzip` on a plain body, say), at most 32 characters; None when the body
    was cut short (a deflate body that ends early raises the same class, saying only `deflate`)."""
    cause = exc.__cause__
    message = getattr(cause, "message", None)
    if not isinstance(cause, aiohttp.http_exceptions.ContentEncodingError) or not isinstance(message, str):
        return None
    said, sep, encoding = message.partition("content-encoding:")
    if not sep or not said.lower().startswith("can not decode"):
        return None
    return (encoding.split() or ["?"])[0][:32]  # ("brotli (br). Please install `Brotli`": brotli)


def _proxy_fault(exc: BaseException, proxy: str) -> str | None:
    """What went wrong at the proxy (not reached, or it refused the tunnel), or None."""
    if isinstance(exc, aiohttp.ClientHttpProxyError):
        hint = PROXY_CREDENTIALS if exc.status == PROXY_AUTH else ""
        return f"the proxy {proxy} answered {exc.status} to the tunnel's CONNECT{hint}"
    if isinstance(exc, aiohttp.ClientConnectorError):
        address = urlsplit(proxy)
        if isinstance(exc, aiohttp.ClientProxyConnectionError) or (exc.host, exc.port) == (address.hostname,
                                                                                             address.port):
            return f"could not reach the proxy {proxy} ({describe(exc)[0]})"
    return None


def transport_error(provider_id: str, exc: BaseException, *, connect_ms: int, read_ms: int,
                    proxy: str | None = None) -> ProviderError:
    """The ProviderError of a run whose HTTP exchange failed. A provider that could not be
    reached or broke off may serve another attempt once it is back (`Retry.ANY`); one that
    answered garbage (not JSON, or not HTTP at all: another protocol's banner, binary junk, a
    header line past aiohttp's limit) would answer the same again, and one that took the request
    but sent nothing for `read_ms` is most likely still working on it (a server that answers a
    non-stream request only when it is done goes on generating for nobody): another attempt goes
    only to another provider (`Retry.ELSEWHERE`), so one long request costs one strike, not one
    an attempt until the provider is taken down. (An answer that is not HTTP keeps its strike: a
    provider that answers every run so goes down, and is probed again.)"""
    what, strikes = describe(exc, connect_ms=connect_ms, read_ms=read_ms, proxy=proxy)
    busy = isinstance(exc, (aiohttp.ServerTimeoutError, TimeoutError)) and not isinstance(
        exc, aiohttp.ConnectionTimeoutError)
    not_http = isinstance(exc, aiohttp.ClientResponseError) and not isinstance(exc, aiohttp.ClientHttpProxyError)
    return ProviderError(f"provider {provider_id}: {what}",
                         retry=Retry.ELSEWHERE if strikes == 0 or busy or not_http else Retry.ANY,
                         strikes=None if strikes == NO_STRIKE else strikes,
                         code=ErrorCode.PROVIDER_TIMEOUT if busy else ErrorCode.PROVIDER_ERROR)


def probe_failure(what_failed: str, exc: BaseException, total_ms: int, proxy: str | None = None) -> ProbeResult:
    """The result of a probe whose request failed (`what_failed`: `GET /health`, say)."""
    what, strikes = describe(exc, total_ms=total_ms, proxy=proxy)
    return ProbeResult(Health.UNAVAILABLE, f"{what_failed}: {what}", strikes=max(strikes, 1),
                       timed_out=isinstance(exc, (TimeoutError, aiohttp.ServerTimeoutError)))


def names(message: str, served: str | None) -> bool:
    """Whether `message` names the served model as a word of its own ('The model "m" does not
    exist', `model "m" not found`), not inside another (`chat` in `/v1/chat/completions`)."""
    return bool(served) and re.search(rf"(?<![\w.:/-]){re.escape(served or '')}(?![\w.:/-])", message) is not None


def probe_answered(what: str, status: int, said: str = "") -> ProbeResult:
    """A probe (`GET /path`) answered with an error status (`said`: what its body says, in a few
    words): down, unless it said it is busy (a 429: a hosted API's rate limit covers its model
    list too), which is a sign of life (`workers.heartbeat.probe_evidence`)."""
    if status == 429:
        return ProbeResult(Health.UNKNOWN, f"{what} answered 429 (rate limited)", strikes=0, busy=True)
    hint = PROXY_CREDENTIALS if status == PROXY_AUTH else ""
    return ProbeResult(Health.UNAVAILABLE, f"{what} answered {status}" + (f" ({said})" if said else "") + hint)


def parse_retry_after(header: str | None, now_s: float | None = None) -> int | None:
    """A `Retry-After` header's seconds (a number of them, or an HTTP date, GMT when it names no
    zone, as asctime's form does), at most `MAX_RETRY_AFTER_S`; None when there is none or it is
    neither. Never raises: a provider's header must not fail the run it came with."""
    text = (header or "").strip()
    if text.isascii() and text.isdigit():
        digits = text.lstrip("0") or "0"
        return MAX_RETRY_AFTER_S if len(digits) > 3 else min(int(digits), MAX_RETRY_AFTER_S)
    try:
        when = email.utils.parsedate_to_datetime(text)
        if when.tzinfo is None:
            when = when.replace(tzinfo=datetime.UTC)
        wait = when.timestamp() - (time.time() if now_s is None else now_s)
    except (TypeError, ValueError, IndexError, OverflowError, OSError):  # (a date beyond what Python holds)
        return None
    return min(max(math.ceil(wait), 0), MAX_RETRY_AFTER_S)


#: Azure OpenAI's wait, in milliseconds (the official `openai` clients read it before `Retry-After`)
RETRY_AFTER_MS = "retry-after-ms"
#: The type of a Google API error's detail that says how long to wait: Gemini's 429 says it only there
#: (`{"@type": …, "retryDelay": "47s"}`, a protobuf Duration), with no `Retry-After`
RETRY_INFO = "type.googleapis.com/google.rpc.RetryInfo"
_DECIMAL = re.compile(r"([0-9]+)(?:\.[0-9]+)?")
#: the most digits of a wait's whole part read as a number: more is longer than any wait kept
_WAIT_DIGITS = 15


def _whole_seconds(number: str, per_second: int) -> int | None:
    """A decimal number of `1 / per_second` seconds as whole seconds (rounded up), at most
    `MAX_RETRY_AFTER_S`; None when it is not one. However many digits it has: a wait of 10^30 ms is
    the longest kept, as a `Retry-After` of as many seconds is (`parse_retry_after`), not none (1 s)."""
    match = _DECIMAL.fullmatch(number.strip())
    if match is None:
        return None
    if len(match.group(1).lstrip("0")) > _WAIT_DIGITS:
        return MAX_RETRY_AFTER_S
    return min(math.ceil(float(match.group(0)) / per_second), MAX_RETRY_AFTER_S)


def retry_info_s(detail: dict[str, Any] | None) -> int | None:
    """The seconds a Google API error asks to wait (`RETRY_INFO` among its `details`), or None."""
    details = (detail or {}).get("details")
    for item in details if isinstance(details, list) else ():
        delay = item.get("retryDelay") if isinstance(item, dict) and item.get("@type") == RETRY_INFO else None
        if isinstance(delay, str) and delay.endswith("s") and (wait := _whole_seconds(delay[:-1], 1)) is not None:
            return wait
    return None


def asked_wait_s(headers: Mapping[str, str] | None, detail: dict[str, Any] | None,
                 now_s: float | None = None) -> int | None:
    """How long a busy provider asked to be left alone, in whole seconds (at most `MAX_RETRY_AFTER_S`),
    as the hosted APIs say it: `retry-after-ms` first (Azure OpenAI's; the official `openai` clients read
    it first too), then `Retry-After` (`parse_retry_after`), then a `RetryInfo` in its error (Gemini's);
    None when it said nothing of it. Never raises."""
    if headers is not None:
        millis = headers.get(RETRY_AFTER_MS)
        wait = _whole_seconds(millis, 1000) if millis is not None else None
        if wait is None:
            wait = parse_retry_after(headers.get("Retry-After"), now_s)
        if wait is not None:
            return wait
    return retry_info_s(detail)


#: how a server says a request carries a field it does not know (the runner may first ask again
#: without `stream_options`, or with the limit's other name): OpenAI's and Azure's "Unrecognized request
#: argument supplied", pydantic's "Extra inputs are not permitted" (Mistral's 422), Google's `Unknown
#: name "x"` (Gemini's), OpenAI's "Unsupported parameter". Another provider of the model may know it
#: (vLLM takes `top_k`, OpenAI does not): `Retry.UNABLE`
UNKNOWN_FIELD = re.compile(r"unrecognized request argument|extra inputs are not permitted|unknown name \"|"
                           r"unsupported parameter", re.IGNORECASE)
#: how a server says it was not started to do what a request asks, naming the flag it lacks: vLLM's
#: `"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set` (any request
#: with `tools`, renderers/online_renderer.py:271-291 in 0.34), SGLang's `max_thinking_tokens requires the
#: server to be launched with --enable-strict-thinking` and `Start the server with
#: --trust-request-chat-template to permit it`. Another provider of the model, started with it, may serve
#: the request: `Retry.UNABLE`. (Not SGLang's "Use a shorter input or enable --allow-auto-truncate", a
#: prompt over its context: the caller's.)
SERVER_FLAG = re.compile(r"\brequires\b[^.]{0,80}?\s--[a-z][\w-]*|\bstart the server with --[a-z]", re.IGNORECASE)
#: where a server's message starts to echo what the caller sent: pydantic's `input_value=…` and FastAPI's
#: `'input': …` (vLLM's 400 to a request that fails validation, a message's content among it; FastAPI's own
#: 422 has it as compact JSON, `,"input":…`), vLLM's `(parameter=…, value=…)` tail. The caller's text says
#: nothing of how the server was started. (Only as a key of an error's object: Gemini's `Unknown name
#: "input": Cannot find field.` is its own words, of a field named `input`.)
_ECHO = re.compile(r"input_value=|[{,]\s*['\"]input['\"]:|\(parameter=")


def own_words(message: str) -> str:
    """What of a server's `message` is its own, before it echoes what the request sent (`_ECHO`): a
    caller's message that fails validation and reads "npm publish requires --access public" (or
    "Unrecognized request argument") says nothing of the server."""
    echo = _ECHO.search(message)
    return message if echo is None else message[:echo.start()]


def callers_retry(status: int, message: str) -> Retry:
    """Whether a caller's error (`callers_fault`) is tried on another provider first, answered
    whole or sent in a stream alike: a 402 for a request larger than this account's credits pay
    for (another provider's may), or a 400 or 422 saying the request carries a field this server
    does not know (`UNKNOWN_FIELD`: another may take it) or that the server was not started with a
    flag the request needs (`SERVER_FLAG`: another may be) is (`Retry.UNABLE`: no attempt used up);
    any other is the caller's answer at once."""
    own = own_words(message)  # (read once, for both: what the server says, not what it echoes)
    unable = status == PAYMENT_REQUIRED or (status in (400, 422) and bool(
        UNKNOWN_FIELD.search(own) or SERVER_FLAG.search(own)))
    return Retry.UNABLE if unable else Retry.NO


def another_may(error: ProviderError) -> ProviderError:
    """A caller's 4xx that says what this server cannot do, not what the request did wrong (Ollama's
    `"m" does not support tools`, llama-server's `n` over its slots): tried on another provider
    of the model first, which may do it (no strike: it answered; `Retry.UNABLE`: no attempt used
    up); the caller gets it when none is left to try."""
    error.retry = Retry.UNABLE
    return error


#: Azure OpenAI's `code` of a 404 for a deployment (the served name) its resource does not have ("The API
#: deployment for this resource does not exist. …": it names none)
DEPLOYMENT_NOT_FOUND = "DeploymentNotFound"


def model_gone(status: int, message: str, detail: dict[str, Any] | None, served: str | None) -> bool:
    """Whether an error says this provider has not, or may not use, the `served` model: a 404 that
    names it or says `DeploymentNotFound` (the provider lost it; Azure's names none), a 403 that names
    it or says `model_not_found` (a hosted API's key that may not use it, as OpenAI answers a project
    without access to it). One model's matter on one provider, not the caller's (iop routed the run
    there) nor the provider's health (a strike took it down for all its models): another provider of
    the model may serve the run. (Not a 403 of the provider's moderation, which names the model too:
    the caller's input, `callers_fault`.)"""
    code = (detail or {}).get("code")
    return (status == NOT_THERE and (names(message, served) or code == DEPLOYMENT_NOT_FOUND)) or (
        status == FORBIDDEN and not callers_fault(status, message) and (names(message, served)
                                                                         or code == "model_not_found"))


#: OpenAI's 429 of an account out of quota (its billing), not of a rate: the error's `type` and `code`
INSUFFICIENT_QUOTA = "insufficient_quota"


def out_of_quota(status: int, detail: dict[str, Any] | None, message: str = "") -> bool:
    """Whether an error says the provider's account is out of quota or credits, which no wait of a few
    seconds clears (it takes someone's payment, or the end of a billing period): a 402 (OpenRouter's,
    DeepSeek's, Mistral's), OpenAI's 429 `insufficient_quota` (which carries no `Retry-After`), or a
    403 saying iop's key reached its spending limit (OpenRouter's, `KEY_LIMIT`)."""
    return status == PAYMENT_REQUIRED or (
        status == 429 and any((detail or {}).get(field) == INSUFFICIENT_QUOTA for field in ("code", "type"))) or (
        status == FORBIDDEN and bool(KEY_LIMIT.search(message)))


def answered_error(provider_id: str, status: int, message: str, detail: dict[str, Any] | None,
                   served: str | None = None, headers: Mapping[str, str] | None = None) -> ProviderError:
    """A provider's error answer (4xx or 5xx) with its one-line `message`. The caller's fault
    (`callers_fault`) is passed through (`detail`, its message the one-line one), never retried, and
    shows the provider alive; a 5xx, a 429, a refusal of iop's credentials, or a 404 that names the
    `served` model (the provider lost it: the caller asked for a model iop routes there), a 403 that
    names it or says `model_not_found` (iop's key may not use that model), or a 404 that is no
    error object (a path the server does not have: `base_url` or a proxy is wrong) goes to another
    provider (a refusal of credentials is a strike: every run there would get it; a 429 shows it
    alive; a 5xx or a 404 shows nothing: its model list is probed again once nothing else shows
    it alive). A busy provider's (`BUSY`) wait, as its `headers` or its error say it (`asked_wait_s`),
    is kept, in seconds; one whose account is out of quota or credits (`out_of_quota`) and said none
    is left alone `MAX_RETRY_AFTER_S`, not asked again every second, and its caller is told that its
    own retry would get the same (`repeats`: the official clients waited those 60 s twice)."""
    if (status == NOT_THERE and detail is None) or model_gone(status, message, detail, served):
        return ProviderError(f"provider {provider_id} answered {status}: {message}", retry=Retry.ELSEWHERE,
                             strikes=None)
    if callers_fault(status, message):
        if detail is not None:  # (its other text fields on one line too, and short)
            detail = {**detail, **{name: one_line(value, MAX_FIELD_CHARS) for name in ("type", "param", "code")
                                   if isinstance(value := detail.get(name), str)}, "message": message}
        return ProviderError(f"provider {provider_id} answered {status}: {message}", status=status, detail=detail,
                             retry=callers_retry(status, message), strikes=0)
    too_busy = busy(status, message)  # (a key at its spending limit is no refusal of it: `KEY_LIMIT`)
    refused = status in CREDENTIALS_REFUSED and not too_busy
    hint = (PROXY_CREDENTIALS if status == PROXY_AUTH
            else " (it refused iop's credentials: check the provider's api_key_env)" if refused else "")
    return ProviderError(f"provider {provider_id} answered {status}: {message}{hint}", status=status,
                         retry=Retry.ELSEWHERE, strikes=1 if refused else 0 if status < 500 else None,
                         retry_after_s=_busy_for(status, message, headers, detail) if too_busy else None,
                         repeats=too_busy and out_of_quota(status, detail, message))


def _busy_for(status: int, message: str, headers: Mapping[str, str] | None,
              detail: dict[str, Any] | None) -> int | None:
    """The seconds a busy provider is left alone for (`answered_error`), or None (1 s)."""
    wait = asked_wait_s(headers, detail)
    return MAX_RETRY_AFTER_S if wait is None and out_of_quota(status, detail, message) else wait
