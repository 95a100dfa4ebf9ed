"""The HTTP proxy a provider's requests go through: the one the worker's environment names, as
curl and the `openai` client take it. `https_proxy` (or `HTTPS_PROXY`) for a provider at an
https:// URL, `http_proxy` (or `HTTP_PROXY`) for one at http://, none for a host that `no_proxy`
(or `NO_PROXY`) covers: a GPU box on the local network is reached directly while a hosted API goes
through a company's egress proxy. Decided once per provider when the worker starts (aiohttp's own
`trust_env` looks the environment and `~/.netrc` up again on a thread for every request)."""

from __future__ import annotations

import base64
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from common.shown import quoted


class ProxyError(ValueError):
    """A proxy the environment names that cannot be used; the message names the variable."""


@dataclass(frozen=True, slots=True)
class Proxy:
    #: the proxy's URL without its credentials
    url: str
    #: its credentials, from the URL's `user:password@`, as the `Proxy-Authorization` header says them
    authorization: str | None
    #: the variable that named it
    variable: str


def proxy_for(base_url: str, environ: Mapping[str, str]) -> Proxy | None:
    """The proxy for requests to `base_url`, or None: none named, its host is in `no_proxy`, or it
    is this machine's loopback (which a proxy elsewhere cannot reach: `iop dev`'s simulators)."""
    target = urlsplit(base_url)
    if target.hostname and loopback(target.hostname):
        return None
    scheme = target.scheme.lower()
    names = (f"{scheme}_proxy", f"{scheme.upper()}_PROXY")
    variable = next((name for name in names if environ.get(name, "").strip()), None)
    if variable is None:
        return None
    if target.hostname and bypassed(target.hostname, target.port or (443 if scheme == "https" else 80),
                                    environ.get("no_proxy") or environ.get("NO_PROXY") or ""):
        return None
    value = environ[variable].strip()
    if "://" not in value:
        value = "http://" + value  # (as curl reads `proxy:3128`)
    try:
        proxy = urlsplit(value)
        port = proxy.port
    except ValueError as exc:
        raise ProxyError(f"{variable} is not a proxy URL ({exc})") from None
    if proxy.scheme.lower() != "http" or not proxy.hostname:
        shown = f"{proxy.scheme}://{proxy.hostname or ''}"
        raise ProxyError(f"{variable} names the proxy {quoted(shown)}: only an http:// proxy with a host is "
                         "supported (it may tunnel https:// requests)")
    auth = None
    if proxy.username:
        user_pass = f"{unquote(proxy.username)}:{unquote(proxy.password or '')}"
        auth = "Basic " + base64.b64encode(user_pass.encode()).decode()
    host = f"[{proxy.hostname}]" if ":" in proxy.hostname else proxy.hostname
    return Proxy(f"http://{host}" + (f":{port}" if port is not None else ""), auth, variable)


def loopback(host: str) -> bool:
    """`localhost`, a name under `.localhost`, or a loopback address (127.0.0.0/8, ::1)."""
    host = host.lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bypassed(host: str, port: int, no_proxy: str) -> bool:
    """Whether `no_proxy` (comma-separated, as curl reads it) covers `host` at `port`: `*`, the host
    itself, a domain it is under (`example.com` and `.example.com` both cover `a.example.com`), each
    optionally with `:port`."""
    host = host.lower().rstrip(".")
    for entry in no_proxy.split(","):
        entry = entry.strip().lower()
        if entry == "*":
            return True
        name, sep, tail = entry.rpartition(":")
        if sep and tail.isdigit() and ":" not in name.strip("[]"):  # (`host:port`, not a bare IPv6 address)
            if int(tail) != port:
                continue
            entry = name
        name = entry.strip("[]").lstrip("*").lstrip(".").rstrip(".")
        if name and (host == name or host.endswith("." + name)):
            return True
    return False


class Via:
    """What a provider's requests carry to go through its proxy (none: nothing). Its credentials go
    to the proxy only: in the request's own headers when the provider is at http:// (the request
    goes to the proxy as it is), in the tunnel's CONNECT when at https:// (in the request they
    would reach the provider, through the tunnel)."""

    __slots__ = ("url", "_authorization", "_https")

    def __init__(self, proxy: Proxy | None, https: bool) -> None:
        self.url = proxy.url if proxy else None
        self._authorization = proxy.authorization if proxy else None
        self._https = https

    def headers(self, headers: dict[str, str]) -> dict[str, str]:
        """A request's headers, with the proxy's credentials when they go in them."""
        if self._authorization and not self._https:
            return {**headers, "Proxy-Authorization": self._authorization}
        return headers

    def tunnel_headers(self) -> dict[str, str] | None:
        """The CONNECT's headers (a new dict a request: aiohttp writes `Host` into it)."""
        if self._authorization and self._https:
            return {"Proxy-Authorization": self._authorization}
        return None
