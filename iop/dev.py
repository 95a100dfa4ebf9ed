"""`iop dev`: the whole stack in one command, on a fresh machine.

An embedded Redis (no persistence, in a temp dir), then, as child processes: for the
demo config one `iop simulator` per local provider, the gateway, one scheduler and one
worker per node. Each child is waited for by its "ready" line on stdout, its output is
forwarded prefixed with its name, and once the gateway answers /readyz and a provider
heartbeat is in Redis a banner tells how to use it. Ctrl-C or SIGTERM stops everything
in reverse start order; a child dying on its own stops everything with exit status 1.
"""

from __future__ import annotations

import json
import os
import re
import select
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn, TypeVar
from urllib.parse import urlsplit

from common import keys
from common.auth import ApiKeyConfig, KeyRing, UnresolvedKeys
from common.config import Config, ConfigError, load_config
from common.shown import near_name
from iop.config_cmd import fault_lines
from iop.embedded_redis import RedisServer

T = TypeVar("T")

DEMO_CONFIG = Path(__file__).resolve().parents[1] / "examples" / "demo.yaml"
LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost"})
SIM_LATENCY = ("--ttft-ms", "150", "--itl-ms", "20", "--tokens", "24")
START_TIMEOUT_S = 30.0  # per child, from spawn to its ready line
READY_TIMEOUT_S = 30.0  # gateway /readyz and the first provider heartbeat
STOP_TIMEOUT_S = 15.0  # per shutdown stage, then SIGKILL (workers give runs 10 s)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

LISTENING = r"listening on (http://[^\s\"]+)"  # (not the \" that ends a JSON log line: IOP_LOG_FORMAT=json)
SCHEDULER_READY = r"iop scheduler \S+ running"

_print_lock = threading.Lock()


def say(text: str, *, err: bool = False) -> None:
    """Print whole lines, never interleaved with the children's forwarded output."""
    with _print_lock:
        print(text, file=sys.stderr if err else sys.stdout, flush=True)


class DevError(Exception):
    """The stack could not start or a child died: the message says which and why."""


class Interrupted(Exception):
    """A stop signal arrived."""


def exit_status(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exit status {code}"


Spec = tuple[str, int, Sequence[str], str]  # name, shutdown stage, `iop` arguments, ready-line regex


@dataclass
class Child:
    name: str
    stage: int  # shutdown goes from the highest stage down
    popen: subprocess.Popen[str]
    ready: re.Pattern[str]
    match: re.Match[str] | None = None
    reader: threading.Thread | None = None

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None


@dataclass
class Supervisor:
    """Starts children, waits on them without fixed sleeps, and stops them all."""

    env: dict[str, str] = field(default_factory=dict)
    children: list[Child] = field(default_factory=list)
    signals: int = 0
    _wake: tuple[int, int] = field(default_factory=os.pipe)
    _closed: bool = False

    def __post_init__(self) -> None:
        for fd in self._wake:
            os.set_blocking(fd, False)

    # -- waking up: signal handlers and reader threads write a byte to a pipe

    def wake(self) -> None:
        if self._closed:
            return
        try:
            os.write(self._wake[1], b".")
        except OSError:  # pipe full (already awake) or closed (shutting down)
            pass

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signals += 1
        self.wake()

    def pause(self, timeout: float) -> None:
        """Block until woken (signal, child output or exit) or `timeout` passes."""
        ready, _, _ = select.select([self._wake[0]], [], [], max(timeout, 0.0))
        if ready:
            try:
                os.read(self._wake[0], 4096)
            except BlockingIOError:
                pass

    def close(self) -> None:
        self._closed = True
        for fd in self._wake:
            os.close(fd)

    # -- starting

    def spawn(self, name: str, stage: int, args: Sequence[str], ready: str) -> Child:
        popen = subprocess.Popen(
            # -P: not the working directory first on sys.path, where a project's own `common.py`
            # (or `gateway/`, `workers/`, `scheduler/`) would take the place of iop's package
            [sys.executable, "-P", "-m", "iop", *args], env=self.env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1,
            process_group=0,  # Ctrl-C reaches only us; we stop the children in order
        )
        child = Child(name, stage, popen, re.compile(ready))
        self.children.append(child)
        child.reader = threading.Thread(target=self._forward, args=(child,), name=f"out {name}", daemon=True)
        child.reader.start()
        return child

    def _forward(self, child: Child) -> None:
        assert child.popen.stdout is not None
        for line in child.popen.stdout:
            say(f"[{child.name}] {line.rstrip()}")
            if child.match is None and (m := child.ready.search(line)):
                child.match = m
                self.wake()
        child.popen.wait()  # EOF comes a moment before the exit status: wake once it is known
        self.wake()

    def start(self, *specs: Spec) -> list[re.Match[str]]:
        """Spawn the children together, then wait for each one's ready line."""
        children = [self.spawn(*spec) for spec in specs]
        return [self.wait_started(child) for child in children]

    def wait_started(self, child: Child) -> re.Match[str]:
        return self.wait_for(lambda: child.match, f"{child.name} to start", START_TIMEOUT_S)

    # -- waiting

    def check(self) -> None:
        """Raise if a stop signal arrived or a child has exited."""
        if self.signals:
            raise Interrupted
        for child in self.children:
            code = child.popen.poll()
            if code is not None:
                raise DevError(f"{child.name} exited unexpectedly ({exit_status(code)})")

    def poll(self, probe: Callable[[], T | None], timeout: float, every: float = 1.0) -> T | None:
        """Call `probe` until it returns a value, waking on any event or every `every` s; None
        once `timeout` s passed without one."""
        deadline = time.monotonic() + timeout
        while True:
            self.check()
            value = probe()
            if value:
                return value
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.pause(min(left, every))

    def wait_for(self, probe: Callable[[], T | None], what: str, timeout: float, every: float = 1.0) -> T:
        """`poll`, which must get a value."""
        value = self.poll(probe, timeout, every)
        if value is None:
            raise DevError(f"timed out after {timeout:.0f}s waiting for {what}")
        return value

    def run_until_stopped(self) -> NoReturn:
        while True:
            self.check()
            self.pause(5.0)  # woken at once by signals and child exits; this is a safety net

    # -- stopping

    def stop_all(self) -> None:
        """SIGTERM the children stage by stage in reverse start order; SIGKILL stragglers."""
        for stage in sorted({c.stage for c in self.children}, reverse=True):
            group = [c for c in reversed(self.children) if c.stage == stage]
            for child in group:
                if child.alive:
                    child.popen.send_signal(signal.SIGTERM)
            self._reap(group)
        for child in self.children:
            if child.reader is not None:
                child.reader.join(timeout=2.0)
            if child.popen.stdout is not None:
                child.popen.stdout.close()

    def _reap(self, group: list[Child]) -> None:
        deadline = time.monotonic() + STOP_TIMEOUT_S
        forced = self.signals
        while any(c.alive for c in group):
            if time.monotonic() > deadline or self.signals > forced:
                for child in group:
                    if child.alive:
                        say(f"iop dev: killing {child.name}", err=True)
                        child.popen.kill()
                for child in group:
                    child.popen.wait()
                return
            self.pause(0.05)  # children write a byte at EOF; this only bounds a missed wake-up


# --------------------------------------------------------------------------- config


def read_config(path: Path) -> Config | None:
    """The config, or None once every fault is said: its own, and keys held in environment
    variables that are not set (the gateway would refuse to start without them)."""
    try:
        config = load_config(path)
        if config.auth is not None:
            KeyRing.from_config(config.auth, os.environ)
        return config
    except (ConfigError, UnresolvedKeys) as exc:
        for line in fault_lines(path, exc.errors, always_count=False):
            say(line, err=True)
        return None


@dataclass(frozen=True)
class SimSpec:
    provider: str
    host: str
    port: int
    models: tuple[str, ...]


def simulators(config: Config) -> list[SimSpec]:
    """One simulator per provider whose base_url points at this machine."""
    specs = []
    for node in config.nodes:
        for provider in node.providers:
            url = urlsplit(provider.base_url or "")
            if url.hostname in LOCAL_HOSTS:
                port = url.port or (443 if url.scheme == "https" else 80)
                specs.append(SimSpec(provider.id, "127.0.0.1", port, tuple(provider.models)))
    return specs


def ensure_port_free(host: str, port: int, what: str) -> None:
    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except (OSError, OverflowError) as exc:  # OverflowError: a port beyond 0..65535
            reason = (exc.strerror if isinstance(exc, OSError) else None) or exc
            raise DevError(f"cannot use {host}:{port} for {what}: {reason} "
                           "(is another `iop dev` running?)") from None


# --------------------------------------------------------------------------- readiness


def client_host(host: str) -> str:
    """Where a client on this machine reaches a server bound to `host`."""
    if host in ("", "0.0.0.0", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


_no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_ok(url: str) -> bool:
    try:
        with _no_proxy.open(url, timeout=1.0) as resp:
            return int(resp.status) == 200
    except OSError:
        return False


def wait_heartbeat(sup: Supervisor, redis_url: str, provider_ids: list[str]) -> None:
    import redis

    client: Any = redis.Redis.from_url(redis_url, socket_timeout=1.0)
    names = [keys.heartbeat(p) for p in provider_ids]

    def published() -> bool:
        try:
            return bool(client.exists(*names))
        except redis.RedisError:
            return False

    try:
        sup.wait_for(published, "a provider heartbeat", READY_TIMEOUT_S, every=0.05)
    finally:
        client.close()


def first_health(sup: Supervisor, redis_url: str, config: Config) -> dict[str, str]:
    """Each provider's health once its first probe has said (each is probed at once when its
    worker starts), waited for at most a probe's time: {provider: why it takes no runs} for
    those that are not `available` then, in config order."""
    import redis

    client: Any = redis.Redis.from_url(redis_url, socket_timeout=1.0)
    providers = [p for n in config.nodes for p in n.providers]
    limit_s = min(10.0, max(p.probe_timeout_ms for p in providers) * 2 / 1000 + 1.0)
    seen: dict[str, tuple[str, str]] = {}

    def said() -> bool:
        try:
            for p in providers:
                health, reason = (v.decode(errors="replace") if v else "" for v in
                                  client.hmget(keys.heartbeat(p.id), "health", "reason"))
                seen[p.id] = (health, reason)
        except redis.RedisError:
            return False
        return not [h for h, why in seen.values() if not h or (h == "unknown" and why == "not probed yet")]

    try:
        sup.poll(said, limit_s, every=0.05)  # (a probe slower than that: said as it stands)
    finally:
        client.close()
    return {pid: f"{health or 'unknown'}: {reason or 'no heartbeat yet'}"
            for pid, (health, reason) in seen.items() if health != "available"}


def unlisted(redis_url: str, config: Config) -> dict[str, str]:
    """{provider: the served names it does not list, and of which models} for the providers that
    answer their probes but whose own model list lacks a served name the config gives them (a
    typo there, or a model the server does not have): none of that model's runs go there, and
    a model served only there is refused with a 503. Read as the catalog reads it, in config order."""
    import asyncio

    from common.catalog import read_catalog
    from common.redisconn import REDIS_DOWN, connect, now_ms

    async def read() -> dict[str, list[str]]:
        client = connect(redis_url)
        try:
            catalog = await read_catalog(client, config, now_ms())
        finally:
            await client.aclose()
        listed = {p.id: p.models.observed or [] for p in catalog.providers}
        missing: dict[str, list[str]] = {}
        for m in catalog.models:
            for pl in m.providers:
                if pl.reason == "model_not_listed":
                    near = near_name(pl.target, listed.get(pl.provider_id, []))
                    hint = "" if near is None else f"; it lists {near!r}"
                    missing.setdefault(pl.provider_id, []).append(f"{pl.target!r} (model {m.id}{hint})")
        return missing

    try:
        missing = asyncio.run(read())
    except REDIS_DOWN:
        return {}
    return {p.id: "its model list lacks " + ", ".join(missing[p.id])
            for n in config.nodes for p in n.providers if p.id in missing}


def try_key(config: Config) -> tuple[int, ApiKeyConfig, str] | None:
    """For the banner's example: the key to show (its index in auth.keys, the key, a model it may
    use), or None when the config has no keys (the gateway then takes any). A key held in an
    environment variable first: its curl line works as printed where that variable is set."""
    if config.auth is None:
        return None
    found: list[tuple[int, ApiKeyConfig, str]] = []
    for i, key in enumerate(config.auth.keys):
        model = next((m.id for m in config.models if key.models is None or m.id in key.models), None)
        if model is not None:
            found.append((i, key, model))
    found.sort(key=lambda item: item[1].env is None)  # stable: config order otherwise
    return found[0] if found else None


def banner(config: Config, base: str, redis_url: str, path: Path, down: dict[str, str] | None = None,
           lacking: dict[str, str] | None = None) -> str:
    """What `iop dev` prints once the stack is ready: where it listens, a curl line to try it, and
    the `iop` command line that operates it (its config and Redis: the commands' defaults,
    `iop.yaml` and Redis on 6379, are not this stack's); and the providers that take no runs
    (`down`: provider -> why) or no runs of a model whose served name its model list lacks
    (`lacking`: provider -> which), so that a first request's 503 is no surprise."""
    model = config.models[0].id
    keyed = try_key(config)
    access = "(any API key)"
    key_lines: list[str] = []
    auth_header = ""
    if config.auth is not None:
        access = "(an API key of the config's auth.keys; no other is accepted)"
        auth_header = ' -H "Authorization: Bearer $KEY"'
        if keyed is None:
            key_lines = ["    # no key of auth.keys may use any model of the config"]
        else:
            i, key, model = keyed
            where = f"key {key.name!r} (auth.keys[{i}])"
            if key.env is not None:
                key_lines = [f'    KEY="${key.env}"   # {where}, from the environment variable {key.env}']
            else:
                key_lines = [f"    KEY=...   # the key {key.name!r} (auth.keys[{i}]) itself: "
                             "the config holds only its hash"]
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}]})
    curl = (f"curl {base}/chat/completions -H 'Content-Type: application/json'{auth_header} "
            f"-d {shlex.quote(body)}")
    models = ", ".join(m.id for m in config.models)
    providers = sum(len(n.providers) for n in config.nodes)
    rule = "-" * 72
    return "\n".join([
        rule,
        f"iop dev is ready: {len(config.models)} models ({models}), "
        f"{providers} providers on {len(config.nodes)} nodes",
        f"  OpenAI-compatible API: {base}   {access}",
        f"  Redis:                 {redis_url}",
        f"  Catalog page:          {base.removesuffix('/v1')}/catalog"
        + (" (an operator key)" if config.auth is not None else ""),
        "  Try it:",
        *key_lines,
        f"    {curl}",
        "  Operate it (iop queues, iop provider drain ... take the same options):",
        f"    iop catalog --config {shlex.quote(str(path))} --redis {redis_url}",
        *([f"  Not taking runs now ({len(down)} of {providers} providers; probed again every few seconds, "
           "iop catalog shows when they are back):"] if down else []),
        *(f"    {pid}: {why}" for pid, why in (down or {}).items()),
        *(["  Taking no runs of a model its server does not list (check the served name, or the server's models):"]
          if lacking else []),
        *(f"    {pid}: {which}" for pid, which in (lacking or {}).items()),
        "  Ctrl-C stops everything.",
        rule,
    ])


# --------------------------------------------------------------------------- the stack


def simulator_spec(sim: SimSpec) -> Spec:
    args = ["simulator", "--host", sim.host, "--port", str(sim.port), "--models", ",".join(sim.models)]
    return (f"simulator {sim.provider}", 0, [*args, *SIM_LATENCY], LISTENING)


def start_stack(sup: Supervisor, config: Config, demo: bool, host: str, port: int) -> str:
    """Start every child in order; return the gateway's client base URL (…/v1)."""
    ensure_port_free(host, port, "the gateway")
    sims = simulators(config) if demo else []
    for sim in sims:
        ensure_port_free(sim.host, sim.port, f"the simulator of provider {sim.provider}")
    sup.start(*(simulator_spec(sim) for sim in sims))
    listening, *_ = sup.start(
        ("gateway", 1, ["gateway", "--host", host, "--port", str(port)], LISTENING),
        ("scheduler", 2, ["scheduler"], SCHEDULER_READY),
        # a short grace: Ctrl-C on a dev stack should not wait out long demo streams
        *((f"worker {node.id}", 3, ["worker", "--node", node.id, "--grace", "2"],
           rf"iop worker for node {re.escape(node.id)} running") for node in config.nodes),
    )
    bound = urlsplit(listening.group(1)).port or port
    return f"http://{client_host(host)}:{bound}"


def wait_ready(sup: Supervisor, config: Config, root: str, redis_url: str) -> None:
    sup.wait_for(lambda: http_ok(f"{root}/readyz"), "the gateway's /readyz", READY_TIMEOUT_S, every=0.05)
    provider_ids = [p.id for n in config.nodes for p in n.providers]
    if provider_ids:
        wait_heartbeat(sup, redis_url, provider_ids)


def serve(sup: Supervisor, config: Config, path: Path, demo: bool, host: str, port: int, redis_url: str) -> int:
    try:
        root = start_stack(sup, config, demo, host, port)
        wait_ready(sup, config, root, redis_url)
        down = first_health(sup, redis_url, config) if any(n.providers for n in config.nodes) else {}
        say(banner(config, f"{root}/v1", redis_url, path, down, unlisted(redis_url, config)))
        sup.run_until_stopped()
    except Interrupted:
        say("iop dev: stopping...")
        return 0
    except DevError as exc:
        say(f"iop dev: {exc}; stopping everything", err=True)
        return 1


@contextmanager
def signals_to(sup: Supervisor) -> Iterator[None]:
    previous = {sig: signal.signal(sig, sup.on_signal) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


#: the directory that holds the `iop` package this process runs (a checkout run without an install
#: too): the children, started without the working directory on their path, import the same code
CODE_ROOT = str(Path(__file__).resolve().parents[1])


def _installed_root() -> bool:
    """Whether CODE_ROOT is a site-packages directory, on every child's path already (put on
    PYTHONPATH it would come before the standard library)."""
    import site

    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    return any(Path(d).resolve() == Path(CODE_ROOT) for d in dirs)


def child_env(config_path: Path, redis_url: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"IOP_CONFIG": str(config_path), "REDIS_URL": redis_url, "PYTHONUNBUFFERED": "1"})
    if not _installed_root():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (CODE_ROOT, env.get("PYTHONPATH")) if p)
    return env


@contextmanager
def terminal_signals_blocked() -> Iterator[None]:
    """Children spawned inside inherit a mask blocking SIGINT/SIGHUP, so a Ctrl-C sent by the
    terminal to our whole process group does not reach them; we stop them ourselves, in order.
    (RedisServer does not start its server in a process group of its own.)"""
    blocked = {signal.SIGINT, signal.SIGHUP}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def start_redis() -> RedisServer | None:
    try:
        server = RedisServer()
    except FileNotFoundError as exc:
        say(f"iop dev: {exc}", err=True)
        return None
    try:
        with terminal_signals_blocked():
            return server.start()
    except (OSError, RuntimeError) as exc:  # TimeoutError is an OSError
        say(f"iop dev: cannot start Redis ({server.binary}): {exc}", err=True)
        server.cleanup()
        return None


def run_dev(config_path: str | None, host: str, port: int) -> int:
    path = Path(config_path).resolve() if config_path else DEMO_CONFIG
    config = read_config(path)
    if config is None:
        return 2
    if config.auth is None:
        from gateway.auth import is_loopback

        if not is_loopback(host):  # (the gateway would refuse to start, suggesting a flag iop dev does not have)
            say(f"error: iop dev refuses to serve anyone who can reach {host} without API keys: add auth.keys to "
                "the config, or serve on loopback only (--host 127.0.0.1, the default)", err=True)
            return 2
    say(f"iop dev: config {path}")
    sup = Supervisor()
    try:
        with signals_to(sup):
            redis = start_redis()
            if redis is None:
                return 1
            sup.env = child_env(path, redis.url)
            try:
                return serve(sup, config, path, config_path is None, host, port, redis.url)
            finally:
                sup.stop_all()
                redis.cleanup()
                say("iop dev: stopped")
    finally:
        sup.close()
