"""Wire models shared by gateway, scheduler and workers: run states, events, errors.

Everything here is written to Redis as plain strings except request bodies and event
payloads, which are msgpack (see `common.codec`); a job is its run id alone, with no arq payload.
"""

from __future__ import annotations

import os
import re
import uuid
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class RunKind(StrEnum):
    """Which OpenAI endpoint a run came in on; decides the provider call."""

    CHAT = "chat"  # POST /v1/chat/completions
    COMPLETION = "completion"  # POST /v1/completions
    EMBEDDING = "embedding"  # POST /v1/embeddings


class RunState(StrEnum):
    QUEUED = "queued"  # waiting in its model's stream
    DISPATCHED = "dispatched"  # slot reserved, job queued on a node
    RUNNING = "running"  # a worker started it
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"  # waited queue_timeout_ms without a slot


ACTIVE_STATES = frozenset({RunState.QUEUED, RunState.DISPATCHED, RunState.RUNNING})
TERMINAL_STATES = frozenset({RunState.COMPLETED, RunState.FAILED, RunState.CANCELLED, RunState.TIMED_OUT})


class EventType(StrEnum):
    DISPATCHED = "dispatched"  # data: provider, node, target
    STARTED = "started"  # data: attempt
    DELTA = "delta"  # data: chunks (list of OpenAI chunk objects from one provider read)
    COMPLETED = "completed"  # data: response (non-stream) or {} (stream)
    FAILED = "failed"  # data: an `ErrorInfo`
    REQUEUED = "requeued"  # data: an `ErrorInfo` for the failed attempt; the run waits again


TERMINAL_EVENTS = frozenset({EventType.COMPLETED, EventType.FAILED})


#: A provider's 4xx answers that are the pool's fault, not the caller's request's: its rate limit
#: (429), its account out of credits (402), its refusal of iop's own credentials (401, 403, 407: the
#: provider's `api_key_env`), and a conflict with its own state (409: Lemonade that cannot load the
#: model while every loaded one is pinned, or beside the one it has). The run goes to another provider;
#: the caller gets a 502 (a 503 for a 429 or a 402: `BUSY`), not the provider's status. (So does a 404
#: that names the served model: `workers.adapters.failures.answered_error`.)
POOL_FAULT_4XX = frozenset({401, 402, 403, 407, 409, 429})
#: A hosted API's account out of money (OpenRouter's "Insufficient credits", DeepSeek's "Insufficient
#: Balance", Mistral's): iop's account, not the caller's
PAYMENT_REQUIRED = 402
#: That conflict: a state of the server's that lasts (until its operator unpins a model), so a run
#: it refused so blames it for the model as a 5xx does (`workers.runner.suspect`).
CONFLICT = 409
#: The status of a provider that does not have what was asked for: the served model (the pool's
#: fault, when its message names it), or an endpoint for that model (the caller's).
NOT_THERE = 404
#: Those of them that refuse iop's credentials.
CREDENTIALS_REFUSED = frozenset({401, 403, 407})


#: A provider's answers that say it cannot take runs for a while: its rate limit (429), its overload
#: (503), and its account out of credits (402: `PAYMENT_REQUIRED`). A run whose last attempt got one is
#: a 503 with `Retry-After` (the provider's own, or 1 s; 60 for an account out of quota or credits,
#: `workers.adapters.failures.out_of_quota`).
BUSY = frozenset({PAYMENT_REQUIRED, 429, 503})
#: The longest `Retry-After` passed on from a provider, in seconds (the official `openai` clients
#: wait what it says up to 60 s; beyond, their own backoff).
MAX_RETRY_AFTER_S = 60


#: How a hosted API's 402 says the request costs more than the account's credits left pay for, not that
#: none are left (OpenRouter: "This request requires more credits, or fewer max_tokens. You requested up
#: to 65536 tokens, but can only afford 3919"; the model's own limit when the request sent none): a
#: request of fewer tokens is served there at the same time, so the API is not left alone for it. (Not
#: one that "can only afford 0": no request is, as for a key out of credits)
FEWER_TOKENS = re.compile(r"\bfewer max_tokens\b(?![^\n]*\bcan only afford 0\b)", re.IGNORECASE)


#: How a hosted API's 403 says its moderation refused the caller's input, not iop's credentials
#: (OpenRouter: "openai/gpt-5 requires moderation on OpenAI. Your input was flagged for \"violence\". No
#: credits were charged.", naming the model by its own slug, which may be a dated one, not the name asked for)
FLAGGED = re.compile(r"\brequires moderation on\b|\byour input was flagged\b", re.IGNORECASE)
#: The status of a refusal of iop's credentials, or of a model those credentials may not use, or of the
#: caller's input by a hosted API's moderation (`FLAGGED`)
FORBIDDEN = 403


def callers_fault(status: int, message: str = "") -> bool:
    """A provider's answer `status` is about the caller's request (passed through, not retried); so is
    a 402 whose `message` says the request asks for more tokens than the credits left pay for
    (`FEWER_TOKENS`: it says what to ask for instead), though another provider may serve it first, and a
    403 whose `message` says the provider's moderation flagged the caller's input (`FLAGGED`)."""
    return 400 <= status < 500 and (status not in POOL_FAULT_4XX or (
        status == PAYMENT_REQUIRED and bool(FEWER_TOKENS.search(message))) or (
        status == FORBIDDEN and bool(FLAGGED.search(message))))


#: How a hosted API's 403 says iop's key reached the spending limit its owner set on it, not that the
#: key is refused (OpenRouter: "Key limit exceeded (monthly limit). Manage it using
#: https://openrouter.ai/settings/keys", also "(total limit)", "(daily limit)"): an account out of
#: credits, as a 402 is (`busy`: left alone, not struck down), until its owner raises the limit or
#: the period ends
KEY_LIMIT = re.compile(r"\bkey limit exceeded\b", re.IGNORECASE)


def busy(status: int | None, message: str = "") -> bool:
    """A provider's answer `status` (with its `message`) says it cannot take runs for a while (`BUSY`,
    or a 403 saying iop's key reached its spending limit: `KEY_LIMIT`), not that the caller's request
    is too large for it (`callers_fault`)."""
    if status is None or callers_fault(status, message):
        return False
    return status in BUSY or (status == FORBIDDEN and bool(KEY_LIMIT.search(message)))


class ErrorCode(StrEnum):
    """Why a run failed. The gateway maps each to an HTTP status in one place."""

    INVALID_REQUEST = "invalid_request_error"
    INVALID_API_KEY = "invalid_api_key"  # no key, or one the gateway does not know (gateway only)
    PERMISSION_DENIED = "permission_denied"  # a caller key on an operator route (gateway only)
    CROSS_SITE = "cross_site_request"  # a page of a site not in runtime.cors_origins (gateway only)
    HOST_NOT_ALLOWED = "host_not_allowed"  # a keyless gateway on loopback asked by another name (gateway only)
    RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"  # the key is at one of its limits (gateway only)
    MODEL_NOT_FOUND = "model_not_found"
    QUEUE_FULL = "queue_full"
    NO_AVAILABLE_PROVIDER = "no_available_provider"
    QUEUE_TIMEOUT = "queue_timeout"
    EXECUTION_TIMEOUT = "execution_timeout"
    PROVIDER_ERROR = "provider_error"
    PROVIDER_TIMEOUT = "provider_timeout"  # the provider took the request and sent nothing for its read_timeout_ms
    OUTPUT_TOO_LARGE = "output_too_large"  # the run's output or the provider's answer passed a limit
    WORKER_LOST = "worker_lost"
    CANCELLED = "cancelled"
    REQUEST_TOO_LARGE = "request_too_large"
    REQUEST_TIMEOUT = "request_timeout"  # the caller sent its request too slowly (gateway only)
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    UNAVAILABLE = "service_unavailable"
    INTERNAL = "internal_error"


@dataclass(slots=True)
class ErrorInfo:
    """The error carried by a `failed` event."""

    code: ErrorCode
    message: str
    #: provider HTTP status when the provider answered 4xx (passed through to the caller)
    status: int | None = None
    #: the provider's own error object, if it sent an OpenAI-shaped one
    detail: dict[str, Any] | None = None
    #: whether this failure happened before any output reached the caller
    before_output: bool = True
    #: the seconds a provider that answered `BUSY` asked to be left alone (its `Retry-After`)
    retry_after_s: int | None = None
    #: another try of the same request would only get the same answer (iop tried it nowhere else:
    #: an answer it cannot carry; or the last provider's account is out of quota or credits, which no
    #: client's wait clears): the caller is told so (`x-should-retry: false`)
    repeats: bool = False

    def to_wire(self) -> dict[str, Any]:
        wire = {
            "code": self.code.value,
            "message": self.message,
            "status": self.status,
            "detail": self.detail,
            "before_output": self.before_output,
        }
        if self.retry_after_s is not None:
            wire["retry_after_s"] = self.retry_after_s
        if self.repeats:
            wire["repeats"] = True
        return wire

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> ErrorInfo:
        try:
            code = ErrorCode(data.get("code", ErrorCode.INTERNAL))
        except ValueError:
            code = ErrorCode.INTERNAL
        retry_after = data.get("retry_after_s")
        return cls(
            code=code,
            message=str(data.get("message", "")),
            status=data.get("status"),
            detail=data.get("detail"),
            before_output=bool(data.get("before_output", True)),
            retry_after_s=retry_after if type(retry_after) is int and 0 <= retry_after <= MAX_RETRY_AFTER_S
            else None,
            repeats=data.get("repeats") is True,
        )


class RunField(StrEnum):
    """Fields of the run record hash (`keys.run_record`)."""

    MODEL = "model"
    KIND = "kind"
    STREAM = "stream"  # "1" or "0"
    BODY = "body"  # msgpack of the caller's request body
    STATE = "state"
    CREATED_MS = "created_ms"
    ENTRY = "entry"  # id of its entry in the model's runs stream (read only while it is queued)
    ATTEMPTS = "attempts"
    MAX_ATTEMPTS = "max_attempts"  # the queue's max_attempts when the run was queued
    UNABLE = "unable"  # attempts whose provider could not do what was asked: none of max_attempts used up
    PROVIDER = "provider"
    NODE = "node"
    TARGET = "target"
    DISPATCHED_MS = "dispatched_ms"
    STARTED_MS = "started_ms"
    FINISHED_MS = "finished_ms"
    OUTPUT = "output"  # "1" once any output was published to the caller
    EMITTED = "emitted"  # "{attempt}:{n}": the last event the attempt emitted (the same emit again adds nothing)
    TRIED = "tried"  # comma-separated providers of every attempt so far
    UNABLE_BY = "unable_by"  # comma-separated providers that refused it as unable: never asked again
    ELSEWHERE = "elsewhere"  # comma-separated providers whose failure retried it only elsewhere: never again
    WORKER = "worker"  # host:pid of the worker running the current attempt (shown to operators only)
    KEY = "key"  # the name of the API key that started it ("anonymous" without keys)
    LIMITED = "limited"  # "1" when it is in its key's in-flight set (the key has a max_in_flight), else "0"
    ERROR_CODE = "error_code"
    ERROR_MESSAGE = "error_message"


def cancelled_by_caller() -> ErrorInfo:
    """The error a run ends with when its caller cancelled it (disconnect or DELETE)."""
    return ErrorInfo(ErrorCode.CANCELLED, "cancelled by the caller")


def uuid4_hex() -> str:
    """A random UUID (version 4) as 32 hex digits: `uuid.uuid4().hex` in a third of its time (0.5
    against 1.7 µs: no `UUID` object is made). Run and request ids are made so, one a request."""
    raw = bytearray(os.urandom(16))
    raw[6] = (raw[6] & 0x0F) | 0x40
    raw[8] = (raw[8] & 0x3F) | 0x80
    return raw.hex()


def upstream_request_id(run_id: str) -> str:
    """The `X-Request-Id` a provider gets for a run: a UUID, which every server accepts (some,
    such as llama-cpp-python's, answer 400 to any other value). A run id is `run_` + the hex of
    a UUID, so this is that UUID; any other id maps to a stable UUID of its own."""
    try:
        return str(uuid.UUID(hex=run_id.removeprefix("run_")))
    except ValueError:
        return str(uuid.uuid5(uuid.NAMESPACE_URL, run_id))
