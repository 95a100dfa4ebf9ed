"""End to end: real processes (gateway, scheduler, workers, simulators) on a real Redis,
driven with the official `openai` client the way a caller would."""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.request
from typing import Any, Literal

import aiohttp
import openai
import pytest
import redis as sync_redis
from pydantic import BaseModel

from tests.conftest import Stack, async_wait_until, wait_until
from tests.openapi import validate

pytestmark = pytest.mark.e2e

FAST_RUNTIME = {"heartbeat_interval_ms": 200, "heartbeat_ttl_ms": 1000, "probe_interval_ms": 200, "lease_ttl_ms": 2000,
                "scheduler_liveness_ms": 1000}


def pool_config(providers: dict[str, tuple[str, str, int]], model: str = "qwen3.6:35b",
                queue: dict[str, int] | None = None) -> dict[str, Any]:
    """providers: id -> (node, base_url, capacity); served name = f"{id}-served"."""
    nodes: dict[str, list[dict[str, Any]]] = {}
    for pid, (node, url, capacity) in providers.items():
        nodes.setdefault(node, []).append(
            {"id": pid, "type": "vllm", "base_url": url, "capacity": capacity, "models": [f"{pid}-served"]})
    config: dict[str, Any] = {
        "models": [{"id": model, "display_name": "Test model",
                    "providers": {pid: f"{pid}-served" for pid in providers}}],
        "nodes": [{"id": n, "providers": ps} for n, ps in nodes.items()],
        "runtime": FAST_RUNTIME,
    }
    if queue:
        config["queue"] = queue
    return config


def wait_available(redis_url: str, provider_ids: list[str]) -> None:
    client = sync_redis.Redis.from_url(redis_url)

    def ready() -> bool:
        return all(client.hget(f"iop:provider:{p}", "health") == b"available" for p in provider_ids)

    wait_until(ready, what=f"heartbeats of {provider_ids}")
    client.close()


def one_node_gateway(stack: Stack, models: list[dict[str, Any]], providers: list[dict[str, Any]],
                     available: list[str] | None = None) -> str:
    """A config of `models` and one node, `n1`, of `providers` (FAST_RUNTIME, 3 attempts a run), its
    scheduler, its worker and a gateway, once those providers (or the `available` of them) are
    available: the gateway's URL."""
    stack.write_config({"models": models, "nodes": [{"id": "n1", "providers": providers}],
                        "runtime": FAST_RUNTIME, "queue": {"max_attempts": 3}})
    stack.scheduler()
    stack.worker("n1")
    url = stack.gateway()
    wait_available(stack.redis_url, [p["id"] for p in providers] if available is None else available)
    return url


def start_pool(stack: Stack, capacities: dict[str, int], queue: dict[str, int] | None = None,
               sim_args: tuple[str, ...] = ()) -> tuple[str, dict[str, str]]:
    """One simulator and one node per provider, a scheduler, a worker per node, the gateway."""
    urls = {pid: stack.simulator([f"{pid}-served"], *sim_args) for pid in capacities}
    stack.write_config(pool_config(
        {pid: (f"node-{pid}", urls[pid], cap) for pid, cap in capacities.items()}, queue=queue))
    stack.scheduler()
    for pid in capacities:
        stack.worker(f"node-{pid}")
    gateway = stack.gateway()
    wait_available(stack.redis_url, list(capacities))
    return gateway, urls


async def sim_stats(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url + "/stats") as resp:
        data: dict[str, Any] = await resp.json()
        return data


def test_openai_client_stream_and_non_stream(stack: Stack) -> None:
    gateway, urls = start_pool(stack, {"vllm-a": 2, "vllm-b": 2})
    client = stack.openai(gateway)

    models = client.models.list()
    assert [m.id for m in models.data] == ["qwen3.6:35b"]
    validate("ListModelsResponse", models.model_dump(exclude_unset=True))

    raw = client.chat.completions.with_raw_response.create(
        model="qwen3.6:35b", messages=[{"role": "user", "content": "hello there"}], max_tokens=4,
        temperature=0.3)
    assert raw.headers["x-iop-run-id"].startswith("run_")
    assert raw.request_id == raw.headers["x-iop-run-id"]  # OpenAI's x-request-id: the client's `_request_id`
    chat = raw.parse()
    assert chat.model == "qwen3.6:35b"
    assert chat.choices[0].message.content == "tok0 tok1 tok2 tok3 "
    validate("CreateChatCompletionResponse", json.loads(raw.text))

    chunks = list(client.chat.completions.create(
        model="qwen3.6:35b", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True,
        stream_options={"include_usage": True}))
    assert chunks and all(c.model == "qwen3.6:35b" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "tok0 tok1 tok2 "
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    for c in chunks:
        validate("CreateChatCompletionStreamResponse", c.model_dump(exclude_unset=True))

    completion = client.completions.create(model="qwen3.6:35b", prompt="say", max_tokens=2)
    assert completion.model == "qwen3.6:35b" and completion.choices[0].text == "tok0 tok1 "
    validate("CreateCompletionResponse", completion.model_dump(exclude_unset=True))
    streamed = list(client.completions.create(model="qwen3.6:35b", prompt="say", max_tokens=2, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == "tok0 tok1 "
    assert all(c.model == "qwen3.6:35b" for c in streamed)

    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert err.value.code == "model_not_found"
    validate("ErrorResponse", err.value.response.json())
    # (an endpoint of the client that iop does not serve: a 404 that says what it does serve)
    with pytest.raises(openai.NotFoundError) as err:
        client.audio.speech.create(model="qwen3.6:35b", input="x", voice="alloy")
    assert "Invalid URL (POST /v1/audio/speech)" in err.value.message and "/v1/responses" in err.value.message
    validate("ErrorResponse", err.value.response.json())
    # (stored chat completions: iop keeps none, and says so as for a stored Response, whatever `store` said)
    stored = client.chat.completions.create(model="qwen3.6:35b", messages=[{"role": "user", "content": "x"}],
                                            max_tokens=1, store=True)
    for call in (lambda: client.chat.completions.retrieve(stored.id), lambda: client.chat.completions.list(),
                 lambda: client.chat.completions.messages.list(stored.id)):
        with pytest.raises(openai.NotFoundError) as err:
            call()
        assert "iop keeps no chat completions" in err.value.message and "GET /v1/runs/" in err.value.message
        validate("ErrorResponse", err.value.response.json())

    async def served_names() -> dict[str, dict[str, int]]:
        async with aiohttp.ClientSession() as session:
            return {pid: (await sim_stats(session, url))["by_model"] for pid, url in urls.items()}

    seen = asyncio.run(served_names())
    # Each simulator only ever heard its own provider's served name, never the model id.
    for pid, by_model in seen.items():
        assert set(by_model) <= {f"{pid}-served"}
    assert sum(sum(by_model.values()) for by_model in seen.values()) == 5  # (four above, one stored)


async def _hold_streams(gateway: str, n: int, ttft_ms: int) -> list[asyncio.Task[int]]:
    """n streamed chat runs that sit at the provider for ttft_ms."""
    async def one(session: aiohttp.ClientSession) -> int:
        body = {"model": "qwen3.6:35b", "messages": [{"role": "user", "content": "x"}], "stream": True,
                "max_tokens": 1, "sim": {"ttft_ms": ttft_ms}}
        async with session.post(gateway + "/v1/chat/completions", json=body) as resp:
            await resp.read()
            return resp.status

    session = aiohttp.ClientSession()
    tasks = [asyncio.create_task(one(session)) for _ in range(n)]
    _SESSIONS.append(session)
    return tasks


_SESSIONS: list[aiohttp.ClientSession] = []


async def _close_sessions() -> None:
    while _SESSIONS:
        await _SESSIONS.pop().close()


def test_a_tool_call_reaches_the_openai_client_whole_streamed_and_as_a_response_s_item(stack: Stack) -> None:
    """What a caller of tools sees through iop, from the simulator asked for a call (`tool_choice`)."""
    gateway, urls = start_pool(stack, {"vllm-a": 1})
    client = stack.openai(gateway)
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages: Any = [{"role": "user", "content": "weather?"}]
    raw = client.chat.completions.with_raw_response.create(model="qwen3.6:35b", messages=messages, tools=tools,
                                                           tool_choice="required")
    validate("CreateChatCompletionResponse", json.loads(raw.text))
    choice = raw.parse().choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls is not None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and (call.function.name, call.function.arguments) == ("get_weather", "{}")
    chunks = list(client.chat.completions.create(model="qwen3.6:35b", messages=messages, tools=tools,
                                                 tool_choice="required", stream=True))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert deltas[0].function is not None and deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas if d.function) == "{}"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    response = client.responses.create(model="qwen3.6:35b", input="weather?", tool_choice="required",
                                       tools=[{"type": "function", "name": "get_weather", "strict": False,
                                               "parameters": {"type": "object"}}])
    validate("Response", response.model_dump(exclude_unset=True))
    (item,) = response.output
    assert item.type == "function_call" and (item.name, item.arguments) == ("get_weather", "{}")


class Forecast(BaseModel):
    """What an application asks for with the `openai` client's parse helpers (a pydantic model)."""

    city: str
    days: list[int]
    unit: Literal["celsius", "fahrenheit"]
    note: str | None


_JSON_SCHEMA: Any = {"type": "json_schema", "json_schema": {"name": "f", "schema": Forecast.model_json_schema()}}


def test_the_openai_client_s_parse_helpers_read_what_the_simulator_answers(stack: Stack) -> None:
    """`iop dev`'s simulator answered text to a `response_format` and `{}` to any tool: every parse helper
    of the `openai` client (`chat.completions.parse`, its `stream`, `pydantic_function_tool`,
    `responses.parse`) raised pydantic's ValidationError on it, so an application could not be tried
    against the demo stack. It answers JSON its schema takes now, whole and streamed."""
    gateway, _ = start_pool(stack, {"vllm-a": 2})
    client = stack.openai(gateway)
    messages: Any = [{"role": "user", "content": "forecast?"}]
    parsed = client.chat.completions.parse(model="qwen3.6:35b", messages=messages, response_format=Forecast)
    assert isinstance(parsed.choices[0].message.parsed, Forecast) and parsed.choices[0].finish_reason == "stop"
    with client.chat.completions.stream(model="qwen3.6:35b", messages=messages, response_format=Forecast) as stream:
        kinds = {event.type for event in stream}
        final = stream.get_final_completion()
    assert {"content.delta", "content.done"} <= kinds
    assert final.choices[0].message.parsed == parsed.choices[0].message.parsed
    called = client.chat.completions.parse(model="qwen3.6:35b", messages=messages,
                                           tools=[openai.pydantic_function_tool(Forecast)], tool_choice="required")
    (call,) = called.choices[0].message.tool_calls or []
    assert isinstance(call.function.parsed_arguments, Forecast)
    response = client.responses.parse(model="qwen3.6:35b", input="forecast?", text_format=Forecast)
    assert isinstance(response.output_parsed, Forecast)
    whole = client.chat.completions.create(model="qwen3.6:35b", messages=messages,
                                           response_format={"type": "json_object"}, extra_body={"sim": {"tokens": 3}})
    assert json.loads(whole.choices[0].message.content or "") == {"text": "tok0 tok1 tok2"}
    cut = client.chat.completions.create(model="qwen3.6:35b", messages=messages, response_format=_JSON_SCHEMA,
                                         max_tokens=3)  # (cut at its limit, as a model's JSON is)
    assert (cut.choices[0].finish_reason, cut.choices[0].message.content) == ("length", '{"city')


def test_the_openai_client_s_own_retries_run_again_only_what_may_end_otherwise(stack: Stack) -> None:
    """The official client retries every 429 and 5xx twice unless told not to (`x-should-retry`); what
    reached the provider is counted: one run for a run cut at its `execution_timeout_ms` or a provider's
    400, three for a provider's 500 or a provider too busy (after the `retry-after-ms` it was told)."""
    gateway, urls = start_pool(stack, {"only": 4},
                               queue={"execution_timeout_ms": 700, "max_attempts": 1, "queue_timeout_ms": 60000})
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=2)
    stack.clients.append(client)
    messages: Any = [{"role": "user", "content": "x"}]

    def runs_of(sim: dict[str, Any], error: type[openai.APIStatusError], status: int) -> int:
        before: int = _stats(urls["only"])["total"]
        with pytest.raises(error) as caught:
            client.chat.completions.create(model="qwen3.6:35b", messages=messages, max_tokens=1,
                                           extra_body={"sim": sim})
        assert caught.value.status_code == status
        total: int = _stats(urls["only"])["total"]
        return total - before

    assert runs_of({"ttft_ms": 60_000}, openai.InternalServerError, 504) == 1
    assert runs_of({"fail_status": 400}, openai.BadRequestError, 400) == 1
    assert runs_of({"fail_status": 500}, openai.InternalServerError, 502) == 3
    assert runs_of({"fail_status": 429, "fail_retry_after": "1"}, openai.InternalServerError, 503) == 3
    wait_until(lambda: _stats(urls["only"])["current"] == 0, what="the timed-out run to end at the provider")


def _stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/stats") as resp:
        data: dict[str, Any] = json.load(resp)
        return data


def test_capacity_1_and_3_split_four_long_runs(stack: Stack) -> None:
    gateway, urls = start_pool(stack, {"small": 1, "large": 3})

    async def scenario() -> None:
        tasks = await _hold_streams(gateway, 4, ttft_ms=2000)
        async with aiohttp.ClientSession() as session:
            async def running() -> dict[str, int] | None:
                current = {pid: (await sim_stats(session, url))["current"] for pid, url in urls.items()}
                return current if sum(current.values()) == 4 else None

            current = await async_wait_until(running, what="four runs at the providers")
            assert current == {"small": 1, "large": 3}
            assert [await t for t in tasks] == [200, 200, 200, 200]
            for pid, url in urls.items():
                stats = await sim_stats(session, url)
                assert stats["max_concurrent"] == {"small": 1, "large": 3}[pid]
                assert stats["by_model"] == {f"{pid}-served": {"small": 1, "large": 3}[pid]}
        await _close_sessions()

    asyncio.run(scenario())


def test_burst_past_max_queue_gets_exactly_the_overflow_as_429(stack: Stack) -> None:
    gateway, urls = start_pool(stack, {"only": 1}, queue={"max_queue": 3, "queue_timeout_ms": 60000})
    r = sync_redis.Redis.from_url(stack.redis_url)

    async def scenario() -> None:
        holder = await _hold_streams(gateway, 1, ttft_ms=600_000)
        async with aiohttp.ClientSession() as session:
            await async_wait_until(lambda: _current(session, urls["only"], 1), what="the slot to be taken")

            async def one() -> tuple[int, str | None]:
                body = {"model": "qwen3.6:35b", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
                async with session.post(gateway + "/v1/chat/completions", json=body) as resp:
                    if resp.status == 429:
                        validate("ErrorResponse", await resp.json())
                    return resp.status, resp.headers.get("Retry-After")

            burst = [asyncio.create_task(one()) for _ in range(12)]
            rejected = await async_wait_until(lambda: _done_429(burst, 9), what="nine 429 answers")
            assert len(rejected) == 9 and all(h is not None for _, h in rejected)
            assert r.xlen("iop:runs:qwen3.6:35b") == 3
            holder[0].cancel()  # the caller leaves: its run is cancelled and the slot frees
            statuses = sorted(s for s, _ in await asyncio.gather(*burst))
            assert statuses == [200] * 3 + [429] * 9
        await _close_sessions()
        assert r.xlen("iop:runs:qwen3.6:35b") == 0

    asyncio.run(scenario())
    r.close()


async def _current(session: aiohttp.ClientSession, url: str, n: int) -> bool:
    return bool((await sim_stats(session, url))["current"] == n)


async def _done_429(tasks: list[asyncio.Task[tuple[int, str | None]]], n: int) -> list[tuple[int, str | None]]:
    done = [t.result() for t in tasks if t.done() and t.result()[0] == 429]
    return done if len(done) >= n else []


def test_run_without_a_slot_in_time_gets_504(stack: Stack) -> None:
    gateway, urls = start_pool(stack, {"only": 1}, queue={"max_queue": 8, "queue_timeout_ms": 300})

    async def scenario() -> None:
        holder = await _hold_streams(gateway, 1, ttft_ms=600_000)
        async with aiohttp.ClientSession() as session:
            await async_wait_until(lambda: _current(session, urls["only"], 1), what="the slot to be taken")
            body = {"model": "qwen3.6:35b", "messages": [{"role": "user", "content": "x"}]}
            async with session.post(gateway + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 504
                error = await resp.json()
                validate("ErrorResponse", error)
                assert error["error"]["code"] == "queue_timeout"
                # (another try would wait as long again: the official clients' two retries made a
                # 30 s queue_timeout_ms a wait of ~90 s before the caller heard of it)
                assert resp.headers.get("x-should-retry") == "false"
            holder[0].cancel()
        await _close_sessions()

    asyncio.run(scenario())


def test_a_run_every_provider_was_too_busy_for_is_a_503_that_says_when_to_try_again(stack: Stack) -> None:
    """Both providers answer 429 (a hosted API's rate limit) or 503 (vLLM overloaded): the caller
    gets a 503 with the last one's `Retry-After` (the official `openai` client waits it before its
    own retry), or 1 s when it gave none; found by a hostile-provider audit: a 502 without it, so
    the client tried again within a second, into a provider that had asked for seven. Each provider
    is then left alone for the model as long as it asked (benched: a hosted API answering 429
    `Retry-After: 30` got every new run first, 194 a second, keeping its key at its rate limit): the
    next caller's run waits in its queue, no provider asked (busy is not down: it is not refused),
    and goes when the bench ends (here ended by hand, as if the time had passed); a bench that ends
    after the run's queue_timeout_ms fails it at once, a 503 saying when the bench ends."""
    gateway, urls = start_pool(stack, {"a": 1, "b": 1})
    r = sync_redis.Redis.from_url(stack.redis_url)

    def unbench() -> None:
        for provider in ("a", "b"):
            assert r.hdel(f"iop:provider:{provider}", f"bench:{provider}-served") == 1

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            async def call(sim: dict[str, Any], stream: bool) -> tuple[int, str | None, dict[str, Any]]:
                body = {"model": "qwen3.6:35b", "messages": [{"role": "user", "content": "x"}], "sim": sim,
                        "stream": stream}
                async with session.post(gateway + "/v1/chat/completions", json=body) as resp:
                    return resp.status, resp.headers.get("Retry-After"), await resp.json()

            async def one_waiting() -> bool:
                return bool(r.xlen("iop:runs:qwen3.6:35b") == 1)

            async def asked() -> list[int]:
                return [(await sim_stats(session, url))["total"] for url in urls.values()]

            for n, (status, said, expected) in enumerate(((429, "7", "7"), (503, None, "1"), (429, "86400", "60"))):
                sim = {"fail_status": status, **({"fail_retry_after": said} if said else {})}
                answer = await call(sim, False)  # tried on both, each too busy
                assert answer[:2] == (503, expected), answer
                validate("ErrorResponse", answer[2])
                assert answer[2]["error"]["code"] == "provider_error"
                assert answer[2]["error"]["message"].startswith(("provider a answered", "provider b answered"))
                assert await asked() == [2 * n + 1] * 2
                if expected == "60":  # (back after the run's queue_timeout_ms, 30 s: it fails now, saying when)
                    answer = await call(sim, True)
                    assert answer[0] == 503 and answer[2]["error"]["code"] == "no_available_provider", answer
                    assert answer[1] is not None and 59 <= int(answer[1]) <= 60
                    assert await asked() == [2 * n + 1] * 2
                    continue
                waiting = asyncio.create_task(call(sim, True))  # both benched: it waits, no provider asked
                await async_wait_until(one_waiting, what="the run to wait")
                assert await asked() == [2 * n + 1] * 2 and not waiting.done()
                unbench()
                answer = await waiting  # (on both again, each too busy again)
                assert answer[:2] == (503, expected) and answer[2]["error"]["code"] == "provider_error", answer
                assert await asked() == [2 * n + 2] * 2
                unbench()

    try:
        asyncio.run(scenario())
    finally:
        r.close()


def test_every_service_runs_over_a_unix_socket(tmp_path: Any) -> None:
    """`REDIS_URL=unix:///path.sock?db=N` (a Redis beside the services): the gateway, the
    scheduler and the workers connect over the socket (Redis's CLIENT LIST shows each on it),
    and runs complete, streamed and not. (Every service crashed on such a URL: redis-py's Unix
    socket connection takes no TCP keepalive option.)"""
    from pathlib import Path

    from iop.embedded_redis import RedisServer
    from tests.conftest import Stack as ServiceStack

    sock = Path(tmp_path) / "redis.sock"
    server = RedisServer(unix_socket=str(sock)).start()
    stack = ServiceStack(Path(tmp_path), server.unix_url)
    try:
        gateway, _ = start_pool(stack, {"vllm-a": 2})
        client = stack.openai(gateway)
        answer = client.chat.completions.create(model="qwen3.6:35b", messages=[{"role": "user", "content": "hi"}])
        assert answer.model == "qwen3.6:35b" and answer.choices[0].message.content
        chunks = list(client.chat.completions.create(model="qwen3.6:35b", stream=True,
                                                     messages=[{"role": "user", "content": "hi"}]))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        over_tcp = sync_redis.Redis(port=server.port)
        names = {c["name"].split(":")[0]: c["addr"] for c in over_tcp.client_list() if c["name"].startswith("iop-")}
        over_tcp.close()
        assert {"iop-gateway", "iop-scheduler", "iop-worker"} <= set(names)
        # (each on the socket: Redis shows `{path}:0` as its `addr`, cut short past 77 characters, as a
        # pytest-xdist worker's longer temporary path is; a TCP client's is host:port)
        assert all(addr and f"{sock}:0".startswith(addr) for addr in names.values()), names
    finally:
        stack.stop_all()
        server.cleanup()


def one_worker_pool(stack: Stack, capacity: int, grace_s: str) -> tuple[str, Any]:
    """Provider vllm-a on node-a with one worker (`--grace grace_s`), a scheduler and the gateway:
    (the gateway's URL, the worker's process)."""
    url = stack.simulator(["vllm-a-served"])
    stack.write_config(pool_config({"vllm-a": ("node-a", url, capacity)}))
    stack.scheduler()
    worker = stack.start("worker-node-a", "worker", "--node", "node-a", "--grace", grace_s)
    worker.wait_for_line(r"worker for queue \S+ started")
    gateway = stack.gateway()
    wait_available(stack.redis_url, ["vllm-a"])
    return gateway, worker


def test_a_worker_stopped_while_a_run_outlasts_its_grace_exits_0_and_the_run_ends(stack: Stack) -> None:
    """SIGTERM, and a run still going when `--grace` ran out: the run is cut (its caller hears
    worker_lost), and the worker stops cleanly, status 0, no traceback (it exited 1 with one, its
    HTTP session left open)."""
    gateway, worker = one_worker_pool(stack, capacity=1, grace_s="0.5")

    async def scenario() -> str:
        body = {"model": "qwen3.6:35b", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                "max_tokens": 1000, "sim": {"tokens": 1000, "itl_ms": 50}}
        async with aiohttp.ClientSession() as session:
            async with session.post(gateway + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                first = await resp.content.readline()  # output is flowing: the run is on the worker
                assert first.startswith(b"data: ")
                code = await asyncio.to_thread(worker.stop, 30)
                assert code == 0, worker.output()
                return (await resp.read()).decode()

    rest = asyncio.run(scenario())
    assert '"code":"worker_lost"' in rest and rest.rstrip().endswith("data: [DONE]")
    assert "Traceback" not in worker.output() and "Unclosed" not in worker.output()


def test_runs_are_not_sent_to_a_node_whose_last_worker_is_stopping(stack: Stack) -> None:
    """The node's only worker got SIGTERM and finishes its run within its grace: it takes its
    provider's heartbeat away at once (no worker of the node lives on), without waiting for it to
    lapse, so a new run is refused (503, as for a provider that is down) instead of being
    dispatched to a node no worker will serve, to wait out a lease there (an attempt spent, 504s
    later). The next worker of the node serves runs."""
    gateway, stopping = one_worker_pool(stack, capacity=2, grace_s="30")
    r = sync_redis.Redis.from_url(stack.redis_url)
    long = {"model": "qwen3.6:35b", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "max_tokens": 1000, "sim": {"tokens": 1000, "itl_ms": 5}}
    short = {"model": "qwen3.6:35b", "messages": [{"role": "user", "content": "hi"}]}

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            async with session.post(gateway + "/v1/chat/completions", json=long) as running:
                assert (await running.content.readline()).startswith(b"data: ")  # on the worker
                stopping.send(signal.SIGTERM)

                await asyncio.to_thread(stopping.wait_for_line, r"the node's last worker stops")
                assert not r.exists("iop:provider:vllm-a")  # (taken away, not lapsed: the line above says so)
                async with session.post(gateway + "/v1/chat/completions", json=short) as refused:
                    assert refused.status == 503
                    assert (await refused.json())["error"]["code"] == "no_available_provider"
                assert r.llen("iop:wake:node-a") == 0 and r.zcard("iop:leases:vllm-a") == 1  # only the running one
                assert (await running.read()).rstrip().endswith(b"data: [DONE]")  # the grace let it end
            assert await asyncio.to_thread(stopping.popen.wait, 30) == 0
            assert stopping.wait_for_line(r"iop worker for node node-a stopped", timeout=5)  # its last line
            await asyncio.to_thread(stack.worker, "node-a")
            await asyncio.to_thread(wait_available, stack.redis_url, ["vllm-a"])
            async with session.post(gateway + "/v1/chat/completions", json=short) as served:
                assert served.status == 200

    try:
        asyncio.run(scenario())
    finally:
        r.close()


def test_a_worker_whose_config_lacks_a_provider_leaves_its_runs_to_the_node_s_other_worker(stack: Stack) -> None:
    """A rollout half done: provider b was added to node-a, and only one of the node's two workers
    runs the new config. The old one, blocked on the node's wake list like the other, took about
    every other run of b off it, and failed it ("provider b is not on node node-a"): an attempt
    spent each time, and with `max_attempts` 1 its caller got 503. Now it passes them over to the
    worker that serves b: every run completes, on its first attempt."""
    url = stack.simulator(["a-served", "b-served"])
    providers = {"a": {"id": "a", "type": "vllm", "base_url": url, "capacity": 8, "models": ["a-served"]},
                 "b": {"id": "b", "type": "vllm", "base_url": url, "capacity": 8, "models": ["b-served"]}}
    model_a = {"id": "m-a", "providers": {"a": "a-served"}}
    old = stack.tmp / "old.yaml"
    old.write_text(json.dumps({"models": [model_a], "nodes": [{"id": "node-a", "providers": [providers["a"]]}],
                               "runtime": FAST_RUNTIME, "queue": {"max_attempts": 1}}))
    stack.write_config({"models": [model_a, {"id": "m-b", "providers": {"b": "b-served"}}],
                        "nodes": [{"id": "node-a", "providers": [providers["a"], providers["b"]]}],
                        "runtime": FAST_RUNTIME, "queue": {"max_attempts": 1}})
    stack.scheduler()
    stack.worker("node-a")
    old_worker = stack.worker("node-a", "--config", str(old))
    gateway = stack.gateway()
    wait_available(stack.redis_url, ["a", "b"])

    async def call(session: aiohttp.ClientSession, i: int) -> tuple[int, str]:
        body = {"model": "m-b", "messages": [{"role": "user", "content": f"hi {i}"}]}
        async with session.post(gateway + "/v1/chat/completions", json=body) as resp:
            return resp.status, await resp.text()

    async def calls() -> list[tuple[int, str]]:
        async with aiohttp.ClientSession() as session:
            answers = []
            for _ in range(4):  # (rounds: both workers idle, blocked on the wake list, at each one's start)
                answers += await asyncio.gather(*(call(session, i) for i in range(8)))
            return answers

    answers = asyncio.run(calls())
    assert [status for status, _ in answers] == [200] * 32, [text for status, text in answers if status != 200]
    # (it did take some off the wake list: the case is the one above, not luck of the draw)
    assert old_worker.wait_for_line(r"runs of model 'm-b' on provider b are left to the node's other workers")
    r = sync_redis.Redis.from_url(stack.redis_url)
    try:
        assert r.llen("iop:passed:node-a") == 0 and r.zcard("iop:node:node-a") == 0
    finally:
        r.close()


def test_a_node_named_like_another_s_health_check_key_runs(stack: Stack) -> None:
    """arq wrote node n1's health check at `{its queue}:health-check`, which is the queue of a node
    named `n1:health-check` (ids may hold ':'): that node's worker died on WRONGTYPE at its first
    poll, for an hour (found by an operator's audit). The health check has a key of its own now."""
    url = stack.simulator(["a-served", "b-served"])
    stack.write_config({
        "models": [{"id": "m-a", "providers": {"a": "a-served"}}, {"id": "m-b", "providers": {"b": "b-served"}}],
        "nodes": [{"id": "n1", "providers": [{"id": "a", "type": "vllm", "base_url": url, "capacity": 1,
                                              "models": ["a-served"]}]},
                  {"id": "n1:health-check", "providers": [{"id": "b", "type": "vllm", "base_url": url,
                                                           "capacity": 1, "models": ["b-served"]}]}],
        "runtime": FAST_RUNTIME})
    stack.scheduler()
    stack.worker("n1")  # (first: it writes its health check as it starts)
    other = stack.worker("n1:health-check")
    gateway = stack.gateway()
    wait_available(stack.redis_url, ["a", "b"])
    client = stack.openai(gateway)
    for model in ("m-b", "m-a", "m-b"):
        answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
        assert answer.choices[0].message.content
    assert other.popen.poll() is None and "WRONGTYPE" not in other.output()
