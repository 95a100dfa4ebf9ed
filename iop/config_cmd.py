"""`iop config validate` and `iop config migrate`."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from common.config import ConfigError, load_config, parse_config, read_yaml
from common.config_yaml import ConfigDumper
from common.legacy import is_legacy
from common.legacy import migrate as migrate_legacy
from common.shown import counted


def fault_lines(path: str | Path, errors: list[str], *, always_count: bool = True) -> list[str]:
    """What says a config's faults: each one, then which file held how many. `always_count` False (a
    service's or command's start): not that last line when every fault names the file already."""
    lines = [f"error: {err}" for err in errors]
    if always_count or not all(err.startswith(f"{path}: ") for err in errors):
        lines.append(f"{path}: {len(errors)} error(s)")
    return lines


def _errors(path: str, errors: list[str]) -> int:
    for line in fault_lines(path, errors):
        print(line, file=sys.stderr)
    return 1


def validate(path: str) -> int:
    try:
        cfg = load_config(path)
    except ConfigError as exc:
        return _errors(path, exc.errors)
    providers = sum(len(n.providers) for n in cfg.nodes)
    print(f"OK: {counted(len(cfg.models), 'model')}, {counted(len(cfg.nodes), 'node')}, "
          f"{counted(providers, 'provider')}")
    return 0


def migrate(path: str) -> int:
    """Print the new-shape equivalent of a legacy config on stdout (comments are not kept).
    The result is validated first: a config that would not load is reported, not printed."""
    try:
        data = read_yaml(path)
        parse_config(data)  # every fault, at its legacy path
    except ConfigError as exc:
        return _errors(path, exc.errors)
    if not is_legacy(data):
        print(f"{path}: already in the new shape; printed as it is", file=sys.stderr)
        sys.stdout.write(Path(path).read_text(encoding="utf-8"))  # (its comments and layout too)
        return 0
    migration = migrate_legacy(data)
    for note in migration.notes:
        print(f"note: {note}", file=sys.stderr)
    new = migration.data
    print(f"# {Path(path).name} in the new config shape, written by `iop config migrate`")
    print(yaml.dump(new, Dumper=ConfigDumper, sort_keys=False, allow_unicode=True, default_flow_style=False), end="")
    return 0
