"""The one place that turns failures into OpenAI-shaped HTTP errors.

Every error body is `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from aiohttp import web
from redis.exceptions import OutOfMemoryError, RedisError

from common.jsonio import dumps, json_response
from common.redisconn import REDIS_DOWN
from common.wire import BUSY, ErrorCode, ErrorInfo, callers_fault, uuid4_hex

log = logging.getLogger("iop.gateway")

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


#: Run failures that another try of the same request would only repeat, at the provider's cost: a run
#: that outlasted its `execution_timeout_ms`, a provider that took it and went silent for its
#: `read_timeout_ms` (most likely still at it: a server that answers only when done goes on for
#: nobody), an answer over the output limits. Their answers say `x-should-retry: false`, which the
#: official `openai` clients obey (they retry every 5xx twice by default, so a runaway generation
#: took three times its GPU time, and a silent provider three times the caller's wait).
NOT_WORTH_RETRYING = frozenset({ErrorCode.EXECUTION_TIMEOUT, ErrorCode.PROVIDER_TIMEOUT, ErrorCode.OUTPUT_TOO_LARGE})

#: Run failures worth trying again in a second, and said so in `Retry-After`, as the gateway says
#: it when it refuses a run itself: every provider of the model went down while the run waited
#: (one that is down is probed again every `runtime.heartbeat_interval_ms`, and back at its first answer).
RETRY_SOON = frozenset({ErrorCode.NO_AVAILABLE_PROVIDER})


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
        not its 429 nor its refusal of iop's credentials (`POOL_FAULT_4XX`): those are the pool's
        fault, not the caller's (the run was tried on another provider first). A refusal is a 502,
        like a 5xx; the last provider tried too busy to take it (`BUSY`: its 429 or 503) is a 503
        that says when to try again, as the provider said it (or in 1 s). A failure that another try
        would only repeat says so (`NOT_WORTH_RETRYING`); one worth trying again soon says when
        (`RETRY_SOON`: in 1 s, or when the scheduler said, as when the first bench ends)."""
        if info.status is not None and callers_fault(info.status):
            return cls(info.code, info.message, status=info.status, detail=info.detail)
        if info.code is ErrorCode.PROVIDER_ERROR and info.status in BUSY:
            return cls(info.code, info.message, status=503, headers={"Retry-After": str(info.retry_after_s or 1)})
        if info.code in NOT_WORTH_RETRYING:
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
        response = json_response(self.body(), status=self.status, headers=with_request_id(self.headers))
        response.set_status(self.status, phrase(self.status))
        return response

    def raw_response(self) -> bytes:
        """The whole HTTP/1.1 response, for a connection answered outside any handler (a request
        that came too slowly, a connection over the limit); the connection closes after it. Each
        call has an `X-Request-Id` of its own."""
        body = dumps(self.body())
        head = [f"HTTP/1.1 {self.status} {phrase(self.status)}", "Content-Type: application/json",
                f"Content-Length: {len(body)}", "Connection: close",
                *(f"{name}: {value}" for name, value in with_request_id(self.headers).items())]
        return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


#: OpenAI's header for a request's id (the `openai` client's `_request_id`): every answer has one
REQUEST_ID_HEADER = "X-Request-Id"


def new_request_id() -> str:
    """The id of an answer that is not a run's (`req_` and 32 hex digits, as OpenAI's)."""
    return f"req_{uuid4_hex()}"


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


#: What a caller who reached an unknown path is told the gateway serves (OpenAI's own API has more)
SERVED_PATHS = ("POST /v1/chat/completions, POST /v1/completions, POST /v1/embeddings, POST /v1/responses, "
                "GET /v1/models, GET /v1/models/{model}, GET /v1/usage and the runs API (GET and DELETE "
                "/v1/runs/{id}, GET /v1/runs/{id}/events)")
#: How much of an unknown path an error repeats
MAX_SHOWN_PATH = 200


def unknown_path(request: web.Request) -> str:
    """The message of a 404 for a path the gateway does not serve, in OpenAI's words ("Invalid
    URL (POST /v1/x)"), with what it does serve: an `openai` client's call of an endpoint iop
    does not have (`client.audio.speech.create`) says so. The path is cut at `MAX_SHOWN_PATH`."""
    return f"Invalid URL ({request.method} {_shown_path(request)}): iop serves {SERVED_PATHS}"


def _shown_path(request: web.Request) -> str:
    path = request.path
    return path if len(path) <= MAX_SHOWN_PATH else path[:MAX_SHOWN_PATH] + "…"


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def caller_left(request: web.Request) -> bool:
    """The caller's connection is closed or closing: a write to it fails, and no answer reaches it."""
    return request.transport is None or request.transport.is_closing()


def error_response(request: web.Request, error: Exception) -> web.StreamResponse:
    """The OpenAI-shaped answer to what a request's handling raised (the one place errors get
    their shape; `gateway.middleware` calls it). A redirect (an HTTPException under 400) is
    raised again.

    The error is told apart by its type, not raised again and caught: raising it here would add
    this frame to its traceback, and this frame holds the error, a reference cycle that keeps the
    whole traceback (the request, its body) alive until the garbage collector comes by."""
    if isinstance(error, ApiError):
        return error.response()
    if isinstance(error, web.HTTPException):
        if error.status < 400:
            raise error
        if error.status == 404:
            message = unknown_path(request)
        elif error.status == 413:
            message = f"request body is too large: {error.text}"
        elif error.status == 405 and "Allow" in error.headers:
            allowed = ", ".join(m.strip() for m in error.headers["Allow"].split(","))
            message = f"{request.method} {_shown_path(request)} is not allowed: it takes {allowed}"
        else:
            message = error.reason
        answer = from_status(error.status, message)
        if "Allow" in error.headers:  # (a 405 says which methods the path takes)
            answer.headers["Allow"] = error.headers["Allow"]
        return answer.response()
    if isinstance(error, web.RequestPayloadError):  # a body that cannot be decoded (Content-Encoding) or was cut short
        return invalid(f"the request body could not be read: {error.__cause__ or error}").response()
    if isinstance(error, ConnectionError) and caller_left(request):  # (not Redis: the caller's own connection)
        log.debug("the caller left during %s %s: %s", request.method, request.path, error)
        return ApiError(ErrorCode.CANCELLED, "the caller left").response()
    if isinstance(error, REDIS_DOWN):
        log.warning("redis unavailable on %s %s: %s", request.method, request.path, error)
        return ApiError(ErrorCode.UNAVAILABLE, "the run store (Redis) is unavailable; retry shortly",
                        headers={"Retry-After": "1"}).response()
    if isinstance(error, OutOfMemoryError):  # Redis at `maxmemory` (noeviction, as iop runs it) refuses writes
        log.warning("redis is full (maxmemory) on %s %s", request.method, request.path)
        return ApiError(ErrorCode.UNAVAILABLE, "the run store (Redis) is full; nothing was queued; retry later",
                        headers={"Retry-After": "5"}).response()
    if isinstance(error, RedisError):  # Redis answered an error: an ACL user without a command iop sends, ...
        log.error("redis refused a command on %s %s: %s", request.method, request.path, error)
        return ApiError(ErrorCode.UNAVAILABLE, "the run store (Redis) refused iop's command; the operator can see why "
                        "in the gateway's log", headers={"Retry-After": "5"}).response()
    log.error("unhandled error on %s %s", request.method, request.path, exc_info=error)
    return ApiError(ErrorCode.INTERNAL, "internal error").response()
