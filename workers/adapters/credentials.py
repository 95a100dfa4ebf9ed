"""What a provider's HTTP requests carry besides their body, and what no error text may show: the
config's `headers`, the run's request id, the key from `api_key_env` (`Authorization: Bearer <key>`,
or the key as it is in `api_key_header`: Azure's `api-key`), and the proxy's credentials (`Via`).
Shared by the OpenAI family's adapter and Ollama's (ollama.com's API, or a server behind a proxy
that asks for a bearer token)."""

from __future__ import annotations

import os
from typing import Any

from common.config import ProviderConfig
from common.wire import upstream_request_id
from workers.adapters.failures import key_secrets, url_secrets
from workers.adapters.proxies import Proxy, Via


def sendable(value: str) -> bool:
    """Whether a header can carry `value` as it is: printable ASCII."""
    return value.isascii() and value.isprintable()


class Credentials:
    __slots__ = ("provider", "via")

    def __init__(self, provider: ProviderConfig, proxy: Proxy | None) -> None:
        """`proxy`: the HTTP proxy its requests go through (`workers.adapters.proxies`), or none."""
        self.provider = provider
        self.via = Via(proxy, (provider.base_url or "").lower().startswith("https:"))

    def key(self) -> str | None:
        """The key, read from the environment at each request (whitespace at its ends, a line end
        of an env file, left out: no header could carry it); none if it holds what no header can
        carry (a line break inside it: aiohttp refused each request, which then failed as "not
        valid JSON", no strike; the worker warns at its start, `workers.service.key_warnings`)."""
        if not self.provider.api_key_env:
            return None
        key = os.environ.get(self.provider.api_key_env, "").strip()
        return key if key and sendable(key) else None

    def headers(self, run_id: str | None) -> dict[str, str]:
        """The config's `headers`, the run's request id (none for a probe), and the key."""
        headers = dict(self.provider.headers) if self.provider.headers else {}
        if run_id:
            headers["X-Request-Id"] = upstream_request_id(run_id)
        key = self.key()
        if key:
            if self.provider.api_key_header:
                headers[self.provider.api_key_header] = key
            else:
                headers["Authorization"] = f"Bearer {key}"
        return self.via.headers(headers)

    def options(self, run_id: str | None, json_body: bool = False) -> dict[str, Any]:
        """What a request to the provider carries besides its URL and body, as aiohttp's keyword
        arguments: `headers` (with `Content-Type: application/json` for a `json_body`), and the
        proxy's `proxy` and `proxy_headers`."""
        headers = self.headers(run_id)  # (a new dict each time: it may be added to)
        if json_body:
            headers["Content-Type"] = "application/json"
        return {"headers": headers, "proxy": self.via.url, "proxy_headers": self.via.tunnel_headers()}

    def secrets(self) -> list[str]:
        """What no error text may show: the key (as it is, or percent-encoded), credentials in
        `base_url`, the proxy's."""
        return key_secrets(self.key()) + url_secrets(self.provider.base_url) + self.via.secrets
