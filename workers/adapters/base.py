"""The small interface every provider adapter implements."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from common.policy import Health
from common.wire import RunKind


class ProviderError(Exception):
    """The provider could not serve the run.

    `retryable` says whether another attempt (maybe on another provider) could succeed,
    e.g. connection refused or a 5xx; a provider's 4xx is the caller's fault and is not.
    """

    def __init__(self, message: str, *, status: int | None = None, detail: dict[str, Any] | None = None,
                 retryable: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.detail = detail
        self.retryable = retryable


@dataclass(frozen=True, slots=True)
class ProbeResult:
    health: Health
    reason: str = ""
    #: served names the provider says it has; None when it cannot list them
    models: list[str] | None = field(default=None)


class Adapter(Protocol):
    async def complete(self, kind: RunKind, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        """One whole response (non-stream)."""
        ...

    def stream(self, kind: RunKind, body: dict[str, Any], request_id: str) -> AsyncIterator[list[dict[str, Any]]]:
        """OpenAI chunk objects, one list per read from the provider."""
        ...

    async def probe(self) -> ProbeResult:
        ...

    async def close(self) -> None:
        ...
