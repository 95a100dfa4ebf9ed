"""Every process refuses a bad config the same way at its start, as `iop config validate` does: a
non-zero exit, the same fault lines, no traceback. The real `iop` command, against a real Redis, with
the worst configs the fuzzer (`test_config_fuzz`) found."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.test_cli_errors import iop
from tests.test_config_fuzz import _PROVIDER, _laughs

DEMO = (ROOT / "examples" / "demo.yaml").read_text()
CONFIGS = {
    "alias-bomb": _laughs(1000, 1000),
    "key-true": "true: x\n" + DEMO,
    "legacy-list-id": "openai: {model_routes: [{model: m, adapter: a, target: t}]}\n"
                      "models: [{id: [1], providers: {a: t}}]\n"
                      "nodes: [{id: n, adapters: [{id: a, type: vllm, endpoint: 'http://h:1', capacity: 1}]}]\n",
    "escape-and-twice": DEMO.replace("id: gpu-2", 'id: "gpu-2\\x1b[2J"').replace("id: lemonade-c", "id: vllm-a"),
    "long-served": f"models: [{{id: m, providers: {{p: {'x' * 5000}}}}}]\n"
                   f"nodes: [{{id: n, providers: [{_PROVIDER}]}}]\n",
}
COMMANDS = [["gateway", "--host", "127.0.0.1", "--port", "0"], ["scheduler"], ["worker", "--node", "gpu-1"],
            ["catalog"], ["dev", "--port", "0"]]


@pytest.fixture(scope="module")
def said(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[str]]]:
    """Each config's file, and the fault lines `iop config validate` says of it."""
    out = {}
    for name, text in CONFIGS.items():
        path = tmp_path_factory.mktemp(name) / "c.yaml"
        path.write_text(text)
        done = iop("config", "validate", str(path))
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
        lines = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
        assert lines and all(len(line) < 300 for line in lines), done.stderr
        out[name] = (path, lines)
    return out


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_process_refuses_a_bad_config_at_its_start_as_validate_does(
        command: list[str], name: str, said: dict[str, tuple[Path, list[str]]], redis_url: str) -> None:
    path, lines = said[name]
    done = iop(*command, "--config", str(path), env={**os.environ, "REDIS_URL": redis_url})
    assert done.returncode != 0, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr + done.stdout, done.stderr
    assert [line for line in done.stderr.splitlines() if line.startswith("error: ")] == lines, done.stderr
