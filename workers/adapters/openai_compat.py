"""The OpenAI-compatible family: vLLM, SGLang, Lemonade and hosted `openai_api` providers."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from common.config import ProviderConfig
from common.policy import Health
from common.wire import RunKind
from workers.adapters.base import ProbeResult, ProviderError

PATHS = {RunKind.CHAT: "/chat/completions", RunKind.COMPLETION: "/completions", RunKind.EMBEDDING: "/embeddings"}


def api_root(base_url: str) -> str:
    """`http://host:8000` and `http://host:8000/v1` both mean the API under /v1."""
    root = base_url.rstrip("/")
    return root if root.endswith("/v1") else root + "/v1"


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
        self.root = api_root(provider.base_url)
        self.timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=provider.connect_timeout_ms / 1000,
            sock_read=provider.read_timeout_ms / 1000,
        )

    def _headers(self, request_id: str) -> dict[str, str]:
        headers = {"X-Request-Id": request_id}
        if self.provider.api_key_env:
            key = os.environ.get(self.provider.api_key_env)
            if key:
                headers["Authorization"] = f"Bearer {key}"
        return headers

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

    async def complete(self, kind: RunKind, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        try:
            async with self._post(kind, body, request_id) as resp:
                await self._raise_for(resp)
                data = await resp.json(content_type=None)
        except ProviderError:
            raise
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise ProviderError(f"provider {self.provider.id} failed: {exc!r}", retryable=True) from exc
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
        except ProviderError:
            raise
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise ProviderError(f"provider {self.provider.id} failed: {exc!r}", retryable=True) from exc
        if not parser.done:
            raise ProviderError(f"provider {self.provider.id} closed the stream before [DONE]", retryable=True)

    async def probe(self) -> ProbeResult:
        timeout = aiohttp.ClientTimeout(total=self.provider.probe_timeout_ms / 1000)
        try:
            async with self.session.get(self.root + "/models", headers=self._headers("probe"),
                                        timeout=timeout) as resp:
                if resp.status != 200:
                    return ProbeResult(Health.UNAVAILABLE, f"GET /v1/models answered {resp.status}")
                data = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            return ProbeResult(Health.UNAVAILABLE, f"GET /v1/models failed: {type(exc).__name__}: {exc}")
        models = [m["id"] for m in data.get("data", []) if isinstance(m, dict) and "id" in m] \
            if isinstance(data, dict) else None
        return ProbeResult(Health.AVAILABLE, "", models)

    async def close(self) -> None:
        return None
