"""The small interface every provider adapter implements, and how a failure is described."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from common.policy import DOWN as DOWN  # (the adapters take it from here)
from common.policy import Health
from common.wire import ErrorCode, RunKind


class Retry(StrEnum):
    """Where another attempt of a run that failed before any output may go."""

    NO = "no"  # the caller's fault (a 4xx), or nothing would change
    ELSEWHERE = "elsewhere"  # the provider answered 5xx/429: only another provider, each at most once
    ANY = "any"  # the provider could not be reached or broke off: any provider (others first)
    #: this provider cannot do what the request asks (a 400 saying so: a CLI tool's tools, an Ollama
    #: model without tools, llama-server's `n` over its slots): another provider of the model that the
    #: run was not tried on, else one it was tried on that did not refuse it so, never this one again,
    #: without using up one of its attempts (it only asked; nothing was generated)
    UNABLE = "unable"


class ProviderError(Exception):
    """The provider could not serve the run.

    `message` is one line naming the provider and what failed, with no addresses or reprs.
    `retry` says where another attempt could go; `strikes` what the failure says about the
    provider's health: None nothing (it was never reached), 0 it answered (alive, whatever it
    said), n > 0 that many strikes against it (`DOWN` takes it down at once); `retry_after_s`
    the seconds a busy provider asked for (its `Retry-After`); `repeats` that the caller's own
    try would get the same (an answer iop cannot carry), which its client is told (`ErrorInfo.repeats`):
    not every failure iop does not try again would repeat (a CLI tool that exited with an error)."""

    def __init__(self, message: str, *, status: int | None = None, detail: dict[str, Any] | None = None,
                 retry: Retry = Retry.NO, strikes: int | None = None,
                 code: ErrorCode = ErrorCode.PROVIDER_ERROR, retry_after_s: int | None = None,
                 repeats: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.detail = detail
        self.retry = retry
        self.strikes = strikes
        self.code = code
        self.retry_after_s = retry_after_s
        self.repeats = repeats

    @property
    def retryable(self) -> bool:
        return self.retry is not Retry.NO


@dataclass(frozen=True, slots=True)
class ReadLimits:
    """What an adapter reads from a provider at most (`runtime.max_*`)."""

    response_bytes: int = 16 * 1024 * 1024  # a whole (non-stream) answer
    line_bytes: int = 1024 * 1024  # one SSE or NDJSON line
    error_chars: int = 500  # a provider's error text passed on
    #: a probe's answer (`/health`, a model list). A big server's model list is ~100 KB; a hosted
    #: aggregator's, with descriptions and prices for hundreds of models, can pass 1 MB. A probe
    #: reads at most this (and never more than `response_bytes`): more is a probe that failed.
    probe_bytes: int = 4 * 1024 * 1024

    @property
    def probe_limit(self) -> int:
        return min(self.probe_bytes, self.response_bytes)

    def too_large(self, provider_id: str, what: str, limit: int) -> ProviderError:
        """`what` ("an answer", "a line") went over `limit`, the setting named in the message."""
        setting = "runtime.max_response_bytes" if what == "an answer" else "runtime.max_line_bytes"
        return ProviderError(f"provider {provider_id} sent {what} over {limit} bytes ({setting})", retry=Retry.NO,
                             strikes=0, code=ErrorCode.OUTPUT_TOO_LARGE)


#: The defaults of `runtime.max_*`, for adapters made without a config (tests).
DEFAULT_LIMITS = ReadLimits()


@dataclass(frozen=True, slots=True)
class ProbeResult:
    health: Health
    reason: str = ""
    #: served names the provider says it has; None when it cannot list them
    models: list[str] | None = field(default=None)
    #: how much a failed probe counts against the provider (see `ProviderError.strikes`);
    #: a probe that passed is a sign of life, whatever this says
    strikes: int = DOWN
    #: the probe got no answer in time (on a busy provider that says nothing about its health)
    timed_out: bool = False
    #: the provider answered that it is busy (429, rate limited): a sign of life, not of health
    busy: bool = False


class LastRead(list[dict[str, Any]]):
    """A stream's read after which nothing but its end may come: its `[DONE]` or Ollama's `done`
    came in it, or every choice has its finish_reason (a usage chunk may follow, and [DONE], within
    `FINISHED_GRACE_S`). The runner sends it with the run's end, one Redis call for both (and for
    the reads after it, as many as `MAX_OPENING` at most). The adapter may still raise after it: a
    stream it finds cut short."""

    __slots__ = ()


class Adapter(Protocol):
    async def complete(self, kind: RunKind, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        """One whole response (non-stream)."""
        ...

    def stream(self, kind: RunKind, body: dict[str, Any], request_id: str) -> AsyncIterator[list[dict[str, Any]]]:
        """OpenAI chunk objects, one list per read from the provider; the last one a `LastRead` where
        the adapter knows it is."""
        ...

    async def probe(self) -> ProbeResult:
        ...

    async def close(self) -> None:
        ...


def not_taken(provider_id: str, message: str, param: str | None) -> ProviderError:
    """A request this provider's adapter cannot give it (a CLI tool's tools, Ollama's n > 1): the
    caller's 400 naming the field, as the gateway's own 400s are worded, unless another provider
    of the model takes it (`Retry.UNABLE`; no strike: it says nothing of the provider's health)."""
    detail = {"message": message, "type": "invalid_request_error", "param": param, "code": "invalid_request_error"}
    return ProviderError(f"provider {provider_id}: {message}", status=400, detail=detail, retry=Retry.UNABLE)
