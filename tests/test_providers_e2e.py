"""End to end with real providers of every kind: real iop processes (gateway, scheduler,
workers) on a real Redis, a fake Ollama (native API, in a thread of the test on port 0), the
simulator (OpenAI family) and a CLI script, driven with the official `openai` client.

- One model served by three providers of three types at once: each provider is asked for its
  own served name, and the caller always sees the model id (stream and non-stream).
- The legacy fixture (tests/fixtures/legacy.yaml), pointed at fakes, routes every model id
  to the same adapter and target as before, embeddings through Ollama included.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import redis as sync_redis
import yaml

from tests.conftest import Stack, wait_until
from tests.conftest import async_wait_until as until
from tests.fakes.ollama_server import FakeOllama, FakeState

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent
CLI_SCRIPT = str(ROOT / "fakes" / "cli_llm.py")
LEGACY = ROOT / "fixtures" / "legacy.yaml"
FAST_RUNTIME = {"heartbeat_interval_ms": 200, "heartbeat_ttl_ms": 1000, "probe_interval_ms": 200, "lease_ttl_ms": 2000,
                "scheduler_liveness_ms": 1000}
MODEL = "qwen3.6:35b"
SERVED = {"a-ollama": "qwen3.6:35b-q4_K_M", "b-cli": "qwen-cli", "c-sim": "Qwen/Qwen3.6-35B-A3B"}


class ThreadedOllama:
    """The fake Ollama on its own event loop in a thread, so the test's code may block."""

    def __init__(self, state: FakeState) -> None:
        self.fake = FakeOllama(state)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        return asyncio.run_coroutine_threadsafe(self.fake.start(), self.loop).result(10)

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.fake.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    def records(self) -> list[dict[str, Any]]:
        return list(self.fake.state.records)


@pytest.fixture
def ollama_factory(stack: Stack) -> Iterator[Callable[[FakeState], tuple[ThreadedOllama, str]]]:
    started: list[ThreadedOllama] = []

    def start(state: FakeState) -> tuple[ThreadedOllama, str]:
        fake = ThreadedOllama(state)
        url = fake.__enter__()
        started.append(fake)
        return fake, url

    yield start
    stack.stop_all()  # the worker goes before the servers it talks to (none connects while they stop)
    for fake in started:
        fake.__exit__()


def wait_available(redis_url: str, provider_ids: list[str]) -> None:
    client = sync_redis.Redis.from_url(redis_url)
    try:
        wait_until(lambda: all(client.hget(f"iop:provider:{p}", "health") == b"available" for p in provider_ids),
                   what=f"heartbeats of {provider_ids}")
    finally:
        client.close()




async def sim_stats(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(url + "/stats") as resp:
        data: dict[str, Any] = await resp.json()
        return data


def log_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def ask(client: openai.AsyncOpenAI, stream: bool) -> tuple[str, list[str], Any]:
    """(text, every `model` the caller saw, usage)."""
    messages: Any = [{"role": "user", "content": "hello from the pool"}]
    if not stream:
        reply = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
        return reply.choices[0].message.content or "", [reply.model], reply.usage
    chunks = [c async for c in await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, stream=True, stream_options={"include_usage": True})]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, [c.model for c in chunks], chunks[-1].usage


def test_one_model_on_ollama_the_simulator_and_a_cli_tool_at_once(
        stack: Stack, tmp_path: Path, ollama_factory: Callable[[FakeState], tuple[ThreadedOllama, str]]) -> None:
    ollama, ollama_url = ollama_factory(FakeState(models=[SERVED["a-ollama"]], hold=True, word="oll"))
    sim_url = stack.simulator([SERVED["c-sim"]])
    cli_log, hold_file = tmp_path / "cli.jsonl", tmp_path / "release-cli"
    command = [sys.executable, CLI_SCRIPT, "--model", "{model}", "--words", "2", "--log", str(cli_log),
               "--hold-file", str(hold_file)]
    # Equal capacities: the tie-break (provider id) sends the first run to a-ollama, the second
    # to b-cli; both hold their run until released, so the third can only go to c-sim.
    stack.write_config({
        "models": [{"id": MODEL, "providers": dict(SERVED)}],
        "nodes": [
            {"id": "box-1", "providers": [
                {"id": "a-ollama", "type": "ollama", "base_url": ollama_url, "capacity": 1,
                 "models": [SERVED["a-ollama"]]},
                {"id": "b-cli", "type": "cli", "command": command, "capacity": 1, "models": [SERVED["b-cli"]]}]},
            {"id": "box-2", "providers": [
                {"id": "c-sim", "type": "vllm", "base_url": sim_url, "capacity": 1, "models": [SERVED["c-sim"]]}]},
        ],
        "runtime": FAST_RUNTIME,
    })
    stack.scheduler()
    stack.worker("box-1")
    stack.worker("box-2")
    gateway = stack.gateway()
    wait_available(stack.redis_url, list(SERVED))

    async def one_round(stream: bool, n: int) -> None:
        client = openai.AsyncOpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0)
        calls = [asyncio.create_task(ask(client, stream)) for _ in range(3)]

        async def all_three_started() -> bool:
            held = sum(1 for r in ollama.records() if r.get("held"))
            return held == 1 and len(log_lines(cli_log)) == n and (await sim_stats(sim_url))["total"] == n

        await until(all_three_started, what="one run at each provider")
        async with aiohttp.ClientSession() as s, s.post(ollama_url + "/fake/release") as resp:
            assert resp.status == 200
        hold_file.touch()
        answers = await asyncio.gather(*calls)
        hold_file.unlink()
        await client.close()
        assert sorted(text for text, _, _ in answers) == ["oll0 oll1 oll2 ", "tok0 tok1 tok2 ", "w0 w1 "]
        for _, models, usage in answers:
            assert set(models) == {MODEL}  # never a served name
            assert usage is not None and usage.completion_tokens in (2, 3)

    asyncio.run(one_round(stream=True, n=1))
    asyncio.run(one_round(stream=False, n=2))

    # Each provider was asked for its own served name, once per round (Ollama as a stream both times:
    # a whole answer is its stream's lines merged).
    assert [(r["model"], r["stream"]) for r in ollama.records()] == [(SERVED["a-ollama"], True),
                                                                    (SERVED["a-ollama"], True)]
    assert [(line["model"], line["env_model"]) for line in log_lines(cli_log)] == [(SERVED["b-cli"],) * 2] * 2
    assert all(line["prompt"] == "hello from the pool" for line in log_lines(cli_log))
    stats = asyncio.run(sim_stats(sim_url))
    assert stats["by_model"] == {SERVED["c-sim"]: 2}

    # What neither Ollama nor the CLI tool can carry (n > 1, an image by URL) goes to the provider
    # that can at its first attempt (the gateway tells the queue which providers would refuse it:
    # each refusal used up one of its attempts, and with the tie-break sending it to a-ollama
    # first, a run with `max_attempts: 2` failed), and counts nothing against the two.
    client = stack.openai(gateway)
    image: Any = [{"role": "user", "content": [{"type": "text", "text": "what is it"},
                                               {"type": "image_url", "image_url": {"url": "https://example.com/c.png"}}]}]
    seen = client.chat.completions.create(model=MODEL, messages=image, max_tokens=2)
    assert seen.choices[0].message.content == "tok0 tok1 "
    for stream in (False, True):
        if stream:
            chunks = list(client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, n=2, stream=True))
            texts = {i: "".join(c.choices[0].delta.content or "" for c in chunks
                                if c.choices and c.choices[0].index == i) for i in (0, 1)}
        else:
            reply = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, n=2)
            texts = {c.index: c.message.content or "" for c in reply.choices}
        assert texts == {0: "tok0 tok1 ", 1: "tok0 tok1 "}, texts  # (both choices, each within max_tokens)
    assert asyncio.run(sim_stats(sim_url))["by_model"] == {SERVED["c-sim"]: 5}
    assert len(ollama.records()) == 2 and len(log_lines(cli_log)) == 2  # neither was sent it
    with sync_redis.Redis.from_url(stack.redis_url) as r:
        refused = [r.hmget(k, "refuse", "attempts", "tried") for k in r.scan_iter("iop:run:*")
                   if r.hexists(k, "refuse")]
        assert refused == [[b"a-ollama,b-cli", b"1", b"c-sim"]] * 3, refused
        for pid in ("a-ollama", "b-cli"):
            assert r.hget(f"iop:provider:{pid}", "fails") in (None, b"0")
            assert r.hget(f"iop:provider:{pid}", "health") == b"available"


def test_the_legacy_fixture_routes_every_model_as_before(
        stack: Stack, tmp_path: Path, ollama_factory: Callable[[FakeState], tuple[ThreadedOllama, str]]) -> None:
    data = yaml.safe_load(LEGACY.read_text())
    routes = {r["model"]: (r["adapter"], r["target"]) for r in data["openai"]["model_routes"]}
    targets = {adapter: [t for a, t in routes.values() if a == adapter] for adapter, _ in routes.values()}
    ollama, ollama_url = ollama_factory(FakeState(models=targets["ollama-b"]))
    urls = {"vllm-a": stack.simulator(targets["vllm-a"]), "hosted-c": stack.simulator(targets["hosted-c"]),
            "ollama-b": ollama_url}
    cli_log = tmp_path / "cli.jsonl"
    for node in data["nodes"]:  # the fixture as it is, pointed at the fakes
        for adapter in node["adapters"]:
            if adapter["type"] == "cli":
                adapter["command"] = [sys.executable, CLI_SCRIPT, "--model", "{model}", "--log", str(cli_log)]
            else:
                adapter["endpoint"] = urls[adapter["id"]]
    data["runtime"] = FAST_RUNTIME
    stack.write_config(data)
    stack.scheduler()
    stack.worker("gpu-1")
    stack.worker("gpu-2")
    gateway = stack.gateway()
    wait_available(stack.redis_url, list(targets))

    client = stack.openai(gateway)
    assert sorted(m.id for m in client.models.list().data) == sorted(routes)
    for model_id in routes:
        reply = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2)
        assert reply.model == model_id and reply.choices[0].message.content
    # Ollama's log probabilities, streamed, read as the official client reads them
    stream = client.chat.completions.create(model="llama3:8b", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=2, stream=True, logprobs=True, top_logprobs=1)
    said = [t for chunk in stream for c in chunk.choices if c.logprobs and c.logprobs.content
            for t in c.logprobs.content]
    assert [(t.token, [a.token for a in t.top_logprobs]) for t in said] == [("tok0 ", ["tok0 "]), ("tok1 ", ["tok1 "])]
    embedded = client.embeddings.create(model="llama3:8b", input=["one two", "three"])
    assert embedded.model == "llama3:8b" and [d.index for d in embedded.data] == [0, 1]
    assert embedded.data[0].embedding == [7.0, 0.5, -0.25, 1.0]

    seen = {adapter: asyncio.run(sim_stats(urls[adapter]))["by_model"] for adapter in ("vllm-a", "hosted-c")}
    assert seen["vllm-a"] == {routes["qwen3.6:35b"][1]: 1, routes["llama3.3:70b"][1]: 1}
    assert seen["hosted-c"] == {routes["gpt-4o-mini"][1]: 1}
    assert [(r["path"], r["model"]) for r in ollama.records()] == [
        (path, routes["llama3:8b"][1]) for path in ("/api/chat", "/api/chat", "/api/embed")]
    assert [line["model"] for line in log_lines(cli_log)] == [routes["local-cli"][1]]


def test_a_caller_leaving_stops_the_run_at_ollama_and_kills_the_cli_tool(
        stack: Stack, tmp_path: Path, ollama_factory: Callable[[FakeState], tuple[ThreadedOllama, str]]) -> None:
    ollama, ollama_url = ollama_factory(FakeState(models=["slow:latest"], hang_after=1))
    pid_file = tmp_path / "pids"
    command = [sys.executable, CLI_SCRIPT, "--model", "{model}", "--hang", "--pid-file", str(pid_file)]
    stack.write_config({
        "models": [{"id": "via-ollama", "providers": {"ollama-h": "slow:latest"}},
                   {"id": "via-cli", "providers": {"cli-h": "slow-cli"}}],
        "nodes": [{"id": "box", "providers": [
            {"id": "ollama-h", "type": "ollama", "base_url": ollama_url, "capacity": 1, "models": ["slow:latest"]},
            {"id": "cli-h", "type": "cli", "command": command, "capacity": 1, "models": ["slow-cli"]}]}],
        "runtime": FAST_RUNTIME,
    })
    stack.scheduler()
    stack.worker("box")
    gateway = stack.gateway()
    wait_available(stack.redis_url, ["ollama-h", "cli-h"])

    async def leave_after_first_output(model: str) -> None:
        body = {"model": model, "messages": [{"role": "user", "content": "x"}], "stream": True}
        async with aiohttp.ClientSession() as s, s.post(gateway + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            line = await resp.content.readline()
            assert line.startswith(b"data: ") and json.loads(line[6:])["model"] == model
        # leaving the block closes the connection: the caller is gone

    asyncio.run(leave_after_first_output("via-ollama"))
    wait_until(lambda: ollama.records() and ollama.records()[-1]["disconnected"], what="Ollama to see the disconnect")

    asyncio.run(leave_after_first_output("via-cli"))
    pids = [int(x) for x in pid_file.read_text().split()]

    wait_until(lambda: not any(alive(p) for p in pids), what="the cli tool's process group to be killed")


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent to reap it counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
