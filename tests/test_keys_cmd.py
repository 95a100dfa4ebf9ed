"""`iop keys new`: it prints only an entry the config takes."""

from __future__ import annotations

import pytest

from iop import keys_cmd


@pytest.mark.parametrize("name", ["anonymous", ".team", "-team", "a" * 65, "team a"])
def test_a_name_the_config_refuses_gets_no_key(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert keys_cmd.new(name, "caller") == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"error: --name {name!r}")


def test_anonymous_is_refused_saying_why(capsys: pytest.CaptureFixture[str]) -> None:
    keys_cmd.new("anonymous", "caller")
    assert "every caller when the config has no keys" in capsys.readouterr().err


def test_a_leading_dot_is_refused_saying_the_first_must_be_a_letter_or_digit(
        capsys: pytest.CaptureFixture[str]) -> None:
    keys_cmd.new(".team", "caller")
    assert "the first a letter or digit" in capsys.readouterr().err


def test_a_good_name_gets_a_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert keys_cmd.new("team-a", "caller") == 0
    assert "name: team-a" in capsys.readouterr().out
