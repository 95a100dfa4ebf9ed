"""The scripts are put together from shared fragments (`common.scripts`). Redis's Lua refuses a
global, so a fragment's function called before its definition (a script that lacks the fragment,
or has it after its user) fails only when that line runs: often on a rare path (a key written by
hand with another type). These checks read every script as Redis gets it."""

from __future__ import annotations

import re

import pytest

from common import scripts

DEFINED = re.compile(r"^\s*local function (\w+)\(", re.MULTILINE)
#: every function any script defines: a call of one of them must follow its definition
FUNCTIONS = sorted({name for src in scripts.ALL.values() for name in DEFINED.findall(src)})


def problems(src: str) -> list[str]:
    found = []
    for name in FUNCTIONS:
        definitions = [m.start(1) for m in re.finditer(rf"local function ({name})\(", src)]
        calls = [m.start() for m in re.finditer(rf"(?<![\w.:]){name}\(", src) if m.start() not in definitions]
        if len(definitions) > 1:
            found.append(f"{name} defined {len(definitions)} times")
        if calls and not definitions:
            found.append(f"{name} called, never defined")
        elif calls and calls[0] < definitions[0]:
            found.append(f"{name} called before its definition")
    return found


@pytest.mark.parametrize("name", sorted(scripts.ALL))
def test_each_function_is_defined_once_and_before_its_calls(name: str) -> None:
    assert problems(scripts.ALL[name]) == []


def test_the_check_sees_a_missing_fragment_and_one_after_its_user() -> None:
    # (the check itself: the two ways a composition goes wrong)
    assert sorted(problems(scripts._EVENTS)) == ["drop_wrong called, never defined", "wrongtype called, never defined"]
    assert "wrongtype called before its definition" in problems(scripts._EVENTS + scripts._WRONG)
    assert "wrongtype defined 2 times" in problems(scripts._WRONG + scripts._WRONG + scripts._EVENTS)


def test_the_scripts_that_heal_a_wrong_typed_key_have_the_prelude() -> None:
    using = {name for name, src in scripts.ALL.items() if "wrongtype(" in src.replace("local function wrongtype(", "")}
    assert using >= {"finish", "reap", "orphans", "emit", "dispatch", "take"}
