"""Answers a browser may read when a page of another site calls the gateway (CORS).

Off unless `runtime.cors_origins` lists sites (`https://app.example.com`, or `*` for any): a
gateway without keys on a developer's machine must not be usable by every page its browser
opens. A listed site's preflight (`OPTIONS` with `Access-Control-Request-Method`) is answered
before any key is asked for (a browser sends none with it); its other requests are let in or
refused by their key as any other, and every answer to them, errors and streams included, names
the site in `Access-Control-Allow-Origin` and shows the headers a client reads (the run id, the
rate-limit headers). Keys travel in `Authorization`, never in cookies, so no credentials mode is
allowed.
"""

from __future__ import annotations

from aiohttp import web

#: The sites a browser may call the gateway from (`runtime.cors_origins`).
ORIGINS = web.AppKey("cors_origins", frozenset[str])
METHODS = "GET, POST, DELETE, OPTIONS"
#: The answer headers a page's script may read.
EXPOSED = ("X-Request-Id, X-IOP-Run-Id, Retry-After, x-ratelimit-limit-requests, x-ratelimit-remaining-requests, "
           "x-iop-limit, x-should-retry")
#: How long a browser may keep a preflight's answer, in seconds.
MAX_AGE_S = 600


def allowed_origin(request: web.Request) -> str | None:
    """The request's `Origin`, if the config lets that site's pages read the answers (compared
    without case: a browser sends the host in lower case, an operator may not write it so)."""
    origins = request.app.get(ORIGINS)
    origin = request.headers.get("Origin")
    if not origins or not origin:
        return None
    return origin if "*" in origins or origin.lower() in origins else None


def preflight(request: web.Request) -> web.Response | None:
    """The answer to a listed site's preflight; None for any other request."""
    if request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers:
        return None
    origin = allowed_origin(request)
    if origin is None:
        return None
    return web.Response(status=204, headers={
        "Access-Control-Allow-Origin": origin, "Access-Control-Allow-Methods": METHODS,
        "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers", ""),
        "Access-Control-Max-Age": str(MAX_AGE_S), "Vary": "Origin"})


async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer to a listed site's request names it (`on_response_prepare`); every answer says
    it depends on `Origin`, so a cache never gives one site's answer to another."""
    if "Access-Control-Allow-Origin" in response.headers:  # (a preflight's own)
        return
    response.headers.add("Vary", "Origin")
    origin = allowed_origin(request)
    if origin is not None:
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Expose-Headers"] = EXPOSED


def setup(app: web.Application, origins: list[str]) -> None:
    if origins:
        app[ORIGINS] = frozenset(origin.lower() for origin in origins)
        app.on_response_prepare.append(on_prepare)
