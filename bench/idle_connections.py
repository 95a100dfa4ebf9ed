#!/usr/bin/env python
"""Gateway memory per open idle connection.

    python bench/idle_connections.py [--connections 2000,4000] [--out FILE]

Starts a private Redis and, for each count, a fresh `iop gateway` process; opens that many
keep-alive connections, each answered once (GET /healthz) and then left idle, and reads the
gateway's resident memory (VmRSS in /proc/PID/status) before and after. Prints one JSON
document: the RSS figures and the bytes per connection at each count.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from iop.embedded_redis import RedisServer
from iop.proc import IopProcess

ROOT = Path(__file__).resolve().parents[1]
HEALTH = b"GET /healthz HTTP/1.1\r\nHost: bench\r\n\r\n"


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def open_idle(address: tuple[str, int], count: int) -> list[socket.socket]:
    """`count` connections, each answered once, so the gateway holds each as an idle keep-alive."""
    socks: list[socket.socket] = []
    for _ in range(count):
        sock = socket.create_connection(address, timeout=30)
        sock.sendall(HEALTH)
        reply = b""
        while b'{"status": "ok"}' not in reply:
            chunk = sock.recv(4096)
            if not chunk:
                raise RuntimeError(f"the gateway closed connection {len(socks) + 1}: {reply!r}")
            reply += chunk
        socks.append(sock)
    return socks


def settled_rss(pid: int) -> int:
    """RSS once two readings 0.2 s apart agree to within 64 KiB (the gateway has finished its
    work on the last connections)."""
    last = rss_bytes(pid)
    for _ in range(25):
        time.sleep(0.2)
        now = rss_bytes(pid)
        if abs(now - last) < 65536:
            return now
        last = now
    return last


def gateway_config(connections: int) -> dict[str, Any]:
    return {
        "models": [{"id": "m", "providers": {"p": "p-served"}}],
        "nodes": [{"id": "n", "providers": [{"id": "p", "type": "vllm", "base_url": "http://127.0.0.1:9",
                                             "capacity": 1, "models": ["p-served"]}]}],
        "runtime": {"max_connections": connections + 64, "idle_timeout_ms": 600_000, "header_timeout_ms": 600_000},
    }


def measure_once(count: int, redis_url: str, tmp: Path) -> dict[str, Any]:
    """A fresh gateway process: RSS once warm, then with `count` idle connections open."""
    (tmp / "iop.yaml").write_text(yaml.safe_dump(gateway_config(count)))
    env = dict(os.environ, IOP_CONFIG=str(tmp / "iop.yaml"), REDIS_URL=redis_url, PYTHONUNBUFFERED="1",
               IOP_LOG_LEVEL="WARNING")
    gw = IopProcess("gateway", ["gateway", "--host", "127.0.0.1", "--port", "0"], env, cwd=ROOT, keep_lines=200)
    try:
        port = int(gw.wait_for_line(r"listening on http://\S+:(\d+)").group(1))
        pid = gw.popen.pid
        for s in open_idle(("127.0.0.1", port), 50):  # first-use allocations are not per-connection costs
            s.close()
        before = settled_rss(pid)
        socks = open_idle(("127.0.0.1", port), count)
        after = settled_rss(pid)
        for s in socks:
            s.close()
        return {"connections": count, "rss_before_bytes": before, "rss_after_bytes": after,
                "bytes_per_connection": round((after - before) / count)}
    finally:
        gw.stop()


def measure(counts: list[int]) -> dict[str, Any]:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    tmp = Path(tempfile.mkdtemp(prefix="iop-bench-idle-"))
    load = os.getloadavg()[0]
    redis = RedisServer().start()
    try:
        results = [measure_once(count, redis.url, tmp) for count in counts]
    finally:
        redis.cleanup()
    return {
        "results": results,
        "machine": {"python": sys.version.split()[0], "loadavg_at_start": load},
        "notes": "RSS is VmRSS of the gateway process, a fresh one per count (Python keeps freed memory, "
                 "so a second count in the same process would reuse the first one's). Each connection sent "
                 "one GET /healthz and then holds its keep-alive idle; nothing else runs.",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", default="1000,4000", help="comma-separated counts of idle connections")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()
    doc = json.dumps(measure([int(c) for c in args.connections.split(",")]), indent=2)
    print(doc)
    if args.out:
        Path(args.out).write_text(doc + "\n")


if __name__ == "__main__":
    main()
