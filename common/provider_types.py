"""What each provider type is by default: its category (D04, S06) and its coarse lifecycle
flags (D05, S08). Pure data; the config may override both per provider.

The flags only describe what the provider's own API can do with models. iop shows them in
the heartbeat and the catalog and never acts on them (D06).
"""

from __future__ import annotations

from typing import Literal, get_args

ProviderType = Literal["ollama", "vllm", "sglang", "llamacpp", "lemonade", "openai_api", "cli"]
Category = Literal["api", "cli", "local_inference"]
LifecycleFlag = Literal["list_models", "load_model", "unload_model", "pull_model", "delete_model"]

PROVIDER_TYPES: tuple[str, ...] = get_args(ProviderType)
CATEGORIES: tuple[str, ...] = get_args(Category)
LIFECYCLE_FLAGS: tuple[str, ...] = get_args(LifecycleFlag)

#: The types that speak the OpenAI HTTP API themselves.
OPENAI_FAMILY: frozenset[str] = frozenset({"vllm", "sglang", "llamacpp", "lemonade", "openai_api"})

#: Types whose health probe disturbs a run in progress, so it is only sent while the provider
#: runs nothing (and no run starts while it is out). llama-cpp-python's server takes its
#: generation lock for `GET /v1/models`, and by default a request waiting for that lock cuts the
#: running stream short (`interrupt_requests`).
PROBE_DISTURBS: frozenset[str] = frozenset({"llamacpp"})

#: Types that load a model the run names before they answer anything, not even the head (Ollama's
#: `streamResponse` writes its head with the first line, after the scheduler's load; Lemonade's handler
#: loads it before it answers; a llama-server router, by default, has `router_validate_model` wait in
#: `ensure_model_ready` for the load, without a timeout, before it proxies the request to the model's
#: server, tools/server/server-models.cpp; and a llama-server put to sleep by `--sleep-idle-seconds`,
#: whose request waits in `wait_until_no_sleep` for the model's reload, server-queue.cpp): their
#: answer's head may take `load_timeout_ms` more than `read_timeout_ms`. Ollama aborts a load whose
#: request's client went away (llm/llama_server.go's `WaitUntilRunning`), so one given up on after
#: `read_timeout_ms` was never loaded at all (a llama-server router's goes on, whoever waits for it).
LOADS_FIRST: frozenset[str] = frozenset({"ollama", "lemonade", "llamacpp"})

#: The category a provider gets when its config does not say.
DEFAULT_CATEGORY: dict[str, Category] = {
    "ollama": "local_inference",
    "vllm": "local_inference",
    "sglang": "local_inference",
    "llamacpp": "local_inference",
    "lemonade": "local_inference",
    "openai_api": "api",
    "cli": "cli",
}

_ALL: tuple[LifecycleFlag, ...] = ("list_models", "load_model", "unload_model", "pull_model", "delete_model")

#: The lifecycle flags a provider gets when its config does not say. Ollama and Lemonade
#: manage their own model store (pull, delete, load, unload); vLLM and SGLang serve the
#: models they were started with and can only list them (so does llama.cpp's server); a hosted API lists; a CLI tool
#: says nothing about its models.
DEFAULT_LIFECYCLE: dict[str, tuple[LifecycleFlag, ...]] = {
    "ollama": _ALL,
    "lemonade": _ALL,
    "vllm": ("list_models",),
    "sglang": ("list_models",),
    "llamacpp": ("list_models",),
    "openai_api": ("list_models",),
    "cli": (),
}


def default_category(provider_type: str) -> Category:
    return DEFAULT_CATEGORY[provider_type]


def default_lifecycle(provider_type: str) -> tuple[LifecycleFlag, ...]:
    return DEFAULT_LIFECYCLE[provider_type]
