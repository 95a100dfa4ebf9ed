"""A Redis primary, a replica and three sentinels as real processes, all from the one Redis binary
the tests use (`redis-server --sentinel`), for the failover tests.

Each server and sentinel gets a free port and a directory of its own (a sentinel rewrites its
config file). Nothing is persisted: a failover keeps only what reached the replica.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis as sync_redis

from iop.embedded_redis import find_server_binary, free_port

MASTER = "mymaster"
#: A primary silent this long is down for a sentinel; a failover gives up after this long.
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 3000
#: The name of the tests' own connections to the servers (`CLIENT LIST` tells them from iop's).
TESTS_CLIENT = "iop-tests"


def poll(predicate: Callable[[], Any], timeout: float, what: str, every: float = 0.05) -> Any:
    """Call `predicate` until it returns something truthy (errors count as not yet), with a deadline."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except (sync_redis.RedisError, OSError) as exc:
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}" + (f" (last error: {last})" if last else ""))
        time.sleep(every)


@dataclass
class SentinelCluster:
    """primary, replica and `sentinels` sentinels on 127.0.0.1, quorum 2."""

    sentinels: int = 3
    binary: str = field(default_factory=find_server_binary)
    dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="iop-sentinel-")))
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)

    @property
    def sentinel_names(self) -> list[str]:
        return [f"sentinel-{i}" for i in range(1, self.sentinels + 1)]

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{self.ports[name]}" for name in self.sentinel_names)
        return f"redis+sentinel://{hosts}/{MASTER}/0"

    # ------------------------------------------------------------------ processes
    def _spawn(self, name: str, args: list[str]) -> None:
        where = self.dir / name
        where.mkdir(exist_ok=True)
        log = (where / "out.log").open("wb")
        self.procs[name] = subprocess.Popen(args, cwd=where, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def _server(self, name: str, *extra: str) -> None:
        self.ports[name] = free_port()
        self._spawn(name, [self.binary, "--port", str(self.ports[name]), "--bind", "127.0.0.1",
                           "--save", "", "--appendonly", "no", "--protected-mode", "no", *extra])

    def _sentinel(self, name: str) -> None:
        self.ports[name] = free_port()
        conf = self.dir / name / "sentinel.conf"
        conf.parent.mkdir(exist_ok=True)
        conf.write_text(
            f"port {self.ports[name]}\nbind 127.0.0.1\nprotected-mode no\ndir {conf.parent}\n"
            f"sentinel monitor {MASTER} 127.0.0.1 {self.ports['primary']} 2\n"
            f"sentinel down-after-milliseconds {MASTER} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {MASTER} {FAILOVER_TIMEOUT_MS}\n"
            f"sentinel parallel-syncs {MASTER} 1\n")
        self._spawn(name, [self.binary, str(conf), "--sentinel"])

    def start(self, timeout: float = 30.0) -> SentinelCluster:
        self._server("primary")
        poll(lambda: self.ask("primary", lambda r: r.ping()), timeout, "the primary to answer")
        self._server("replica", "--replicaof", "127.0.0.1", str(self.ports["primary"]))
        poll(lambda: self.ask("replica", lambda r: r.info("replication").get("master_link_status") == "up"),
             timeout, "the replica to sync")
        for name in self.sentinel_names:
            self._sentinel(name)

        def aware() -> bool:  # every sentinel sees the replica and every other sentinel
            for name in self.sentinel_names:
                state = self.ask(name, lambda s: s.sentinel_master(MASTER))
                if int(state["num-slaves"]) < 1 or int(state["num-other-sentinels"]) < self.sentinels - 1:
                    return False
            return True

        poll(aware, timeout, "the sentinels to find the replica and each other", every=0.1)
        return self

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        proc.kill()
        proc.wait(timeout=10)

    def cleanup(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ state
    def client(self, name: str) -> sync_redis.Redis:
        return sync_redis.Redis(host="127.0.0.1", port=self.ports[name], socket_timeout=2, socket_connect_timeout=2,
                                client_name=TESTS_CLIENT)

    def ask(self, name: str, question: Callable[[sync_redis.Redis], Any]) -> Any:
        """`question(client)` on a fresh client of that server or sentinel, closed after."""
        with self.client(name) as client:
            return question(client)

    def master_port(self, sentinel: str) -> int | None:
        """Where this sentinel says the primary is now."""
        addr = self.ask(sentinel, lambda s: s.sentinel_get_master_addr_by_name(MASTER))
        return int(addr[1]) if addr else None

    def promoted(self) -> bool:
        """Every sentinel that answers names the replica as the primary, and it says it is one."""
        ports = []
        for name in self.sentinel_names:
            if self.procs[name].poll() is None:
                ports.append(self.master_port(name))
        if not ports or any(p != self.ports["replica"] for p in ports):
            return False
        return bool(self.ask("replica", lambda r: r.info("replication")["role"] == "master"))

    def clients_on(self, name: str) -> list[dict[str, Any]]:
        """The connections to that server other than the sentinels' and the tests' own: iop's."""
        listed = self.ask(name, lambda r: r.client_list())
        return [c for c in listed if c.get("name") != TESTS_CLIENT and not c.get("name", "").startswith("sentinel-")
                and "S" not in c.get("flags", "") and "M" not in c.get("flags", "")]

    def primary(self) -> sync_redis.Redis:
        """A client of the server that is the primary now (as the sentinels say)."""
        port = self.master_port(self.sentinel_names[0])
        assert port is not None
        return sync_redis.Redis(host="127.0.0.1", port=port, socket_timeout=5, socket_connect_timeout=2,
                                client_name=TESTS_CLIENT)


@dataclass
class LoneSentinel:
    """A primary and one sentinel (quorum 1), with passwords on both, over TLS if `tls_dir` holds
    `tests.tls.make_certificates`' files: enough to show a client finds and reaches the primary."""

    password: str
    sentinel_password: str
    tls_dir: Path | None = None
    binary: str = field(default_factory=find_server_binary)
    dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="iop-sentinel-")))
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    port: int = 0
    sentinel_port: int = 0

    def _tls(self) -> list[str]:
        if self.tls_dir is None:
            return []
        return ["tls-cert-file", str(self.tls_dir / "server.crt"), "tls-key-file", str(self.tls_dir / "server.key"),
                "tls-ca-cert-file", str(self.tls_dir / "ca.crt"), "tls-auth-clients", "no"]

    def _listen(self, port: int) -> list[str]:
        return ["port", "0", "tls-port", str(port), "tls-replication", "yes"] if self.tls_dir else ["port", str(port)]

    def url(self, scheme: str = "redis+sentinel", query: str = "") -> str:
        return f"{scheme}://:{self.password}@127.0.0.1:{self.sentinel_port}/{MASTER}/0{query}"

    def start(self) -> LoneSentinel:
        self.port, self.sentinel_port = free_port(), free_port()
        primary = [*self._listen(self.port), "bind", "127.0.0.1", "save", "", "appendonly", "no",
                   "requirepass", self.password, *self._tls()]
        self.procs.append(subprocess.Popen([self.binary, *(f"--{a}" if i % 2 == 0 else a
                                                           for i, a in enumerate(primary))],
                                           cwd=self.dir, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        settings = [*self._listen(self.sentinel_port), "bind", "127.0.0.1", "dir", str(self.dir),
                    "requirepass", self.sentinel_password, *self._tls()]
        conf = self.dir / "sentinel.conf"
        conf.write_text("".join(f"{k} {v}\n" for k, v in zip(settings[::2], settings[1::2], strict=True))
                        + f"sentinel monitor {MASTER} 127.0.0.1 {self.port} 1\n"
                        + f"sentinel auth-pass {MASTER} {self.password}\n")
        self.procs.append(subprocess.Popen([self.binary, str(conf), "--sentinel"], cwd=self.dir,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        return self

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
            proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)
