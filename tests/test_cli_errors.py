"""A command that cannot run stops with one line on stderr and a non-zero exit, never a traceback:
the real `iop` command, as a person runs it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as sync_redis
import yaml

from tests.conftest import ROOT

DEMO = "examples/demo.yaml"
#: Long enough for a slow start; a command that should have stopped at once and did not fails here.
TIMEOUT_S = 60.0


def iop(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `iop ARGS` to its end (a service that never stops fails the test with TimeoutExpired)."""
    environ = dict(os.environ if env is None else env)
    environ.update({"PYTHONUNBUFFERED": "1"})
    environ.pop("IOP_LOG_FORMAT", None)
    return subprocess.run([sys.executable, "-m", "iop", *args], cwd=ROOT, env=environ, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    """The one line a failed command said on stderr."""
    assert done.returncode != 0, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


# ---------------------------------------------------------------------------- ports
@pytest.mark.parametrize("args", [
    ["gateway", "--config", DEMO, "--host", "127.0.0.1", "--port", "70000"],
    ["gateway", "--config", DEMO, "--host", "127.0.0.1", "--port", "-1"],
    ["scheduler", "--config", DEMO, "--metrics-port", "70000"],
    ["worker", "--config", DEMO, "--node", "gpu-1", "--metrics-port", "65536"],
    ["dev", "--port", "70000"],
    ["dev", "--port", "-1"],
    ["dev", "--port", "\u0668\u0660\u0668\u0660"],  # Arabic-Indic 8080: int() reads it, a port is ASCII
], ids=lambda args: " ".join(args[:1] + args[-2:]))
def test_a_port_outside_0_to_65535_is_refused_before_anything_starts(args: list[str], redis_url: str) -> None:
    # (a port taken modulo 65536 listened on 4464; `iop dev` died of an OverflowError)
    done = iop(*args, "--redis", redis_url) if args[0] in ("scheduler", "worker", "gateway") else iop(*args)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and "listening on" not in done.stdout, (done.stdout, done.stderr)
    option = args[-2]
    said = done.stderr.strip().splitlines()[-1]  # argparse's usage line, then its error
    assert said.startswith(f"iop {args[0]}: error: argument {option}: "), done.stderr
    assert "port" in said


# ---------------------------------------------------------------------------- the gateway's address
@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_gateway_whose_host_does_not_resolve_says_so_in_one_line(redis_url: str) -> None:
    done = iop("gateway", "--config", DEMO, "--redis", redis_url, "--host", "256.1.1.1", "--port", "8080",
               "--allow-anonymous")
    assert one_line(done).startswith("error: cannot listen on 256.1.1.1:8080: "), done.stderr


def test_a_gateway_on_a_port_in_use_says_so_in_one_line(redis_url: str, taken_port: int) -> None:
    done = iop("gateway", "--config", DEMO, "--redis", redis_url, "--host", "127.0.0.1", "--port", str(taken_port))
    assert one_line(done) == f"error: cannot listen on 127.0.0.1:{taken_port}: Address already in use"
    assert "listening on" not in done.stdout


@pytest.mark.parametrize("service", [["scheduler"], ["worker", "--node", "gpu-1"]], ids=lambda s: s[0])
def test_a_metrics_port_in_use_says_so_in_one_line(service: list[str], redis_url: str, taken_port: int) -> None:
    # (found by an operator's audit: a traceback ending in OSError, the worker's jobs task begun)
    done = iop(*service, "--config", DEMO, "--redis", redis_url, "--metrics-host", "127.0.0.1",
               "--metrics-port", str(taken_port))
    assert one_line(done) == f"error: cannot listen for metrics on 127.0.0.1:{taken_port}: Address already in use"
    assert "running" not in done.stdout, done.stdout


# ---------------------------------------------------------------------------- the Redis database
def _database(redis_url: str, db: str) -> str:
    base, _, _ = redis_url.rpartition("/")
    return f"{base}/{db}"


REDIS_COMMANDS = [
    ["catalog", "--config", DEMO],
    ["queues", "--config", DEMO, "--json"],
    ["runs", "show", "run-1"],
    ["usage", "--config", DEMO],
    ["audit"],
    ["provider", "drain", "vllm-a", "--config", DEMO],
    ["node", "cordon", "gpu-1", "--config", DEMO],
    ["scheduler", "--config", DEMO],
    ["scheduler", "--config", DEMO, "--metrics-port", "0", "--metrics-host", "127.0.0.1"],
    ["worker", "--config", DEMO, "--node", "gpu-1"],
    ["gateway", "--config", DEMO, "--host", "127.0.0.1", "--port", "0"],  # (before it listens)
]


@pytest.mark.parametrize("args", REDIS_COMMANDS, ids=lambda args: " ".join(a for a in args if a != DEMO))
def test_a_database_the_server_refuses_stops_the_command_with_one_line(args: list[str], redis_url: str) -> None:
    """A refused SELECT is not an outage to wait out: the command stops (the services too, however
    they retry a lost Redis), saying which server refused which database and why."""
    url = _database(redis_url, "99")
    done = iop(*args, "--redis", url)
    address = url.split("//", 1)[1].split("/", 1)[0]
    assert one_line(done) == f"error: Redis at {address} refused database 99: DB index is out of range"


@pytest.mark.parametrize("db", ["abc", "1/2", "-1", "%31x"])
def test_a_database_that_is_not_a_number_is_a_url_error_naming_the_path_and_never_the_password(
        db: str, redis_url: str) -> None:
    # (`/abc` was database 0, `/1/2` database 12)
    url = _database(redis_url, db).replace("redis://", "redis://:s3cret@")
    done = iop("queues", "--config", DEMO, "--redis", url)
    assert done.returncode == 2
    line = one_line(done)
    assert line.startswith("error: --redis: Redis URL 'redis://:***@"), line
    assert "is not a database number" in line and "s3cret" not in line, line


# ---------------------------------------------------------------------------- config files
@pytest.mark.parametrize("command", [
    ["config", "validate"], ["config", "migrate"], ["catalog", "--config"], ["dev", "--config"],
])
def test_a_config_that_is_not_utf8_is_one_error_naming_the_file(command: list[str], tmp_path: Path,
                                                                 redis_url: str) -> None:
    path = tmp_path / "b.yaml"
    path.write_bytes(b"\xff\xfe")
    extra = ["--redis", redis_url] if command[0] == "catalog" else []
    done = iop(*command, str(path), *extra)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {path}: not UTF-8 text (byte 0 is 0xff)"], done.stderr


@pytest.mark.parametrize("command", [
    ["gateway", "--host", "127.0.0.1", "--port", "0"], ["scheduler"], ["worker", "--node", "gpu-1"],
    ["catalog"], ["provider", "drain", "vllm-a"], ["dev", "--port", "0"], ["config", "validate"],
])
@pytest.mark.parametrize("given", ["--config", "IOP_CONFIG"])
def test_a_config_with_faults_names_its_file_as_validate_does(command: list[str], given: str, tmp_path: Path,
                                                              redis_url: str) -> None:
    """A service started on a typo'd config said each fault's path in the config, but not which file
    held them: with $IOP_CONFIG set elsewhere, the operator had to guess."""
    config = yaml.safe_load((ROOT / DEMO).read_text())
    config["nodes"][0]["providers"][0]["capacty"] = config["nodes"][0]["providers"][0].pop("capacity")
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "REDIS_URL": redis_url}
    if command == ["config", "validate"]:
        done = iop(*command, str(path), env=env)
    elif given == "--config" or command[0] == "dev":  # (`iop dev` without --config runs the demo pool)
        done = iop(*command, "--config", str(path), env=env)
    else:
        done = iop(*command, env={**env, "IOP_CONFIG": str(path)})
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[:2] == ["error: nodes[0].providers[0].capacity: Field required",
                         "error: nodes[0].providers[0].capacty: unknown field (did you mean capacity?)"], done.stderr
    assert lines[2:] == [f"{path}: 2 error(s)"], done.stderr


def test_a_limit_takes_ascii_digits_only(redis_url: str) -> None:
    done = iop("audit", "--redis", redis_url, "--limit", "\u0661")  # int() reads it as 1
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("iop audit: error: argument --limit: ")


@pytest.mark.parametrize("grace", ["-1", "nan", "inf", "1e9", "soon"])
def test_a_worker_s_grace_is_seconds_from_0_to_a_day(grace: str, redis_url: str) -> None:
    # (a negative or NaN grace was taken as it came)
    done = iop("worker", "--config", DEMO, "--node", "gpu-1", "--redis", redis_url, "--grace", grace)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("iop worker: error: argument --grace: ")


def test_output_piped_to_a_reader_that_stopped_ends_without_a_traceback(redis_url: str) -> None:
    # `iop catalog --json | head -c 300`: the reader is gone before the output is all written (here
    # before any of it: the pipe's reading end is closed)
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([sys.executable, "-m", "iop", "catalog", "--json", "--config", DEMO,
                               "--redis", redis_url], cwd=ROOT, stdout=write_end, stdin=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, timeout=TIMEOUT_S)
    finally:
        os.close(write_end)
    assert done.returncode == 1 and done.stderr == "", done.stderr


@pytest.mark.parametrize("args", [["scheduler"], ["worker", "--node", "gpu-1"]], ids=["scheduler", "worker"])
def test_a_service_waiting_for_redis_at_its_start_stops_on_sigterm(args: list[str]) -> None:
    """Redis is not there (yet): the service waits for it, retrying, and a SIGTERM meanwhile
    stops it with status 0 (the scheduler went on waiting, and needed a SIGKILL)."""
    import signal

    from iop.proc import IopProcess

    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "IOP_CONFIG": str(ROOT / DEMO),
           "REDIS_URL": f"redis://127.0.0.1:{port}/0"}
    env.pop("IOP_LOG_FORMAT", None)
    proc = IopProcess(args[0], args, env, cwd=ROOT)
    try:
        proc.wait_for_line(r"Redis unavailable|waiting for Redis", timeout=TIMEOUT_S)
        code = proc.stop(timeout=15, sig=signal.SIGTERM)  # (then SIGKILL: -9)
    finally:
        if proc.popen.poll() is None:
            proc.stop(timeout=5, sig=signal.SIGKILL)
    assert code == 0, proc.output()


@pytest.mark.parametrize("name, value, says", [
    ("IOP_LOG_LEVEL", "bogus", "error: IOP_LOG_LEVEL='bogus' is not a log level; use one of DEBUG, INFO, WARNING, "
                               "ERROR, CRITICAL"),
    ("IOP_LOG_FORMAT", "xml", "error: IOP_LOG_FORMAT='xml' is not a log format; use text or json"),
])
@pytest.mark.parametrize("args", [["gateway", "--host", "127.0.0.1", "--port", "0"], ["scheduler"]],
                         ids=["gateway", "scheduler"])
def test_a_log_setting_that_is_not_one_stops_the_service_with_one_line(args: list[str], name: str, value: str,
                                                                      says: str, redis_url: str) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "IOP_CONFIG": str(ROOT / DEMO), "REDIS_URL": redis_url}
    env.pop("IOP_LOG_FORMAT", None)
    env[name] = value  # (`iop` would drop an IOP_LOG_FORMAT)
    done = subprocess.run([sys.executable, "-m", "iop", *args], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 2 and one_line(done) == says


def test_a_gateway_whose_redis_does_not_answer_still_starts_after_its_database_check(taken_port: int) -> None:
    """The start's database check waits at most STARTUP_CHECK_S for a Redis that takes the
    connection and says nothing (here a socket nobody reads); then the gateway listens, and says
    it is not ready."""
    import signal
    import time

    from gateway.service import STARTUP_CHECK_S
    from iop.proc import IopProcess

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "IOP_CONFIG": str(ROOT / DEMO),
           "REDIS_URL": f"redis://127.0.0.1:{taken_port}/0"}
    env.pop("IOP_LOG_FORMAT", None)
    proc = IopProcess("gateway", ["gateway", "--host", "127.0.0.1", "--port", "0"], env, cwd=ROOT)
    began = time.monotonic()
    try:
        proc.wait_for_line(r"listening on http://", timeout=TIMEOUT_S)
        waited = time.monotonic() - began
    finally:
        proc.stop(timeout=15, sig=signal.SIGTERM)
    assert waited >= STARTUP_CHECK_S  # (it did wait: the check is there) ...
    assert "Traceback" not in proc.output()  # ... and let the silence pass


def test_a_worker_for_a_node_not_in_the_config_says_so_in_one_line(redis_url: str) -> None:
    done = iop("worker", "--config", DEMO, "--redis", redis_url, "--node", "nope")
    assert one_line(done).startswith("error: node 'nope' is not in the config (nodes: "), done.stderr


def test_a_worker_for_a_node_without_providers_says_so_in_one_line(redis_url: str, tmp_path: Path) -> None:
    """It validated, and its worker ran saying "1 slots", with nothing to run (a new user's finding)."""
    config = yaml.safe_load((ROOT / DEMO).read_text())
    config["nodes"].append({"id": "spare", "providers": []})
    path = tmp_path / "iop.yaml"
    path.write_text(yaml.safe_dump(config))
    done = iop("worker", "--config", str(path), "--redis", redis_url, "--node", "spare")
    assert done.returncode != 0
    index = len(config["nodes"]) - 1
    assert one_line(done) == (f"error: node 'spare' has no providers (nodes[{index}].providers is empty): its worker "
                              "would have nothing to run"), done.stderr


def test_a_gateway_without_keys_on_every_address_names_it(redis_url: str) -> None:
    done = iop("gateway", "--config", DEMO, "--redis", redis_url, "--host", "", "--port", "0")
    assert "refusing to serve anyone who can reach every address without API keys" in one_line(done)


def test_a_gateway_on_an_ipv6_address_says_where_as_a_url(redis_url: str) -> None:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    environ = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with subprocess.Popen([sys.executable, "-m", "iop", "gateway", "--config", DEMO, "--redis", redis_url,
                           "--host", "::1", "--port", "0"], cwd=ROOT, env=environ, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as proc:
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()  # (blocks until the gateway listens, or exits)
            assert line.startswith("iop gateway listening on http://[::1]:"), line
        finally:
            proc.terminate()
            proc.wait(TIMEOUT_S)


def test_a_user_name_holding_a_newline_or_an_escape_cannot_forge_a_line_of_the_audit(redis_url: str) -> None:
    # (`who` came from $USER and was printed raw: a newline added an audit line nobody wrote)
    forged = "eve\n2026-01-01 00:00:00  cli:root  drain  provider sglang-b  \x1b[2J"
    done = iop("provider", "drain", "vllm-a", "--config", DEMO, "--redis", redis_url,
               env={**os.environ, "USER": forged, "LOGNAME": forged})
    assert done.returncode == 0, done.stderr
    shown = iop("audit", "--redis", redis_url)
    assert shown.returncode == 0, shown.stderr
    header, *entries = shown.stdout.strip().splitlines()
    assert header.startswith("TIME") and len(entries) == 1, shown.stdout
    assert "cli:eve\\u000a2026-01-01" in entries[0] and "\\u001b[2J" in entries[0], entries
    assert "\x1b" not in shown.stdout


def test_the_commands_that_read_no_config_take_the_pair_the_others_take(redis_url: str) -> None:
    """`iop dev` prints `--config F --redis R` to add to every command; `iop audit` and `iop runs
    show` refused the `--config` (argparse's exit 2)."""
    pair = ("--config", DEMO, "--redis", redis_url)
    shown = iop("audit", *pair)
    assert shown.returncode == 0 and shown.stdout.strip() == "no operator changes recorded", shown.stderr
    shown = iop("runs", "show", "run_nosuchrun", *pair)
    assert shown.returncode != 2 and "unrecognized arguments" not in shown.stderr, shown.stderr
    assert "run_nosuchrun" in shown.stderr + shown.stdout


@pytest.fixture
def not_redis() -> Iterator[str]:
    """A server on a port of its own that answers every command with an HTML page (an HTTP server
    where Redis was meant to be)."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                try:
                    if conn.recv(65536):
                        conn.sendall(b"<html><body>Bad request</body></html>\r\n")
                        conn.recv(65536)  # (until the client closes)
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
    stop.set()
    thread.join(timeout=10)
    listener.close()


@pytest.fixture
def refusing_user(redis_url: str) -> Iterator[str]:
    """The test's Redis, as an ACL user that may connect but run none of the commands iop sends."""
    import redis as sync_redis

    user = "iop-may-not"
    admin = sync_redis.Redis.from_url(redis_url)
    admin.execute_command("ACL", "SETUSER", user, "on", ">pw", "~*", "&*", "-@all", "+auth", "+select", "+client",
                          "+ping", "+hello")
    try:
        yield redis_url.replace("redis://", f"redis://{user}:pw@")
    finally:
        admin.execute_command("ACL", "DELUSER", user)
        admin.close()


@pytest.mark.parametrize("server", ["not_redis", "refusing_user"])
@pytest.mark.parametrize("args", REDIS_COMMANDS[:7], ids=lambda args: " ".join(a for a in args if a != DEMO))
def test_an_error_redis_answers_stops_an_operator_command_with_one_line(
        args: list[str], server: str, request: pytest.FixtureRequest) -> None:
    # (a server that is not Redis, or a user without the right to a command, ended in a traceback)
    url: str = request.getfixturevalue(server)
    done = iop(*args, "--redis", url)
    line = one_line(done)
    assert done.returncode == 1 and line.startswith("error: Redis at "), line
    assert "pw@" not in line, line
    assert ("Protocol error" in line) if server == "not_redis" else ("no permissions" in line), line


def test_an_empty_iop_config_is_as_if_it_were_not_set(redis_url: str) -> None:
    # (an empty $IOP_CONFIG, as compose's `${IOP_CONFIG:-}` gives, said "error: : cannot read: Is a directory")
    done = iop("queues", "--redis", redis_url, env={**os.environ, "IOP_CONFIG": ""})
    assert one_line(done) == "error: iop.yaml: cannot read: No such file or directory"


@pytest.mark.parametrize("command", ["catalog", "queues"])
def test_a_catalog_read_from_a_redis_no_worker_beats_in_says_that_redis_may_not_be_the_pool_s(
        command: str, redis_url: str) -> None:
    # `iop catalog --config pool.yaml` without the `--redis` that `iop dev` printed reads another
    # Redis: every provider `unknown`, every queue empty, and nothing said the address was wrong
    done = iop(command, "--config", DEMO, "--redis", redis_url)
    assert done.returncode == 0, done.stderr
    assert "--redis is not the pool's" in done.stderr and redis_url.split("//")[1] in done.stderr, done.stderr


def test_iop_version_prints_the_installed_version() -> None:
    """`iop --version`, which a new user's review looked for (and an operator's bug report wants)."""
    import tomllib

    declared = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["version"]
    done = subprocess.run([sys.executable, "-m", "iop", "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == f"iop {declared}\n", (done.stdout, done.stderr)


@pytest.mark.parametrize("given", [["--for", "-5m"], ["--for=-5m"]])
def test_a_duration_typed_with_a_leading_dash_is_told_what_is_wrong_with_it(given: list[str], redis_url: str) -> None:
    """`--for -5m` got argparse's "argument --for: expected one argument" (a value starting with `-`
    reads as an option to it), which says nothing of the duration; `--for=-5m` got the duration's own
    message. Both get that one now, and nothing is written."""
    done = iop("provider", "capacity", "vllm-a", "1", *given, "--config", DEMO, "--redis", redis_url)
    assert done.returncode == 2
    assert one_line(done) == "error: --for: '-5m' is not a duration such as 90s, 30m, 2h, 7d or 1h30m"
    r = sync_redis.Redis.from_url(redis_url)
    try:
        assert r.exists("iop:capacity:vllm-a") == 0
    finally:
        r.close()


def test_an_option_after_for_is_still_an_option() -> None:
    """Only a value that is not an option is joined to `--for`: `--for --json` stays argparse's error."""
    done = iop("provider", "capacity", "vllm-a", "1", "--for", "--json", "--config", DEMO)
    assert done.returncode == 2 and "argument --for: expected one argument" in done.stderr, done.stderr
