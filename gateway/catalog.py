"""Read-only operations routes: `GET /v1/catalog` (JSON), `GET /v1/catalog/history` (the load of
the last hour, as the schedulers sampled it) and `GET /catalog` (a page for people).

The page is one static HTML file (inline CSS and JS, no build step) that polls `/v1/catalog` and
the history; its operator controls call `/v1/admin/…` (`gateway.admin`). Nothing here changes
routing.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import re
from collections.abc import Callable
from importlib import resources

from aiohttp import web
from redis.asyncio import Redis

from common.catalog import read_catalog
from common.config import Config
from common.history import read_history
from common.redisconn import now_ms
from common.shown import shown
from common.wire import ErrorCode
from gateway.errors import ApiError, invalid
from gateway.requests import query_value

#: Longest a catalog read may take before the gateway answers 503.
READ_TIMEOUT_S = 2.0

_PAGE = resources.files("gateway").joinpath("catalog.html")
_PAGE_TEXT = _PAGE.read_text(encoding="utf-8")


def _hashes(tag: str) -> str:
    """The CSP sources of the page's own inline `<tag>` blocks, by their SHA-256: they run, and no
    other inline script or style would (one injected into the page, an `onerror=` attribute)."""
    blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", _PAGE_TEXT, re.DOTALL)
    return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in blocks)


#: The page's own script and style (inline) may run, and read this gateway only: no other site's
#: script, frame, image or request, nor a page of another site framing it (its operator key's clicks)
PAGE_HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": f"default-src 'none'; script-src {_hashes('script')}; style-src {_hashes('style')}; "
                               "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}

#: `?since=`: ASCII digits only (`str.isdigit` takes a superscript 2, which `int` refuses), below 2**63.
_SINCE = re.compile(r"[0-9]{1,19}")


def setup(app: web.Application, config: Config, redis: Callable[[], Redis]) -> None:
    """Add the catalog routes; `redis` returns the app's client once it is started."""

    async def catalog_json(request: web.Request) -> web.Response:
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                catalog = await read_catalog(redis(), config, now_ms())
        except TimeoutError:
            raise ApiError(ErrorCode.UNAVAILABLE, "the catalog could not be read from Redis in time",
                           headers={"Retry-After": "1"}) from None
        return web.json_response(catalog.to_json(), headers={"Cache-Control": "no-store"})

    async def history_json(request: web.Request) -> web.Response:
        since = query_value(request, "since")
        if since is not None and (not _SINCE.fullmatch(since) or int(since) >= 2**63):
            raise invalid(f"since: {shown(since)} is not a time in ms since the epoch", "since")
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                history = await read_history(redis(), config, now_ms(), int(since) if since is not None else None)
        except TimeoutError:
            raise ApiError(ErrorCode.UNAVAILABLE, "the history could not be read from Redis in time",
                           headers={"Retry-After": "1"}) from None
        return web.json_response(history, headers={"Cache-Control": "no-store"})

    async def catalog_page(request: web.Request) -> web.Response:
        return web.Response(text=_PAGE_TEXT, content_type="text/html", headers=PAGE_HEADERS)

    app.router.add_get("/v1/catalog", catalog_json)
    app.router.add_get("/v1/catalog/history", history_json)
    app.router.add_get("/catalog", catalog_page)
