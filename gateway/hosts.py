"""The names a gateway without keys answers to on loopback (DNS rebinding).

A web page cannot read another site's answers, but a page can make its own name point at
127.0.0.1 once loaded (DNS rebinding): its scripts then reach a gateway on the reader's machine as
their own site, `Origin` and all, and read whatever a gateway without keys answers to anyone (the
models, the runs, the catalog), and start runs. What gives such a request away is its `Host`: the
page's name. So a gateway without `auth` answers a request that came over loopback only when its
`Host` is an IP address, `localhost`, a name no public DNS serves (under `.localhost`, `.local` or
`.internal`), this machine's own name, or a name in `runtime.allowed_hosts` (`*` for any: a proxy
on the same machine that passes its public name on); any other is a 403 `host_not_allowed`. With
keys, a page has no key to send. A request from another machine is not checked: such a gateway was
told to serve anyone (`--allow-anonymous`).
"""

from __future__ import annotations

import ipaddress
import socket

from aiohttp import web

from common.shown import quoted
from common.wire import ErrorCode
from gateway.errors import ApiError

#: names no public DNS serves, so no page's own (mDNS's `.local`, `.internal` for private networks)
PRIVATE_SUFFIXES = (".localhost", ".local", ".internal")
#: How many `Host` values found good a gateway remembers (a header's check costs ~2 µs, a lookup ~0.05)
MAX_REMEMBERED = 64


class Names:
    """The names (lower case) a gateway answers to over loopback besides addresses and localhost,
    and the `Host` values already found good."""

    __slots__ = ("allowed", "good")

    def __init__(self, allowed: frozenset[str]) -> None:
        self.allowed = allowed
        self.good: set[str] = set()

    def answers(self, host: str) -> bool:
        if host in self.good:
            return True
        name = _name(host)
        if name == "localhost" or name.endswith(PRIVATE_SUFFIXES) or name in self.allowed or _is_address(name):
            if len(self.good) < MAX_REMEMBERED:
                self.good.add(host)
            return True
        return False


#: absent when the gateway has keys (or `*` is listed): nothing is checked
ALLOWED = web.AppKey("allowed_hosts", Names)


def _name(host: str) -> str:
    """A `Host` header's name: lower case, without its port or a final dot (`localhost.`), an IPv6
    address without brackets."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    name, _, port = host.rpartition(":")
    return (name if name and port.isdigit() else host).rstrip(".")


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _came_over_loopback(request: web.Request) -> bool:
    transport = request.transport
    local = transport.get_extra_info("sockname") if transport is not None else None
    if not isinstance(local, tuple) or not local:
        return False  # (a Unix socket: no page's name reaches it)
    try:
        return ipaddress.ip_address(str(local[0]).partition("%")[0]).is_loopback
    except ValueError:
        return False


def refuse_foreign_host(request: web.Request) -> None:
    """Refuse a request to a gateway without keys over loopback whose `Host` names another site."""
    names = request.app.get(ALLOWED)
    if names is None:
        return
    host = request.headers.get("Host")
    if not host or names.answers(host):  # (HTTP/1.0 without one: no page's name)
        return
    if not _came_over_loopback(request):
        return
    raise ApiError(ErrorCode.HOST_NOT_ALLOWED,
                   f"this gateway has no keys: on loopback it answers only to localhost, addresses and its own "
                   f"names, not to {quoted(_name(host))}: add it to runtime.allowed_hosts if it is yours")


def setup(app: web.Application, keyed: bool, hosts: list[str]) -> None:
    if keyed or "*" in hosts:
        return
    own = socket.gethostname().lower()
    app[ALLOWED] = Names(frozenset({own, own.partition(".")[0], *(h.lower() for h in hosts)}))
