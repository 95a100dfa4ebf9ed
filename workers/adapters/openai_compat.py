"""The OpenAI-compatible family: vLLM, SGLang, Lemonade and hosted `openai_api` providers.

Bodies go to the provider as they came (only `model` was rewritten, by the scheduler), so
unknown fields (`tools`, `response_format`, `logprobs`, ...) pass through, and streamed
chunks (tool-call deltas, usage) come back as the provider sent them.

Where the API lives: `base_url` ending in `/v1` (`http://h:8000/v1`, `http://h:8000/api/v1`)
is the API root as it is; otherwise the type's path is appended (`/v1`; Lemonade `/api/v1`).
`api_path` overrides that (`api_path: /openai/v1`).

Probes per type: vLLM and SGLang `GET /health` (server root) and `GET <api>/models`;
Lemonade `GET <api>/health` and `GET <api>/models`; `openai_api` `GET <api>/models`.

An API key is read from the environment variable named by `api_key_env` at each request.
It never appears in errors or probe reasons: any echo of it by the provider is redacted.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from common.config import ProviderConfig
from common.policy import Health
from common.wire import RunKind
from workers.adapters.base import ProbeResult, ProviderError

PATHS = {RunKind.CHAT: "/chat/completions", RunKind.COMPLETION: "/completions", RunKind.EMBEDDING: "/embeddings"}


#: the path of the OpenAI API on a server of each type, when base_url does not say
DEFAULT_API_PATH = {"lemonade": "/api/v1"}
#: types whose health endpoint lives at the server root rather than under the API root
ROOT_HEALTH = frozenset({"vllm", "sglang"})
REDACTED = "[redacted]"


def api_root(base_url: str, provider_type: str = "vllm", api_path: str | None = None) -> str:
    """`http://host:8000` and `http://host:8000/v1` both mean the API under /v1."""
    root = base_url.rstrip("/")
    if api_path is not None:
        return root + api_path.rstrip("/")
    return root if root.endswith("/v1") else root + DEFAULT_API_PATH.get(provider_type, "/v1")


def server_root(base_url: str, api_path: str | None = None) -> str:
    """The server itself, where vLLM and SGLang answer `/health`."""
    root = base_url.rstrip("/")
    return root.removesuffix("/v1") if api_path is None else root


def _error_detail(payload: Any) -> dict[str, Any] | None:
    error = payload.get("error") if isinstance(payload, dict) else None
    return error if isinstance(error, dict) else None


class SSEParser:
    """Splits an SSE byte stream into `data:` payloads; keeps partial lines between reads."""

    def __init__(self) -> None:
        self._buf = b""
        self.done = False

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        chunks = []
        for line in lines:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                continue
            obj = json.loads(payload)
            if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
                raise ProviderError(str(obj["error"].get("message", "provider error")), detail=obj["error"])
            chunks.append(obj)
        return chunks


class OpenAICompatAdapter:
    def __init__(self, provider: ProviderConfig, session: aiohttp.ClientSession) -> None:
        assert provider.base_url
        self.provider = provider
        self.session = session
        self.root = api_root(provider.base_url, provider.type, provider.api_path)
        self.health_url = (server_root(provider.base_url, provider.api_path) if provider.type in ROOT_HEALTH
                           else self.root) + "/health"
        self.timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=provider.connect_timeout_ms / 1000,
            sock_read=provider.read_timeout_ms / 1000,
        )

    def _key(self) -> str | None:
        if not self.provider.api_key_env:
            return None
        return os.environ.get(self.provider.api_key_env) or None

    def _headers(self, request_id: str) -> dict[str, str]:
        headers = {"X-Request-Id": request_id}
        key = self._key()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def _redact(self, text: str) -> str:
        key = self._key()
        return text.replace(key, REDACTED) if key else text

    def _clean(self, exc: ProviderError) -> ProviderError:
        """The same error with any echo of the API key removed."""
        key = self._key()
        if not key:
            return exc
        detail = json.loads(json.dumps(exc.detail).replace(key, REDACTED)) if exc.detail else exc.detail
        return ProviderError(exc.message.replace(key, REDACTED), status=exc.status, detail=detail,
                             retryable=exc.retryable)

    async def _raise_for(self, resp: aiohttp.ClientResponse) -> None:
        if resp.status < 400:
            return
        text = await resp.text(errors="replace")
        try:
            detail = _error_detail(json.loads(text))
        except ValueError:
            detail = None
        message = (detail or {}).get("message") or text[:500] or resp.reason or "error"
        raise ProviderError(
            f"provider {self.provider.id} answered {resp.status}: {message}",
            status=resp.status,
            detail=detail if 400 <= resp.status < 500 else None,
            retryable=resp.status >= 500 or resp.status == 429,
        )

    def _post(self, kind: RunKind, body: dict[str, Any], request_id: str) -> Any:
        return self.session.post(self.root + PATHS[kind], json=body, headers=self._headers(request_id),
                                 timeout=self.timeout)

    def _failed(self, exc: BaseException) -> ProviderError:
        return ProviderError(self._redact(f"provider {self.provider.id} failed: {exc!r}"), retryable=True)

    async def complete(self, kind: RunKind, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        try:
            async with self._post(kind, body, request_id) as resp:
                await self._raise_for(resp)
                data = await resp.json(content_type=None)
        except ProviderError as exc:
            raise self._clean(exc) from None
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise self._failed(exc) from exc
        if not isinstance(data, dict):
            raise ProviderError(f"provider {self.provider.id} sent a response that is not a JSON object")
        return data

    async def stream(self, kind: RunKind, body: dict[str, Any], request_id: str) -> AsyncIterator[list[dict[str, Any]]]:
        parser = SSEParser()
        try:
            async with self._post(kind, body, request_id) as resp:
                await self._raise_for(resp)
                async for data in resp.content.iter_any():
                    chunks = parser.feed(data)
                    if chunks:
                        yield chunks
        except ProviderError as exc:
            raise self._clean(exc) from None
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise self._failed(exc) from exc
        if not parser.done:
            raise ProviderError(f"provider {self.provider.id} closed the stream before [DONE]", retryable=True)

    async def _get(self, url: str, what: str) -> tuple[Any, ProbeResult | None]:
        """GET a probe URL: its JSON (or None), or the result that ends the probe."""
        timeout = aiohttp.ClientTimeout(total=self.provider.probe_timeout_ms / 1000)
        try:
            async with self.session.get(url, headers=self._headers("probe"), timeout=timeout) as resp:
                if resp.status != 200:
                    return None, ProbeResult(Health.UNAVAILABLE, f"GET {what} answered {resp.status}")
                text = await resp.text(errors="replace")
        except (aiohttp.ClientError, TimeoutError) as exc:
            reason = self._redact(f"GET {what} failed: {type(exc).__name__}: {exc}")
            return None, ProbeResult(Health.UNAVAILABLE, reason)
        try:
            return json.loads(text), None
        except ValueError:
            return None, None

    async def probe(self) -> ProbeResult:
        if self.provider.type in ROOT_HEALTH or self.provider.type == "lemonade":
            _, failed = await self._get(self.health_url, urlsplit(self.health_url).path)
            if failed is not None:
                return failed
        models_path = urlsplit(self.root).path + "/models"
        data, failed = await self._get(self.root + "/models", models_path)
        if failed is not None:
            return failed
        listed = data.get("data") if isinstance(data, dict) else None
        if not isinstance(listed, list):
            return ProbeResult(Health.UNKNOWN, f"GET {models_path} answered 200 but not with a model list")
        return ProbeResult(Health.AVAILABLE, "", [m["id"] for m in listed if isinstance(m, dict) and "id" in m])

    async def close(self) -> None:
        return None
