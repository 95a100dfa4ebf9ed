"""The operator routes (`/v1/admin/…`), `GET /v1/catalog/history`, the `iop provider|node|audit`
commands and the scheduler's control gauges, against a real Redis and the real gateway app on
port 0 (no scheduler or worker processes)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any
from unittest.mock import patch

import aiohttp
import pytest
import redis as sync_redis
import yaml
from prometheus_client import generate_latest
from redis.asyncio import Redis

from common import keys
from common.auth import hash_key, new_key
from common.config import Config, parse_config
from common.control import Action, Change, apply
from common.history import max_entries, offer_sample, read_history
from common.redisconn import now_ms
from iop import cli, control_cmd
from iop.embedded_redis import RedisServer
from scheduler import metrics as scheduler_metrics
from tests.conftest import async_wait_until, paused
from tests.openapi import validate
from tests.test_catalog_api import free_port, serve

OPERATOR, CALLER = new_key(), new_key()
POOL: dict[str, Any] = {
    "models": [{"id": "qwen:35b", "providers": {"vllm-a": "Qwen/A", "ollama-b": "qwen-b"}}],
    "nodes": [
        {"id": "gpu-1", "providers": [{"id": "vllm-a", "type": "vllm", "base_url": "http://127.0.0.1:9",
                                       "capacity": 4, "models": ["Qwen/A"]}]},
        {"id": "gpu-2", "providers": [{"id": "ollama-b", "type": "ollama", "base_url": "http://127.0.0.1:9",
                                       "capacity": 2, "models": ["qwen-b"]}]},
    ],
    "runtime": {"history_interval_ms": 100, "history_retention_s": 600},
}
KEYS = {"keys": [{"name": "ops", "sha256": hash_key(OPERATOR), "role": "operator"},
                 {"name": "team-a", "sha256": hash_key(CALLER)}]}
OPEN = parse_config(POOL)
LOCKED = parse_config({**POOL, "auth": KEYS})


async def call(method: str, url: str, key: str | None = None, body: Any = None,
               raw: bytes | None = None) -> tuple[int, dict[str, Any], dict[str, str]]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    async with aiohttp.ClientSession() as session, session.request(method, url, data=data, headers=headers) as resp:
        text = await resp.text()
        return resp.status, json.loads(text) if text else {}, dict(resp.headers)


async def beat(redis: Redis, config: Config) -> None:
    for node in config.nodes:
        for p in node.providers:
            await redis.hset(keys.heartbeat(p.id), mapping={"health": "available", "capacity": p.capacity,
                                                             "ts_ms": now_ms()})


async def test_drain_and_undrain_over_http(redis: Redis, redis_url: str) -> None:
    await beat(redis, OPEN)
    await redis.zadd(keys.leases("vllm-a"), {"run_1": now_ms() + 60_000})
    async with serve(OPEN, redis_url) as base:
        status, body, headers = await call("POST", base + "/v1/admin/providers/vllm-a/drain")
        assert status == 200 and headers["Cache-Control"] == "no-store"
        assert body["object"] == "control.change"
        change = body["change"]
        assert (change["action"], change["target"], change["who"], change["value"], change["previous"]) == (
            "drain", "vllm-a", "anonymous", "drained", "active")
        (record,) = body["providers"]
        assert record["id"] == "vllm-a" and record["control"]["state"] == "draining" and record["in_flight"] == 1
        _, catalog, _ = await call("GET", base + "/v1/catalog")
        assert catalog["providers"][0]["control"]["state"] == "draining"
        assert catalog["models"][0]["providers"][0]["reason"] == "drained"
        await redis.delete(keys.leases("vllm-a"))  # its run ended
        _, catalog, _ = await call("GET", base + "/v1/catalog")
        assert catalog["providers"][0]["control"]["state"] == "drained"
        status, body, _ = await call("POST", base + "/v1/admin/providers/vllm-a/undrain")
        assert status == 200 and body["change"]["previous"] == "drained"
        assert body["providers"][0]["control"]["state"] == "active"
    assert not await redis.exists(keys.drained("vllm-a"))


async def test_a_change_answers_its_providers_without_building_every_model_s_record(
        redis: Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each change answered with a whole catalog: 50 changes at once in a pool of 300 models and 100
    providers held each gateway's one thread for up to 5.5 s (its /healthz waited as long)."""
    import common.catalog as catalog

    built: list[str] = []
    model_record = catalog._model_record

    def counted(config: Config, m: Any, *args: Any) -> Any:
        built.append(m.id)
        return model_record(config, m, *args)

    monkeypatch.setattr(catalog, "_model_record", counted)
    await beat(redis, OPEN)
    async with serve(OPEN, redis_url) as base:
        status, body, _ = await call("POST", base + "/v1/admin/providers/vllm-a/drain")
        assert status == 200 and [p["id"] for p in body["providers"]] == ["vllm-a"]
        assert body["providers"][0]["serves"] == {"qwen:35b": "Qwen/A"}
        status, body, _ = await call("POST", base + "/v1/admin/nodes/gpu-2/cordon")
        assert status == 200 and [p["id"] for p in body["providers"]] == ["ollama-b"]
        assert built == []
        _, cat, _ = await call("GET", base + "/v1/catalog")  # (the catalog itself has them all)
        assert [pl["reason"] for pl in cat["models"][0]["providers"]] == ["drained", "cordoned"]


async def test_cordon_and_uncordon_a_node_over_http(redis: Redis, redis_url: str) -> None:
    await beat(redis, OPEN)
    async with serve(OPEN, redis_url) as base:
        status, body, _ = await call("POST", base + "/v1/admin/nodes/gpu-2/cordon")
        assert status == 200
        assert body["node"]["id"] == "gpu-2" and body["node"]["cordoned_since_ms"] is not None
        assert [(p["id"], p["control"]["state"]) for p in body["providers"]] == [("ollama-b", "drained")]
        _, catalog, _ = await call("GET", base + "/v1/catalog")
        assert [n["cordoned_since_ms"] is not None for n in catalog["nodes"]] == [False, True]
        assert [p["reason"] for p in catalog["models"][0]["providers"]] == [None, "cordoned"]
        status, body, _ = await call("POST", base + "/v1/admin/nodes/gpu-2/uncordon")
        assert status == 200 and body["node"]["cordoned_since_ms"] is None
    assert not await redis.exists(keys.cordoned("gpu-2"))


async def test_capacity_override_over_http(redis: Redis, redis_url: str) -> None:
    await beat(redis, OPEN)
    async with serve(OPEN, redis_url) as base:
        url = base + "/v1/admin/providers/vllm-a/capacity"
        status, body, _ = await call("POST", url, body={"capacity": 1, "for": "30m"})
        assert status == 200
        change = body["change"]
        assert (change["value"], change["previous"]) == ("1", "none")
        assert change["until_ms"] - change["at_ms"] == 1_800_000
        (record,) = body["providers"]
        assert (record["configured_capacity"], record["capacity"], record["effective_capacity"]) == (4, 4, 1)
        assert record["control"]["capacity_override"] == 1
        assert record["control"]["capacity_override_until_ms"] == change["until_ms"]  # (Redis's expiry time: exact)
        status, body, _ = await call("POST", url, body={"capacity": 3})  # until cleared
        assert status == 200 and body["providers"][0]["control"]["capacity_override_until_ms"] is None
        assert body["change"]["previous"] == "1" and body["change"]["previous_until_ms"] == change["until_ms"]
        assert body["providers"][0]["effective_capacity"] == 3
        status, body, _ = await call("DELETE", url)
        assert status == 200 and body["change"]["action"] == "capacity_clear"
        assert body["providers"][0]["effective_capacity"] == 4
    assert not await redis.exists(keys.capacity_override("vllm-a"))


@pytest.mark.parametrize(("body", "param", "says"), [
    ({}, "capacity", "required"),
    ({"capacity": 0}, "capacity", "less than 1"),
    ({"capacity": 5}, "capacity", "is above vllm-a's configured capacity 4 (an override can only lower it"),
    ({"capacity": "two"}, "capacity", "not a whole number"),
    ({"capacity": "1"}, "capacity", "'1' is text, not a whole number (send a JSON number"),  # (found in an audit)
    ({"capacity": "01"}, "capacity", "is text, not a whole number"),
    ({"capacity": 1.5}, "capacity", "not a whole number"),
    ({"capacity": 2.0}, "capacity", "2.0 is a decimal number; give it as a whole number (2)"),  # (an audit:
    ({"capacity": 1e2}, "capacity", "100.0 is a decimal number; give it as a whole number (100)"),  # "is not whole")
    ({"capacity": 2, "x" * 3000: 1}, "x" * 256, "unknown field 'xxx"),  # (param: cut, as the message)
    ({"capacity": None}, "capacity", "not a whole number"),
    ({"capacity": 2, "for": "8d"}, "for", "longer than 7d"),
    ({"capacity": 2, "for": "soon"}, "for", "not a duration"),
    ({"capacity": 2, "for": 60}, "for", "not a duration such as 90s, 30m, 2h, 7d or 1h30m"),
    ({"capacity": 2, "ttl": "5m"}, "ttl", "unknown field"),
    ([2], None, "must be a JSON object"),
])
async def test_a_bad_capacity_is_a_400_naming_it_and_changes_nothing(
        redis: Redis, redis_url: str, body: Any, param: str | None, says: str) -> None:
    async with serve(OPEN, redis_url) as base:
        status, error, _ = await call("POST", base + "/v1/admin/providers/vllm-a/capacity", body=body)
    assert status == 400
    validate("ErrorResponse", error)
    assert error["error"]["code"] == "invalid_request_error" and error["error"]["param"] == param
    assert says in error["error"]["message"]
    assert await redis.keys("iop:*") == []


async def test_a_full_redis_refuses_a_change_that_adds_and_takes_one_that_removes(redis: Redis, redis_url: str) -> None:
    """At `maxmemory` a drain (it adds a key) is refused whole, saying so: nothing changed, no audit
    entry (it said "nothing was queued" before); an undrain (it frees) goes through, recorded."""
    await beat(redis, OPEN)
    async with serve(OPEN, redis_url) as base:
        assert (await call("POST", base + "/v1/admin/providers/vllm-a/drain"))[0] == 200
        await redis.config_set("maxmemory", 1)
        try:
            status, body, headers = await call("POST", base + "/v1/admin/providers/ollama-b/drain")
            assert (status, headers["Retry-After"]) == (503, "5"), body
            validate("ErrorResponse", body)
            assert body["error"]["message"].startswith("the run store (Redis) is full (maxmemory) and refuses writes: "
                                                       "nothing changed")
            status, body, _ = await call("POST", base + "/v1/admin/providers/vllm-a/undrain")
            assert status == 200 and body["change"]["action"] == "undrain", body
        finally:
            await redis.config_set("maxmemory", 0)
        assert not await redis.exists(keys.drained("ollama-b"), keys.drained("vllm-a"))
        assert [e[1][b"action"] for e in await redis.xrange(keys.AUDIT_STREAM)] == [b"drain", b"undrain"]


async def test_a_body_that_is_not_json_is_a_400(redis: Redis, redis_url: str) -> None:
    async with serve(OPEN, redis_url) as base:
        for path in ("providers/vllm-a/capacity", "providers/vllm-a/drain"):
            status, error, _ = await call("POST", f"{base}/v1/admin/{path}", raw=b"{not json")
            assert status == 400 and "not valid JSON" in error["error"]["message"]
    assert await redis.keys("iop:*") == []


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "providers/nope/drain", None), ("POST", "providers/nope/undrain", None),
    ("POST", "providers/nope/capacity", {"capacity": 1}), ("DELETE", "providers/nope/capacity", None),
    ("POST", "nodes/nope/cordon", None), ("POST", "nodes/vllm-a/uncordon", None),  # a provider is no node
    ("POST", "providers/gpu-1/drain", None),  # nor a node a provider
    ("POST", "providers/" + "a" * 7000 + "/drain", None),  # (its message cut, found in an audit: 7 KB)
])
async def test_an_unknown_provider_or_node_is_a_404(redis: Redis, redis_url: str, method: str, path: str,
                                                    body: Any) -> None:
    async with serve(OPEN, redis_url) as base:
        status, error, _ = await call(method, f"{base}/v1/admin/{path}", body=body)
    assert status == 404
    validate("ErrorResponse", error)
    assert error["error"]["code"] == "not_found" and "in the config" in error["error"]["message"]
    assert len(error["error"]["message"]) < 200
    assert await redis.keys("iop:*") == []


async def test_only_operator_keys_may_act_and_the_audit_names_the_key(redis: Redis, redis_url: str) -> None:
    routes = [("POST", "/v1/admin/providers/vllm-a/drain", None),
              ("POST", "/v1/admin/providers/vllm-a/capacity", {"capacity": 1}),
              ("DELETE", "/v1/admin/providers/vllm-a/capacity", None),
              ("POST", "/v1/admin/nodes/gpu-1/cordon", None), ("GET", "/v1/admin/audit", None),
              ("GET", "/v1/catalog/history", None)]
    async with serve(LOCKED, redis_url) as base:
        for method, path, body in routes:
            status, error, headers = await call(method, base + path, None, body)
            assert status == 401 and error["error"]["code"] == "invalid_api_key", path
            assert headers["WWW-Authenticate"].startswith("Bearer")
            status, error, _ = await call(method, base + path, "sk-unknown", body)
            assert status == 401, path
            status, error, _ = await call(method, base + path, CALLER, body)
            assert status == 403 and error["error"]["code"] == "permission_denied", path
        # nothing was changed, nothing recorded (but the serving gateway's own liveness keys)
        liveness = (keys.GATEWAYS.encode(), keys.gateway_alive("").encode())
        assert [k for k in await redis.keys("iop:*") if not k.startswith(liveness)] == []
        status, answer, _ = await call("POST", base + "/v1/admin/providers/vllm-a/drain", OPERATOR)
        assert status == 200 and answer["change"]["who"] == "ops"
        status, trail, _ = await call("GET", base + "/v1/admin/audit", OPERATOR)
    assert status == 200 and [(e["who"], e["action"]) for e in trail["data"]] == [("ops", "drain")]


async def test_the_catalog_itself_stays_read_only(redis_url: str) -> None:
    async with serve(OPEN, redis_url) as base:
        for method in ("POST", "PUT", "PATCH", "DELETE"):
            status, error, _ = await call(method, base + "/v1/catalog", body={"providers": []})
            assert status == 405 and error["error"]["code"] == "method_not_allowed"


async def test_the_audit_route_pages_newest_first(redis: Redis, redis_url: str) -> None:
    for i, capacity in enumerate([1, 2, 3, 4, 2]):
        await apply(redis, OPEN, Change(Action.CAPACITY, "vllm-a", f"k{i}", capacity=capacity))
    async with serve(OPEN, redis_url) as base:
        status, page, _ = await call("GET", base + "/v1/admin/audit?limit=2")
        assert status == 200 and [e["who"] for e in page["data"]] == ["k4", "k3"]
        assert page["data"][0]["previous"] == "4" and page["data"][0]["value"] == "2"
        status, more, _ = await call("GET", f"{base}/v1/admin/audit?limit=2&before={page['data'][-1]['id']}")
        assert [e["who"] for e in more["data"]] == ["k2", "k1"]
        for bad in ("limit=0", "limit=1001", "limit=x", "before=yesterday"):
            status, error, _ = await call("GET", f"{base}/v1/admin/audit?{bad}")
            assert status == 400 and error["error"]["param"] == bad.split("=")[0], bad


async def test_the_history_serves_the_samples_as_series(redis: Redis, redis_url: str) -> None:
    await beat(redis, OPEN)
    await redis.zadd(keys.leases("vllm-a"), {"r1": now_ms() + 60_000, "r2": now_ms() + 60_000})
    first = await offer_sample(redis, OPEN, now_ms())
    assert first is not None
    # one was written just now: not again, and the pool is not read for it (a scale-out soak: every
    # replica but the writer built the whole catalog every interval)
    with patch("common.history.read_catalog", side_effect=AssertionError("read")):
        assert await offer_sample(redis, OPEN, now_ms()) is None
    await apply(redis, OPEN, Change(Action.CAPACITY, "vllm-a", "ops", capacity=1))
    await redis.xadd(keys.runs_stream("qwen:35b"), {"run": "run_w"}, id=f"{now_ms() - 3000}-0")

    async def second() -> str | None:
        return await offer_sample(redis, OPEN, now_ms())
    await async_wait_until(second, what="a second sample, an interval later")
    async with serve(OPEN, redis_url) as base:
        status, history, _ = await call("GET", base + "/v1/catalog/history")
        assert status == 200
        assert (history["object"], history["interval_ms"], history["retention_s"]) == ("catalog.history", 100, 600)
        assert len(history["t"]) == 2 and history["t"][0] == int(first.split("-")[0])
        assert history["providers"]["vllm-a"] == {"in_flight": [2, 2], "capacity": [4, 1]}
        assert history["providers"]["ollama-b"] == {"in_flight": [0, 0], "capacity": [2, 2]}
        qwen = history["models"]["qwen:35b"]
        assert qwen["queued"] == [0, 1] and qwen["oldest_waiting_ms"][0] is None
        assert qwen["oldest_waiting_ms"][1] >= 3000
        status, newer, _ = await call("GET", f"{base}/v1/catalog/history?since={history['t'][0]}")
        assert status == 200 and newer["t"] == history["t"][1:]
        status, error, _ = await call("GET", f"{base}/v1/catalog/history?since=-1")
        assert status == 400 and error["error"]["param"] == "since"


async def test_the_history_is_trimmed_by_time(redis: Redis) -> None:
    old = now_ms() - 601_000  # older than the retention (600 s)
    for i in range(250):
        await redis.xadd(keys.HISTORY_STREAM, {"sample": "{}"}, id=f"{old + i}-0")
    assert await offer_sample(redis, OPEN, now_ms()) is not None
    # MINID ~ drops whole blocks of entries (100 by default): at most one block of old ones is left
    left = await redis.xlen(keys.HISTORY_STREAM)
    assert 1 <= left <= 101
    assert len((await read_history(redis, OPEN, now_ms()))["t"]) == 1  # the reader skips what is left


async def test_a_history_fuller_than_a_read_gives_its_newest_samples(redis: Redis) -> None:
    """More samples in the retention than a read takes (`max_entries`: a shorter interval just
    configured, samples written by hand): the newest are read, not the oldest."""
    newest = now_ms()
    most = max_entries(OPEN)
    pipe = redis.pipeline(transaction=False)
    for i in range(most + 50, -1, -1):
        pipe.xadd(keys.HISTORY_STREAM, {"sample": "{}"}, id=f"{newest - i}-0")
    await pipe.execute()
    t = (await read_history(redis, OPEN, newest))["t"]
    assert len(t) == most and t[-1] == newest and t == sorted(t)


async def test_the_scheduler_gauges_show_the_control_state(redis: Redis) -> None:
    await beat(redis, OPEN)
    await redis.zadd(keys.leases("vllm-a"), {"r1": now_ms() + 60_000})
    await apply(redis, OPEN, Change(Action.DRAIN, "vllm-a", "ops"))
    await apply(redis, OPEN, Change(Action.CAPACITY, "vllm-a", "ops", capacity=3))
    await apply(redis, OPEN, Change(Action.CORDON, "gpu-2", "ops"))
    await scheduler_metrics.refresh(redis, OPEN, {})
    text = generate_latest(scheduler_metrics.REGISTRY).decode()
    for line in ('iop_provider_effective_capacity{node="gpu-1",provider="vllm-a"} 3.0',
                 'iop_provider_effective_capacity{node="gpu-2",provider="ollama-b"} 2.0',
                 'iop_provider_control{node="gpu-1",provider="vllm-a",state="draining"} 1.0',
                 'iop_provider_control{node="gpu-1",provider="vllm-a",state="active"} 0.0',
                 'iop_provider_control{node="gpu-2",provider="ollama-b",state="drained"} 1.0',
                 'iop_node_cordoned{node="gpu-2"} 1.0', 'iop_node_cordoned{node="gpu-1"} 0.0'):
        assert line in text, line
    await apply(redis, OPEN, Change(Action.UNDRAIN, "vllm-a", "ops"))
    await scheduler_metrics.refresh(redis, OPEN, {})
    text = generate_latest(scheduler_metrics.REGISTRY).decode()
    assert 'iop_provider_control{node="gpu-1",provider="vllm-a",state="active"} 1.0' in text


# --- the iop commands ------------------------------------------------------------------------------


def iop(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        cli.main(list(args))
    out = capsys.readouterr()
    return int(exit_.value.code or 0), out.out, out.err


def test_the_commands_act_on_redis_and_record_the_os_user(
        redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOGNAME", "carol")
    path = tmp_path / "iop.yaml"
    path.write_text(yaml.safe_dump(POOL))
    where = ["--config", str(path), "--redis", redis_url]
    redis = sync_redis.Redis.from_url(redis_url)
    for node in OPEN.nodes:
        for p in node.providers:
            redis.hset(keys.heartbeat(p.id), mapping={"health": "available", "capacity": p.capacity, "ts_ms": now_ms()})
    code, out, _ = iop(capsys, "provider", "drain", "vllm-a", *where)
    assert code == 0 and out.startswith("drain provider vllm-a: drained (was active)")
    assert "provider vllm-a (node gpu-1): drained, capacity 4, 0 in flight" in out
    code, out, _ = iop(capsys, "provider", "capacity", "vllm-a", "2", "--for", "1h30m", *where)
    assert code == 0 and "capacity 2 (configured 4) until " in out
    assert 0 < redis.pttl(keys.capacity_override("vllm-a")) <= 5_400_000
    code, out, _ = iop(capsys, "node", "cordon", "gpu-2", *where, "--json")
    assert code == 0 and json.loads(out)["node"]["id"] == "gpu-2"
    code, out, _ = iop(capsys, "catalog", *where)
    rows = {line.split()[1]: [cell.strip() for cell in line.split("  ") if cell.strip()]
            for line in out.splitlines()[1:3]}
    assert rows["vllm-a"][5:8] == ["0/2 (0.00)", "drained cap 2 (of 4, 90m left)", "0"]
    assert rows["ollama-b"][5:8] == ["0/2 (0.00)", "drained (node)", "0"]
    redis.set(keys.capacity_override("vllm-a"), 6)  # (set before a config lowered the capacity to 4)
    code, out, _ = iop(capsys, "catalog", *where)
    assert "drained cap 6 (of 4: 4 counts)" in out, out
    redis.set(keys.capacity_override("vllm-a"), 2, px=5_400_000)
    code, out, _ = iop(capsys, "provider", "capacity", "vllm-a", "clear", *where)
    assert code == 0 and out.startswith("capacity_clear provider vllm-a: none (was 2 until ")
    code, out, _ = iop(capsys, "provider", "undrain", "vllm-a", *where)
    assert code == 0
    code, out, _ = iop(capsys, "node", "uncordon", "gpu-2", *where)
    assert code == 0
    code, out, _ = iop(capsys, "audit", "--redis", redis_url)
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["TIME", "WHO", "ACTION", "TARGET", "VALUE", "PREVIOUS"]
    assert [line.split()[1:3] for line in lines[1:]] == [
        ["cli:carol", "uncordon"], ["cli:carol", "undrain"], ["cli:carol", "capacity_clear"],
        ["cli:carol", "cordon"], ["cli:carol", "capacity"], ["cli:carol", "drain"]]
    code, out, _ = iop(capsys, "audit", "--redis", redis_url, "--json", "--limit", "1")
    assert [e["action"] for e in json.loads(out)["data"]] == ["uncordon"]
    assert redis.keys("iop:drain:*") == [] and redis.keys("iop:cordon:*") == []
    redis.close()


def test_a_provider_drained_on_a_cordoned_node_says_both(
        redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by an operator audit: the catalog showed `drained` alone, and an undrain printed
    `active (was drained)` for a provider its node's cordon still held."""
    path = tmp_path / "iop.yaml"
    path.write_text(yaml.safe_dump(POOL))
    where = ["--config", str(path), "--redis", redis_url]
    redis = sync_redis.Redis.from_url(redis_url)
    redis.hset(keys.heartbeat("vllm-a"), mapping={"health": "available", "capacity": 4, "ts_ms": now_ms()})
    assert iop(capsys, "provider", "drain", "vllm-a", *where)[0] == 0
    assert iop(capsys, "node", "cordon", "gpu-1", *where)[0] == 0
    code, out, _ = iop(capsys, "catalog", *where)
    row = next(line for line in out.splitlines() if line.split()[1:2] == ["vllm-a"])
    assert code == 0 and "  drained (and node)  " in row, row
    code, out, _ = iop(capsys, "provider", "drain", "vllm-a", *where)  # (drained already, and by its node)
    assert code == 0 and "provider vllm-a (node gpu-1): drained (its node is cordoned too), capacity 4" in out, out
    code, out, _ = iop(capsys, "provider", "undrain", "vllm-a", *where)
    assert code == 0 and "provider vllm-a (node gpu-1): drained (its node is cordoned), capacity 4" in out, out
    redis.close()


def test_an_override_above_the_announced_capacity_says_the_capacity_in_effect(
        redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by an operator helper: a node's workers announcing 2 (their config lowered it) while
    the command's config says 4, `iop provider capacity vllm-a 3` printed `capacity 3 (configured
    4)`, but the schedulers dispatch against 2 (the catalog's LOAD said 0/2)."""
    path = tmp_path / "iop.yaml"
    path.write_text(yaml.safe_dump(POOL))
    where = ["--config", str(path), "--redis", redis_url]
    redis = sync_redis.Redis.from_url(redis_url)
    redis.hset(keys.heartbeat("vllm-a"), mapping={"health": "available", "capacity": 2, "ts_ms": now_ms()})
    code, out, _ = iop(capsys, "provider", "capacity", "vllm-a", "3", *where)
    assert code == 0 and ("provider vllm-a (node gpu-1): active, capacity 2 (override 3, above the 2 its "
                          "workers announce; configured 4) until cleared, 0 in flight") in out, out
    code, out, _ = iop(capsys, "provider", "capacity", "vllm-a", "1", *where)  # below it: as before
    assert code == 0 and "provider vllm-a (node gpu-1): active, capacity 1 (configured 4) until cleared" in out, out
    redis.close()


@pytest.mark.parametrize(("args", "says"), [
    (["provider", "drain", "nope"], "no provider 'nope' in the config"),
    (["node", "cordon", "vllm-a"], "no node 'vllm-a' in the config ('vllm-a' is a provider, of node gpu-1)"),
    (["provider", "drain", "gpu-1"], "no provider 'gpu-1' in the config ('gpu-1' is a node)"),
    (["provider", "capacity", "vllm-a", "0"], "N: 0 is less than 1 (to take no runs, drain it)"),
    (["provider", "capacity", "vllm-a", "5"], "capacity: 5 is above vllm-a's configured capacity 4"),
    (["provider", "capacity", "vllm-a", "lots"], "N: 'lots' is not a whole number"),
    (["provider", "capacity", "vllm-a", "2", "--for", "8d"], "--for: '8d' is longer than 7d"),
    (["provider", "capacity", "vllm-a", "2", "--for", "0s"], "--for: '0s' is shorter than 1s"),
    (["provider", "capacity", "vllm-a", "clear", "--for", "1h"], "--for: only with a capacity"),
    # ASCII digits only, nothing around them
    (["provider", "capacity", "vllm-a", "\u00b2"], "N: '\u00b2' is not a whole number"),  # isdigit(), not int()
    (["provider", "capacity", "vllm-a", "\u0661"], "N: '\u0661' is not a whole number"),  # int() reads it as 1
    (["provider", "capacity", "vllm-a", "2", "--for", "\u0661h"], "--for: '\u0661h' is not a duration"),
    (["provider", "capacity", "vllm-a", "2", "--for", " 1h"], "--for: ' 1h' is not a duration"),
    (["provider", "capacity", "vllm-a", "2", "--for", "1h\n"], "--for: '1h\\n' is not a duration"),
])
def test_the_commands_refuse_bad_input_with_exit_2_in_one_line_and_change_nothing(
        redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], says: str) -> None:
    path = tmp_path / "iop.yaml"
    path.write_text(yaml.safe_dump(POOL))
    code, out, err = iop(capsys, *args, "--config", str(path), "--redis", redis_url)
    assert code == 2 and out == "" and err.startswith(f"error: {says}") and err.count("\n") == 1, err
    with sync_redis.Redis.from_url(redis_url) as redis:
        assert redis.keys("iop:*") == []


def test_a_change_in_a_redis_without_the_providers_heartbeats_warns_that_it_may_be_the_wrong_one(
        redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--redis` defaults to 127.0.0.1:6379: forgotten, a drain goes to whatever Redis is there."""
    path = tmp_path / "iop.yaml"
    path.write_text(yaml.safe_dump(POOL))
    where = ["--config", str(path), "--redis", redis_url]
    code, out, err = iop(capsys, "provider", "drain", "vllm-a", *where)
    assert code == 0 and out.startswith("drain provider vllm-a: drained")
    assert err == (f"warning: no provider it touched has a heartbeat in Redis at {redis_url}: no worker of its node "
                   "runs against it now (stopped, or --redis is not the pool's); the change is recorded there\n")
    with sync_redis.Redis.from_url(redis_url) as redis:
        redis.hset(keys.heartbeat("vllm-a"), mapping={"health": "available", "capacity": 4, "ts_ms": now_ms()})
    code, _, err = iop(capsys, "provider", "undrain", "vllm-a", *where)
    assert code == 0 and err == ""


def test_the_commands_exit_1_when_redis_is_down(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "iop.yaml"
    path.write_text(yaml.safe_dump(POOL))
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    code, _, err = iop(capsys, "provider", "drain", "vllm-a", "--config", str(path), "--redis", url)
    assert code == 1 and "cannot reach Redis" in err and "hunter2" not in err
    assert control_cmd.audit(url, 10, as_json=False) == 1


async def test_a_change_redis_did_not_answer_in_time_says_it_may_still_be_made(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A paused Redis runs what it had received once it resumes: a change answered "unavailable,
    retry shortly" (it said) was made all the same, and sent again, made twice; a drain then an
    undrain, both timed out, both applied. The answer says to look at the audit trail first."""
    server = RedisServer().start()
    url = server.url + "?socket_timeout=0.3"
    path = tmp_path / "iop.yaml"
    path.write_text(yaml.safe_dump(POOL))
    redis = Redis.from_url(server.url)
    try:
        await beat(redis, OPEN)
        async with serve(OPEN, url) as base:
            assert (await call("POST", base + "/v1/admin/providers/vllm-a/undrain"))[0] == 200  # (scripts loaded)
            with paused(server):
                status, body, headers = await call("POST", base + "/v1/admin/providers/vllm-a/drain")
                code, _, err = await asyncio.to_thread(iop, capsys, "node", "cordon", "gpu-2", "--config", str(path),
                                                       "--redis", url)
        assert (status, headers["Retry-After"]) == (503, "5"), body
        validate("ErrorResponse", body)
        assert body["error"]["message"] == ("Redis did not answer in time; the change may still be made when Redis "
                                            "answers (a paused Redis runs what it had received): look at the audit "
                                            "trail before sending it again (GET /v1/admin/audit)")
        assert code == 1 and err.count("\n") == 1 and "look at the audit trail" in err and "(iop audit)" in err, err
        # (what Redis had received ran once it resumed: here, both changes)
        async def both() -> bool:
            return bool(await redis.xlen(keys.AUDIT_STREAM) == 3)

        await async_wait_until(both, what="the two changes to be made")
        actions = [e[1][b"action"] for e in await redis.xrange(keys.AUDIT_STREAM)]
        assert actions[0] == b"undrain" and sorted(actions[1:]) == [b"cordon", b"drain"], actions
    finally:
        await redis.aclose()
        server.cleanup()
