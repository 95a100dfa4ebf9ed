"""`iop keys new`: it prints only an entry the config takes."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.auth import KeyRing, hash_key
from common.config import load_config
from iop import keys_cmd

POOL = ("models: [{id: m, providers: {p: m}}]\n"
        "nodes: [{id: n, providers: [{id: p, type: vllm, base_url: 'http://h', capacity: 1, models: [m]}]}]\n"
        "auth:\n  keys:\n    - name: ops\n      sha256: '" + "0" * 64 + "'\n      role: operator\n")


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


@pytest.mark.parametrize("name", ["1e3", "0o17", "1.5e3", "1e-3", "123", "nan", "team-a"])
def test_the_entry_printed_is_read_back_by_the_config_as_it_was_given(
        name: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Found by a newcomer's audit: `--name 1e3` printed `- name: 1e3`, which the config (YAML 1.2)
    reads as the number 1000.0 and refuses (`Input should be a valid string`)."""
    assert keys_cmd.new(name, "caller") == 0
    (tmp_path / "pool.yaml").write_text(POOL + capsys.readouterr().out)
    config = load_config(tmp_path / "pool.yaml")
    assert config.auth is not None and config.auth.keys[-1].name == name


def test_its_output_appended_to_the_config_adds_the_entry_and_stores_no_key(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`iop keys new --name team-a >> iop.yaml` wrote the key itself into the config (as a line that
    broke it: "could not find expected ':'"), and showed it nowhere. The key goes to stderr, the
    entry alone to stdout, indented as under `auth:` and `keys:`."""
    assert keys_cmd.new("team-a", "caller") == 0
    out, err = capsys.readouterr()
    key = err.splitlines()[1]
    assert key.startswith("iop-") and key not in out and hash_key(key) in out
    (tmp_path / "iop.yaml").write_text(POOL + out)
    config = load_config(tmp_path / "iop.yaml")
    assert config.auth is not None and [k.name for k in config.auth.keys] == ["ops", "team-a"]
    found = KeyRing.from_config(config.auth, {}).lookup(key)
    assert found is not None and found.name == "team-a"


def test_its_output_appended_to_a_config_without_a_final_line_end_adds_the_entry(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Found by a newcomer's audit: appended (`>> iop.yaml`) to a file whose last line has no line
    end (`printf`, some editors), the entry's `#` line was glued to that last line, and the config
    no longer read: "mapping values are not allowed in this context"."""
    assert keys_cmd.new("team-a", "caller") == 0
    (tmp_path / "iop.yaml").write_text(POOL.removesuffix("\n") + capsys.readouterr().out)
    config = load_config(tmp_path / "iop.yaml")
    assert config.auth is not None and [(k.name, k.role) for k in config.auth.keys] == [
        ("ops", "operator"), ("team-a", "caller")]
