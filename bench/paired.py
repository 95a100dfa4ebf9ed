#!/usr/bin/env python
"""Two checkouts of iop side by side at concurrency 1, each request alternating between them.

    python bench/paired.py BEFORE_DIR AFTER_DIR [--requests 2000] [--out FILE]

Each directory is a checkout (a `git worktree` of another commit, say); each starts its own stack
with its own `bench/bench.py` (a private Redis, two zero-latency simulators, a gateway, a scheduler,
one worker per node), both at once. Then the same non-stream request, then the same streamed one,
goes to one stack's gateway, the other's, and each one's simulator straight, in turns (the order
swapped every round), one at a time. A machine whose speed drifts by 25% within minutes (these
do) moves both sides alike, which runs of `bench.py` minutes apart cannot give: this is for a
change of a few percent at concurrency 1. Prints one JSON document: for each side and kind the
added latency (p50 of the gateway's, less p50 of straight to the simulators; the time to the first
chunk with text for streams), and the CPU each process spent per request in that phase.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

MESSAGES = [{"role": "user", "content": "Say hello."}]
WARMUP = 100


def serve(tokens: int) -> None:
    """In a checkout's directory (the cwd): start its stack with its own `bench/bench.py`, print
    its gateway, simulators and process ids as one JSON line, and stop it once stdin closes."""
    sys.path[:0] = [str(Path.cwd() / "bench"), str(Path.cwd())]  # (before this script's own directory)
    import bench as checkout  # the checkout's, not this script's: nothing imported it in this process yet

    stack = checkout.Stack(log_level="WARNING")
    try:
        stack.start(tokens)
        assert stack.redis is not None and stack.redis.proc is not None
        pids = {p.name: p.popen.pid for p in stack.procs} | {"redis": stack.redis.proc.pid}
        print(json.dumps({"gateway": stack.gateway, "sims": stack.sims, "pids": pids}), flush=True)
        sys.stdin.read()
    finally:
        stack.stop()


def body(stream: bool, model: str) -> bytes:
    return json.dumps({"model": model, "messages": MESSAGES, "max_tokens": 16, "stream": stream}).encode()


async def timed(session: aiohttp.ClientSession, url: str, data: bytes, stream: bool) -> int:
    """ns to the whole answer (non-stream) or to the first chunk with text (stream)."""
    from bench import FIRST_TEXT  # bench/bench.py (this script's directory is on sys.path)

    began = time.perf_counter_ns()
    async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}")
        if not stream:
            await resp.read()
            return time.perf_counter_ns() - began
        seen = b""
        first: int | None = None
        async for part in resp.content.iter_any():
            if first is None:
                seen += part
                if FIRST_TEXT.search(seen):
                    first = time.perf_counter_ns() - began
        if first is None:
            raise RuntimeError(f"{url}: a stream without text")
        return first


def cpu_of(pids: dict[str, int]) -> dict[str, float]:
    from bench import cpu_seconds

    return {name: cpu_seconds(pid) or 0.0 for name, pid in pids.items()}


async def measure(stacks: list[dict[str, Any]], requests: int) -> dict[str, Any]:
    from bench import MODEL

    out: dict[str, Any] = {}
    async with aiohttp.ClientSession() as session:
        for stream in (False, True):
            kind = "stream" if stream else "non_stream"
            request = body(stream, MODEL)
            for _ in range(WARMUP):
                for side in stacks:
                    await timed(session, side["gateway"] + "/v1/chat/completions", request, stream)
            samples: list[dict[str, list[int]]] = [{"gateway": [], "direct": []} for _ in stacks]
            before = [cpu_of(side["pids"]) for side in stacks]
            for n in range(requests):
                order = (0, 1) if n % 2 == 0 else (1, 0)
                for i in order:
                    samples[i]["gateway"].append(await timed(
                        session, stacks[i]["gateway"] + "/v1/chat/completions", request, stream))
                for i in order:
                    served, url = sorted(stacks[i]["sims"].items())[n % 2]
                    samples[i]["direct"].append(await timed(session, url + "/v1/chat/completions",
                                                            body(stream, served), stream))
            after = [cpu_of(side["pids"]) for side in stacks]
            for i, side in enumerate(stacks):
                g, d = (statistics.median(samples[i][k]) / 1e6 for k in ("gateway", "direct"))
                per_request = {name: round((after[i][name] - before[i][name]) / (2 * requests) * 1000, 3)
                               for name in before[i]}
                iop = sum(v for name, v in per_request.items() if not name.startswith("simulator"))
                out.setdefault(side["name"], {})[kind] = {
                    "added_p50_ms": round(g - d, 3), "gateway_p50_ms": round(g, 3), "direct_p50_ms": round(d, 3),
                    "iop_cpu_ms_per_request": round(iop, 3), "cpu_ms_per_request": per_request}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("before", nargs="?", help="a checkout's directory")
    p.add_argument("after", nargs="?", help="another checkout's directory")
    p.add_argument("--requests", type=int, default=2000, help="requests per side and kind (default 2000)")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--out", default=None, help="also write the JSON to this file")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # (the child, in a checkout)
    args = p.parse_args(argv)
    if args.serve:
        serve(args.tokens)
        return 0
    if not args.before or not args.after or args.requests < 1:
        p.error("give two checkout directories, and --requests of at least 1")
    children: list[subprocess.Popen[bytes]] = []
    stacks: list[dict[str, Any]] = []
    try:
        for name, directory in (("before", args.before), ("after", args.after)):
            child = subprocess.Popen(  # (this script in the checkout's directory: older ones have none)
                [sys.executable, str(Path(__file__).resolve()), "--serve", "--tokens", str(args.tokens)],
                cwd=directory, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=dict(os.environ))
            children.append(child)
            assert child.stdout is not None
            line = child.stdout.readline()
            if not line:
                raise SystemExit(f"paired: the stack of {directory} did not start")
            stacks.append({"name": name, "dir": str(Path(directory).resolve()), **json.loads(line)})
        results = asyncio.run(measure(stacks, args.requests))
    finally:
        for child in children:
            if child.stdin is not None:
                child.stdin.close()
        for child in children:
            child.wait(timeout=60)
    doc = {"benchmark": "paired", "requests": args.requests,
           "checkouts": {s["name"]: s["dir"] for s in stacks}, "results": results}
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
