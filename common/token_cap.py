"""A model's `max_tokens` (config): the most tokens a run's choice may generate. Pure.

The gateway refuses a request that asks for more (`over_cap`), as OpenAI refuses a `max_tokens`
past a model's output limit, and any limit that is not a whole number from 1 to the cap: servers
read 0, a negative number, `false` or text their own ways, several as no limit at all
(llama-cpp-python generates to the end of its context for `0`, `-1` or `false`; Ollama's
`num_predict: -1`). The worker gives a request that asks for no limit the model's own
(`with_cap`). Embeddings have no such limit. Like OpenAI's `max_tokens`, it is a choice's: `n`
choices may make `n` times it.
"""

from __future__ import annotations

import re
from typing import Any

from common.choices import whole_within
from common.wire import RunKind

#: the fields a request names its limit in, the one that wins first (as vLLM reads the two)
LIMIT_FIELDS = ("max_completion_tokens", "max_tokens")


def asked(body: dict[str, Any]) -> tuple[str, Any] | None:
    """The limit the request asks for and the field it is in; None when it asks for none (absent, or
    `null`: an unset one, as clients send it)."""
    for field in LIMIT_FIELDS:
        value = body.get(field)
        if value is not None:
            return field, value
    return None


def over_cap(body: dict[str, Any], cap: int) -> str | None:
    """The first field (`max_completion_tokens`, `max_tokens`, Ollama's `options.num_predict`, which
    iop passes to Ollama and which wins there) that is neither null nor a whole number from 1 to
    `cap`, if one is."""
    options = body.get("options")
    limits = [(field, body.get(field)) for field in LIMIT_FIELDS]
    if isinstance(options, dict):
        limits.append(("options.num_predict", options.get("num_predict")))
    for field, value in limits:
        if value is not None and not whole_within(value, cap):
            return field
    return None


def with_cap(body: dict[str, Any], cap: int, kind: RunKind) -> bool:
    """Give a request that asks for no limit the model's: as `max_tokens`, which every server takes.
    On legacy completions only `max_tokens` is a limit: `max_completion_tokens` is no field of
    OpenAI's CreateCompletionRequest, and servers of the OpenAI family ignore it there (vLLM reads
    `max_tokens` alone), so a request naming only it gets the cap as `max_tokens` too. (Where it is
    read, it still wins: llama.cpp's servers get it as `max_tokens`, Ollama as `num_predict`.)"""
    if kind is RunKind.COMPLETION:
        if body.get("max_tokens") is None:
            body["max_tokens"] = cap
            return True
    elif asked(body) is None:
        body["max_tokens"] = cap
        return True
    return False


#: SGLang's refusal of a request whose prompt and limit together pass its context (`validate_total_tokens`,
#: always on: srt/managers/tokenizer_manager.py:1352-1378 in 0.5.23), and of a chat limit over the context
#: itself (`_validate_request`, srt/entrypoints/openai/serving_chat.py:1180-1190, no space after its period)
_TOTAL_OVER = re.compile(r"maximum context length of (\d+) tokens\. You requested a total of (\d+) tokens: "
                         r"(\d+) tokens from the input messages")
_LIMIT_OVER = re.compile(r"max_completion_tokens is too large: \d+\. ?This model supports at most (\d+) "
                         r"completion tokens")


def fitted(body: dict[str, Any], refusal: str) -> dict[str, Any] | None:
    """The request again with the model's cap (`with_cap` gave it, the caller asked for no limit) cut to
    what the server said it has room for, when its `refusal` says the cap passes its context: SGLang
    refuses a limit that, with the prompt, passes its context, where without one it generates to the
    end of its context (vLLM cuts such a limit itself). None when it said nothing of the kind, or left
    no room. (SGLang 0.5.2, say, refuses a total that equals its context too, `>= context_len`, where
    0.5.23 refuses only one over it: one that said so has a token less room.)"""
    total = _TOTAL_OVER.search(refusal)
    limit = _LIMIT_OVER.search(refusal)
    room = (int(total[1]) - int(total[3]) - (int(total[2]) == int(total[1])) if total
            else int(limit[1]) if limit else 0)
    # (the cap `with_cap` gave is `max_tokens`: a legacy completion's `max_completion_tokens` beside it is the
    # caller's, and no limit to a server of the OpenAI family, SGLang's included)
    cap = body.get("max_tokens")
    if not isinstance(cap, int) or room < 1 or room >= cap:
        return None
    return {**body, "max_tokens": room}
