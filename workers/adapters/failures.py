"""What went wrong talking to a provider, as one line a person can read.

Error texts reach callers, the catalog and the logs, so they follow one rule: one line, what
failed and where (the provider id, or the probed path), never a Python repr, never an
address, never empty after a colon. Each failure also says what it means for the provider's
health (`strikes`, see `workers.health`) and whether another attempt could help (`Retry`).
"""

from __future__ import annotations

import errno
import json
import os
import re
import ssl
from urllib.parse import unquote, urlsplit

import aiohttp

from common.policy import Health
from workers.adapters.base import DOWN, ProbeResult, ProviderError, Retry

#: The longest provider-supplied text (an error message, a stderr tail) passed on, in characters.
MAX_ERROR_TEXT = 500

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


REDACTED = "[redacted]"


def url_secrets(url: str | None) -> list[str]:
    """The credentials a provider URL carries in its userinfo (`https://user:pass@host`)."""
    parts = urlsplit(url or "")
    return [unquote(p) for p in (parts.password, parts.username) if p]


def redact(text: str, secrets: list[str]) -> str:
    """`text` with every secret in it replaced by `[redacted]`."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, REDACTED)
    return text


def redacted(exc: ProviderError, secrets: list[str]) -> ProviderError:
    """The same error with every echo of a secret removed (its message and the provider's detail)."""
    if not any(secret and secret in exc.message + json.dumps(exc.detail) for secret in secrets):
        return exc
    detail = json.loads(redact(json.dumps(exc.detail), secrets)) if exc.detail else exc.detail
    return ProviderError(redact(exc.message, secrets), status=exc.status, detail=detail, retry=exc.retry,
                         strikes=exc.strikes)


def _os_text(code: int | None) -> str:
    return os.strerror(code).lower() if code else "a network error"


#: `describe`'s strikes for a failure that says nothing about the provider's health
NO_STRIKE = -1


def describe(exc: BaseException, *, connect_ms: int | None = None, read_ms: int | None = None,
             total_ms: int | None = None) -> tuple[str, int]:
    """(what happened, strikes against the provider's health: 0 it answered, `NO_STRIKE` no
    evidence either way) for a failed HTTP exchange.

    The timeouts in effect are passed so that a timeout says how long was waited; `total_ms`
    (a probe's whole deadline) names every timeout when given."""
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        return "its host name did not resolve", DOWN
    if isinstance(exc, (aiohttp.ClientConnectorCertificateError, aiohttp.ClientSSLError, ssl.SSLError)):
        return "the TLS handshake failed (certificate or protocol)", DOWN
    if isinstance(exc, aiohttp.ClientConnectorError):
        if exc.os_error.errno == errno.ECONNREFUSED:
            return "connection refused", DOWN
        return f"could not connect ({_os_text(exc.os_error.errno)})", DOWN
    if total_ms is not None and isinstance(exc, (aiohttp.ServerTimeoutError, TimeoutError)):
        return f"no answer within {total_ms} ms", 1
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return f"no connection within {connect_ms} ms" if connect_ms else "no connection in time", 1
    if isinstance(exc, aiohttp.SocketTimeoutError):
        return f"sent nothing for {read_ms} ms" if read_ms else "went silent", 1
    if isinstance(exc, (aiohttp.ServerTimeoutError, TimeoutError)):
        return "no answer in time", 1
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the server closed the connection", 1
    if isinstance(exc, aiohttp.ClientPayloadError):
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


def transport_error(provider_id: str, exc: BaseException, *, connect_ms: int, read_ms: int) -> ProviderError:
    """The ProviderError of a run whose HTTP exchange failed. A provider that could not be
    reached or broke off may serve another attempt once it is back (`Retry.ANY`); one that
    answered garbage would answer the same again (`Retry.ELSEWHERE`)."""
    what, strikes = describe(exc, connect_ms=connect_ms, read_ms=read_ms)
    return ProviderError(f"provider {provider_id}: {what}", retry=Retry.ELSEWHERE if strikes == 0 else Retry.ANY,
                         strikes=None if strikes == NO_STRIKE else strikes)


def probe_failure(what_failed: str, exc: BaseException, total_ms: int) -> ProbeResult:
    """The result of a probe whose request failed (`what_failed`: `GET /health`, say)."""
    what, strikes = describe(exc, total_ms=total_ms)
    return ProbeResult(Health.UNAVAILABLE, f"{what_failed}: {what}", strikes=max(strikes, 1),
                       timed_out=isinstance(exc, (TimeoutError, aiohttp.ServerTimeoutError)))
