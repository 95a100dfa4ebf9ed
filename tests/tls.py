"""A private Redis server that speaks only TLS, with a throwaway CA made by the `openssl` command.

Skips (saying why) when `openssl` is missing or the Redis binary was built without TLS; with
IOP_REQUIRE_TLS=1 (as `.ci/run` sets) it fails instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis as sync_redis

from iop.embedded_redis import find_server_binary, free_port


def _unavailable(reason: str) -> None:
    if os.environ.get("IOP_REQUIRE_TLS") == "1":
        pytest.fail(f"IOP_REQUIRE_TLS=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certificates(where: Path) -> None:
    """ca.crt, and server.crt/server.key for 127.0.0.1 signed by it."""
    if shutil.which("openssl") is None:
        _unavailable("the openssl command is not installed")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=iop test CA",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=where)
    _openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1", cwd=where)
    (where / "server.ext").write_text(
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.crt", "-days", "2", "-extfile", "server.ext", cwd=where)


@dataclass
class TlsRedis:
    """redis-server on a free port, TLS only (no plain-text port), clients not asked for certificates."""

    dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="iop-tls-redis-")))
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def ca(self) -> Path:
        return self.dir / "ca.crt"

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={self.ca}"

    def start(self, timeout_s: float = 15.0) -> TlsRedis:
        make_certificates(self.dir)
        self.port = free_port()
        args = [find_server_binary(), "--port", "0", "--tls-port", str(self.port), "--bind", "127.0.0.1",
                "--tls-cert-file", "server.crt", "--tls-key-file", "server.key", "--tls-ca-cert-file", "ca.crt",
                "--tls-auth-clients", "no", "--dir", str(self.dir), "--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen(args, cwd=self.dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        client = sync_redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self.proc.poll() is not None:
                    output = self.proc.stdout.read().decode(errors="replace") if self.proc.stdout else ""
                    _unavailable(f"{args[0]} cannot serve TLS: {output.strip()[-300:]}")
                try:
                    if client.ping():
                        return self
                except sync_redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"TLS Redis did not answer on port {self.port}") from None
                    time.sleep(0.05)  # polling the port, with a deadline, while the server boots
        finally:
            client.close()

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        shutil.rmtree(self.dir, ignore_errors=True)
