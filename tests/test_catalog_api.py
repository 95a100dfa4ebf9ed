"""`GET /v1/catalog`, `GET /catalog`, `iop catalog` and `iop queues` against a real Redis.

Heartbeats are written with the workers' own `heartbeat_fields` and runs are queued with
the gateway's own `RunClient`, so the catalog reads exactly what the services write.
"""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from redis.asyncio import Redis

from common import keys
from common.config import Config, parse_config
from common.policy import Health
from common.redisconn import now_ms
from common.wire import RunKind
from gateway.app import build_app
from gateway.requests import ParsedRequest
from gateway.runs import RunClient
from iop import catalog_cmd, cli
from tests.openapi import validate
from workers.adapters.base import ProbeResult
from workers.heartbeat import heartbeat_fields

CONFIG_DATA: dict[str, Any] = {
    "models": [
        {"id": "qwen:35b", "display_name": "Qwen", "aliases": ["chat", "qwen"],
         "providers": {"vllm-a": "Qwen/A", "ollama-b": "qwen-b"}},
        {"id": "llama:70b", "providers": {"vllm-a": "Llama/A"}, "queue": {"max_queue": 8}},
    ],
    "nodes": [
        {"id": "gpu-1", "providers": [{"id": "vllm-a", "type": "vllm", "base_url": "http://127.0.0.1:9",
                                       "capacity": 2, "models": ["Qwen/A", "Llama/A"], "api_key_env": "SECRET_VAR"}]},
        {"id": "gpu-2", "providers": [{"id": "ollama-b", "type": "ollama", "base_url": "http://127.0.0.1:9",
                                       "capacity": 1, "models": ["qwen-b"]}]},
    ],
}
CONFIG = parse_config(CONFIG_DATA)


@asynccontextmanager
async def serve(config: Config, redis_url: str) -> AsyncIterator[str]:
    runner = web.AppRunner(build_app(config, redis_url))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def publish(redis: Redis, config: Config, provider_id: str, probe: ProbeResult) -> None:
    """A heartbeat as a worker writes it once it has judged `probe`'s result."""
    p = config.provider(provider_id)
    fields = heartbeat_fields(p, config.node_of(p.id), probe.health, probe.reason, now_ms())
    fields["observed_models"] = "" if probe.models is None else json.dumps(probe.models)
    await redis.hset(keys.heartbeat(p.id), mapping=fields)


async def get_json(url: str) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return resp.status, await resp.json()


async def test_catalog_reports_health_load_and_queues(redis: Redis, redis_url: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SECRET_VAR", "sk-top-secret")
    await publish(redis, CONFIG, "vllm-a", ProbeResult(Health.AVAILABLE, "", models=["Qwen/A", "Llama/A"]))
    await publish(redis, CONFIG, "ollama-b", ProbeResult(Health.UNAVAILABLE, "connection refused"))
    await redis.zadd(keys.leases("vllm-a"), {"run_live": now_ms() + 60_000, "run_expired": now_ms() - 1})
    model = CONFIG.model("qwen:35b")
    assert model is not None
    client = RunClient(redis, CONFIG)
    body = {"model": model.id, "messages": [{"role": "user", "content": "x"}]}
    first, _ = await client.submit(model, ParsedRequest(RunKind.CHAT, model.id, False, body))
    await client.submit(model, ParsedRequest(RunKind.CHAT, model.id, False, body))

    async with serve(CONFIG, redis_url) as base:
        status, cat = await get_json(base + "/v1/catalog")
    assert status == 200
    text = json.dumps(cat)
    assert "sk-top-secret" not in text and "SECRET_VAR" not in text and "127.0.0.1:9" not in text
    a, b = cat["providers"]
    assert (a["id"], a["node_id"], a["type"], a["category"]) == ("vllm-a", "gpu-1", "vllm", "local_inference")
    assert (a["health"], a["capacity"], a["in_flight"], a["load_ratio"], a["queued"]) == ("available", 2, 1, 0.5, 2)
    assert a["models"] == {"configured": ["Qwen/A", "Llama/A"], "observed": ["Qwen/A", "Llama/A"]}
    assert a["last_heartbeat"] is not None
    assert (b["health"], b["health_reason"], b["in_flight"], b["queued"]) == ("unavailable", "connection refused", 0, 2)
    qwen, llama = cat["models"]
    assert (qwen["id"], qwen["display_name"], qwen["queued"], qwen["max_queue"]) == ("qwen:35b", "Qwen", 2, 64)
    assert qwen["oldest_run_id"] == first and qwen["oldest_waiting_ms"] >= 0
    assert [(p["provider_id"], p["target"], p["selectable"], p["reason"]) for p in qwen["providers"]] == [
        ("vllm-a", "Qwen/A", True, None), ("ollama-b", "qwen-b", False, "unavailable")]
    assert (llama["queued"], llama["max_queue"], llama["oldest_waiting_ms"]) == (0, 8, None)


async def test_a_provider_without_a_heartbeat_is_unknown(redis_url: str) -> None:
    async with serve(CONFIG, redis_url) as base:
        status, cat = await get_json(base + "/v1/catalog")
    assert status == 200
    assert [(p["health"], p["capacity"], p["load_ratio"], p["last_heartbeat"]) for p in cat["providers"]] == [
        ("unknown", None, None, None)] * 2
    assert {p["reason"] for m in cat["models"] for p in m["providers"]} == {"unknown"}


async def test_the_page_is_served_as_html(redis_url: str) -> None:
    async with serve(CONFIG, redis_url) as base, aiohttp.ClientSession() as session:
        async with session.get(base + "/catalog") as resp:
            assert resp.status == 200
            assert resp.content_type == "text/html"
            page = await resp.text()
    assert "/v1/catalog" in page and "<script>" in page


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def test_catalog_answers_503_openai_shaped_when_redis_is_down() -> None:
    async with serve(CONFIG, f"redis://127.0.0.1:{free_port()}/0") as base:
        async with aiohttp.ClientSession() as session, session.get(base + "/v1/catalog") as resp:
            assert resp.status == 503
            assert resp.headers.get("Retry-After")
            error = await resp.json()
        async with aiohttp.ClientSession() as session, session.get(base + "/catalog") as resp:
            assert resp.status == 200  # the page itself needs no Redis; it shows the data as stale
    validate("ErrorResponse", error)
    assert error["error"]["code"] == "service_unavailable"


async def test_cli_prints_the_same_records(redis: Redis, redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    await publish(redis, CONFIG, "vllm-a", ProbeResult(Health.AVAILABLE, ""))
    await redis.xadd(keys.runs_stream("llama:70b"), {"run": "run_waiting"}, id=f"{now_ms() - 5000}-0")
    catalog, _ = await catalog_cmd._read_checked(CONFIG, redis_url)
    out = catalog_cmd.render_catalog(catalog)
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["NODE", "PROVIDER", "TYPE", "CATEGORY", "HEALTH"]
    assert lines[1].split()[:7] == ["gpu-1", "vllm-a", "vllm", "local_inference", "available", "0/2", "(0.00)"]
    assert lines[2].split()[:6] == ["gpu-2", "ollama-b", "ollama", "local_inference", "unknown", "0/?"]
    assert "vllm-a:ok, ollama-b:unknown" in out
    models = lines[lines.index("") + 1:]
    assert models[0].split()[:2] == ["MODEL", "ALIASES"]
    assert [line.split()[:2] for line in models[1:]] == [["qwen:35b", "chat,qwen"], ["llama:70b", "-"]]
    queues = catalog_cmd.render_queues(catalog).splitlines()
    assert queues[2].split()[:3] == ["llama:70b", "1", "8"] and queues[2].split()[-1] == "run_waiting"
    assert float(queues[2].split()[3].rstrip("s")) >= 5.0
    [llama] = [q for q in catalog_cmd.queue_records(catalog) if q["model"] == "llama:70b"]
    assert llama["oldest_waiting_ms"] >= 5000


def test_cli_exits_1_and_hides_the_password_when_redis_is_down(capsys: pytest.CaptureFixture[str]) -> None:
    code = catalog_cmd.main("queues", CONFIG, f"redis://:hunter2@127.0.0.1:{free_port()}/0", as_json=True)
    assert code == 1
    err = capsys.readouterr().err
    assert "cannot read Redis" in err and "hunter2" not in err


def test_cli_json(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert catalog_cmd.main("catalog", CONFIG, redis_url, as_json=True) == 0
    data = json.loads(capsys.readouterr().out)
    assert [p["id"] for p in data["providers"]] == ["vllm-a", "ollama-b"]
    assert catalog_cmd.main("queues", CONFIG, redis_url, as_json=True) == 0
    assert [q["model"] for q in json.loads(capsys.readouterr().out)["queues"]] == ["qwen:35b", "llama:70b"]


def test_the_iop_command_parses_its_options(redis_url: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "iop.yaml"
    path.write_text(yaml.safe_dump(CONFIG_DATA))
    for command in ("catalog", "queues"):
        with pytest.raises(SystemExit) as exit_:
            cli.main([command, "--config", str(path), "--redis", redis_url])
        assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "PROVIDER" in out and "OLDEST WAITING" in out


def test_iop_usage_names_the_redis_it_could_not_read_as_the_other_commands_do(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Found by a newcomer's audit: `iop catalog`, `queues`, `audit` and `provider …` name the Redis
    they could not reach (its password hidden); `iop usage` said only `cannot read Redis`."""
    from iop import usage_cmd

    port = free_port()
    code = usage_cmd.main(CONFIG, f"redis://:hunter2@127.0.0.1:{port}/0", None, None, None, None, as_json=False)
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot read Redis at redis://:***@127.0.0.1:{port}/0: ") and "hunter2" not in err
    # (and where the Redis it tried came from: an operator's shell without the pool's $REDIS_URL)
    assert err.rstrip("\n").endswith("(the pool's Redis is --redis URL, else $REDIS_URL, else "
                                      "redis://127.0.0.1:6379/0)") and err.count("\n") == 1


@pytest.mark.parametrize("command", ["catalog", "queues"])
def test_runs_waiting_with_no_scheduler_running_are_said_to_wait_for_one(
        command: str, redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by an operator's day: with every scheduler stopped, `iop catalog` showed a queue that only
    grew beside providers all `ok` (free slots, healthy), and `iop queues` its waits: nothing said that
    nobody dispatches. Now both say so on stderr, and only while it is so."""
    import redis as sync_redis

    with sync_redis.Redis.from_url(redis_url) as r:
        assert catalog_cmd.main(command, CONFIG, redis_url, as_json=False) == 0
        assert "no scheduler" not in capsys.readouterr().err  # (nothing waits: nothing to say)
        r.xadd(keys.runs_stream("llama:70b"), {"run": "run_waiting"})
        assert catalog_cmd.main(command, CONFIG, redis_url, as_json=True) == 0
        err = capsys.readouterr().err
        assert (f"warning: runs wait and no scheduler is running against Redis at {redis_url.split('://')[0]}://"
                in err and "(`iop scheduler`)" in err), err
        r.set(keys.scheduler_alive("replica-1"), "1", px=60_000)
        assert catalog_cmd.main(command, CONFIG, redis_url, as_json=False) == 0
        assert "no scheduler" not in capsys.readouterr().err
