"""Per-type defaults (category, lifecycle flags), their config overrides, the type-specific
provider fields, and what the heartbeat publishes about them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from common.config import ConfigError, parse_config
from common.policy import Health
from common.provider_types import (
    CATEGORIES,
    DEFAULT_CATEGORY,
    DEFAULT_LIFECYCLE,
    LIFECYCLE_FLAGS,
    PROVIDER_TYPES,
    default_category,
    default_lifecycle,
)
from workers.heartbeat import heartbeat_fields


def one_provider(**fields: Any) -> dict[str, Any]:
    provider = {"id": "p", "type": "vllm", "base_url": "http://h:8000", "capacity": 2, "models": ["served"]}
    provider.update(fields)
    return {"models": [{"id": "m", "providers": {"p": "served"}}],
            "nodes": [{"id": "n", "providers": [provider]}]}


def errors_of(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    return err.value.errors


def test_every_type_has_defaults_drawn_from_the_known_values() -> None:
    assert set(DEFAULT_CATEGORY) == set(DEFAULT_LIFECYCLE) == set(PROVIDER_TYPES)
    assert set(DEFAULT_CATEGORY.values()) <= set(CATEGORIES)
    for flags in DEFAULT_LIFECYCLE.values():
        assert set(flags) <= set(LIFECYCLE_FLAGS)


@pytest.mark.parametrize(("ptype", "category", "flags"), [
    ("ollama", "local_inference", {"list_models", "load_model", "unload_model", "pull_model", "delete_model"}),
    ("lemonade", "local_inference", {"list_models", "load_model", "unload_model", "pull_model", "delete_model"}),
    ("vllm", "local_inference", {"list_models"}),
    ("sglang", "local_inference", {"list_models"}),
    ("openai_api", "api", {"list_models"}),
    ("cli", "cli", set()),
])
def test_defaults_per_type(ptype: str, category: str, flags: set[str]) -> None:
    assert default_category(ptype) == category
    assert set(default_lifecycle(ptype)) == flags
    extra = {"command": ["tool"], "base_url": None} if ptype == "cli" else {}
    cfg = parse_config(one_provider(type=ptype, **extra))
    assert cfg.provider("p").effective_category == category
    assert set(cfg.provider("p").effective_lifecycle) == flags


def test_the_config_overrides_category_and_flags() -> None:
    cfg = parse_config(one_provider(type="ollama", category="api", lifecycle_capabilities=["list_models"]))
    assert cfg.provider("p").effective_category == "api"
    assert cfg.provider("p").effective_lifecycle == ["list_models"]
    cfg = parse_config(one_provider(type="ollama", lifecycle_capabilities=[]))
    assert cfg.provider("p").effective_lifecycle == []
    cfg = parse_config(one_provider(lifecycle_capabilities=["pull_model", "list_models", "pull_model"]))
    assert cfg.provider("p").effective_lifecycle == ["pull_model", "list_models"]


def test_an_unknown_lifecycle_flag_is_named_by_its_path() -> None:
    errors = errors_of(one_provider(lifecycle_capabilities=["list_models", "drain"]))
    assert len(errors) == 1
    assert errors[0].startswith("nodes[0].providers[0].lifecycle_capabilities[1]: ")
    assert "'drain'" in errors[0] and "pull_model" in errors[0]
    assert errors_of(one_provider(lifecycle_capabilities="list_models"))[0].startswith(
        "nodes[0].providers[0].lifecycle_capabilities: ")


def test_a_cli_provider_needs_its_command() -> None:
    assert errors_of(one_provider(type="cli", base_url=None)) == [
        "nodes[0].providers[0].command: required for type cli (the argv to run)"]
    [error] = errors_of(one_provider(type="cli", base_url=None, command=[]))  # (not "required": it was given)
    assert error.startswith("nodes[0].providers[0].command: ") and "required" not in error, error
    assert errors_of(one_provider(type="cli", base_url=None, command=["tool", ""]))[0].startswith(
        "nodes[0].providers[0].command[1]: ")
    cfg = parse_config(one_provider(type="cli", base_url=None, command=["my-llm", "--model", "{model}"]))
    assert cfg.provider("p").command == ["my-llm", "--model", "{model}"]


def test_api_path_is_a_path() -> None:
    assert parse_config(one_provider(type="lemonade", api_path="/api/v1")).provider("p").api_path == "/api/v1"
    assert parse_config(one_provider(api_path="")).provider("p").api_path == ""
    assert errors_of(one_provider(api_path="v1"))[0].startswith("nodes[0].providers[0].api_path: ")


def test_the_heartbeat_carries_what_the_catalog_shows() -> None:
    cfg = parse_config(one_provider(type="ollama", lifecycle_capabilities=["list_models", "pull_model"]))
    fields = heartbeat_fields(cfg.provider("p"), "n", Health.UNAVAILABLE, "GET /api/tags answered 500", 1234)
    assert fields["health"] == "unavailable" and fields["reason"] == "GET /api/tags answered 500"
    assert fields["category"] == "local_inference" and fields["type"] == "ollama"
    assert json.loads(fields["lifecycle"]) == ["list_models", "pull_model"]
    assert json.loads(fields["models"]) == ["served"] and fields["ts_ms"] == "1234"
    # the beat never overwrites what probes and runs found (`workers.health.Field`, observed models)
    assert not {"observed_models", "ok_ms", "fails", "fail_ms", "fail_reason", "probe_ms"} & set(fields)
    assert "api_key" not in json.dumps(fields)
