"""Pure tests of the config schema and its validation (common/config.py) and `iop config validate`."""

from __future__ import annotations

import copy
import glob
import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from common.config import (
    CATEGORIES,
    DEFAULT_CATEGORY,
    IOP_HEADERS,
    PROVIDER_TYPES,
    Config,
    ConfigError,
    QueuePolicy,
    check_references,
    format_path,
    load_config,
    parse_config,
    shown,
)
from common.config_yaml import FAST, ConfigLoader, bounds_nesting
from iop.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "demo.yaml"

Mutation = Callable[[dict[str, Any]], None]

VLLM_MODELS = ["Qwen/Qwen3.6-35B-A3B", "meta-llama/Llama-3.3-70B-Instruct"]


def good() -> dict[str, Any]:
    """A valid config: two models, two nodes, three providers (one a cli provider without base_url)."""
    return {
        "models": [
            {
                "id": "qwen3.6:35b",
                "display_name": "Qwen 3.6 35B",
                "providers": {"vllm-a": "Qwen/Qwen3.6-35B-A3B", "sglang-b": "qwen3.6-35b-a3b"},
            },
            {
                "id": "llama3.3:70b",
                "providers": {"vllm-a": "meta-llama/Llama-3.3-70B-Instruct", "cli-c": "llama-cli"},
                "queue": {"max_queue": 16},
            },
        ],
        "nodes": [
            {
                "id": "gpu-1",
                "providers": [
                    {"id": "vllm-a", "type": "vllm", "base_url": "http://gpu-1:8000", "capacity": 4,
                     "models": list(VLLM_MODELS)},
                ],
            },
            {
                "id": "gpu-2",
                "providers": [
                    {"id": "sglang-b", "type": "sglang", "base_url": "http://gpu-2:30000", "capacity": 2,
                     "models": ["qwen3.6-35b-a3b"]},
                    {"id": "cli-c", "type": "cli", "command": ["llama-cli", "--quiet"], "capacity": 1,
                     "models": ["llama-cli"]},
                ],
            },
        ],
        "queue": {"max_queue": 64, "queue_timeout_ms": 30000},
    }


def _parent(data: dict[str, Any], path: tuple[str | int, ...]) -> Any:
    node: Any = data
    for part in path[:-1]:
        node = node[part]
    return node


def set_at(*path: str | int, value: Any) -> Mutation:
    def mutate(data: dict[str, Any]) -> None:
        _parent(data, path)[path[-1]] = value

    return mutate


def delete_at(*path: str | int) -> Mutation:
    def mutate(data: dict[str, Any]) -> None:
        del _parent(data, path)[path[-1]]

    return mutate


def append_copy(src: tuple[str | int, ...], dest: tuple[str | int, ...]) -> Mutation:
    """Append a deep copy of the item at `src` to the list at `dest`."""

    def mutate(data: dict[str, Any]) -> None:
        item = copy.deepcopy(_parent(data, src)[src[-1]])
        _parent(data, dest)[dest[-1]].append(item)

    return mutate


def append_at(*path: str | int, value: Any) -> Mutation:
    def mutate(data: dict[str, Any]) -> None:
        _parent(data, path)[path[-1]].append(value)

    return mutate


def both(*mutations: Mutation) -> Mutation:
    def mutate(data: dict[str, Any]) -> None:
        for m in mutations:
            m(data)

    return mutate


def config_errors(data: Any) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return info.value.errors


# (id, mutation, [(exact path, fragment of the message after "path: ")])
REJECTED: list[tuple[str, Mutation, list[tuple[str, str]]]] = [
    # --- references -------------------------------------------------------------------------
    ("provider-no-node-defines", set_at("models", 1, "providers", "ghost", value="x"),
     [("models[1].providers.ghost", "provider 'ghost' is not defined by any node")]),
    ("served-name-not-in-provider-models", set_at("models", 1, "providers", "vllm-a", value="x"),
     [("models[1].providers.vllm-a",
       "served model 'x' is not in provider vllm-a's models "
       "['Qwen/Qwen3.6-35B-A3B', 'meta-llama/Llama-3.3-70B-Instruct']")]),
    ("served-name-of-another-provider", set_at("models", 0, "providers", "sglang-b", value="llama-cli"),
     [("models[0].providers.sglang-b",
       "served model 'llama-cli' is not in provider sglang-b's models ['qwen3.6-35b-a3b']")]),
    # --- duplicates ---------------------------------------------------------------------------
    ("duplicate-model-id", set_at("models", 1, "id", value="qwen3.6:35b"),
     [("models[1].id", "duplicate model id 'qwen3.6:35b' (first at models[0].id)")]),
    ("model-id-differing-only-in-case", set_at("models", 1, "id", value="Qwen3.6:35B"),
     [("models[1].id", "'Qwen3.6:35B' differs from the model id 'qwen3.6:35b' (at models[0].id) only in case or "
                       "Unicode form: callers would take one for the other")]),
    ("model-id-differing-only-in-unicode-form", set_at("models", 1, "id", value="qwen3.6\uff1a35b"),
     [("models[1].id", "differs from the model id 'qwen3.6:35b' (at models[0].id) only in case or Unicode form")]),
    # (a 20 MB display_name went out with every /v1/models and catalog answer: operator's audit)
    ("display-name-too-long", set_at("models", 0, "display_name", value="x" * 257),
     [("models[0].display_name", "at most 256 characters")]),
    ("served-name-too-long", set_at("models", 1, "providers", "vllm-a", value="x" * 1025),
     [("models[1].providers.vllm-a", "at most 1024 characters"),
      ("models[1].providers.vllm-a", "is not in provider vllm-a's models")]),
    ("duplicate-node-id", set_at("nodes", 1, "id", value="gpu-1"),
     [("nodes[1].id", "duplicate node id 'gpu-1' (first at nodes[0].id)")]),
    # (an operator's `iop provider drain P1` drained another box than p1: operator's audit)
    ("node-id-differing-only-in-case", set_at("nodes", 1, "id", value="GPU-1"),
     [("nodes[1].id", "'GPU-1' differs from the node id 'gpu-1' (at nodes[0].id) only in case or Unicode form: "
                      "operators would take one for the other")]),
    ("provider-id-differing-only-in-unicode-form",
     both(append_copy(("nodes", 0, "providers", 0), ("nodes", 1, "providers")),
          set_at("nodes", 1, "providers", 2, "id", value="VLLM\uff0dA")),
     [("nodes[1].providers[2].id", "differs from the provider id 'vllm-a' (at nodes[0].providers[0].id) only in "
                                   "case or Unicode form: operators would take one for the other")]),
    ("duplicate-provider-id-same-node",
     append_copy(("nodes", 1, "providers", 0), ("nodes", 1, "providers")),
     [("nodes[1].providers[2].id", "duplicate provider id 'sglang-b' (first at nodes[1].providers[0].id)")]),
    ("duplicate-provider-id-across-nodes",
     append_copy(("nodes", 0, "providers", 0), ("nodes", 1, "providers")),
     [("nodes[1].providers[2].id", "duplicate provider id 'vllm-a' (first at nodes[0].providers[0].id)")]),
    ("duplicate-served-model", append_at("nodes", 1, "providers", 0, "models", value="qwen3.6-35b-a3b"),
     [("nodes[1].providers[0].models[1]",
       "duplicate served model id 'qwen3.6-35b-a3b' (first at nodes[1].providers[0].models[0])")]),
    # --- type / category ----------------------------------------------------------------------
    ("unknown-type", set_at("nodes", 0, "providers", 0, "type", value="tgi"),
     [("nodes[0].providers[0].type", "got 'tgi'")]),
    ("unknown-category", set_at("nodes", 1, "providers", 1, "category", value="gpu"),
     [("nodes[1].providers[1].category", "got 'gpu'")]),
    # --- capacity -----------------------------------------------------------------------------
    ("capacity-0", set_at("nodes", 0, "providers", 0, "capacity", value=0),
     [("nodes[0].providers[0].capacity", "greater than or equal to 1")]),
    ("capacity-negative", set_at("nodes", 1, "providers", 0, "capacity", value=-1),
     [("nodes[1].providers[0].capacity", "greater than or equal to 1")]),
    ("capacity-not-a-number", set_at("nodes", 0, "providers", 0, "capacity", value="four"),
     [("nodes[0].providers[0].capacity", "valid integer")]),
    ("capacity-null", set_at("nodes", 0, "providers", 0, "capacity", value=None),
     [("nodes[0].providers[0].capacity", "valid integer")]),
    ("capacity-fractional", set_at("nodes", 0, "providers", 0, "capacity", value=2.5),
     [("nodes[0].providers[0].capacity", "valid integer")]),
    ("capacity-a-string", set_at("nodes", 0, "providers", 0, "capacity", value="4"),
     [("nodes[0].providers[0].capacity", "valid integer")]),
    ("capacity-a-bool", set_at("nodes", 0, "providers", 0, "capacity", value=True),
     [("nodes[0].providers[0].capacity", "valid integer")]),
    ("capacity-missing", delete_at("nodes", 0, "providers", 0, "capacity"),
     [("nodes[0].providers[0].capacity", "Field required")]),
    # a worker given more than a Redis integer takes ran nothing (`value is not an integer or out of range`)
    ("capacity-beyond-64-bits", set_at("nodes", 1, "providers", 1, "capacity", value=99999999999999999999999),
     [("nodes[1].providers[1].capacity", "less than or equal to 1000000")]),
    ("capacity-beyond-the-maximum", set_at("nodes", 0, "providers", 0, "capacity", value=1_000_001),
     [("nodes[0].providers[0].capacity", "less than or equal to 1000000")]),
    ("execution-timeout-beyond-7-days", set_at("queue", "execution_timeout_ms", value=2**63),
     [("queue.execution_timeout_ms", "less than or equal to 604800000")]),
    ("model-queue-timeout-beyond-7-days", set_at("models", 1, "queue", "queue_timeout_ms", value=604_800_001),
     [("models[1].queue.queue_timeout_ms", "less than or equal to 604800000")]),
    ("read-timeout-beyond-7-days", set_at("nodes", 0, "providers", 0, "read_timeout_ms", value=10**30),
     [("nodes[0].providers[0].read_timeout_ms", "less than or equal to 604800000")]),
    ("lease-ttl-and-run-ttl-beyond-their-maximum", set_at("runtime", value={"lease_ttl_ms": 2**64, "run_ttl_s": 2**63}),
     [("runtime.lease_ttl_ms", "less than or equal to 604800000"),
      ("runtime.run_ttl_s", "less than or equal to 2592000")]),
    ("body-bytes-beyond-redis-s-largest-value", set_at("runtime", value={"max_body_bytes": 2**40}),
     [("runtime.max_body_bytes", "less than or equal to 536870912")]),
    ("stream-batch-beyond-10-s", set_at("runtime", value={"stream_batch_ms": 10_001}),
     [("runtime.stream_batch_ms", "less than or equal to 10000")]),
    ("stream-batch-negative", set_at("runtime", value={"stream_batch_ms": -1}),
     [("runtime.stream_batch_ms", "greater than or equal to 0")]),
    # --- base_url -----------------------------------------------------------------------------
    ("base-url-missing-vllm", delete_at("nodes", 0, "providers", 0, "base_url"),
     [("nodes[0].providers[0].base_url", "required for type vllm")]),
    ("base-url-empty-sglang", set_at("nodes", 1, "providers", 0, "base_url", value=""),
     [("nodes[1].providers[0].base_url", "required for type sglang")]),
    ("base-url-not-a-url", set_at("nodes", 1, "providers", 0, "base_url", value="not a url"),
     [("nodes[1].providers[0].base_url", "'not a url' has no http:// or https://")]),
    ("base-url-ftp", set_at("nodes", 0, "providers", 0, "base_url", value="ftp://x"),
     [("nodes[0].providers[0].base_url", "'ftp://x' has scheme 'ftp://'; write an http:// or https:// URL")]),
    ("base-url-no-scheme", set_at("nodes", 0, "providers", 0, "base_url", value="gpu-1:8000"),
     [("nodes[0].providers[0].base_url", "has no http:// or https://")]),
    ("base-url-no-host", set_at("nodes", 0, "providers", 0, "base_url", value="http:///v1"),
     [("nodes[0].providers[0].base_url", "'http:///v1' names no host")]),
    ("base-url-bad-port", set_at("nodes", 0, "providers", 0, "base_url", value="http://gpu-1:99999"),
     [("nodes[0].providers[0].base_url", "'http://gpu-1:99999' is not a usable URL (Port out of range")]),
    # (iop adds the API's paths to base_url: a query or a fragment there took them in, and every probe
    # and run went to the path before it, the reason naming a path never asked: a new operator's Azure URL)
    ("base-url-with-a-query",
     set_at("nodes", 0, "providers", 0, "base_url", value="http://gpu-1:8000/v1?api-version=2024-10-21"),
     [("nodes[0].providers[0].base_url", "'http://gpu-1:8000/v1?api-version=2024-10-21' has a query "
                                         "('?api-version=2024-10-21')")]),
    ("base-url-with-a-fragment", set_at("nodes", 0, "providers", 0, "base_url", value="http://gpu-1:8000#main"),
     [("nodes[0].providers[0].base_url", "'http://gpu-1:8000#main' has a fragment ('#main')")]),
    ("base-url-with-an-empty-query", set_at("nodes", 0, "providers", 0, "base_url", value="http://gpu-1:8000/v1?"),
     [("nodes[0].providers[0].base_url", "'http://gpu-1:8000/v1?' has a query ('?')")]),
    # (fields a type never reads: a type changed without them, said rather than ignored; a new operator)
    ("base-url-of-a-cli-provider", set_at("nodes", 1, "providers", 1, "base_url", value="http://gpu-2:9000"),
     [("nodes[1].providers[1].base_url", "not for type cli, which runs its command")]),
    ("command-of-a-vllm-provider", set_at("nodes", 0, "providers", 0, "command", value=["rm", "-rf", "/"]),
     [("nodes[0].providers[0].command", "only for type cli; type vllm is served over HTTP at base_url")]),
    ("api-path-of-a-cli-provider", set_at("nodes", 1, "providers", 1, "api_path", value="/v1"),
     [("nodes[1].providers[1].api_path", "not for type cli; only the OpenAI family's types (vllm, sglang, "
                                          "llamacpp, lemonade, openai_api) read it")]),
    ("url-credentials-and-a-bearer-key",  # (both are Authorization: every probe raised, a helper)
     lambda data: data["nodes"][0]["providers"][0].update({"base_url": "http://u:p@gpu-1:8000", "api_key_env": "K"}),
     [("nodes[0].providers[0].api_key_env", "its key goes in Authorization, as base_url's user:password@ does")]),
    ("url-credentials-and-a-key-in-authorization",  # (a header named Authorization is the same: a review)
     lambda data: data["nodes"][0]["providers"][0].update({"base_url": "http://u:p@gpu-1:8000", "api_key_env": "K",
                                                          "api_key_header": "authorization"}),
     [("nodes[0].providers[0].api_key_env", "its key goes in Authorization, as base_url's user:password@ does")]),
    ("probe-path-of-an-ollama-provider",
     lambda data: data["nodes"][0]["providers"][0].update({"type": "ollama", "probe_path": "/health"}),
     [("nodes[0].providers[0].probe_path", "not for type ollama")]),
    ("load-timeout-of-a-vllm-provider", set_at("nodes", 0, "providers", 0, "load_timeout_ms", value=600_000),
     [("nodes[0].providers[0].load_timeout_ms", "only for types that load a model a run names before they answer "
                                                "(lemonade, llamacpp, ollama); type vllm answers within "
                                                "read_timeout_ms")]),
    ("models-listed-of-a-vllm-provider", set_at("nodes", 0, "providers", 0, "models_listed", value=False),
     [("nodes[0].providers[0].models_listed", "only for type openai_api (a hosted API)")]),
    ("base-url-missing-openai-api", set_at("nodes", 1, "providers", 1, "type", value="openai_api"),
     [("nodes[1].providers[1].base_url", "required for type openai_api"),
      ("nodes[1].providers[1].command", "only for type cli; type openai_api is served over HTTP")]),
    # --- unknown fields (typos) at several depths ---------------------------------------------
    ("typo-top-level", set_at("queu", value={"max_queue": 1}), [("queu", "unknown field")]),
    ("typo-model", set_at("models", 0, "dispaly_name", value="x"),
     [("models[0].dispaly_name", "unknown field")]),
    ("typo-model-queue", set_at("models", 1, "queue", "max_queu", value=1),
     [("models[1].queue.max_queu", "unknown field")]),
    ("typo-node", set_at("nodes", 1, "provider", value=[]), [("nodes[1].provider", "unknown field")]),
    ("typo-provider", set_at("nodes", 1, "providers", 1, "capacty", value=3),
     [("nodes[1].providers[1].capacty", "unknown field")]),
    ("typo-queue", set_at("queue", "queue_timeout", value=5), [("queue.queue_timeout", "unknown field")]),
    ("typo-runtime", set_at("runtime", value={"heartbeat_ms": 5}),
     [("runtime.heartbeat_ms", "unknown field")]),
    # (a newcomer's: the field a typo was likely meant as, where one is close)
    ("typo-queue-said", set_at("queue", "timeout_ms", value=5),
     [("queue.timeout_ms", "unknown field (did you mean queue_timeout_ms or execution_timeout_ms?)")]),
    ("typo-model-queue-said", set_at("models", 1, "queue", "max_queu", value=1),
     [("models[1].queue.max_queu", "unknown field (did you mean max_queue?)")]),
    ("typo-provider-said", set_at("nodes", 1, "providers", 1, "capacty", value=3),
     [("nodes[1].providers[1].capacty", "unknown field (did you mean capacity?)")]),
    ("typo-model-said", set_at("models", 0, "provider", value={}),
     [("models[0].provider", "unknown field (did you mean providers?)")]),
    ("api-key-in-the-config", set_at("nodes", 0, "providers", 0, "api_key", value="sk-secret"),
     [("nodes[0].providers[0].api_key", "unknown field (an API key never goes in the config: name the "
                                        "environment variable that holds it in api_key_env)")]),
    ("typo-nothing-close", set_at("runtime", value={"zzz": 5}), [("runtime.zzz", "unknown field")]),
    ("typo-top-level-said", set_at("model", value=[]), [("model", "unknown field (did you mean models?)")]),
    # --- the gateway's limits -----------------------------------------------------------------
    ("json-depth-too-large", set_at("runtime", value={"max_json_depth": 300}),
     [("runtime.max_json_depth", "less than or equal to 256")]),
    ("json-depth-1", set_at("runtime", value={"max_json_depth": 1}),
     [("runtime.max_json_depth", "greater than or equal to 2")]),
    ("header-timeout-0", set_at("runtime", value={"header_timeout_ms": 0}),
     [("runtime.header_timeout_ms", "greater than or equal to 10")]),
    ("body-timeout-a-string", set_at("runtime", value={"body_timeout_ms": "60s"}),
     [("runtime.body_timeout_ms", "valid integer")]),
    ("idle-timeout-negative", set_at("runtime", value={"idle_timeout_ms": -1}),
     [("runtime.idle_timeout_ms", "greater than or equal to 10")]),
    ("max-connections-0", set_at("runtime", value={"max_connections": 0}),
     [("runtime.max_connections", "greater than or equal to 1")]),
    ("redis-pool-of-1", set_at("runtime", value={"redis_max_connections": 1}),
     [("runtime.redis_max_connections", "greater than or equal to 2")]),
    # --- empty collections --------------------------------------------------------------------
    ("empty-model-providers-map", set_at("models", 0, "providers", value={}),
     [("models[0].providers", "at least 1 item")]),
    ("empty-models-list", set_at("models", value=[]), [("models", "at least 1 item")]),
    ("empty-nodes-list", set_at("nodes", value=[]), [("nodes", "at least 1 item")]),
    ("empty-provider-models", set_at("nodes", 1, "providers", 1, "models", value=[]),
     [("nodes[1].providers[1].models", "at least 1 item")]),
    ("missing-nodes", delete_at("nodes"), [("nodes", "Field required")]),
    ("missing-model-providers", delete_at("models", 1, "providers"),
     [("models[1].providers", "Field required")]),
    # --- wrong types --------------------------------------------------------------------------
    ("models-not-a-list", set_at("models", value={"id": "x"}), [("models", "valid list")]),
    ("model-providers-a-list", set_at("models", 0, "providers", value=["vllm-a"]),
     [("models[0].providers", "valid dictionary")]),
    ("served-name-not-a-string", set_at("models", 0, "providers", "vllm-a", value=5),
     [("models[0].providers.vllm-a", "valid string")]),
    ("model-id-not-a-string", set_at("models", 1, "id", value=5), [("models[1].id", "valid string")]),
    ("model-id-with-space", set_at("models", 1, "id", value="llama 3"),
     [("models[1].id", "must be one word (no spaces), got 'llama 3'")]),
    ("model-id-empty", set_at("models", 1, "id", value=""), [("models[1].id", "must be one word (no spaces), got ''")]),
    ("provider-models-a-string", set_at("nodes", 0, "providers", 0, "models", value="x"),
     [("nodes[0].providers[0].models", "valid list")]),
    ("probe-path-without-slash", set_at("nodes", 0, "providers", 0, "probe_path", value="health"),
     [("nodes[0].providers[0].probe_path", "must be a path that starts with / (no spaces), got 'health'")]),
    ("api-path-without-slash", set_at("nodes", 0, "providers", 0, "api_path", value="v1"),
     [("nodes[0].providers[0].api_path", "must be empty or a path that starts with / (no spaces, no ? or #: "
                                         "iop adds the API's paths to it), got 'v1'")]),
    # (iop adds the API's paths to api_path as to base_url: after a `?` or `#` they were in the query)
    ("api-path-with-a-query", set_at("nodes", 0, "providers", 0, "api_path", value="/openai/v1?api-version=1"),
     [("nodes[0].providers[0].api_path", "must be empty or a path that starts with / (no spaces, no ? or #: "
                                         "iop adds the API's paths to it), got '/openai/v1?api-version=1'")]),
    ("api-path-with-a-fragment", set_at("nodes", 0, "providers", 0, "api_path", value="/v1#x"),
     [("nodes[0].providers[0].api_path", "no ? or #")]),
    ("provider-models-item-not-a-string", set_at("nodes", 0, "providers", 0, "models", 1, value=3),
     [("nodes[0].providers[0].models[1]", "valid string")]),
    ("node-providers-a-mapping", set_at("nodes", 0, "providers", value={}),
     [("nodes[0].providers", "valid list")]),
    ("queue-a-string", set_at("queue", value="fast"),
     [("queue", "should be a mapping (`field: value` lines), got 'fast'")]),
    ("model-queue-negative", set_at("models", 1, "queue", "max_queue", value=-1),
     [("models[1].queue.max_queue", "greater than or equal to 0")]),
    ("queue-timeout-zero", set_at("queue", "queue_timeout_ms", value=0),
     [("queue.queue_timeout_ms", "greater than or equal to 1")]),
    # --- several faults at once: every one is reported ----------------------------------------
    ("several-schema-faults",
     both(set_at("nodes", 0, "providers", 0, "capacity", value=0),
          set_at("nodes", 1, "providers", 0, "type", value="tgi"),
          set_at("colour", value="blue"),
          set_at("models", 1, "id", value="a b")),
     [("models[1].id", "must be one word"),
      ("nodes[0].providers[0].capacity", "greater than or equal to 1"),
      ("nodes[1].providers[0].type", "got 'tgi'"),
      ("colour", "unknown field")]),
    ("several-reference-faults",
     both(set_at("models", 0, "providers", "ghost", value="x"),
          set_at("models", 1, "providers", "cli-c", value="nope"),
          set_at("nodes", 1, "id", value="gpu-1"),
          set_at("models", 1, "id", value="qwen3.6:35b"),
          delete_at("nodes", 0, "providers", 0, "base_url")),
     [("models[1].id", "duplicate model id 'qwen3.6:35b' (first at models[0].id)"),
      ("nodes[1].id", "duplicate node id 'gpu-1' (first at nodes[0].id)"),
      ("nodes[0].providers[0].base_url", "required for type vllm"),
      ("models[0].providers.ghost", "provider 'ghost' is not defined by any node"),
      ("models[1].providers.cli-c", "served model 'nope' is not in provider cli-c's models ['llama-cli']")]),
    ("model-id-with-a-zero-width-space", set_at("models", 0, "id", value="qwen3.6:35b\u200b"),
     [("models[0].id", "'qwen3.6:35b\\u200b' holds the character U+200B; an id is printable text")]),
    ("node-id-with-a-control-character", set_at("nodes", 0, "id", value="gpu\x01"),
     [("nodes[0].id", "holds the character U+0001")]),
    ("provider-id-with-a-format-character",
     both(set_at("nodes", 1, "providers", 1, "id", value="cli-c\u2060"),
          set_at("models", 1, "providers", "cli-c\u2060", value="llama-cli"),
          delete_at("models", 1, "providers", "cli-c")),
     [("nodes[1].providers[1].id", "holds the character U+2060")]),
    ("ids-that-are-steps-of-a-url-path",
     both(set_at("nodes", 0, "id", value=".."),
          set_at("nodes", 1, "providers", 1, "id", value="."),
          set_at("models", 1, "providers", ".", value="llama-cli"),
          delete_at("models", 1, "providers", "cli-c")),
     [("nodes[0].id", "'..' is a step of a URL's path, not a name a URL can carry"),
      ("nodes[1].providers[1].id", "'.' is a step of a URL's path")]),
    ("ids-too-long",
     both(set_at("models", 0, "id", value="m" * 257), set_at("nodes", 0, "id", value="n" * 257),
          set_at("nodes", 1, "providers", 0, "id", value="p" * 257)),
     [("models[0].id", "at most 256 characters"), ("nodes[0].id", "at most 256 characters"),
      ("nodes[1].providers[0].id", "at most 256 characters"),
      ("models[0].providers.sglang-b", "not defined by any node")]),
    ("api-key-env-not-a-name",
     both(set_at("nodes", 0, "providers", 0, "api_key_env", value=""),
          set_at("nodes", 1, "providers", 0, "api_key_env", value="$KEY")),
     [("nodes[0].providers[0].api_key_env", "must be the name of an environment variable"),
      ("nodes[1].providers[0].api_key_env", "got '$KEY'")]),
]


@pytest.mark.parametrize(("mutation", "expected"), [(m, e) for _, m, e in REJECTED],
                         ids=[name for name, _, _ in REJECTED])
def test_rejected_config_names_the_exact_path(mutation: Mutation, expected: list[tuple[str, str]]) -> None:
    data = good()
    mutation(data)
    errors = config_errors(data)
    assert len(errors) == len(expected), errors
    by_path = sorted(errors, key=lambda e: e.split(": ", 1)[0])
    for (path, fragment), error in zip(sorted(expected), by_path, strict=True):
        assert error.startswith(f"{path}: "), (path, errors)
        assert fragment in error[len(path) + 2:], (fragment, error)


def test_reference_errors_are_exact_strings() -> None:
    data = good()
    set_at("models", 1, "providers", "vllm-a", value="x")(data)
    assert config_errors(data) == [
        "models[1].providers.vllm-a: served model 'x' is not in provider vllm-a's models "
        "['Qwen/Qwen3.6-35B-A3B', 'meta-llama/Llama-3.3-70B-Instruct']"
    ]


def test_several_faults_are_in_the_exception_message() -> None:
    data = good()
    set_at("nodes", 0, "providers", 0, "capacity", value=-1)(data)
    set_at("nodes", 1, "providers", 1, "category", value="gpu")(data)
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert str(info.value) == "\n".join(info.value.errors)
    assert len(info.value.errors) == 2


@pytest.mark.parametrize(("data", "shown"), [
    (None, "null (an empty document)"), ([], "a list"), (["models"], "a list"), ("models: []", "the text 'models: []'"),
    (3, "3"), (1.5, "1.5"), (True, "true"), (float("inf"), ".inf"),
])
def test_top_level_must_be_a_mapping(data: Any, shown: str) -> None:
    assert config_errors(data) == [f"(top level): expected a mapping, got {shown}"]


def test_good_config_parses() -> None:
    cfg = parse_config(good())
    assert isinstance(cfg, Config)
    assert [m.id for m in cfg.models] == ["qwen3.6:35b", "llama3.3:70b"]
    assert [n.id for n in cfg.nodes] == ["gpu-1", "gpu-2"]
    model = cfg.model("qwen3.6:35b")
    assert model is not None
    assert model.providers == {"vllm-a": "Qwen/Qwen3.6-35B-A3B", "sglang-b": "qwen3.6-35b-a3b"}
    assert model.title == "Qwen 3.6 35B"
    other = cfg.model("llama3.3:70b")
    assert other is not None and other.title == "llama3.3:70b"
    assert cfg.model("qwen3.6") is None
    assert cfg.provider("cli-c").base_url is None
    assert cfg.provider("vllm-a").capacity == 4
    assert cfg.provider("vllm-a").models == VLLM_MODELS
    assert cfg.node_of("vllm-a") == "gpu-1"
    assert cfg.node_of("sglang-b") == "gpu-2"
    assert cfg.node_of("cli-c") == "gpu-2"
    node = cfg.node("gpu-2")
    assert node is not None and [p.id for p in node.providers] == ["sglang-b", "cli-c"]
    assert cfg.node("gpu-3") is None
    with pytest.raises(KeyError):
        cfg.provider("ghost")
    assert check_references(cfg) == []


def test_parse_does_not_mutate_its_input() -> None:
    data = good()
    before = copy.deepcopy(data)
    parse_config(data)
    assert data == before


def test_check_references_is_pure_and_returns_every_fault() -> None:
    data = good()
    set_at("models", 0, "providers", "ghost", value="x")(data)
    set_at("nodes", 1, "id", value="gpu-1")(data)
    cfg = Config.model_validate(data)  # the schema alone accepts it
    assert check_references(cfg) == [
        "nodes[1].id: duplicate node id 'gpu-1' (first at nodes[0].id)",
        "models[0].providers.ghost: provider 'ghost' is not defined by any node",
    ]
    assert check_references(cfg) == check_references(cfg)


# --- queue policy -----------------------------------------------------------------------------


def test_model_without_override_gets_the_default_queue() -> None:
    cfg = parse_config(good())
    model = cfg.model("qwen3.6:35b")
    assert model is not None
    assert cfg.queue_for(model) == QueuePolicy(max_queue=64, queue_timeout_ms=30000)
    assert cfg.queue_for(model) == cfg.queue


def test_queue_defaults_when_no_queue_section() -> None:
    data = good()
    del data["queue"]
    cfg = parse_config(data)
    assert cfg.queue == QueuePolicy(max_queue=64, queue_timeout_ms=30_000, execution_timeout_ms=600_000,
                                    max_attempts=3)


def test_queue_override_merges_only_the_fields_set() -> None:
    data = good()
    data["queue"] = {"max_queue": 50, "queue_timeout_ms": 12_345, "max_attempts": 5}
    data["models"][1]["queue"] = {"max_queue": 16, "execution_timeout_ms": 1_000}
    cfg = parse_config(data)
    model = cfg.model("llama3.3:70b")
    assert model is not None
    assert cfg.queue_for(model) == QueuePolicy(
        max_queue=16, queue_timeout_ms=12_345, execution_timeout_ms=1_000, max_attempts=5
    )
    # the default itself is untouched
    assert cfg.queue == QueuePolicy(max_queue=50, queue_timeout_ms=12_345, max_attempts=5)


def test_queue_override_with_a_falsy_value_still_applies() -> None:
    data = good()
    data["models"][1]["queue"] = {"max_queue": 0}
    cfg = parse_config(data)
    model = cfg.model("llama3.3:70b")
    assert model is not None
    assert cfg.queue_for(model).max_queue == 0
    assert cfg.queue_for(model).queue_timeout_ms == 30_000


def test_empty_queue_override_is_the_default() -> None:
    data = good()
    data["models"][1]["queue"] = {}
    cfg = parse_config(data)
    model = cfg.model("llama3.3:70b")
    assert model is not None
    assert cfg.queue_for(model) == cfg.queue


# --- categories -------------------------------------------------------------------------------


def test_every_type_has_a_valid_default_category() -> None:
    assert set(DEFAULT_CATEGORY) == set(PROVIDER_TYPES)
    assert set(DEFAULT_CATEGORY.values()) <= set(CATEGORIES)


@pytest.mark.parametrize(("ptype", "category"), [
    ("ollama", "local_inference"), ("vllm", "local_inference"), ("sglang", "local_inference"),
    ("lemonade", "local_inference"), ("openai_api", "api"), ("cli", "cli"),
])
def test_default_category_per_type(ptype: str, category: str) -> None:
    data = good()
    provider = data["nodes"][0]["providers"][0]
    provider["type"] = ptype
    if ptype == "cli":
        provider["command"] = ["llm"]
        del provider["base_url"]
    cfg = parse_config(data)
    assert cfg.provider("vllm-a").category is None
    assert cfg.provider("vllm-a").effective_category == category


@pytest.mark.parametrize("category", ["api", "cli", "local_inference"])
def test_explicit_category_wins(category: str) -> None:
    data = good()
    data["nodes"][0]["providers"][0]["category"] = category
    cfg = parse_config(data)
    assert cfg.provider("vllm-a").effective_category == category


# --- format_path ------------------------------------------------------------------------------


@pytest.mark.parametrize(("loc", "expected"), [
    ((), "(top level)"),
    (("models",), "models"),
    (("models", 1, "providers", "vllm-a"), "models[1].providers.vllm-a"),
    (("nodes", 0, "providers", 2, "id"), "nodes[0].providers[2].id"),
    (("nodes", 0, "providers", 2, "models", 0), "nodes[0].providers[2].models[0]"),
    (("queue", "max_queue"), "queue.max_queue"),
    ((3,), "[3]"),
])
def test_format_path(loc: tuple[str | int, ...], expected: str) -> None:
    assert format_path(loc) == expected


# --- load_config ------------------------------------------------------------------------------


def test_load_demo_config() -> None:
    cfg = load_config(DEMO)
    assert [m.id for m in cfg.models] == ["qwen3.6:35b", "llama3.3:70b"]
    assert sum(len(n.providers) for n in cfg.nodes) == 3
    llama = cfg.model("llama3.3:70b")
    assert llama is not None
    assert cfg.queue_for(llama).max_queue == 16
    assert cfg.queue_for(llama).queue_timeout_ms == 30_000


def test_load_accepts_str_path(tmp_path: Path) -> None:
    path = tmp_path / "iop.yaml"
    path.write_text(yaml.safe_dump(good()))
    assert load_config(str(path)) == parse_config(good())


def test_load_missing_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert len(info.value.errors) == 1
    assert info.value.errors[0].startswith(f"{path}: cannot read")
    assert "No such file" in info.value.errors[0]


def test_load_directory_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)
    assert len(info.value.errors) == 1
    assert info.value.errors[0].startswith(f"{tmp_path}: cannot read")


def test_load_invalid_yaml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("models: [\n  - id: x\nnodes: {")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert len(info.value.errors) == 1
    assert info.value.errors[0].startswith(f"{path}: not valid YAML")


def test_a_key_given_twice_is_an_error_naming_its_path_and_lines(tmp_path: Path) -> None:
    """(found by an operator's audit: PyYAML kept the last, so a second `models:` dropped the first's
    models without a word)"""
    text = yaml.safe_dump(good(), sort_keys=False)
    path = tmp_path / "iop.yaml"
    path.write_text(text + "models:\n  - {id: m2, providers: {vllm-a: x, vllm-a: y}}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    first = 1 + text.splitlines().index("models:")
    last = len(text.splitlines()) + 1
    assert info.value.errors == [
        f"models: given twice (lines {first} and {last}); YAML would keep only the last",
        f"models[0].providers.vllm-a: given twice on line {last + 1}; YAML would keep only the last"]
    # an alias and a merge key are not repeats
    path.write_text(text + "defaults: &d {max_queue: 3}\nmerged: {<<: *d, max_queue: 4}\nother: *d\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert sorted(info.value.errors) == ["defaults: unknown field", "merged: unknown field", "other: unknown field"]


def test_plain_scalars_read_as_yaml_1_2_not_1_1(tmp_path: Path) -> None:
    """PyYAML reads YAML 1.1: a model named `no` and a served name `on` became false and true (then
    "should be a valid string", about a name the operator wrote as a name), `1:30` the number 90
    and `capacity: 010` the number 8, without a word."""
    path = tmp_path / "iop.yaml"
    path.write_text(text := """
models:
  - id: no
    providers: {vllm-a: on}
  - id: m2
    providers: {vllm-a: off}
nodes:
  - id: yes
    providers:
      - {id: vllm-a, type: vllm, base_url: "http://gpu-1:8000", capacity: 010, models: [on, off],
         read_timeout_ms: 0x_7530}
queue: {max_queue: 1_000, queue_timeout_ms: 0o1000}
""")
    cfg = load_config(path)
    assert [(m.id, m.providers) for m in cfg.models] == [("no", {"vllm-a": "on"}), ("m2", {"vllm-a": "off"})]
    provider = cfg.nodes[0].providers[0]
    assert (cfg.nodes[0].id, provider.capacity, provider.models, provider.read_timeout_ms) == (
        "yes", 10, ["on", "off"], 30_000)
    assert (cfg.queue.max_queue, cfg.queue.queue_timeout_ms) == (1000, 512)
    # (YAML 1.2 floats that YAML 1.1 read as text: a number that needs no dot, nor a sign in its exponent)
    for value, number in (("1e3", 1000.0), ("1.5e4", 15000.0), ("-.5E+2", -50.0), ("1_0.5", 10.5), ("+2.", 2.0)):
        path.write_text(f"models: {value}\n")
        with pytest.raises(ConfigError) as info:
            load_config(path)
        assert f"models: Input should be a valid list, got {shown(number)}" in info.value.errors, info.value.errors
    for value in ("._", "2026-13-45", "2026-12-05"):  # (read as text: neither a number nor a date, no traceback)
        path.write_text(f"models: {value}\n")
        with pytest.raises(ConfigError) as info:
            load_config(path)
        assert f"models: Input should be a valid list, got '{value}'" in info.value.errors, info.value.errors
    for tagged, said in (("!!float abc", "ValueError: could not convert string to float: 'abc'"),
                         ("!!bool maybe", "KeyError: 'maybe'"),
                         ('!!timestamp "soon"', "AttributeError: 'NoneType' object has no attribute 'groupdict'"),
                         ('!!float ""', "IndexError: string index out of range")):
        path.write_text(f"models: {tagged}\n")  # (what YAML's own tags make, they make or say why not)
        with pytest.raises(ConfigError) as info:
            load_config(path)
        assert info.value.errors == [f"{path}: not valid YAML: a value its tag cannot make ({said})"]
    path.write_text(text)
    path.write_text(path.read_text().replace("capacity: 010", "capacity: 1:30").replace("id: m2", "id: true"))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.errors == ["models[1].id: Input should be a valid string, got true (YAML reads what is "
                                 "written there as a boolean: put it in quotes to make it text)",
                                 "nodes[0].providers[0].capacity: Input should be a valid integer, got '1:30'"]


def test_a_provider_s_headers_and_key_header() -> None:
    """Azure's OpenAI service takes its key in `api-key`; a gateway in front of a server may want a
    header of its own (`X-Title`)."""
    data = good()
    vllm = data["nodes"][0]["providers"][0]
    vllm.update(api_key_env="AZURE_KEY", api_key_header="api-key", headers={"X-Title": "iop", "OpenAI-Project": "p1"})
    provider = parse_config(data).nodes[0].providers[0]
    assert provider.api_key_header == "api-key" and provider.headers == {"X-Title": "iop", "OpenAI-Project": "p1"}

    def errors(**fields: Any) -> list[str]:
        bad = good()
        bad["nodes"][0]["providers"][0].update(fields)
        return config_errors(bad)

    at = "nodes[0].providers[0]"
    assert errors(headers={"Host": "x", "x-request-id": "y"}) == [
        f"{at}.headers.Host: set by iop itself (from base_url), not by the config",
        f"{at}.headers.x-request-id: set by iop itself (the run's UUID), not by the config"]
    assert errors(headers={"X-A": "1", "x-a": "2"}) == [f"{at}.headers.x-a: the same header as X-A (names ignore case)"]
    credentials = ("credentials never go in the config: give the key's variable in api_key_env (and its header in "
                   "api_key_header), or user:password@ in base_url")
    assert errors(headers={"authorization": "Bearer sk-in-the-config"}) == [
        f"{at}.headers.authorization: {credentials}"]
    assert errors(api_key_env="K", api_key_header="api-key", headers={"Api-Key": "x"}) == [
        f"{at}.headers.Api-Key: {credentials}"]
    for iops in ("Content-Type", "host", "X-Request-Id", "Proxy-Authorization", "Content-Length"):  # (a review)
        assert errors(api_key_env="K", api_key_header=iops) == [
            f"{at}.api_key_header: {iops} is set by iop itself ({IOP_HEADERS[iops.lower()]}); the key cannot go in it"]
    assert errors(api_key_header="api-key") == [
        f"{at}.api_key_header: names the header of the key in api_key_env, which is not given"]
    assert errors(headers={"Bad Name": "x", "X-B": "two\nlines"}) == [
        f"{at}.headers.Bad Name (key): must be an HTTP header name (letters, digits, - and !#$%&'*+.^_`|~), "
        "got 'Bad Name'",
        f"{at}.headers.X-B: must be printable ASCII on one line, got 'two\\nlines'"]
    too_many = errors(headers={f"X-{i}": "v" for i in range(33)})
    assert too_many[0].startswith(f"{at}.headers: Dictionary should have at most 32"), too_many
    name, value = "X-" + "n" * 62, "v" * 1024  # (the longest name and value are taken, one more is not)
    assert parse_config({**good(), "nodes": [{**good()["nodes"][0], "providers": [
        {**good()["nodes"][0]["providers"][0], "headers": {name: value}}]}, good()["nodes"][1]]})
    too_long = errors(headers={name + "n": value, "X-B": value + "v"})
    assert [e.split(":")[0] for e in too_long] == [f"{at}.headers.{name}n (key)", f"{at}.headers.X-B"], too_long
    assert all("at most" in e for e in too_long), too_long
    cli = good()
    cli["nodes"][1]["providers"][1].update(headers={"X-Title": "iop"}, api_key_header="k", api_key_env="K")
    assert config_errors(cli) == [
        "nodes[1].providers[1].headers: only for a provider served over HTTP, not type cli",
        "nodes[1].providers[1].api_key_header: only for a provider served over HTTP, not type cli"]


def test_a_provider_id_with_a_comma_is_refused_in_words() -> None:
    """(a run's `tried` providers are a comma-separated list: `x,y` was never seen as tried, and a
    failing provider took all three attempts)"""
    data = good()
    data["nodes"][0]["providers"][0]["id"] = "vllm,a"
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert "nodes[0].providers[0].id: must be one word, without spaces or commas, got 'vllm,a'" in info.value.errors


def test_load_empty_file_is_not_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.errors == ["(top level): expected a mapping, got null (an empty document)"]


def test_load_reports_schema_faults_with_paths(tmp_path: Path) -> None:
    data = good()
    data["nodes"][0]["providers"][0]["capacity"] = 0
    data["nodes"][0]["providers"][0]["type"] = "tgi"
    path = tmp_path / "iop.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert sorted(e.split(":")[0] for e in info.value.errors) == [
        "nodes[0].providers[0].capacity", "nodes[0].providers[0].type",
    ]


# --- `iop config validate` --------------------------------------------------------------------


def run_cli(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as info:
        cli_main(argv)
    code = info.value.code
    assert isinstance(code, int)
    return code


def test_cli_validate_demo_ok(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["config", "validate", str(DEMO)]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("OK")
    assert "2 models, 2 nodes, 3 providers" in out
    assert err == ""


def test_cli_validate_reads_the_config_every_command_reads(capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a FILE: `$IOP_CONFIG`, as every other command (it was a usage error: an operator's review)."""
    monkeypatch.setenv("IOP_CONFIG", str(DEMO))
    assert run_cli(["config", "validate"]) == 0
    assert capsys.readouterr().out.startswith("OK")


def test_cli_validate_counts_one_of_a_kind_in_the_singular(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A pool of one model on one node's one provider read 'OK: 1 models, 1 nodes, 1 providers'."""
    data = good()
    data["models"] = [{"id": "m", "providers": {"sglang-b": "qwen3.6-35b-a3b"}}]
    data["nodes"] = [{**data["nodes"][1], "providers": data["nodes"][1]["providers"][:1]}]
    path = tmp_path / "one.yaml"
    path.write_text(yaml.safe_dump(data))
    assert run_cli(["config", "validate", str(path)]) == 0, capsys.readouterr()
    assert capsys.readouterr().out == "OK: 1 model, 1 node, 1 provider\n"


def test_cli_validate_bad_file_prints_every_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = good()
    data["models"][0]["providers"]["ghost"] = "x"
    data["models"][1]["providers"]["vllm-a"] = "nope"
    data["nodes"][1]["id"] = "gpu-1"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    expected = info.value.errors
    assert len(expected) == 3

    code = run_cli(["config", "validate", str(path)])
    assert code != 0
    out, err = capsys.readouterr()
    assert "OK" not in out
    for error in expected:
        assert error in err
    assert "models[0].providers.ghost: provider 'ghost' is not defined by any node" in err
    assert str(path) in err


def test_cli_validate_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "missing.yaml"
    assert run_cli(["config", "validate", str(path)]) != 0
    out, err = capsys.readouterr()
    assert out == ""
    assert f"{path}: cannot read" in err


def test_schema_and_reference_faults_are_reported_together() -> None:
    data = good()
    set_at("nodes", 0, "providers", 0, "capacity", value=0)(data)
    set_at("models", 0, "providers", "ghost", value="x")(data)
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert err.value.errors == [
        "nodes[0].providers[0].capacity: Input should be greater than or equal to 1",
        "models[0].providers.ghost: provider 'ghost' is not defined by any node",
    ]


def test_a_duplicate_provider_is_reported_once_and_the_first_definition_is_used() -> None:
    data = good()
    clone = copy.deepcopy(data["nodes"][0]["providers"][0])
    clone["models"] = ["something-else"]
    data["nodes"][1]["providers"].append(clone)
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert len(err.value.errors) == 1 and "duplicate provider id" in err.value.errors[0]


def test_a_non_string_mapping_key_is_named_as_a_key() -> None:
    data = good()
    data["models"][0]["providers"][1] = "x"
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert ("models[0].providers.1 (key): Input should be a valid string, got 1 (YAML reads what is written there "
            "as a number: put it in quotes to make it text)") in err.value.errors


@pytest.mark.parametrize(("runtime", "queue", "fragment"), [
    ({"heartbeat_interval_ms": 2000, "heartbeat_ttl_ms": 2000}, {}, "runtime.heartbeat_ttl_ms: must exceed"),
    ({"scheduler_liveness_ms": 3000, "gateway_liveness_ms": 2000}, {}, "runtime.gateway_liveness_ms: must be at least"),
    ({"run_ttl_s": 60}, {"queue_timeout_ms": 30_000, "execution_timeout_ms": 30_000},
     "runtime.run_ttl_s: 60 s does not outlast a run of model"),
])
def test_timings_that_cannot_work_together_are_rejected(runtime: dict[str, int], queue: dict[str, int],
                                                        fragment: str) -> None:
    data = good()
    data["runtime"] = runtime
    data["queue"] = queue
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert any(e.startswith(fragment) for e in err.value.errors), err.value.errors


def test_a_runtime_timing_fault_is_reported_with_the_faults_of_other_sections() -> None:
    # (it showed only once every other fault was mended)
    data = good()
    data["runtime"] = {"heartbeat_interval_ms": 5000, "heartbeat_ttl_ms": 100}
    data["nodes"][0]["providers"][0]["capacity"] = "many"
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert any(e.startswith("nodes[0].providers[0].capacity: ") for e in err.value.errors), err.value.errors
    assert any(e.startswith("runtime.heartbeat_ttl_ms: must exceed") for e in err.value.errors), err.value.errors


def test_an_auth_section_with_every_key_commented_out_is_an_error_not_a_gateway_without_keys() -> None:
    """`auth:` with its lines commented out is YAML's null: it read as no auth section, and the
    gateway served anyone (found by a new operator), while `auth: {}` was an error."""
    data = good()
    data["auth"] = None
    assert config_errors(data) == ["auth: empty (every key under it commented out?): list the keys under auth.keys, "
                                   "or remove the auth section to serve without keys"]


@pytest.mark.parametrize("section", ["queue", "runtime"])
def test_a_section_that_is_not_a_mapping_says_so_without_naming_a_class(section: str) -> None:
    data = good()
    data[section] = None
    assert config_errors(data) == [f"{section}: Input should be a mapping (`field: value` lines), got null (every "
                                   "line under it commented out? remove the line too)"]
    data[section] = [1]
    assert config_errors(data) == [f"{section}: Input should be a mapping (`field: value` lines), got [1]"]


@pytest.mark.parametrize(("mutation", "expected"), [
    (set_at("nodes", 0, "providers", 0, "capacity", value=True),
     "nodes[0].providers[0].capacity: Input should be a valid integer, got true"),
    (set_at("nodes", 0, "providers", 0, "capacity", value=float("inf")),
     "nodes[0].providers[0].capacity: Input should be a valid integer, got .inf"),
    (set_at("nodes", 0, "providers", 0, "type", value=None),
     "nodes[0].providers[0].type: Input should be 'ollama', 'vllm', 'sglang', 'llamacpp', 'lemonade', 'openai_api' "
     "or 'cli', got null"),
    (set_at("nodes", 1, "providers", 1, "category", value=False),
     "nodes[1].providers[1].category: Input should be 'api', 'cli' or 'local_inference', got false"),
    (lambda data: data["models"][0]["providers"].update({None: "x"}),
     "models[0].providers.null: provider null is not defined by any node"),
    (set_at("nodes", 0, "providers", 0, "capacity", value="1e3"),  # (YAML 1.1 reads 1e3 as text)
     "nodes[0].providers[0].capacity: Input should be a valid integer, got '1e3' (YAML reads that as text, not a "
     "number: write the number out in digits)"),
    (set_at("nodes", 0, "providers", 0, "capacity", value=1000.0),  # (YAML 1.2 reads 1e3 as a fraction)
     "nodes[0].providers[0].capacity: Input should be a valid integer, got 1000.0 (a number with a dot or an "
     "exponent is a fraction to YAML: write it out in digits)"),
    (set_at("models", 0, "id", value=3.5),  # (a newcomer's model `id: 3.5`: a name to them, a number to YAML)
     "models[0].id: Input should be a valid string, got 3.5 (YAML reads what is written there as a number: put it "
     "in quotes to make it text)"),
    (set_at("nodes", 0, "id", value=1),
     "nodes[0].id: Input should be a valid string, got 1 (YAML reads what is written there as a number: put it in "
     "quotes to make it text)"),
    (set_at("nodes", 0, "providers", 0, "models", 0, value=True),
     "nodes[0].providers[0].models[0]: Input should be a valid string, got true (YAML reads what is written there "
     "as a boolean: put it in quotes to make it text)"),
])
def test_messages_show_values_as_yaml_writes_them_not_as_python_does(mutation: Mutation, expected: str) -> None:
    data = good()
    mutation(data)
    errors = config_errors(data)
    assert expected in errors, errors
    assert not any(word in e for e in errors for word in ("True", "False", "None", " inf")), errors


def _int_fields() -> list[tuple[str, Any]]:
    from common.config import ProviderConfig, QueueOverride, RuntimeConfig

    return [(f"{model.__name__}.{name}", field) for model in (QueuePolicy, QueueOverride, ProviderConfig, RuntimeConfig)
            for name, field in model.model_fields.items() if "int" in str(field.annotation)]


@pytest.mark.parametrize(("name", "field"), _int_fields(), ids=[name for name, _ in _int_fields()])
def test_every_whole_number_of_the_config_has_an_upper_bound_redis_can_hold(name: str, field: Any) -> None:
    bounds = [m.le for m in field.metadata if getattr(m, "le", None) is not None]
    assert bounds and bounds[0] < 2**63, f"{name} has no upper bound below 2**63"


def test_validate_rejects_a_config_that_cannot_run_naming_each_path(tmp_path: Path) -> None:
    """`iop config validate` said OK to these, and a worker then ran nothing."""
    import subprocess
    import sys

    text = DEMO.read_text()
    text = text.replace("capacity: 4", "capacity: 99999999999999999999999", 1)
    text = text.replace("base_url: http://127.0.0.1:18002", 'base_url: "not a url"', 1)
    text = text.replace("base_url: http://127.0.0.1:18003", "base_url: ftp://x", 1)
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    done = subprocess.run([sys.executable, "-m", "iop", "config", "validate", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "OK" not in done.stdout, done.stdout
    errors = [line.split(": ", 2)[1] for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["nodes[0].providers[0].capacity", "nodes[1].providers[0].base_url",
                      "nodes[1].providers[1].base_url"], done.stderr


def test_a_file_that_is_not_utf8_is_one_error_naming_the_file_and_the_byte(tmp_path: Path) -> None:
    path = tmp_path / "b.yaml"
    path.write_bytes(b"models: []\n\xc3(")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.errors == [f"{path}: not UTF-8 text (byte 11 is 0xc3)"]


def test_invalid_yaml_is_one_line_saying_where(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("models: [\n  - id: x\nnodes: {")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    [error] = info.value.errors
    assert "\n" not in error and error.startswith(f"{path}: not valid YAML: ") and "(line 2, column 3)" in error


@pytest.mark.parametrize(("raw", "expected"), [
    (b"models: []\nx: \"\x00\"\n", "character U+0000 is not allowed (line 2)"),
    (b"models: []\n\x01\n", "character U+0001 is not allowed (line 2)"),
    # (libyaml counts bytes: the 2-byte letters before it must not push it onto a later line)
    (("models: []\nx: " + "é" * 40 + "\ny: \x01\nz: 1\nw: 2\n").encode(), "character U+0001 is not allowed (line 3)"),
    (b"models: " + b"[" * 2000 + b"]" * 2000 + b"\n", "nested too deeply"),
    (b"models: " + b"[" * 50_000 + b"]" * 50_000 + b"\n", "nested too deeply"),
    (b"models:\n" + b"".join(b"  " * i + b"a:\n" for i in range(1, 1000)), "nested too deeply"),
])
def test_a_control_character_or_a_document_nested_beyond_reading_is_one_error_not_a_traceback(
        tmp_path: Path, raw: bytes, expected: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_bytes(raw)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.errors == [f"{path}: not valid YAML: {expected}"]


def test_a_file_that_is_no_config_by_its_size_is_refused_before_it_is_read_whole() -> None:
    """`--config /dev/zero` ended in a MemoryError (or the OOM killer); a 20 MB file took 6 s."""
    with pytest.raises(ConfigError) as info:
        load_config("/dev/zero")
    assert info.value.errors == ["/dev/zero: over 4 MiB: not a config"]


def test_two_merge_keys_in_one_mapping_are_a_key_given_twice(tmp_path: Path) -> None:
    """`<<:` twice in one mapping: the last won, silently (a model took the id of the second
    merge: operator's audit)."""
    path = tmp_path / "c.yaml"
    path.write_text("""models:
  - <<: {id: m1, providers: {p: p-served}}
    <<: {id: m2}
nodes:
  - id: n
    providers: [{id: p, type: vllm, base_url: "http://127.0.0.1:9", capacity: 1, models: [p-served]}]
""")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.errors == ["models[0].<<: given twice (lines 2 and 3); YAML would keep only the last"]


def _alias_bomb(levels: int) -> str:
    """A YAML list of 10**levels leaves in a few hundred bytes (aliases of aliases)."""
    lines = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("value", ["*a3", "[" * 400 + "1" + "]" * 400], ids=["alias-bomb", "nested-400"])
def test_a_huge_or_deep_value_in_a_wrong_field_is_an_error_naming_its_path_at_once(
        tmp_path: Path, value: str) -> None:
    """An error message shows the value it refuses, cut short: it was written whole first, so a 10 KB
    alias bomb (10⁹ leaves) in `display_name` hung `iop config validate` and every service at its
    start, and a list nested 400 deep crashed them with a RecursionError (operator's audit). (A bomb
    of 10⁴ leaves: one that repeats more than 100,000 values is refused before, `test_config_fuzz`.)"""
    path = tmp_path / "c.yaml"
    path.write_text(_alias_bomb(4) + f"""models:
  - id: m
    display_name: {value}
    providers: {{p: p-served}}
nodes:
  - id: n
    providers: [{{id: p, type: vllm, base_url: "http://127.0.0.1:9", capacity: 1, models: [p-served]}}]
""")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    first = info.value.errors[0]  # (then the anchors' top-level keys: unknown fields)
    assert first.startswith("models[0].display_name: Input should be a valid string, got [[[") and first.endswith("…")


def test_a_config_is_read_with_libyaml_where_pyyaml_has_it() -> None:
    """Every process reads the whole config at its start: PyYAML's own parser, in Python, took 0.4 s
    of CPU for 300 models and 100 providers (2.5 s for 1,000 of each), in each of a pool's 24
    processes; libyaml's, a sixth of that. Both read a config alike (every test of this file)."""
    assert FAST is (yaml.__with_libyaml__ and bounds_nesting(yaml.CSafeLoader))
    if FAST:
        assert issubclass(ConfigLoader, yaml.CSafeLoader)


_NESTED = "import sys, yaml\nfrom common.config_yaml import FAST, ConfigLoader, bounds_nesting\n" \
          "print(yaml.__with_libyaml__, FAST)\n" \
          "try:\n    ConfigLoader('models: ' + '[' * 50000 + ']' * 50000).get_single_node()\n" \
          "except RecursionError:\n    print('RecursionError')\n"


def _unbounded_libyaml_pythons() -> list[str]:
    """The system's Pythons whose PyYAML has a libyaml without a nesting limit (Debian's
    python3-yaml over libyaml 0.2.5), which the PyPI wheel iop installs does not have."""
    found = []
    for python in sorted({*glob.glob("/usr/bin/python3"), *glob.glob("/usr/bin/python3.[0-9]*")}):
        if not re.fullmatch(r"/usr/bin/python3(\.\d+)?", python):
            continue
        probe = ("import yaml\nl = yaml.CSafeLoader('[' * 1100 + ']' * 1100)\n"
                 "try:\n    l.get_single_node()\nexcept yaml.YAMLError:\n    print('bounded')\nelse:\n"
                 "    print('unbounded')\n")
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60, check=False)
        if done.stdout.strip() == "unbounded":
            found.append(python)
    return found


def test_a_libyaml_without_a_nesting_limit_is_not_used_so_a_deep_config_is_an_error_not_a_crash() -> None:
    """Debian's python3-yaml (6.0 over libyaml 0.2.5) has libyaml's loader but no nesting limit: a
    config nested 50,000 deep (100 KB) killed the process with SIGSEGV when it was read with it.
    Such a PyYAML reads with its own parser, which stops at Python's recursion limit."""
    pythons = _unbounded_libyaml_pythons()
    if not pythons:
        pytest.skip("no Python here has a libyaml without a nesting limit")
    root = Path(__file__).resolve().parent.parent
    for python in pythons:
        done = subprocess.run([python, "-c", _NESTED], capture_output=True, text=True, timeout=120, check=False,
                              cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
        assert (done.returncode, done.stdout.split()) == (0, ["True", "False", "RecursionError"]), (python, done)
