"""Legacy configs (S05): `openai.model_routes[]` + `nodes[].adapters[]` load through the compat
layer and route exactly as before; `iop config migrate` prints the same pool in the new
shape; mixing both shapes in a conflicting way names both places."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from common.config import Config, ConfigError, load_config, parse_config
from common.legacy import is_legacy, migrate
from common.policy import Health, ProviderSnapshot, select_provider
from iop.cli import main as cli_main

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "legacy.yaml"

#: what the fixture routed before the pool: model id -> (adapter, node, type, endpoint, capacity, target)
BEFORE = {
    "qwen3.6:35b": ("vllm-a", "gpu-1", "vllm", "http://127.0.0.1:18001", 4, "Qwen/Qwen3.6-35B-A3B"),
    "llama3.3:70b": ("vllm-a", "gpu-1", "vllm", "http://127.0.0.1:18001", 4, "meta-llama/Llama-3.3-70B-Instruct"),
    "llama3:8b": ("ollama-b", "gpu-2", "ollama", "http://127.0.0.1:11434", 2, "llama3:8b-instruct-q4_K_M"),
    "gpt-4o-mini": ("hosted-c", "gpu-2", "openai_api", "https://api.example.com/v1", 8, "gpt-4o-mini-2024-07-18"),
    "local-cli": ("cli-d", "gpu-2", "cli", None, 1, "tiny"),
}


def legacy() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(FIXTURE.read_text())
    return data


def route_table(cfg: Config) -> dict[str, list[tuple[str, str, str, str | None, int, str]]]:
    """model id -> every place a run of it can go: (provider, node, type, url, capacity, target)."""
    table: dict[str, list[tuple[str, str, str, str | None, int, str]]] = {}
    for m in cfg.models:
        table[m.id] = [(pid, cfg.node_of(pid), str(cfg.provider(pid).type), cfg.provider(pid).base_url,
                        cfg.provider(pid).capacity, target) for pid, target in m.providers.items()]
    return table


def errors_of(data: Any) -> list[str]:
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    return err.value.errors


def test_the_legacy_fixture_loads_and_routes_as_before() -> None:
    cfg = load_config(FIXTURE)
    assert route_table(cfg) == {model: [route] for model, route in BEFORE.items()}
    assert cfg.provider("vllm-a").models == ["Qwen/Qwen3.6-35B-A3B", "meta-llama/Llama-3.3-70B-Instruct"]
    assert cfg.provider("hosted-c").api_key_env == "EXAMPLE_API_KEY"
    assert cfg.provider("cli-d").command == ["my-llm", "--model", "{model}"]
    assert cfg.queue.max_queue == 32 and cfg.runtime.heartbeat_interval_ms == 1000
    # The selection policy, given the one provider each model has, picks it and nothing else.
    for model_id, (adapter, *_rest) in BEFORE.items():
        model = cfg.model(model_id)
        assert model is not None
        snaps = [ProviderSnapshot(pid, Health.AVAILABLE, cfg.provider(pid).capacity, 0, 1000)
                 for pid in model.providers]
        chosen = select_provider(snaps, now_ms=1000, ttl_ms=6000)
        assert chosen is not None and chosen.provider_id == adapter


def test_migrate_prints_a_new_shape_config_that_routes_the_same(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli_main(["config", "migrate", str(FIXTURE)])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("# legacy.yaml in the new config shape")
    migrated = yaml.safe_load(out)
    assert not is_legacy(migrated) and "openai" not in migrated
    new = parse_config(migrated)
    old = load_config(FIXTURE)
    assert route_table(new) == route_table(old)
    assert new.model_dump() == old.model_dump()
    # the printed file validates on its own
    path = tmp_path / "new.yaml"
    path.write_text(out)
    with pytest.raises(SystemExit) as exit_:
        cli_main(["config", "validate", str(path)])
    assert exit_.value.code == 0


def test_migrate_writes_text_that_reads_as_a_number_quoted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A served name `1e5` (text: quoted in the legacy file) was written plain, which iop's YAML 1.2
    reading takes for a number: the migrated file did not load (a review). Text either YAML reading
    would take for something else is quoted."""
    legacy_file = tmp_path / "legacy.yaml"
    legacy_file.write_text("""
openai:
  model_routes:
    - {model: "m", adapter: vllm-a, target: "1e5"}
    - {model: "yes", adapter: vllm-a, target: "010"}
nodes:
  - id: gpu-1
    adapters:
      - {id: vllm-a, type: vllm, endpoint: "http://gpu-1:8000", capacity: 4}
""")
    with pytest.raises(SystemExit) as exit_:
        cli_main(["config", "migrate", str(legacy_file)])
    assert exit_.value.code == 0
    path = tmp_path / "new.yaml"
    path.write_text(capsys.readouterr().out)
    cfg = load_config(path)
    assert [(m.id, m.providers) for m in cfg.models] == [("m", {"vllm-a": "1e5"}), ("yes", {"vllm-a": "010"})]
    assert cfg.model_dump() == load_config(legacy_file).model_dump()


def test_migrate_reports_faults_at_their_legacy_paths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = legacy()
    data["nodes"][0]["adapters"][0]["capacity"] = 0
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SystemExit) as exit_:
        cli_main(["config", "migrate", str(path)])
    assert exit_.value.code == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "error: nodes[0].adapters[0].capacity: Input should be greater than or equal to 1" in captured.err


def test_migrate_of_a_new_shape_file_prints_it_as_it_is(capsys: pytest.CaptureFixture[str]) -> None:
    demo = Path(__file__).resolve().parents[1] / "examples" / "demo.yaml"
    with pytest.raises(SystemExit) as exit_:
        cli_main(["config", "migrate", str(demo)])
    assert exit_.value.code == 0
    captured = capsys.readouterr()
    assert "already in the new shape" in captured.err
    assert captured.out == demo.read_text()  # as it is: comments and layout too


@pytest.mark.parametrize(("mutate", "expected"), [
    (lambda d: d["nodes"][0]["adapters"][0].update(capacity=0),
     "nodes[0].adapters[0].capacity: Input should be greater than or equal to 1"),
    (lambda d: d["nodes"][0]["adapters"][0].pop("endpoint"),
     "nodes[0].adapters[0].endpoint: required for type vllm"),
    (lambda d: d["nodes"][0]["adapters"][0].update(type="tgi"),
     "nodes[0].adapters[0].type: Input should be 'ollama', 'vllm', 'sglang', 'llamacpp', 'lemonade', 'openai_api' "
     "or 'cli', got 'tgi'"),
    (lambda d: d["openai"]["model_routes"][2].update(adapter="nope"),
     "openai.model_routes[2].adapter: provider 'nope' is not defined by any node"),
    (lambda d: d["openai"]["model_routes"][0].update(adaptor="x"),
     "openai.model_routes[0].adaptor: unknown field"),
    (lambda d: d["openai"]["model_routes"][1].pop("target"),
     "openai.model_routes[1].target: required, a non-empty string"),
    (lambda d: d["openai"].update(listen=":8080"), "openai.listen: unknown field"),
    (lambda d: d["openai"].update(model_routes=[]), "openai.model_routes: expected a non-empty list of routes"),
    (lambda d: d["nodes"][1]["adapters"][0].update(base_url="http://x"),
     "nodes[1].adapters[0].base_url: unknown field (a legacy adapter names its URL `endpoint`)"),
    (lambda d: d["nodes"][1]["adapters"][2].pop("command"),
     "nodes[1].adapters[2].command: required for type cli (the argv to run)"),
    (lambda d: d["openai"]["model_routes"][3].update(model="qwen3.6:35b"),
     "openai.model_routes[3].model: duplicate model id 'qwen3.6:35b' (first at openai.model_routes[0].model); "
     "a legacy route has one adapter, list several providers under `models[]` instead"),
    (lambda d: d["openai"]["model_routes"][0].update(model="has space"),
     "openai.model_routes[0].model: must be one word (no spaces), got 'has space'"),
])
def test_legacy_faults_name_legacy_paths(mutate: Any, expected: str) -> None:
    data = legacy()
    mutate(data)
    assert errors_of(data) == [expected]


def test_an_adapter_no_route_uses_is_left_out_with_a_note(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    data = legacy()
    del data["openai"]["model_routes"][2]
    cfg = parse_config(data)
    assert "ollama-b" not in {p.id for n in cfg.nodes for p in n.providers}
    assert route_table(cfg) == {m: [r] for m, r in BEFORE.items() if m != "llama3:8b"}
    path = tmp_path / "unused.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SystemExit) as exit_:
        cli_main(["config", "migrate", str(path)])
    assert exit_.value.code == 0
    assert "note: nodes[1].adapters[0]: adapter 'ollama-b' serves no route; left out" in capsys.readouterr().err


def test_both_shapes_mix_when_they_do_not_conflict() -> None:
    data = legacy()
    data["models"] = [{"id": "mixed", "display_name": "Mixed", "providers": {"sglang-e": "s1", "vllm-a": "extra"}}]
    data["nodes"][0]["providers"] = [{"id": "sglang-e", "type": "sglang", "base_url": "http://h:30000",
                                      "capacity": 2, "models": ["s1"]}]
    data["openai"]["model_routes"].append({"model": "routed", "adapter": "sglang-e", "target": "s1"})
    cfg = parse_config(data)
    mixed = cfg.model("mixed")
    assert mixed is not None and mixed.providers == {"sglang-e": "s1", "vllm-a": "extra"}
    routed = cfg.model("routed")
    assert routed is not None and routed.providers == {"sglang-e": "s1"}
    # a legacy adapter also serves what new-shape models send it
    assert cfg.provider("vllm-a").models == ["extra", "Qwen/Qwen3.6-35B-A3B", "meta-llama/Llama-3.3-70B-Instruct"]
    assert [p.id for p in cfg.nodes[0].providers] == ["sglang-e", "vllm-a"]
    assert route_table(cfg)["qwen3.6:35b"] == [BEFORE["qwen3.6:35b"]]


def test_a_model_defined_in_both_shapes_names_both_places() -> None:
    data = legacy()
    data["models"] = [{"id": "other", "providers": {"vllm-a": "Qwen/Qwen3.6-35B-A3B"}},
                      {"id": "llama3:8b", "providers": {"ollama-b": "llama3:8b-instruct-q4_K_M"}}]
    assert errors_of(data) == [
        "openai.model_routes[2].model: model 'llama3:8b' is also defined at models[1]; define a model in one "
        "shape only"]


def test_a_provider_defined_in_both_shapes_names_both_places() -> None:
    data = legacy()
    data["nodes"][0]["providers"] = [{"id": "hosted-c", "type": "openai_api", "base_url": "https://x/v1",
                                      "capacity": 1, "models": ["gpt-4o-mini-2024-07-18"]}]
    assert errors_of(data) == [
        "nodes[1].adapters[1].id: provider id 'hosted-c' is also defined at nodes[0].providers[0]; define a "
        "provider in one shape only"]


def test_a_definition_in_both_shapes_is_reported_with_every_other_fault() -> None:
    """Every fault at once, as for any config: the duplicate does not hide the rest."""
    data = legacy()
    data["models"] = [{"id": "other", "providers": {"vllm-a": "Qwen/Qwen3.6-35B-A3B"}},
                      {"id": "llama3:8b", "providers": {"ollama-b": "llama3:8b-instruct-q4_K_M"}}]
    data["nodes"][0]["adapters"][0]["capacity"] = 0
    errors = errors_of(data)
    assert errors[0].startswith("openai.model_routes[2].model: model 'llama3:8b' is also defined at models[1]")
    assert "nodes[0].adapters[0].capacity: Input should be greater than or equal to 1" in errors[1:]


def test_new_shape_faults_in_a_mixed_file_keep_their_paths() -> None:
    data = legacy()
    data["models"] = [{"id": "x", "providers": {"vllm-a": "Qwen/Qwen3.6-35B-A3B"}, "queue": {"max_queue": -1}}]
    assert errors_of(data) == ["models[0].queue.max_queue: Input should be greater than or equal to 0"]


def test_migrate_is_pure_and_leaves_its_input_alone() -> None:
    data = legacy()
    before = copy.deepcopy(data)
    first, second = migrate(data), migrate(data)
    assert data == before and first.data == second.data and not first.errors
    assert is_legacy(data) and not is_legacy(first.data)
    assert is_legacy({"nodes": [{"id": "n", "adapters": []}]}) and not is_legacy({"nodes": "x"})
