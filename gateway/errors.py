"""The one place that turns the gateway's failures into OpenAI-shaped HTTP errors (the shape
itself, and `ApiError`, are `common.api_error`'s, re-exported here for the gateway's modules).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from redis.exceptions import OutOfMemoryError, RedisError

from common.api_error import (
    REQUEST_ID_HEADER,
    STATUS,
    ApiError,
    from_http_error,
    from_status,
    invalid,
    new_request_id,
    shown_path,
)
from common.redisconn import REDIS_DOWN
from common.wire import ErrorCode

__all__ = ["REQUEST_ID_HEADER", "STATUS", "ApiError", "Handler", "caller_left", "error_response", "from_status",
           "invalid", "new_request_id", "unknown_path"]  # (the first ones are common.api_error's)

log = logging.getLogger("iop.gateway")

#: What a caller who reached an unknown path is told the gateway serves (OpenAI's own API has more)
SERVED_PATHS = ("POST /v1/chat/completions, POST /v1/completions, POST /v1/embeddings, POST /v1/responses, "
                "GET /v1/models, GET /v1/models/{model}, GET /v1/usage and the runs API (GET and DELETE "
                "/v1/runs/{id}, GET /v1/runs/{id}/events); for an operator's key also GET /v1/catalog, "
                "GET /v1/catalog/history, GET /catalog, GET /metrics and /v1/admin/... (README: Operating the pool)")


#: The paths of `SERVED_PATHS` without their `/v1`: a client's base_url left it out
UNDER_V1 = ("/chat/completions", "/completions", "/embeddings", "/responses", "/models", "/usage", "/runs/")


def unknown_path(request: web.Request) -> str:
    """The message of a 404 for a path the gateway does not serve, in OpenAI's words ("Invalid
    URL (POST /v1/x)"), with what it does serve: an `openai` client's call of an endpoint iop
    does not have (`client.audio.speech.create`) says so. The path is cut at `MAX_SHOWN_PATH`."""
    shown = shown_path(request)
    if request.path.startswith(UNDER_V1):  # (`OpenAI(base_url="http://host:8080")`, its /v1 left out)
        return (f"Invalid URL ({request.method} {shown}): the API is under /v1 ({request.method} /v1{shown}): "
                f"a client's base_url ends in /v1 (http://host:port/v1); iop serves {SERVED_PATHS}")
    return f"Invalid URL ({request.method} {shown}): iop serves {SERVED_PATHS}"


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
        return from_http_error(request, error, unknown_path(request)).response()
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
