"""Who a request comes from, and what it may reach.

With `auth.keys` in the config, every route but `/healthz` and `/readyz` needs
`Authorization: Bearer <key>`: none, or a key the gateway does not know, is 401
`invalid_api_key` with `WWW-Authenticate: Bearer`. Operator routes (`/v1/catalog`, `/catalog`,
`/metrics`, `/v1/admin/…`) need an operator key: a caller key gets 403 `permission_denied`.
The catalog page itself holds no data: opened in a browser without a header, it asks for the
key and sends it with every read of `/v1/catalog`.

Without `auth`, every request is `ANYONE` (an operator), as before; the gateway then only
listens on loopback unless told otherwise (`gateway.service`).
"""

from __future__ import annotations

import ipaddress

from aiohttp import web

from common.auth import ANYONE, KeyRing, Principal
from common.shown import quoted
from common.wire import ErrorCode
from gateway.errors import ApiError

KEYRING = web.AppKey("keyring", KeyRing)
PRINCIPAL = web.RequestKey("iop_principal", Principal)

#: Routes that answer anyone: container healthchecks and load balancers.
OPEN = frozenset({"/healthz", "/readyz"})
#: The page that asks for a key when opened without one.
PAGE = "/catalog"
#: Routes for operator keys only.
OPERATOR_ROUTES = frozenset({"/v1/catalog", "/v1/catalog/history", PAGE, "/metrics"})
OPERATOR_PREFIXES = ("/v1/admin/",)
CHALLENGE = {"WWW-Authenticate": 'Bearer realm="iop"'}


def principal(request: web.Request) -> Principal:
    """Who sent the request (`ANYONE` when the gateway serves without keys)."""
    who: Principal = request.get(PRINCIPAL, ANYONE)
    return who


def is_operator_route(path: str) -> bool:
    return path in OPERATOR_ROUTES or path.startswith(OPERATOR_PREFIXES)


def _presented(request: web.Request) -> str | None:
    sent = request.headers.getall("Authorization", [])
    if len(sent) > 1:  # (which one counts would be a guess: a proxy may have added one)
        raise ApiError(ErrorCode.INVALID_REQUEST, f"send one Authorization header, not {len(sent)}")
    scheme, _, key = (sent[0] if sent else "").partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None


def _how_to_send(request: web.Request) -> str:
    """What a request that presented no Bearer key is told: how to send the one it may have sent
    another way (never echoing it)."""
    if "Authorization" in request.headers:
        return "the Authorization header must be 'Bearer <key>' (the word Bearer, a space, then the API key)"
    for header in ("api-key", "x-api-key"):
        if header in request.headers:
            return (f"an API key is required: send it as Authorization: Bearer <key>, not in the {header} "
                    "header")
    return "an API key is required: send Authorization: Bearer <key>"


def admit(request: web.Request) -> None:
    """Let the request in, as the key it presents (`request[PRINCIPAL]`), or raise 401/403. With no
    `auth` in the config, everyone is let in."""
    ring = request.app.get(KEYRING)
    if ring is None or request.path in OPEN:
        return
    if request.path == PAGE and "Authorization" not in request.headers:
        return  # the page holds no data; it asks for the key itself
    key = _presented(request)
    if key is None:
        raise ApiError(ErrorCode.INVALID_API_KEY, _how_to_send(request), headers=dict(CHALLENGE))
    who = ring.lookup(key)
    if who is None:
        raise ApiError(ErrorCode.INVALID_API_KEY, "the API key is not valid", headers=dict(CHALLENGE))
    if is_operator_route(request.path) and not who.operator:
        raise ApiError(ErrorCode.PERMISSION_DENIED,
                       f"key {who.name!r} may not use {quoted(request.path)}: it needs an operator key")
    request[PRINCIPAL] = who


def is_loopback(host: str) -> bool:
    """Whether binding `host` only reaches this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
