"""compose.yaml without a Docker engine: it parses, every service runs a valid `iop` command,
the mounted config validates and is the demo pool, healthchecks probe /healthz and /readyz;
and the same service commands, run as local processes (two workers for node gpu-1, the
scheduler's two replicas), serve traffic from the openai client."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import openai
import pytest
import yaml

from common.auth import new_key
from common.config import load_config
from iop.cli import build_parser
from tests.conftest import ROOT, Proc, Stack, wait_until
from tests.test_e2e import wait_available

COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
IOP_SERVICES = {name: svc for name, svc in SERVICES.items() if svc.get("command", [""])[0] == "iop"}
# (compose's IOP_LOG_FORMAT=json makes the iop services' ready lines JSON: a URL ends at a quote)
READY_LINE = {"gateway": r"listening on (http://[^\s\"]+)", "simulator": r"listening on (http://\S+)",
              "scheduler": r"iop scheduler \S+ running", "worker": r"worker for queue \S+ started"}


def mounted_config() -> tuple[Path, str]:
    """(the repo file compose mounts as the config, where it is mounted)."""
    svc = SERVICES["gateway"]
    for volume in svc["volumes"]:
        source, target, *_ = volume.split(":")
        if target == svc["environment"]["IOP_CONFIG"]:
            return ROOT / source, target
    raise AssertionError("the gateway mounts no config at $IOP_CONFIG")


def option(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


def test_compose_has_redis_gateway_two_schedulers_a_worker_per_node_and_a_simulator_per_provider() -> None:
    config = load_config(mounted_config()[0])
    nodes = {f"worker-{n.id}" for n in config.nodes}
    hosts = {urlsplit(p.base_url or "").hostname for n in config.nodes for p in n.providers}
    assert set(SERVICES) == {"redis", "gateway", "scheduler"} | nodes | hosts
    assert SERVICES["scheduler"]["deploy"]["replicas"] == 2
    for node in config.nodes:
        svc = SERVICES[f"worker-{node.id}"]
        assert option(svc["command"], "--node") == node.id
        # Scalable with --scale: nothing that must be unique per container.
        assert "ports" not in svc and "container_name" not in svc
    # an init process reaps what an iop service leaves (a cli tool's children piled up as zombies of
    # a worker running as PID 1: a hostile tool)
    assert all(SERVICES[name].get("init") is True for name in ("gateway", "scheduler", *nodes))
    for node in config.nodes:
        for provider in node.providers:
            host = urlsplit(provider.base_url or "").hostname
            models = option(SERVICES[str(host)]["command"], "--models")
            assert models is not None and set(provider.models) <= set(models.split(","))


def test_every_service_command_is_a_valid_iop_invocation() -> None:
    parser = build_parser()
    assert set(IOP_SERVICES) == set(SERVICES) - {"redis"}
    for name, svc in IOP_SERVICES.items():
        args = parser.parse_args(svc["command"][1:])
        assert args.command in READY_LINE, name


def test_the_mounted_config_exists_validates_and_is_the_demo_pool_with_compose_hostnames() -> None:
    source, target = mounted_config()
    for svc in IOP_SERVICES.values():
        if "environment" in svc:
            assert f"./{source.relative_to(ROOT)}:{target}:ro" in svc["volumes"]
    compose_pool = yaml.safe_load(source.read_text())
    # its one difference: keys, read from the gateway's environment, which compose fills from .env
    assert compose_pool.pop("auth") == {"keys": [{"name": "operator", "env": "IOP_OPERATOR_KEY", "role": "operator"},
                                                 {"name": "caller", "env": "IOP_CALLER_KEY"}]}
    gateway_env = SERVICES["gateway"]["environment"]
    for var in ("IOP_OPERATOR_KEY", "IOP_CALLER_KEY"):
        assert gateway_env[var] == f"${{{var}:?set {var} in .env (see .env.example)}}"
        assert re.search(rf"^{var}=$", (ROOT / ".env.example").read_text(), flags=re.M)
    demo = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
    for pool in (compose_pool, demo):
        for node in pool["nodes"]:
            for provider in node["providers"]:
                provider["base_url"] = urlsplit(provider["base_url"]).path
    assert compose_pool == demo
    load_config(source)


def test_healthchecks_probe_healthz_and_readyz_on_the_port_the_service_listens_on() -> None:
    for name, svc in IOP_SERVICES.items():
        command, probe = svc["command"], svc["healthcheck"]["test"]
        assert probe[:2] == ["CMD", "http-ok"], name  # docker/http-ok: bash, no Python start-up
        port, paths = probe[2], probe[3:]
        if command[1] == "simulator":
            assert (port, paths) == (option(command, "--port"), ["/health"]), name
            continue
        assert port == option(command, "--port" if command[1] == "gateway" else "--metrics-port"), name
        assert paths == ["/healthz", "/readyz"], name


def test_the_dockerfile_installs_every_package_the_services_import_and_the_healthcheck() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    for package in ("common", "gateway", "scheduler", "workers", "iop"):
        assert re.search(rf"^COPY {package} \./{package}$", dockerfile, flags=re.M), package
    assert re.search(r"^RUN pip install --no-deps \.", dockerfile, flags=re.M)
    assert re.search(r"^COPY docker/http-ok /usr/local/bin/http-ok$", dockerfile, flags=re.M)


# ------------------------------------------------------------------ the services as processes


def local_command(command: list[str]) -> list[str]:
    """The service's command on this machine: any free port, loopback addresses."""
    out = list(command[1:])
    for flag in ("--port", "--metrics-port"):
        if flag in out:
            out[out.index(flag) + 1] = "0"
    for flag in ("--host", "--metrics-host"):
        if flag in out:
            out[out.index(flag) + 1] = "127.0.0.1"
    if "--metrics-port" in out and "--metrics-host" not in out:
        out += ["--metrics-host", "127.0.0.1"]
    return out


#: What a user's .env gives compose (.env.example).
DOTENV = {"IOP_OPERATOR_KEY": new_key(), "IOP_CALLER_KEY": new_key()}


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's `${VAR}`, `${VAR:-default}` and `${VAR:?error}` in one value."""
    def one(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2) or "", m.group(3) or ""
        if env.get(name):
            return env[name]
        if op == ":?":
            raise AssertionError(f"compose would refuse to start: {arg}")
        return arg

    return re.sub(r"\$\{(\w+)(?:(:[-?])([^}]*))?\}", one, value)


class ComposeStack:
    """Runs compose services as local processes, with compose's environment rewritten."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.metrics: dict[str, list[str]] = {}

    def run(self, service: str, replica: int = 0) -> Proc:
        svc = SERVICES[service]
        env = self.stack.env()
        env.update({k: interpolate(str(v), DOTENV) for k, v in svc.get("environment", {}).items()})
        env.update({"IOP_CONFIG": str(self.stack.config_path), "REDIS_URL": self.stack.redis_url})
        proc = Proc(f"{service}.{replica}", local_command(svc["command"]), env)
        self.stack.procs.append(proc)
        proc.wait_for_line(READY_LINE[svc["command"][1]])
        if "--metrics-port" in svc["command"]:
            self.metrics.setdefault(service, []).append(proc.wait_for_line(r"metrics on (http://[^\s\"]+)").group(1))
        return proc


@pytest.mark.e2e
def test_the_compose_services_serve_traffic_as_local_processes(stack: Stack) -> None:
    compose = ComposeStack(stack)
    pool = yaml.safe_load(mounted_config()[0].read_text())
    for node in pool["nodes"]:
        for provider in node["providers"]:
            url = urlsplit(provider["base_url"])
            sim = compose.run(str(url.hostname)).wait_for_line(READY_LINE["simulator"]).group(1)
            provider["base_url"] = urlunsplit(urlsplit(sim)._replace(path=url.path))
    pool["runtime"] = {"heartbeat_interval_ms": 200, "heartbeat_ttl_ms": 1000, "probe_interval_ms": 200}
    stack.write_config(pool)

    procs = [compose.run("scheduler", i) for i in range(SERVICES["scheduler"]["deploy"]["replicas"])]
    procs += [compose.run("worker-gpu-1", 0), compose.run("worker-gpu-1", 1), compose.run("worker-gpu-2")]
    procs.append(compose.run("gateway"))
    gateway = procs[-1].wait_for_line(READY_LINE["gateway"]).group(1)
    wait_available(stack.redis_url, [p["id"] for n in pool["nodes"] for p in n["providers"]])

    models = [m["id"] for m in pool["models"]]
    client = openai.AsyncOpenAI(base_url=gateway + "/v1", api_key=DOTENV["IOP_CALLER_KEY"], max_retries=0)

    async def one(i: int) -> tuple[str, str]:
        model = models[i % len(models)]
        messages: Any = [{"role": "user", "content": f"hello {i}"}]
        if i % 2:
            chunks = [c async for c in await client.chat.completions.create(
                model=model, messages=messages, max_tokens=3, stream=True)]
            assert all(c.model == model for c in chunks)
            return model, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reply = await client.chat.completions.create(model=model, messages=messages, max_tokens=3)
        assert reply.model == model
        return model, reply.choices[0].message.content or ""

    async def scenario() -> None:
        results = await asyncio.gather(*(one(i) for i in range(16)))
        assert all(text.split() == ["tok0", "tok1", "tok2"] for _, text in results)
        assert {model for model, _ in results} == set(models)
        await client.close()
        async with aiohttp.ClientSession() as session:
            urls = [gateway + "/readyz"] + [u.removesuffix("/metrics") + "/readyz"
                                            for us in compose.metrics.values() for u in us]
            assert len(urls) == 1 + 2 + 3  # the gateway, two schedulers, three workers
            for url in urls:
                async with session.get(url) as resp:
                    assert resp.status == 200, url
            completed = 0.0
            for url in compose.metrics["worker-gpu-1"] + compose.metrics["worker-gpu-2"]:
                async with session.get(url) as resp:
                    text = await resp.text()
                completed += sum(float(v) for v in re.findall(
                    r'^iop_worker_runs_total\{[^}]*outcome="completed"[^}]*\} (\S+)$', text, flags=re.M))
            assert completed == 16

    asyncio.run(scenario())
    # at least the scheduler's dispatch line of every run (a service's last lines may come 20 ms late)
    wait_until(lambda: run_log_lines(procs) >= 16, timeout=10, what="a log line about each run")
    # The containers' healthcheck command, against the same processes.
    ports = [urlsplit(gateway).port] + [urlsplit(u).port for us in compose.metrics.values() for u in us]
    for port in ports:
        assert http_ok(port, "/healthz", "/readyz") == 0, port
    assert http_ok(ports[0], "/healthz", "/no-such-path") == 1


def http_ok(port: int | None, *paths: str) -> int:
    """Exit status of docker/http-ok, the healthcheck compose.yaml runs in the containers."""
    return subprocess.run([str(ROOT / "docker" / "http-ok"), str(port), *paths],
                          capture_output=True, timeout=10).returncode


def run_log_lines(procs: list[Proc]) -> int:
    """compose sets IOP_LOG_FORMAT=json: every line of an iop service, its ready lines on stdout
    included, is JSON, and each about a run has its fields. Returns how many lines are about a run."""
    about_runs = 0
    for proc in procs:
        for line in proc.lines:
            record = json.loads(line)
            if re.search(r"run_[0-9a-f]{32}", line):
                about_runs += 1
                assert re.fullmatch(r"run_[0-9a-f]{32}", record.get("run", "")), line
                assert record.get("model") not in (None, "-"), line
    return about_runs



def test_compose_redis_keeps_runs_across_a_restart() -> None:
    redis = SERVICES["redis"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert any(str(v).endswith(":/data") for v in redis["volumes"])


def test_redis_caps_its_memory_and_never_evicts_run_state() -> None:
    command = SERVICES["redis"]["command"]
    assert option(command, "--maxmemory-policy") == "noeviction"
    assert interpolate(option(command, "--maxmemory") or "", {}) == "1gb"
    assert option(command, "--appendonly") == "yes"
