"""The README stays true about what the code defines."""

from __future__ import annotations

import json
import re
from pathlib import Path

from common import keys
from tests.key_kinds import kind_of

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_key_table_lists_every_key_the_key_module_defines() -> None:
    table = README.split("## Redis keys", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `([^`]+)` \|", table, flags=re.M))
    defined = {pattern for pattern, *_ in keys.KEY_TABLE}
    assert defined == listed


def test_key_table_gives_each_key_the_type_and_ttl_the_key_module_gives_it() -> None:
    """The README's type of each key (`hash + TTL …`) is the key module's: what Redis's TYPE
    answers, and whether the key always, sometimes or never has a TTL."""
    table = README.split("## Redis keys", 1)[1].split("\n## ", 1)[0]
    listed = {pattern: kind_of(cell) for pattern, cell in re.findall(r"^\| `([^`]+)` \| ([^|]+) \|", table, flags=re.M)}
    defined = {pattern: kind_of(kind) for pattern, kind, *_ in keys.KEY_TABLE}
    assert {p: k for p, k in listed.items() if k != defined.get(p)} == {}


def test_ci_runs_the_readme_test_command() -> None:
    command = re.search(r"## Test it\n\n```bash\n(.+?)\n```", README, flags=re.S)
    assert command is not None
    test_command = command.group(1).split("&&")[-1].strip()
    assert test_command in (ROOT / ".ci" / "run").read_text()


def test_config_table_lists_every_runtime_limit_with_its_default() -> None:
    from common.config import RuntimeConfig

    table = README.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `runtime\.(\w+)` \| ([^|]+) \|", table, flags=re.M))
    assert set(rows) == set(RuntimeConfig.model_fields)
    for name, field in RuntimeConfig.model_fields.items():
        shown = rows[name].strip()
        if shown.endswith("MiB"):
            assert field.default == int(shown.split()[0]) * 1024 * 1024, name
        elif shown.startswith("`"):  # (a list, shown as YAML)
            assert field.get_default(call_default_factory=True) == json.loads(shown.strip("`")), name
        else:
            assert field.default == int(shown), name


def test_config_tables_list_every_field_of_the_config_and_no_other() -> None:
    """Each field of each part of the config has its row, with its default where that is a number; and
    each row names a field (`nodes[].providers` had none)."""
    from pydantic import BaseModel

    from common.auth import ApiKeyConfig, KeyLimits
    from common.config import ModelConfig, NodeConfig, ProviderConfig, QueuePolicy, RuntimeConfig

    parts: dict[str, type[BaseModel]] = {
        "models[]": ModelConfig, "nodes[]": NodeConfig, "nodes[].providers[]": ProviderConfig, "queue": QueuePolicy,
        "runtime": RuntimeConfig, "auth.keys[]": ApiKeyConfig, "auth.keys[].limits": KeyLimits}
    section = README.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for names, default in re.findall(r"^\| (`[^|]+`) \| ([^|]+) \|", section, flags=re.M):
        for name in re.findall(r"`([\w.\[\]*]+)`", names):
            rows[name] = default.strip()
    fields = {f"{prefix}.{name}": field for prefix, cls in parts.items() for name, field in cls.model_fields.items()}
    containers = {"models[].queue", "auth.keys[].limits"}  # (their fields have the rows: `models[].queue.*`)
    assert set(fields) - containers == set(rows) - {"models[].queue.*"}
    for name, field in fields.items():
        if name in rows and isinstance(field.default, int) and not isinstance(field.default, bool) \
                and rows[name].replace(",", "").isdigit():
            assert field.default == int(rows[name].replace(",", "")), name


def test_the_configuration_example_is_a_valid_config() -> None:
    import yaml

    from common.config import parse_config

    section = README.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    example = re.search(r"```yaml\n(.+?)\n```", section, flags=re.S)
    assert example is not None
    config = parse_config(yaml.safe_load(example.group(1)))
    model = config.model("qwen3.6:35b")
    assert model is not None and set(model.providers) == {"vllm-a", "sglang-b"}


def test_the_errors_table_lists_every_error_code_with_its_status() -> None:
    """Every `code` an answer may carry has its row, with the status the gateway gives it (the table
    lacked `500 internal_error`, what a fault of iop's own answers)."""
    from common.api_error import STATUS
    from common.wire import ErrorCode

    table = README.split("### Errors", 1)[1].split("\n### ", 1)[0]
    rows = re.findall(r"^\|[^|]+\| (\d{3})[^|]*\| `(\w+)` \|$", table, flags=re.M)
    listed: dict[str, set[int]] = {}
    for status, code in rows:
        listed.setdefault(code, set()).add(int(status))
    assert set(listed) == {code.value for code in ErrorCode}
    for code in ErrorCode:
        assert STATUS[code] in listed[code.value], code
