"""A whole answer of the OpenAI family is waited for while its server's health check passes
(`workers.adapters.silence`): vLLM and its kin send nothing of a non-stream answer, its head
included, until it is done, so a generation longer than `read_timeout_ms` was a 504 and a strike on a
healthy server, and was tried on another for as long again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from common.config import ProviderConfig
from common.policy import Health
from common.wire import ErrorCode, RunKind
from tests.conftest import async_wait_until as until
from workers.adapters.base import ProbeResult, ProviderError, Retry
from workers.adapters.openai_compat import OpenAICompatAdapter
from workers.adapters.sending import PoolConnector
from workers.adapters.silence import SilenceWatch

SERVED = "m"


class Busy:
    """A server that generates a whole answer for as long as the test says: its chat answer waits for
    `done`; its `/health` answers (`checks` counts them) until `hang` is set, then never."""

    def __init__(self, health: bool = True) -> None:
        #: whether it has `/health` (llama-cpp-python's server has none)
        self.health = health
        #: model lists asked for
        self.listed = 0
        self.done = asyncio.Event()
        self.hang = asyncio.Event()
        self.down = asyncio.Event()
        self.stopping = asyncio.Event()
        #: checks asked, and answered
        self.asked = 0
        self.checks = 0
        self.checked = asyncio.Condition()
        self.runner: web.AppRunner | None = None

    async def _health(self, request: web.Request) -> web.Response:
        async with self.checked:
            self.asked += 1
            self.checked.notify_all()
        if self.hang.is_set():
            await self.stopping.wait()  # (never while the test runs)
        async with self.checked:
            self.checks += 1
            self.checked.notify_all()
        if self.down.is_set():  # (vLLM's engine dead: its /health answers 500)
            return web.json_response({"error": "engine dead"}, status=500)
        return web.Response()

    async def _models(self, request: web.Request) -> web.Response:
        self.listed += 1
        return web.json_response({"object": "list", "data": [{"id": SERVED, "object": "model"}]})

    async def _chat(self, request: web.Request) -> web.Response:
        await self.done.wait()
        return web.json_response({"id": "c", "object": "chat.completion", "created": 1, "model": SERVED,
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "long"},
                                               "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    async def checks_reach(self, n: int, answered: bool = True) -> None:
        async with self.checked:
            await self.checked.wait_for(lambda: (self.checks if answered else self.asked) >= n)

    async def start(self) -> str:
        app = web.Application()
        if self.health:
            app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"


@pytest.fixture(params=[True], ids=["health"])
async def busy(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Busy, str]]:
    server = Busy(health=request.param)
    url = await server.start()
    yield server, url
    server.done.set()
    server.stopping.set()
    assert server.runner is not None
    await server.runner.cleanup()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    s = aiohttp.ClientSession(connector=PoolConnector())
    yield s
    await s.close()


def adapter(ptype: str, url: str, session: aiohttp.ClientSession,
            probe_timeout_ms: int = 15_000) -> OpenAICompatAdapter:
    """(A check's own timeout long, unless the test needs one to fail: a loaded machine's slow check passes.)"""
    config = {"id": "p", "type": ptype, "base_url": url, "capacity": 2, "models": [SERVED], "read_timeout_ms": 100,
              "probe_timeout_ms": probe_timeout_ms}
    if ptype == "openai_api":
        config["probe_path"] = "/health"
    if ptype == "llamacpp":
        config["load_timeout_ms"] = 0
    return OpenAICompatAdapter(ProviderConfig.model_validate(config), session)


def chat() -> dict[str, Any]:
    return {"model": SERVED, "messages": [{"role": "user", "content": "write a long one"}]}


@pytest.mark.parametrize("ptype", ["vllm", "sglang", "openai_api", "llamacpp"])
async def test_a_whole_answer_longer_than_the_read_timeout_comes_while_its_server_is_well(
        busy: tuple[Busy, str], session: aiohttp.ClientSession, ptype: str) -> None:
    server, url = busy
    answering = asyncio.ensure_future(adapter(ptype, url, session).complete(RunKind.CHAT, chat(), "r"))
    await server.checks_reach(3)  # (three silences of read_timeout_ms, each followed by a check that passed)
    assert not answering.done()
    server.done.set()
    answer = await answering
    assert answer["choices"][0]["message"]["content"] == "long"


async def test_a_silent_whole_answer_ends_when_its_server_says_it_is_down(
        busy: tuple[Busy, str], session: aiohttp.ClientSession) -> None:
    server, url = busy
    answering = asyncio.ensure_future(adapter("vllm", url, session).complete(RunKind.CHAT, chat(), "r"))
    await server.checks_reach(2)
    server.down.set()  # (its engine died: its answer never comes, its health check says so)
    with pytest.raises(ProviderError) as err:
        await answering
    assert err.value.message == ("provider p: sent nothing of its answer for 100 ms or more, and its health check "
                                 "then failed (GET /health answered 500 (engine dead))")
    assert err.value.code is ErrorCode.PROVIDER_TIMEOUT
    assert err.value.retry is Retry.ELSEWHERE and err.value.strikes == 1


async def test_a_health_check_unanswered_in_time_never_fails_the_caller(
        busy: tuple[Busy, str], session: aiohttp.ClientSession) -> None:
    """A busy server's check may wait (SGLang's `/health` waits for its next output, up to 20 s):
    no answer in time is no evidence (issue 8: a probe timeout on a provider with runs in flight
    must never fail callers). The answer is waited for, as long as `execution_timeout_ms` lets it."""
    server, url = busy
    server.hang.set()
    answering = asyncio.ensure_future(adapter("vllm", url, session, 300).complete(RunKind.CHAT, chat(), "r"))
    await server.checks_reach(3, answered=False)  # (three checks, each unanswered within its 300 ms)
    assert not answering.done()
    server.done.set()
    assert (await answering)["choices"][0]["message"]["content"] == "long"


async def test_many_silent_whole_answers_on_a_provider_share_their_checks(
        busy: tuple[Busy, str], session: aiohttp.ClientSession) -> None:
    """Ten answers silent together ask the server once, not ten times (a hosted API's `GET /models`
    each `read_timeout_ms` for each waiting run)."""
    server, url = busy
    server.hang.set()  # (the check is held, so that every watch comes to it)
    provider = adapter("vllm", url, session)
    answering = [asyncio.ensure_future(provider.complete(RunKind.CHAT, chat(), f"r{i}")) for i in range(10)]

    async def waiting_checks() -> int:
        return sum(getattr(t.get_coro(), "__qualname__", "") == "SilenceWatch._run" for t in asyncio.all_tasks())

    async def all_waiting() -> bool:  # (and the check they wait for held at the server)
        return await waiting_checks() == 10 and server.asked >= 1

    await until(all_waiting, what="every answer's watch at its check")
    assert server.asked == 1  # (while it is held, no other check goes out)
    server.hang.clear()
    server.stopping.set()  # (the held check answers)
    server.done.set()
    assert [a["choices"][0]["message"]["content"] for a in await asyncio.gather(*answering)] == ["long"] * 10


async def test_a_caller_who_leaves_a_watched_whole_answer_ends_its_wait_and_its_check(
        busy: tuple[Busy, str], session: aiohttp.ClientSession) -> None:
    server, url = busy
    server.hang.set()
    answering = asyncio.ensure_future(adapter("vllm", url, session).complete(RunKind.CHAT, chat(), "r"))
    await server.checks_reach(1, answered=False)  # (a check under way, which the server holds)

    def checks() -> list[asyncio.Task[Any]]:
        return [t for t in asyncio.all_tasks() if getattr(t.get_coro(), "__qualname__", "") == "SilenceWatch._run"]

    assert len(checks()) == 1
    answering.cancel()
    with pytest.raises(asyncio.CancelledError):
        await answering
    left = checks()
    assert all(t.cancelling() for t in left)  # (cancelled: each ends at its next turn)
    await asyncio.gather(*left, return_exceptions=True)


@pytest.mark.parametrize("busy", [False], ids=["no health"], indirect=True)
async def test_a_llama_cpp_python_whole_answer_still_ends_at_its_read_timeout(
        busy: tuple[Busy, str], session: aiohttp.ClientSession) -> None:
    """llama-cpp-python's server has no `/health`, and its `GET /v1/models` waits for the generation
    and may cut it: no model list is asked for there while it is silent."""
    server, url = busy
    with pytest.raises(ProviderError) as err:
        await adapter("llamacpp", url, session).complete(RunKind.CHAT, chat(), "r")
    assert err.value.message == "provider p: sent nothing for 100 ms"
    assert err.value.code is ErrorCode.PROVIDER_TIMEOUT and err.value.strikes == 1
    assert server.listed == 0


async def test_a_check_that_fails_as_the_head_comes_leaves_the_answer_standing() -> None:
    """The head came in the same turn as a check's failing answer (a reviewer's reading): the task,
    already woken with its head, was cancelled before it could close the watch, and an answer that
    came was a 504. The cancel waits a turn; the watch closed by then, it is not asked."""
    head: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def check() -> ProbeResult:
        head.set_result("head")  # (the head, in the turn the check's answer comes)
        return ProbeResult(Health.UNAVAILABLE, "GET /health answered 503")

    watch = SilenceWatch(check, 0.01, 0.01)
    watch.sent()
    assert await head == "head"
    watch.close()
    for _ in range(3):  # (a few turns of the loop: a cancel still due would come in one of them)
        await asyncio.sleep(0)
    assert watch.failed is None and not asyncio.current_task().cancelling()  # type: ignore[union-attr]
