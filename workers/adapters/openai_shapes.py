"""Building OpenAI-shaped answers for adapters whose provider speaks something else
(Ollama's native API, a CLI tool): chat.completion(.chunk), text_completion, usage.

The `model` field carries the served name the provider ran; the gateway replaces it with
the caller's model id.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from common.wire import RunKind

Json = dict[str, Any]


def usage(prompt_tokens: int, completion_tokens: int) -> Json:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass
class Shaper:
    """Chunks and whole responses for one run of a chat or text completion."""

    kind: RunKind
    request_id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    _role_sent: bool = False

    @property
    def id(self) -> str:
        return f"{'chatcmpl' if self.kind is RunKind.CHAT else 'cmpl'}-{self.request_id}"

    def _chunk(self, choices: list[Json]) -> Json:
        obj = "chat.completion.chunk" if self.kind is RunKind.CHAT else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def delta(self, text: str = "", *, finish_reason: str | None = None, tool_calls: list[Json] | None = None,
              extra: Json | None = None, logprobs: Json | None = None) -> Json:
        """One streamed piece of output (chat: the first one also carries the role)."""
        if self.kind is not RunKind.CHAT:
            return self._chunk([{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}])
        delta: Json = {}
        if not self._role_sent:
            delta["role"] = "assistant"
            self._role_sent = True
        if text:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        delta.update(extra or {})
        return self._chunk([{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}])

    def usage_chunk(self, counts: Json) -> Json:
        """The last chunk of a stream asked for with `include_usage`: no choices, only usage."""
        chunk = self._chunk([])
        chunk["usage"] = counts
        return chunk

    def response(self, text: str, finish_reason: str, counts: Json, tool_calls: list[Json] | None = None,
                 extra: Json | None = None, logprobs: Json | None = None) -> Json:
        """The whole (non-stream) answer."""
        if self.kind is RunKind.CHAT:
            message: Json = {"role": "assistant", "content": text, "refusal": None}
            if tool_calls:
                message["tool_calls"] = tool_calls
            message.update(extra or {})
            choice: Json = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice],
                "usage": counts}
