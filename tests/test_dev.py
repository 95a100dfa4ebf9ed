"""`iop dev` as a person runs it: one real process starting the whole stack.

The demo config gives its simulators fixed ports (18001-18003), so only one demo stack can
run at a time; these tests run their stacks one after another.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import openai
import pytest
import yaml

from iop.dev import run_dev, simulators
from iop.embedded_redis import free_port
from iop.proc import IopProcess
from tests.conftest import Proc, wait_until

pytestmark = pytest.mark.e2e

MODEL = "qwen3.6:35b"
SIM_PORTS = (18001, 18002, 18003)
BANNER = r"OpenAI-compatible API: (http://\S+/v1)"
REDIS = r"Redis: +(redis://\S+)"
START_S = 60.0
STOP_S = 30.0


def dev_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"PYTHONUNBUFFERED": "1", "IOP_LOG_LEVEL": "INFO"})
    for name in ("IOP_CONFIG", "REDIS_URL"):
        env.pop(name, None)
    return env


def refuses(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return False
    except OSError:
        return True


def port_of(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None
    return port


def child_pids(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children]


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


@pytest.fixture
def dev_proc() -> Iterator[list[Proc]]:
    procs: list[Proc] = []
    yield procs
    for proc in procs:
        proc.stop()


def test_demo_serves_the_openai_client_and_stops_on_ctrl_c(dev_proc: list[Proc]) -> None:
    proc = Proc("dev", ["dev", "--port", "0"], dev_env())
    dev_proc.append(proc)
    url = proc.wait_for_line(BANNER, timeout=START_S).group(1)
    redis_url = proc.wait_for_line(REDIS).group(1)
    assert port_of(url) != 0
    proc.wait_for_line(r"Ctrl-C stops everything")
    for name in ("simulator vllm-a", "simulator sglang-b", "simulator lemonade-c", "gateway",
                 "scheduler", "worker gpu-1", "worker gpu-2"):
        proc.wait_for_line(rf"^\[{name}\] ")

    client = openai.OpenAI(base_url=url, api_key="x", timeout=30.0)
    try:
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
        assert reply.model == MODEL
        assert reply.choices[0].message.content
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True)
        chunks = list(stream)
    finally:
        client.close()
    assert chunks and all(chunk.model == MODEL for chunk in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # the command line that operates this stack, as printed (the commands' defaults are not its own)
    operate = next(line.strip() for line in proc.lines if line.strip().startswith("iop catalog "))
    done = subprocess.run([sys.executable, "-m", "iop", *shlex.split(operate)[1:]], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert "vllm-a" in done.stdout and "chat-default" in done.stdout, done.stdout  # (the demo's alias)

    assert proc.stop(STOP_S, sig=signal.SIGINT) == 0, proc.output()  # Ctrl-C; SIGKILL after STOP_S
    assert "iop dev: stopped" in proc.lines
    for port in (*SIM_PORTS, port_of(url), port_of(redis_url)):
        assert refuses(port), f"port {port} still answers after iop dev stopped"


def test_a_dying_child_stops_everything(tmp_path: Path, dev_proc: list[Proc]) -> None:
    """With --config (real providers) no simulator starts; a child killed from outside makes
    `iop dev` stop the rest and exit 1 naming it."""
    config = {
        "models": [{"id": "m1", "providers": {"p1": "served-m1"}}],
        "nodes": [{"id": "n1", "providers": [
            {"id": "p1", "type": "vllm", "base_url": f"http://127.0.0.1:{free_port()}",
             "capacity": 1, "models": ["served-m1"]}]}],
    }
    path = tmp_path / "real.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = Proc("dev", ["dev", "--config", str(path), "--port", "0"], dev_env())
    dev_proc.append(proc)
    url = proc.wait_for_line(BANNER, timeout=START_S).group(1)
    assert not any(line.startswith("[simulator") for line in proc.lines)

    children = child_pids(proc.popen.pid)
    scheduler = next(pid for pid in children if "scheduler" in cmdline(pid))
    os.kill(scheduler, signal.SIGKILL)
    proc.popen.wait(timeout=STOP_S)
    assert proc.stop() == 1, proc.output()
    assert any("scheduler exited unexpectedly (killed by SIGKILL)" in line for line in proc.lines), proc.output()
    assert refuses(port_of(url))
    wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in children), timeout=5.0,
               what="every child to be gone")


def test_invalid_config_is_reported_with_status_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("models: []\nnodes: []\n")
    assert run_dev(str(path), "127.0.0.1", 0) == 2
    assert "error: models" in capsys.readouterr().err


def test_a_config_without_keys_on_an_open_host_is_refused_at_once_without_a_flag_dev_lacks(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by a newcomer's audit: `iop dev --host 0.0.0.0` with a keyless config started Redis and
    every child, then stopped on the gateway's refusal, whose advice (`pass --allow-anonymous`) is a
    flag `iop dev` does not take."""
    path = tmp_path / "open.yaml"  # (a config of its own: the demo's would start simulators on fixed ports)
    path.write_text(yaml.safe_dump({
        "models": [{"id": "m1", "providers": {"p": "served-m1"}}],
        "nodes": [{"id": "n1", "providers": [
            {"id": "p", "type": "vllm", "base_url": f"http://127.0.0.1:{free_port()}", "capacity": 1,
             "models": ["served-m1"]}]}],
    }))
    assert run_dev(str(path), "0.0.0.0", 0) == 2
    err = capsys.readouterr().err
    assert "refuses to serve anyone who can reach 0.0.0.0 without API keys" in err, err
    assert "--allow-anonymous" not in err and "iop dev: config" not in err


def test_simulators_cover_the_local_providers_of_the_demo() -> None:
    from iop.dev import DEMO_CONFIG, read_config

    config = read_config(DEMO_CONFIG)
    assert config is not None
    specs = {s.provider: (s.port, s.models) for s in simulators(config)}
    assert specs == {
        "vllm-a": (18001, ("Qwen/Qwen3.6-35B-A3B", "meta-llama/Llama-3.3-70B-Instruct")),
        "sglang-b": (18002, ("qwen3.6-35b-a3b",)),
        "lemonade-c": (18003, ("Llama-3.3-70B-Instruct-GGUF",)),
    }


def test_help_tells_the_host_dev_really_listens_on() -> None:
    import sys

    from tests.conftest import ROOT

    done = subprocess.run([sys.executable, "-m", "iop", "dev", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0
    assert "(default 127.0.0.1)" in done.stdout and "0.0.0.0" not in done.stdout, done.stdout


def auth_config(sim_url: str, key_env: str) -> dict[str, object]:
    return {
        "models": [{"id": "m1", "providers": {"p1": "served-m1"}}],
        "nodes": [{"id": "n1", "providers": [
            {"id": "p1", "type": "vllm", "base_url": sim_url, "capacity": 1, "models": ["served-m1"]}]}],
        "auth": {"keys": [{"name": "ops", "sha256": "0" * 64, "role": "operator"},
                          {"name": "caller", "env": key_env}]},
    }


def simulator(dev_proc: list[Proc]) -> str:
    """A simulator serving `served-m1` (three tokens), stopped with the test's processes: its URL."""
    sim = Proc("simulator", ["simulator", "--port", "0", "--models", "served-m1", "--tokens", "3"], dev_env())
    dev_proc.append(sim)
    return sim.wait_for_line(r"listening on (http://\S+)").group(1)


def dev_banner(path: Path, dev_proc: list[Proc]) -> tuple[Proc, list[str]]:
    """`iop dev --config path` once its banner is out: the process, and its lines without their
    log prefixes."""
    proc = Proc("dev", ["dev", "--config", str(path), "--port", "0"], dev_env())
    dev_proc.append(proc)
    proc.wait_for_line(r"Ctrl-C stops everything", timeout=START_S)
    return proc, [line.split("] ", 1)[-1] for line in proc.lines]


def test_with_api_keys_the_banner_says_which_key_and_its_curl_line_works(tmp_path: Path,
                                                                        dev_proc: list[Proc]) -> None:
    """The banner said "(any API key)" and printed a curl line without a key, which got 401."""

    sim_url = simulator(dev_proc)
    path = tmp_path / "auth.yaml"
    path.write_text(yaml.safe_dump(auth_config(sim_url, "IOP_DEV_TEST_KEY")))
    env = {**dev_env(), "IOP_DEV_TEST_KEY": "iop-dev-test-secret"}
    proc = Proc("dev", ["dev", "--config", str(path), "--port", "0"], env)
    dev_proc.append(proc)
    proc.wait_for_line(r"Ctrl-C stops everything", timeout=START_S)
    banner = list(proc.lines)
    api = next(line for line in banner if "OpenAI-compatible API:" in line)
    assert "any API key" not in api and "auth.keys" in api, api
    key_line = next(line.strip() for line in banner if line.strip().startswith("KEY="))
    assert key_line.startswith('KEY="$IOP_DEV_TEST_KEY"') and "'caller'" in key_line, key_line
    curl = next(line.strip() for line in banner if line.strip().startswith("curl "))
    assert '-H "Authorization: Bearer $KEY"' in curl, curl
    assert "iop-dev-test-secret" not in "\n".join(banner)
    # what a person does: paste the two lines into a shell that has the variable
    done = subprocess.run(["bash", "-c", f"{key_line}\n{curl} -sS -f"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert '"choices"' in done.stdout, done.stdout
    assert proc.stop(STOP_S, sig=signal.SIGINT) == 0, proc.output()


def test_the_banner_names_the_providers_that_take_no_runs(tmp_path: Path, dev_proc: list[Proc]) -> None:
    """Found by a caller audit: `iop dev --config` against servers it cannot reach said it was ready,
    and the first request got a 503 that nothing had warned of."""
    sim_url = simulator(dev_proc)
    closed = f"http://127.0.0.1:{free_port()}"  # (nothing listens there: refused)
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump({
        "models": [{"id": "m1", "providers": {"p-up": "served-m1", "p-down": "served-m1"}}],
        "nodes": [{"id": "n1", "providers": [
            {"id": "p-up", "type": "vllm", "base_url": sim_url, "capacity": 1, "models": ["served-m1"]},
            {"id": "p-down", "type": "vllm", "base_url": closed, "capacity": 1, "models": ["served-m1"]}]}],
    }))
    proc, banner = dev_banner(path, dev_proc)
    at = next(i for i, line in enumerate(banner) if "Not taking runs now" in line)
    assert "(1 of 2 providers;" in banner[at], banner[at]
    assert banner[at + 1].strip() == "p-down: unavailable: GET /health: connection refused", banner[at + 1]
    assert not any(line.strip().startswith("p-up:") for line in banner)
    assert proc.stop(STOP_S, sig=signal.SIGINT) == 0, proc.output()


def test_the_banner_names_a_provider_whose_server_does_not_list_its_served_name(tmp_path: Path,
                                                                               dev_proc: list[Proc]) -> None:
    """Found by a newcomer's audit: a served name the server does not list (a typo: `served-m2`
    for the `served-m1` it serves) validates, the provider is available, and `iop dev` said nothing,
    while every run of the model it alone serves was refused with a 503."""
    sim_url = simulator(dev_proc)
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump({
        "models": [{"id": "m1", "providers": {"p-ok": "served-m1"}},
                   {"id": "m2", "providers": {"p-typo": "served-m2"}},
                   {"id": "m3", "providers": {"p-case": "Served-M1"}}],
        "nodes": [{"id": "n1", "providers": [
            {"id": "p-ok", "type": "vllm", "base_url": sim_url, "capacity": 1, "models": ["served-m1"]},
            {"id": "p-typo", "type": "vllm", "base_url": sim_url, "capacity": 1, "models": ["served-m2"]},
            {"id": "p-case", "type": "vllm", "base_url": sim_url, "capacity": 1, "models": ["Served-M1"]}]}],
    }))
    proc, banner = dev_banner(path, dev_proc)
    assert not any("Not taking runs now" in line for line in banner), banner  # (both answer their probes)
    at = next(i for i, line in enumerate(banner) if "Taking no runs of a model its server does not list" in line)
    assert banner[at + 1].strip() == ("p-typo: its model list lacks 'served-m2' (model m2; it lists 'served-m1')"
                                      ), banner[at + 1]
    # (a name the server lists but for its case: `Served-M1` for `served-m1`, named beside it)
    assert banner[at + 2].strip() == ("p-case: its model list lacks 'Served-M1' (model m3; it lists 'served-m1')"
                                      ), banner[at + 2]
    assert not any(line.strip().startswith("p-ok:") for line in banner)
    assert proc.stop(STOP_S, sig=signal.SIGINT) == 0, proc.output()


def test_dev_runs_with_json_logs(tmp_path: Path, dev_proc: list[Proc]) -> None:
    """Found by a new user's audit: with `IOP_LOG_FORMAT=json` (compose's environment) the gateway's
    ready line ends in `"}`, which `iop dev` took into its port: it stopped the stack with a traceback."""
    env = {**dev_env(), "IOP_LOG_FORMAT": "json"}
    sim = Proc("simulator", ["simulator", "--port", "0", "--models", "served-m1", "--tokens", "3"], env)
    dev_proc.append(sim)
    sim_url = sim.wait_for_line(r"listening on (http://[^\s\"]+)").group(1)
    path = tmp_path / "one.yaml"
    path.write_text(yaml.safe_dump({
        "models": [{"id": "m1", "providers": {"p": "served-m1"}}],
        "nodes": [{"id": "n1", "providers": [
            {"id": "p", "type": "vllm", "base_url": sim_url, "capacity": 1, "models": ["served-m1"]}]}]}))
    proc = Proc("dev", ["dev", "--config", str(path), "--port", "0"], env)
    dev_proc.append(proc)
    url = proc.wait_for_line(BANNER, timeout=START_S).group(1)
    proc.wait_for_line(r"Ctrl-C stops everything")
    client = openai.OpenAI(base_url=url, api_key="x", timeout=30.0, max_retries=0)
    try:
        reply = client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "Hi"}])
    finally:
        client.close()
    assert reply.model == "m1" and reply.choices[0].message.content
    gateway = [line.split("] ", 1)[1] for line in proc.lines if line.startswith("[gateway] ")]
    assert gateway and all(json.loads(line)["msg"] for line in gateway), gateway
    assert proc.stop(STOP_S, sig=signal.SIGINT) == 0, proc.output()


def test_a_key_variable_that_is_not_set_stops_dev_at_once_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "auth.yaml"
    path.write_text(yaml.safe_dump(auth_config("http://127.0.0.1:9", "IOP_DEV_UNSET_KEY")))
    env = dev_env()
    env.pop("IOP_DEV_UNSET_KEY", None)
    proc = Proc("dev", ["dev", "--config", str(path), "--port", "0"], env)
    try:
        assert proc.popen.wait(timeout=START_S) == 2, proc.output()
    finally:
        proc.stop()
    assert "error: auth.keys[1].env: the environment variable IOP_DEV_UNSET_KEY is not set" in proc.lines, \
        proc.output()
    assert not any("Traceback" in line or line.startswith("[gateway]") for line in proc.lines), proc.output()


def test_dev_starts_from_a_directory_holding_a_module_named_as_a_package_of_iop(tmp_path: Path,
                                                                               dev_proc: list[Proc]) -> None:
    """Found by a newcomer: `iop dev` run from a project directory holding a `common.py` (or a
    `gateway/`, `workers/`, `scheduler/`) had every child die at import (`No module named
    'common.listening'; 'common' is not a package`): `python -m iop` put the directory first."""
    sim_url = simulator(dev_proc)
    (tmp_path / "common.py").write_text("raise SystemExit('the directory\\'s own common.py was imported')\n")
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump(auth_config(sim_url, "IOP_DEV_TEST_KEY")))
    env = {**dev_env(), "IOP_DEV_TEST_KEY": "iop-dev-test-secret"}
    # (`-P`: the command itself, as the `iop` script starts, does not read the directory either)
    proc = IopProcess("dev", ["dev", "--config", str(path), "--port", "0"], env, cwd=tmp_path, python_flags=["-P"])
    dev_proc.append(proc)  # type: ignore[arg-type]
    proc.wait_for_line(r"Ctrl-C stops everything", timeout=START_S)
    assert "Traceback" not in proc.output(), proc.output()
    assert proc.stop(STOP_S, sig=signal.SIGINT) == 0, proc.output()


def test_the_banner_names_the_key_once_and_the_catalog_page() -> None:
    """Found by a newcomer: the banner said "the key of key 'team-a'", and did not say where the
    catalog page of the stack it started is (README: Operating it)."""
    from common.config import parse_config
    from iop.dev import banner

    config = parse_config({**auth_config("http://127.0.0.1:9", "UNUSED"), "auth": {"keys": [
        {"name": "team-a", "sha256": "0" * 64}]}})
    text = banner(config, "http://127.0.0.1:5000/v1", "redis://127.0.0.1:6000/0", Path("/p.yaml"))
    assert "key of key" not in text, text
    assert "KEY=...   # the key 'team-a' (auth.keys[0]) itself: the config holds only its hash" in text, text
    assert "  Catalog page:          http://127.0.0.1:5000/catalog (an operator key)" in text, text
