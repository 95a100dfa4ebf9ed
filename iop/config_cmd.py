"""`iop config validate`."""

from __future__ import annotations

import sys

from common.config import ConfigError, load_config


def validate(path: str) -> int:
    try:
        cfg = load_config(path)
    except ConfigError as exc:
        for err in exc.errors:
            print(f"error: {err}", file=sys.stderr)
        print(f"{path}: {len(exc.errors)} error(s)", file=sys.stderr)
        return 1
    providers = sum(len(n.providers) for n in cfg.nodes)
    print(f"OK: {len(cfg.models)} models, {len(cfg.nodes)} nodes, {providers} providers")
    return 0
