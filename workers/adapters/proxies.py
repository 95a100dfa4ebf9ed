"""The HTTP proxy a provider's requests go through: the one the worker's environment names, as
curl and the `openai` client take it. `https_proxy` (or `HTTPS_PROXY`) for a provider at an
https:// URL, `http_proxy` (or `HTTP_PROXY`) for one at http://, none for a host that `no_proxy`
(or `NO_PROXY`) covers: a GPU box on the local network is reached directly while a hosted API goes
through a company's egress proxy. Decided once per provider when the worker starts (aiohttp's own
`trust_env` looks the environment and `~/.netrc` up again on a thread for every request)."""

from __future__ import annotations

import base64
import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from common.shown import quoted

#: A URL's scheme (RFC 3986): what comes before `://` only when it is one.
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")


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
    return _parse(environ[variable].strip(), variable)


def _parse(value: str, variable: str) -> Proxy:
    """`[http://][user[:password]@]host[:port][/]`. The credentials are split off at the last `@`
    first, so that one written without %-encoding (`#`, `/`, `?` or digits in a password) is neither
    taken for the host or the port nor shown in a message or a log."""
    scheme, sep, rest = value.partition("://")
    if not sep or not _SCHEME.fullmatch(scheme):  # (a `://` in a password is no scheme's)
        scheme, rest = "http", value  # (as curl reads `proxy:3128`)
    userinfo, at, hostport = rest.rpartition("@")
    hostport = hostport[:-1] if hostport.endswith("/") else hostport
    if scheme.lower() != "http":
        raise ProxyError(f"{variable} names a {quoted(scheme)} proxy: only an http:// proxy is supported (it may "
                         "tunnel https:// requests)")
    try:
        if any(ch in hostport for ch in "/?#") or not hostport:
            raise ValueError
        proxy = urlsplit("http://" + hostport)
        port, host = proxy.port, proxy.hostname
        if not host:
            raise ValueError
    except ValueError:
        raise ProxyError(f"{variable} is not a proxy URL: write it http://[user:password@]host:port (its password "
                         "%-encoded)") from None
    auth = None
    if at:
        user, _, password = userinfo.partition(":")
        auth = "Basic " + base64.b64encode(f"{unquote(user)}:{unquote(password)}".encode()).decode()
    shown = f"[{host}]" if ":" in host else host
    return Proxy(f"http://{shown}" + (f":{port}" if port is not None else ""), auth, variable)


def loopback(host: str) -> bool:
    """`localhost`, a name under `.localhost`, a loopback address (127.0.0.0/8, ::1, as an IPv4
    address in IPv6 too) or the unspecified one (0.0.0.0, ::: this machine)."""
    host = host.lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    address = _address(host)
    return address is not None and (address.is_loopback or address.is_unspecified)


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address `host` is (an IPv4 one for an IPv4-mapped IPv6 address), or None for a name."""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def bypassed(host: str, port: int, no_proxy: str) -> bool:
    """Whether `no_proxy` (comma-separated, as curl reads it) covers `host` at `port`: `*`; for a
    name, the name itself or a domain it is under (`example.com` and `.example.com` both cover
    `a.example.com`); for an IP address, the address or a block that holds it (`10.0.0.0/8`); each
    optionally with `:port` (`[::1]:8000` for an IPv6 address)."""
    host = host.lower().rstrip(".")
    address = _address(host)
    for item in no_proxy.split(","):
        entry, entry_port = _split_port(item.strip().lower())
        if entry == "*":
            return True
        if not entry or (entry_port is not None and entry_port != port):
            continue
        if address is not None:  # (an address is matched by addresses and blocks, never as a suffix)
            try:
                if address in ipaddress.ip_network(entry, strict=False):
                    return True
            except ValueError:
                pass
            continue
        name = entry.lstrip("*").lstrip(".").rstrip(".")
        if name and (host == name or host.endswith("." + name)):
            return True
    return False


def _split_port(entry: str) -> tuple[str, int | None]:
    """A `no_proxy` entry and its port, if it names one (`host:port`, `[v6]:port`)."""
    if entry.startswith("["):
        inside, _, after = entry[1:].partition("]")
        return inside, int(after[1:]) if after.startswith(":") and after[1:].isdigit() else None
    name, sep, tail = entry.rpartition(":")
    if sep and tail.isdigit() and ":" not in name:  # (not a bare IPv6 address)
        return name, int(tail)
    return entry, None


class Via:
    """What a provider's requests carry to go through its proxy (none: nothing). Its credentials go
    to the proxy only: in the request's own headers when the provider is at http:// (the request
    goes to the proxy as it is), in the tunnel's CONNECT when at https:// (in the request they
    would reach the provider, through the tunnel)."""

    __slots__ = ("url", "_authorization", "_https", "secrets")

    def __init__(self, proxy: Proxy | None, https: bool) -> None:
        self.url = proxy.url if proxy else None
        self._authorization = proxy.authorization if proxy else None
        self._https = https
        #: what no error text may show: the credentials, encoded and the password itself (a proxy's
        #: error page may echo them)
        self.secrets: list[str] = []
        if self._authorization:
            token = self._authorization.removeprefix("Basic ")
            password = base64.b64decode(token).decode(errors="replace").partition(":")[2]
            self.secrets = [token] + ([password] if password else [])

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
