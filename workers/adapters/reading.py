"""Reading from a provider within limits: a whole answer up to a size, lines up to a length.

A provider can send anything: an endless stream, a 100 MB answer, a line with no end. Every
read here stops at its `ReadLimits` with an `output_too_large` error instead of growing."""

from __future__ import annotations

import aiohttp

from workers.adapters.base import ReadLimits


async def read_whole(resp: aiohttp.ClientResponse, provider_id: str, limits: ReadLimits) -> bytes:
    """The whole body of an answer, or ProviderError once it passes `limits.response_bytes`."""
    if resp.content_length is not None and resp.content_length > limits.response_bytes:
        raise limits.too_large(provider_id, "an answer", limits.response_bytes)
    parts: list[bytes] = []
    size = 0
    async for data in resp.content.iter_any():
        size += len(data)
        if size > limits.response_bytes:
            raise limits.too_large(provider_id, "an answer", limits.response_bytes)
        parts.append(data)
    return b"".join(parts)


class LineSplitter:
    """Splits a byte stream into lines; keeps a partial line between reads, up to a length."""

    def __init__(self, provider_id: str, limits: ReadLimits) -> None:
        self.provider_id = provider_id
        self.limits = limits
        self._buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        if len(self._buf) > self.limits.line_bytes or any(len(line) > self.limits.line_bytes for line in lines):
            raise self.limits.too_large(self.provider_id, "a line", self.limits.line_bytes)
        return lines
