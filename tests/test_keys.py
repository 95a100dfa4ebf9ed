"""Pure tests of the Redis key names (common/keys.py)."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from itertools import combinations, product

import pytest

from common import keys

PATTERNS = [row[0] for row in keys.KEY_TABLE]
PLACEHOLDER = re.compile(r"\{([a-z_]+)\}")
#: every placeholder the table uses ({model}, {run}, ...)
PLACEHOLDERS = sorted({m for p in PATTERNS for m in PLACEHOLDER.findall(p)})


def _key_functions() -> list[tuple[str, Callable[..., str]]]:
    """The module's public functions that build a name (str arguments, returning str)."""
    out: list[tuple[str, Callable[..., str]]] = []
    for name, fn in inspect.getmembers(keys, inspect.isfunction):
        if name.startswith("_") or fn.__module__ != keys.__name__:
            continue
        sig = inspect.signature(fn)
        if sig.return_annotation in (str, "str"):
            out.append((name, fn))
    return out


KEY_FUNCTIONS = _key_functions()


def arity(fn: Callable[..., str]) -> int:
    return len(inspect.signature(fn).parameters)


def _as_regex(pattern: str) -> re.Pattern[str]:
    literals = PLACEHOLDER.split(pattern)[::2]  # split() interleaves literals and placeholder names
    return re.compile("^" + "(.+)".join(re.escape(lit) for lit in literals) + "$")


def test_introspection_finds_the_key_functions() -> None:
    names = {name for name, _ in KEY_FUNCTIONS}
    assert {"runs_stream", "run_record", "run_events", "leases", "heartbeat", "node_queue", "node_wake",
            "node_cancel", "scheduler_alive", "arq_in_progress"} <= names
    assert {"key_in_flight", "key_requests", "usage_day", "usage_total"} <= names
    for name, fn in KEY_FUNCTIONS:
        assert 1 <= arity(fn) <= 2, name


@pytest.mark.parametrize(("name", "fn"), KEY_FUNCTIONS, ids=[n for n, _ in KEY_FUNCTIONS])
def test_key_names_are_namespaced(name: str, fn: Callable[..., str]) -> None:
    for arg in ["x", "qwen3.6:35b", "01JABCDEF", "gpu-1"]:
        key = fn(*[arg] * arity(fn))
        assert key.startswith(("iop:", "arq:")), (name, key)
        assert key.endswith(arg), (name, key)


def test_constants_are_namespaced() -> None:
    assert keys.SCHEDULER_SIGNALS.startswith("iop:")
    assert keys.SCHEDULER_SIGNALS in PATTERNS
    assert keys.SCHEDULER_GROUP in PATTERNS


def test_key_table_patterns_are_unique() -> None:
    assert len(PATTERNS) == len(set(PATTERNS))


@pytest.mark.parametrize(("name", "fn"), KEY_FUNCTIONS, ids=[n for n, _ in KEY_FUNCTIONS])
def test_each_key_function_is_in_the_table(name: str, fn: Callable[..., str]) -> None:
    # called with its placeholders, the function yields its table pattern exactly ...
    calls = product(["{" + ph + "}" for ph in PLACEHOLDERS], repeat=arity(fn))
    rows = sorted({p for args in calls for p in PATTERNS if fn(*args) == p})
    assert len(rows) == 1, (name, rows)
    # ... and for real ids its key matches that pattern and no other
    key = fn(*["some-id:1"] * arity(fn))
    matching = [p for p in PATTERNS if _as_regex(p).match(key)]
    assert matching == rows, (name, key, matching)


def test_key_functions_produce_distinct_namespaces() -> None:
    """No two functions can ever build the same key: their fixed prefixes never overlap."""
    prefixes = {name: fn(*[""] * arity(fn)) for name, fn in KEY_FUNCTIONS}
    for (a, pa), (b, pb) in combinations(prefixes.items(), 2):
        assert not pa.startswith(pb) and not pb.startswith(pa), (a, pa, b, pb)


def test_every_table_row_is_complete() -> None:
    for row in keys.KEY_TABLE:
        assert len(row) == 4
        assert all(isinstance(cell, str) and cell.strip() for cell in row), row


def test_table_commands_mention_their_pattern() -> None:
    for pattern, _kind, _what, command in keys.KEY_TABLE:
        if pattern == keys.SCHEDULER_GROUP:
            continue  # a group name, read through the runs stream
        literal = PLACEHOLDER.split(pattern)[0]
        assert literal in command, (pattern, command)
