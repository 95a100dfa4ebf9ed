"""OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}`, each error code's
HTTP status, and `ApiError`, the error a handler raises to answer with. Shared by every HTTP
surface iop has: the gateway (`gateway.errors` decides which failure gets which answer) and the
scheduler's and workers' metrics ports (`common.metrics_http`)."""

from __future__ import annotations

import random
from http import HTTPStatus
from typing import Any

from aiohttp import web

from common.jsonio import dumps, json_response
from common.wire import ErrorCode, ErrorInfo, busy, callers_fault, uuid4_hex

#: the status of a run whose caller cancelled it or left (nginx's, as OpenAI-compatible servers use it)
CLIENT_CLOSED = 499


def phrase(status: int) -> str:
    """The reason phrase of a status (499 is not in the HTTP registry: aiohttp would send none)."""
    return "Client Closed Request" if status == CLIENT_CLOSED else HTTPStatus(status).phrase


#: HTTP status of each error code (DESIGN.md, "HTTP surface").
STATUS: dict[ErrorCode, int] = {
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.INVALID_API_KEY: 401,
    ErrorCode.PERMISSION_DENIED: 403,
    ErrorCode.CROSS_SITE: 403,
    ErrorCode.HOST_NOT_ALLOWED: 403,
    ErrorCode.MODEL_NOT_FOUND: 404,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.METHOD_NOT_ALLOWED: 405,
    ErrorCode.REQUEST_TIMEOUT: 408,
    ErrorCode.REQUEST_TOO_LARGE: 413,
    ErrorCode.QUEUE_FULL: 429,
    ErrorCode.RATE_LIMIT_EXCEEDED: 429,
    ErrorCode.CANCELLED: CLIENT_CLOSED,
    ErrorCode.INTERNAL: 500,
    ErrorCode.PROVIDER_ERROR: 502,
    ErrorCode.OUTPUT_TOO_LARGE: 502,
    ErrorCode.WORKER_LOST: 502,
    ErrorCode.NO_AVAILABLE_PROVIDER: 503,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.QUEUE_TIMEOUT: 504,
    ErrorCode.EXECUTION_TIMEOUT: 504,
    ErrorCode.PROVIDER_TIMEOUT: 504,
}


#: Run failures that another try of the same request would only repeat, at the provider's cost or the
#: caller's: a run that outlasted its `execution_timeout_ms`, a provider that took it and went silent
#: for its `read_timeout_ms` (most likely still at it: a server that answers only when done goes on
#: for nobody), an answer over the output limits, a run that waited its `queue_timeout_ms` for a slot
#: (the operator's bound on a caller's wait). Their answers say `x-should-retry: false`, which the
#: official `openai` clients obey (they retry every 5xx twice by default, so a runaway generation
#: took three times its GPU time, a silent provider three times the caller's wait, and a queue
#: timeout of 30 s ~90 s).
NOT_WORTH_RETRYING = frozenset({ErrorCode.EXECUTION_TIMEOUT, ErrorCode.PROVIDER_TIMEOUT, ErrorCode.OUTPUT_TOO_LARGE,
                                ErrorCode.QUEUE_TIMEOUT})

#: Run failures worth trying again in a second, and said so in `Retry-After`, as the gateway says
#: it when it refuses a run itself: every provider of the model went down while the run waited
#: (one that is down is probed again every `runtime.heartbeat_interval_ms`, and back at its first
#: answer); the pool let the run go (its gateway paused past its liveness, Redis lost part of its
#: output), as a stopping gateway's 503 says it.
RETRY_SOON = frozenset({ErrorCode.NO_AVAILABLE_PROVIDER, ErrorCode.UNAVAILABLE})


def _error_type(status: int, code: ErrorCode | None = None) -> str:
    if code is ErrorCode.RATE_LIMIT_EXCEEDED:
        return "requests"  # (OpenAI's type for a limit on requests)
    if code is ErrorCode.QUEUE_FULL:
        return "server_error"  # (the pool is overloaded, as OpenAI's "model is currently overloaded"; not the request)
    if status < 500:
        return "invalid_request_error"
    return "server_error"


class ApiError(Exception):
    """An error to answer with; raised anywhere in a handler."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        param: str | None = None,
        status: int | None = None,
        headers: dict[str, str] | None = None,
        detail: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.status = status or STATUS[code]
        self.headers = headers or {}
        self.detail = detail
        #: the `model` of the request refused, when its body named one before the fault was found
        #: (the gateway's metrics count a bad request to a model it serves under that model)
        self.model: str | None = None

    @classmethod
    def from_info(cls, info: ErrorInfo) -> ApiError:
        """A run's failure; a provider's 4xx is passed through with its own status and body, but
        not its 429, its 402 (iop's account out of credits) nor its refusal of iop's credentials
        (`POOL_FAULT_4XX`): those are the pool's fault, not the caller's (the run was tried on another
        provider first). A refusal is a 502, like a 5xx; the last provider tried too busy to take it
        (`busy`: its 429 or 503, or its account out of credits, 402, or iop's key at its spending
        limit, a 403 `KEY_LIMIT`) is a 503
        that says when to try again, as the provider said it (or in 1 s). A failure that another try
        would only repeat says so (`NOT_WORTH_RETRYING`); one worth trying again soon says when
        (`RETRY_SOON`: in 1 s, or when the scheduler said, as when the first bench ends), as does
        one the worker judged would repeat (`repeats`: an answer iop cannot carry, an account out of
        quota or credits: that one's 503 says when to come back and not to retry at once)."""
        if info.status is not None and callers_fault(info.status, info.message):
            return cls(info.code, info.message, status=info.status, detail=info.detail)
        if info.code is ErrorCode.PROVIDER_ERROR and busy(info.status, info.message):
            # (an account out of quota: no retry either; the official clients waited its 60 s twice)
            wait = {"Retry-After": str(info.retry_after_s or 1)}
            return cls(info.code, info.message, status=503,
                       headers={**wait, "x-should-retry": "false"} if info.repeats else wait)
        if info.code in NOT_WORTH_RETRYING or info.repeats:
            return cls(info.code, info.message, headers={"x-should-retry": "false"})
        return cls(info.code, info.message,
                   headers={"Retry-After": str(info.retry_after_s or 1)} if info.code in RETRY_SOON else None)

    def body(self) -> dict[str, Any]:
        if self.detail is not None and isinstance(self.detail.get("message"), str):
            param, code, kind = self.detail.get("param"), self.detail.get("code"), self.detail.get("type")
            err = {
                "message": self.detail["message"],
                "type": kind if isinstance(kind, str) and kind else _error_type(self.status),
                "param": param if isinstance(param, str) else None,
                # (a string, as OpenAI's schema has it: vLLM's is the status, a number; a null as it came)
                "code": None if "code" in self.detail and code is None else _code_text(code) or self.code.value,
            }
            return {"error": err}
        return {
            "error": {
                "message": self.message,
                "type": _error_type(self.status, self.code),
                "param": self.param,
                "code": self.code.value,
            }
        }

    def response(self) -> web.Response:
        """The answer, with an `X-Request-Id` of its own unless it has one (a run's)."""
        response = json_response(self.body(), status=self.status, headers=with_request_id(spread(self.headers)))
        response.set_status(self.status, phrase(self.status))
        return response

    def raw_response(self) -> bytes:
        """The whole HTTP/1.1 response, for a connection answered outside any handler (a request
        that came too slowly, a connection over the limit); the connection closes after it. Each
        call has an `X-Request-Id` of its own."""
        body = dumps(self.body())
        head = [f"HTTP/1.1 {self.status} {phrase(self.status)}", "Content-Type: application/json",
                f"Content-Length: {len(body)}", "Connection: close",
                *(f"{name}: {value}" for name, value in with_request_id(spread(self.headers)).items())]
        return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


#: OpenAI's header for a request's id (the `openai` client's `_request_id`): every answer has one
REQUEST_ID_HEADER = "X-Request-Id"


def new_request_id() -> str:
    """The id of an answer that is not a run's (`req_` and 32 hex digits, as OpenAI's)."""
    return f"req_{uuid4_hex()}"


#: the header of a wait in milliseconds, which the official `openai` clients read before
#: `Retry-After` (as Azure OpenAI sends it), and the most of a wait it spreads (`spread`)
RETRY_AFTER_MS_HEADER = "retry-after-ms"
MAX_SPREAD_S = 5


def spread(headers: dict[str, str]) -> dict[str, str]:
    """`headers` with a `retry-after-ms` of their `Retry-After` (n whole seconds, at most 60) and a
    random part of up to n more seconds (at most `MAX_SPREAD_S`; 60 s in all): callers refused together (a full
    queue, no provider) came back together at n s sharp and were mostly refused again; the official
    clients wait what `retry-after-ms` says, others `Retry-After` as before."""
    after = headers.get("Retry-After", "")
    if not after.isdigit() or not 0 < int(after) <= 60 or RETRY_AFTER_MS_HEADER in headers:
        return headers
    # (at most 60 s in all: some versions of the official Python client take a longer wait for none and
    # back off their own way; 3.63 waits up to 120 s and does not try again past that)
    n_ms = int(after) * 1000
    return {**headers, RETRY_AFTER_MS_HEADER: str(min(n_ms + random.randrange(min(n_ms, MAX_SPREAD_S * 1000)),
                                                      60_000))}


def with_request_id(headers: dict[str, str]) -> dict[str, str]:
    return headers if REQUEST_ID_HEADER in headers else {**headers, REQUEST_ID_HEADER: new_request_id()}


def _code_text(code: Any) -> str | None:
    """A provider's error `code` as text: a string as it is, a number in digits, else None."""
    if isinstance(code, str):
        return code or None
    if isinstance(code, int) and not isinstance(code, bool):
        return str(code)
    return None


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(ErrorCode.INVALID_REQUEST, message, param=param)


_HTTP_CODES: dict[int, ErrorCode] = {
    404: ErrorCode.NOT_FOUND,
    405: ErrorCode.METHOD_NOT_ALLOWED,
    413: ErrorCode.REQUEST_TOO_LARGE,
}


def from_status(status: int, message: str) -> ApiError:
    """An error aiohttp gives only a status for: an unknown route or method, a request it could not parse."""
    code = _HTTP_CODES.get(status, ErrorCode.INVALID_REQUEST if status < 500 else ErrorCode.INTERNAL)
    return ApiError(code, message, status=status)


#: How much of a request's path an error repeats
MAX_SHOWN_PATH = 200


def shown_path(request: web.Request) -> str:
    """The request's path, cut at `MAX_SHOWN_PATH`, for an error's message."""
    path = request.path
    return path if len(path) <= MAX_SHOWN_PATH else path[:MAX_SHOWN_PATH] + "…"


def from_http_error(request: web.Request, error: web.HTTPException, unknown: str) -> ApiError:
    """What aiohttp raised for a request it routes no handler for (an unknown path: `unknown` is
    the 404's message; a method the path does not take: a 405 that names those it takes), or whose
    body is too large (413)."""
    if error.status == 404:
        message = unknown
    elif error.status == 413:
        message = f"request body is too large: {error.text}"
    elif error.status == 405 and "Allow" in error.headers:
        allowed = ", ".join(m.strip() for m in error.headers["Allow"].split(","))
        message = f"{request.method} {shown_path(request)} is not allowed: it takes {allowed}"
    else:
        message = error.reason
    answer = from_status(error.status, message)
    if "Allow" in error.headers:  # (a 405 says which methods the path takes)
        answer.headers["Allow"] = error.headers["Allow"]
    return answer
