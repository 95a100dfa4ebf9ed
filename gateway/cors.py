"""Answers a browser may read when a page of another site calls the gateway (CORS).

Off unless `runtime.cors_origins` lists sites (`https://app.example.com`, or `*` for any): a
gateway without keys on a developer's machine must not be usable by every page its browser
opens. A listed site's preflight (`OPTIONS` with `Access-Control-Request-Method`) is answered
before any key is asked for (a browser sends none with it); its other requests are let in or
refused by their key as any other, and every answer to them, errors and streams included, names
the site in `Access-Control-Allow-Origin` and shows the headers a client reads (the run id, the
rate-limit headers). Keys travel in `Authorization`, never in cookies, so no credentials mode is
allowed.

A browser lets any page send a POST to any site without asking first (a "simple" request: a form,
or a `fetch` with `Content-Type: text/plain`), and a gateway without keys would run it: the page
cannot read the answer, but it spends a provider's time (a hosted API's credits). So a request
that changes something (any method but GET, HEAD and OPTIONS) from a page of another site, as its
`Origin` says (a browser sends one with every such request), is refused with a 403
`cross_site_request` unless that site is listed. A page of the gateway's own site (the catalog
page's operator buttons) is let in: its `Origin` names the host the request was sent to (`Host`,
or `X-Forwarded-Host` behind a proxy that rewrites it; a page cannot set that header without a
preflight). Clients that are not browsers send no `Origin`.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from aiohttp import web

from common.shown import quoted
from common.wire import ErrorCode
from gateway.errors import ApiError

#: The sites a browser may call the gateway from (`runtime.cors_origins`).
ORIGINS = web.AppKey("cors_origins", frozenset[str])
METHODS = "GET, POST, DELETE, OPTIONS"
#: The answer headers a page's script may read.
EXPOSED = ("X-Request-Id, X-IOP-Run-Id, Retry-After, retry-after-ms, x-ratelimit-limit-requests, "
           "x-ratelimit-remaining-requests, x-ratelimit-reset-requests, x-iop-limit, x-should-retry")
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


#: methods a page of any site may send without a preflight, which change nothing here
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_DEFAULT_PORTS = {"http": ":80", "https": ":443"}


def _host(netloc: str, scheme: str) -> str:
    """A host as sent, without its scheme's default port (`Host: localhost:80` is `localhost`)."""
    netloc = netloc.strip().lower()
    default = _DEFAULT_PORTS.get(scheme, "")
    return netloc[:-len(default)] if default and netloc.endswith(default) else netloc


def _own_site(request: web.Request, origin: str) -> bool:
    """Whether `origin` names the host the request was sent to."""
    try:
        parts = urlsplit(origin)
    except ValueError:
        return False
    if parts.scheme not in _DEFAULT_PORTS or not parts.netloc:
        return False
    sent_to = [request.headers.get("Host", "")]
    forwarded = request.headers.get("X-Forwarded-Host")
    if forwarded:
        sent_to.append(forwarded.split(",")[0])
    host = _host(parts.netloc, parts.scheme)
    return any(host == _host(h, parts.scheme) for h in sent_to if h)


def refuse_cross_site(request: web.Request) -> None:
    """Refuse a request that changes something, or a preflight, sent by a page of a site that is
    neither the gateway's own nor listed in `runtime.cors_origins` (403 `cross_site_request`)."""
    origin = request.headers.get("Origin")
    # (a preflight asks leave for a change: an unlisted site's is refused as the change would be, not
    # answered 401 "an API key is required", which a preflight never carries)
    asks = request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers
    if origin is None or (request.method in _SAFE_METHODS and not asks):
        return
    if allowed_origin(request) is not None or _own_site(request, origin):
        return
    raise ApiError(ErrorCode.CROSS_SITE,
                   f"a page of {quoted(origin)} may not call this gateway: list its site in runtime.cors_origins "
                   "to let it")


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


async def nosniff(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer is taken as the type it says (`on_response_prepare`): JSON carrying a provider's
    or a caller's text is never sniffed into a page, nor run as a script a page of another site
    includes."""
    response.headers.setdefault("X-Content-Type-Options", "nosniff")


def setup(app: web.Application, origins: list[str]) -> None:
    app.on_response_prepare.append(nosniff)
    if origins:
        app[ORIGINS] = frozenset(origin.lower() for origin in origins)
        app.on_response_prepare.append(on_prepare)
