"""The gateway's stop (SIGTERM) with real processes and a real Redis: it stops listening, the run
requests in flight get `--grace` seconds to end, and those that outlast it are answered with an
error the caller can act on while their runs are cancelled (they were cut short without a word)."""

from __future__ import annotations

import asyncio
import json
import signal
from typing import Any

import aiohttp
import pytest
import redis as sync_redis

from iop.embedded_redis import RedisServer
from tests.conftest import Proc, Stack, paused, wait_until
from tests.test_e2e import pool_config, wait_available

pytestmark = pytest.mark.e2e

MODEL = "qwen3.6:35b"


def pool(stack: Stack, grace_s: str) -> tuple[str, Proc]:
    """One provider (capacity 4), a scheduler, a worker and a gateway with `--grace grace_s`."""
    url = stack.simulator(["vllm-a-served"])
    stack.write_config(pool_config({"vllm-a": ("node-a", url, 4)}))
    stack.scheduler()
    stack.worker("node-a")
    gateway = stack.start("gateway", "gateway", "--host", "127.0.0.1", "--port", "0", "--grace", grace_s)
    address = gateway.wait_for_line(r"listening on (http://\S+)").group(1)
    wait_available(stack.redis_url, ["vllm-a"])
    return address, gateway


def chat(stream: bool, tokens: int, itl_ms: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream,
            "max_tokens": tokens, "sim": {"tokens": tokens, "itl_ms": itl_ms, "ttft_ms": 0}}


def run_state(stack: Stack, run_id: str) -> bytes | None:
    r = sync_redis.Redis.from_url(stack.redis_url)
    try:
        state: bytes | None = r.hget(f"iop:run:{run_id}", "state")
        return state
    finally:
        r.close()


def leases(stack: Stack) -> int:
    r = sync_redis.Redis.from_url(stack.redis_url)
    try:
        return int(r.zcard("iop:leases:vllm-a"))
    finally:
        r.close()


def test_a_stream_that_ends_within_the_grace_comes_whole_and_no_new_connection_is_taken(stack: Stack) -> None:
    gateway, proc = pool(stack, "30")

    async def scenario() -> tuple[str, int]:
        async with aiohttp.ClientSession() as session:
            async with session.post(gateway + "/v1/chat/completions", json=chat(True, 20, 50)) as resp:
                assert resp.status == 200
                assert (await resp.content.readline()).startswith(b"data: ")  # the run is under way
                stopped = asyncio.create_task(asyncio.to_thread(proc.stop, 60))
                # (the gateway stops listening at once: a new caller goes to another gateway)
                await asyncio.to_thread(proc.wait_for_line, r"stopping: waiting up to 30s for 1 run requests")
                with pytest.raises(aiohttp.ClientConnectionError):
                    async with aiohttp.ClientSession() as other:
                        await other.get(gateway + "/healthz")
                rest = (await resp.read()).decode()
            return rest, await stopped

    rest, code = asyncio.run(scenario())
    assert code == 0, proc.output()
    assert rest.rstrip().endswith("data: [DONE]") and '"finish_reason":"length"' in rest and "error" not in rest
    assert "Traceback" not in proc.output()


def test_runs_that_outlast_the_grace_get_a_503_and_are_cancelled(stack: Stack) -> None:
    gateway, proc = pool(stack, "0.5")

    async def scenario() -> dict[str, Any]:
        async with aiohttp.ClientSession() as session:
            streamed = await session.post(gateway + "/v1/chat/completions", json=chat(True, 2000, 50))
            assert streamed.status == 200
            assert (await streamed.content.readline()).startswith(b"data: ")  # output is flowing
            whole = asyncio.create_task(session.post(gateway + "/v1/chat/completions", json=chat(False, 2000, 50)))
            await asyncio.to_thread(wait_until, lambda: leases(stack) == 2, what="both runs on the provider")
            code = await asyncio.to_thread(proc.stop, 30)
            answer = await whole
            return {"code": code, "stream": (await streamed.read()).decode(),
                    "stream_run": streamed.headers["X-IOP-Run-Id"], "status": answer.status,
                    "retry_after": answer.headers.get("Retry-After"), "error": (await answer.json())["error"],
                    "run": answer.headers.get("X-IOP-Run-Id")}

    got = asyncio.run(scenario())
    assert got["code"] == 0 and "Traceback" not in proc.output(), proc.output()
    # A stream whose headers went out: the error in it, then [DONE].
    lines = [line for line in got["stream"].split("\n") if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["code"] == "service_unavailable" and "did not end within 0.5 s of it" in error["message"]
    # A whole answer: 503 with Retry-After (the openai client sends it again).
    assert got["status"] == 503 and got["retry_after"] == "1" and got["error"]["code"] == "service_unavailable"
    # Both runs are cancelled and their slots are back: nothing goes on for nobody.
    runs = (got["stream_run"], got["run"])
    wait_until(lambda: all(run_state(stack, run_id) == b"cancelled" for run_id in runs), what="both runs cancelled")
    wait_until(lambda: leases(stack) == 0, what="the slots to come back")
    with sync_redis.Redis.from_url(stack.redis_url) as r:  # (why: it said "the caller went away")
        assert [r.hget(f"iop:run:{run_id}", "cancel_reason") for run_id in runs] == [
            b"the gateway stopped before the run ended"] * 2


def test_a_whole_answer_that_outlasts_the_grace_is_not_held_back_by_a_redis_that_does_not_answer(
        stack: Stack, redis_server: RedisServer) -> None:
    """Redis paused as the gateway stops: the caller whose run outlasted the grace hears its 503 at
    once, not after the run's cancel waited out `socket_timeout` (5 s: with the grace, past the 15 s
    that compose gives the container before its SIGKILL, which cut those callers' connections). The
    cancel reaches Redis once it answers, and the run's slot comes back."""
    gateway, proc = pool(stack, "0.5")

    async def scenario() -> tuple[int, dict[str, Any], str | None, str]:
        async with aiohttp.ClientSession() as session:
            whole = asyncio.create_task(session.post(gateway + "/v1/chat/completions", json=chat(False, 2000, 50)))
            await asyncio.to_thread(wait_until, lambda: leases(stack) == 1, what="the run on the provider")
            with paused(redis_server):
                proc.send(signal.SIGTERM)
                answer = await whole
                said = proc.output(400)  # (what the gateway had logged when its caller was answered)
                body = await answer.json()
                await asyncio.to_thread(proc.wait_for_line, "iop gateway stopped", 30)
            return answer.status, body["error"], answer.headers.get("X-IOP-Run-Id"), said

    status, error, run_id, said = asyncio.run(scenario())
    assert status == 503 and error["code"] == "service_unavailable", error
    assert "could not cancel yet" not in said, said  # (answered before the cancel waited for Redis)
    assert run_id is not None
    assert proc.stop(30) == 0 and "Traceback" not in proc.output(), proc.output()
    wait_until(lambda: run_state(stack, run_id) == b"cancelled", what="the run cancelled")
    wait_until(lambda: leases(stack) == 0, what="the slot to come back")


def test_a_second_signal_cuts_the_grace_short(stack: Stack) -> None:
    """Ctrl-C twice: the second SIGINT ends the wait of a 60 s grace at once; the stream gets its
    error and [DONE], its run is cancelled, and the gateway exits 0."""
    gateway, proc = pool(stack, "60")

    async def scenario() -> tuple[str, str]:
        async with aiohttp.ClientSession() as session:
            streamed = await session.post(gateway + "/v1/chat/completions", json=chat(True, 2000, 50))
            assert (await streamed.content.readline()).startswith(b"data: ")  # output is flowing
            proc.send(signal.SIGINT)
            await asyncio.to_thread(proc.wait_for_line, r"waiting up to 60s for 1 run requests")
            proc.send(signal.SIGINT)
            return (await streamed.read()).decode(), streamed.headers["X-IOP-Run-Id"]

    text, run_id = asyncio.run(scenario())
    assert proc.stop(30) == 0 and "Traceback" not in proc.output(), proc.output()
    assert "cut short after" in proc.output()  # (not after 60 s: the test would have timed out)
    lines = [line for line in text.split("\n") if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "service_unavailable"
    wait_until(lambda: run_state(stack, run_id) == b"cancelled", what="the run cancelled")


def test_a_runs_api_follower_is_told_the_gateway_stopped_and_where_to_resume(stack: Stack) -> None:
    """A follower of a run's events (`GET /v1/runs/{id}/events`) whose gateway stops ends with an
    `error` event, `service_unavailable`, naming Last-Event-ID, in a stream that ends whole (its
    connection was cut mid-chunk a second after the grace: a client saw a broken transfer, not why,
    where every other stream that ends before the run's end says so last)."""
    gateway, proc = pool(stack, "0.5")
    text, _ = asyncio.run(follow_while_stopping(gateway, gateway, proc, 2000))
    assert "Traceback" not in proc.output(), proc.output()
    # The run's caller was at this gateway too, and outlasted the grace: its run was cancelled. The
    # follower hears of that from the run itself when its end comes before the followers are cut
    # (it did in 1 of 2 runs on a busy machine), else from the gateway, which says so (it was told
    # the run goes on).
    last = text.rstrip("\n").split("\n\n")[-1].split("\n")
    if last[1] == "event: failed":
        assert json.loads(last[2].removeprefix("data: "))["message"] == "the gateway stopped before the run ended"
    else:
        error = last_error(text)
        assert error["code"] == "service_unavailable"
        assert "was cancelled with its caller's request" in error["message"], error


def test_a_runs_api_follower_of_a_run_another_gateway_serves_is_told_it_goes_on(stack: Stack) -> None:
    """Its caller waits at another gateway: the run goes on, and the follower resumes its events
    there with Last-Event-ID. (A follower of a run this gateway cancelled was told so too.)"""
    gateway, proc = pool(stack, "0.5")
    other = stack.start("gateway-b", "gateway", "--host", "127.0.0.1", "--port", "0")
    other_address = other.wait_for_line(r"listening on (http://\S+)").group(1)

    text, whole = asyncio.run(follow_while_stopping(other_address, gateway, proc, 60))
    error = last_error(text)
    assert error["code"] == "service_unavailable" and "goes on" in error["message"], error
    assert "Last-Event-ID" in error["message"]
    assert whole.rstrip().endswith(b"data: [DONE]") and b'"error"' not in whole  # (it did go on, to its end)


async def follow_while_stopping(asked_at: str, followed_at: str, proc: Proc, tokens: int) -> tuple[str, bytes]:
    """A stream of `tokens` asked at `asked_at`, its run's events followed at `followed_at`, and
    that gateway (`proc`) stopped once both flow: what the follower got, and the stream's answer."""
    async with aiohttp.ClientSession() as session:
        streamed = await session.post(asked_at + "/v1/chat/completions", json=chat(True, tokens, 50))
        assert (await streamed.content.readline()).startswith(b"data: ")  # output is flowing
        run_id = streamed.headers["X-IOP-Run-Id"]
        async with session.get(f"{followed_at}/v1/runs/{run_id}/events") as follower:
            assert (await follower.content.readline()).startswith(b"id: ")  # it follows
            stopped = asyncio.create_task(asyncio.to_thread(proc.stop, 30))
            text = (await follower.read()).decode()  # (a broken transfer raises ClientPayloadError)
        whole = await streamed.read()
        assert await stopped == 0
        return text, whole


def last_error(text: str) -> dict[str, Any]:
    """The `error` event that ends a runs-API event stream."""
    last = text.rstrip("\n").split("\n\n")[-1].split("\n")
    assert last[0] == "event: error", text[-500:]
    error: dict[str, Any] = json.loads(last[1].removeprefix("data: "))["error"]
    return error


def test_an_answer_sent_once_the_stop_began_says_its_connection_closes(stack: Stack) -> None:
    """A run request answered after SIGTERM: its connection closes after the answer (`pre_shutdown`),
    so the answer says `Connection: close`. Found in a rolling upgrade: without it, a client took the
    connection for kept alive, sent its next request on it at once, and got no answer at all."""
    gateway, proc = pool(stack, "30")

    async def scenario() -> tuple[str | None, str | None, int]:
        async with aiohttp.ClientSession() as session:
            async with session.post(gateway + "/v1/chat/completions", json=chat(False, 5, 0)) as resp:
                before = resp.headers.get("Connection")
            pending = asyncio.create_task(session.post(gateway + "/v1/chat/completions", json=chat(False, 20, 100)))
            await asyncio.to_thread(wait_until, lambda: leases(stack) == 1, 30, "the run to be dispatched")
            stopped = asyncio.create_task(asyncio.to_thread(proc.stop, 60))
            await asyncio.to_thread(proc.wait_for_line, r"stopping: waiting up to 30s for 1 run requests")
            async with await pending as resp:
                assert resp.status == 200, await resp.text()
                after = resp.headers.get("Connection")
            return before, after, await stopped

    before, after, code = asyncio.run(scenario())
    assert code == 0, proc.output()
    assert before != "close" and after == "close", (before, after)


def test_a_request_sent_after_a_stream_that_began_before_the_stop_is_answered_503(stack: Stack) -> None:
    """A stream whose headers went out before SIGTERM cannot say `Connection: close`. Once it ended, its
    client took the connection for kept alive and sent its next request on it at once. Found by an
    operator's rolling restart of two gateways under load: the gateway closed that connection
    unanswered while it waited for its other runs, so the caller got a connection error (`Server
    disconnected`), not an OpenAI-shaped error. Now that request is answered 503
    `service_unavailable` with `Retry-After: 1`, and the connection closes after it."""
    gateway, proc = pool(stack, "30")

    async def scenario() -> tuple[tuple[int, dict[str, str], dict[str, Any], str, int, int], int]:
        opened = 0

        async def on_create(*_: object) -> None:
            nonlocal opened
            opened += 1
        trace = aiohttp.TraceConfig()
        trace.on_connection_create_end.append(on_create)
        async with aiohttp.ClientSession() as other, \
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1), trace_configs=[trace]) as session:
            # a longer run keeps the gateway stopping after the stream's end (4 s against 1 s)
            longer = asyncio.create_task(other.post(gateway + "/v1/chat/completions", json=chat(False, 40, 100)))
            async with session.post(gateway + "/v1/chat/completions", json=chat(True, 10, 100)) as resp:
                assert resp.status == 200
                assert (await resp.content.readline()).startswith(b"data: ")  # the headers went out
                await asyncio.to_thread(wait_until, lambda: leases(stack) == 2, 30, "both runs on the provider")
                stopped = asyncio.create_task(asyncio.to_thread(proc.stop, 60))
                await asyncio.to_thread(proc.wait_for_line, r"stopping: waiting up to 30s for 2 run requests")
                rest = (await resp.read()).decode()
            async with session.post(gateway + "/v1/chat/completions", json=chat(False, 5, 0)) as nxt:
                got = (nxt.status, dict(nxt.headers), await nxt.json())
            async with await longer as whole:
                longer_status = whole.status
            return (*got, rest, opened, longer_status), await stopped

    (status, headers, body, rest, opened, longer_status), code = asyncio.run(scenario())
    assert code == 0 and "Traceback" not in proc.output(), proc.output()
    assert rest.rstrip().endswith("data: [DONE]") and "error" not in rest  # the stream came whole
    assert opened == 1  # (the next request went on the same connection: the gateway listens no more)
    assert status == 503 and body["error"]["code"] == "service_unavailable", body
    assert body["error"]["message"].startswith("the gateway is stopping")
    assert headers.get("Retry-After") == "1" and headers.get("Connection") == "close"
    assert longer_status == 200  # (the run the gateway waited for was answered in full)
