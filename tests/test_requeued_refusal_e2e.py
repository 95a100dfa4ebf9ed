"""A run one provider refused as the caller's 400 that another provider might serve (Ollama's
`"m" does not support tools`, llama-server's `n` over its slots: `another_may`) goes back to the
queue for the model's other providers; when none serves it, the caller gets that 400 (README). With
the only other provider busy, the run waited out its queue timeout and the caller got a 504
`queue_timeout` naming the provider that refused it as having "a free slot now" (the official
clients send a 504 twice more: three queue timeouts for what was a 400 at once before).

Real iop processes and Redis; an Ollama answering as its source does (server/routes.go:211-212,
3109-3110: the model's name and "does not support tools", 400), holding every other run until the
test lets it go."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.conftest import Stack
from tests.test_e2e import FAST_RUNTIME, wait_available

pytestmark = pytest.mark.e2e

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


class HoldingOllama:
    """`notools`: a run with tools is answered 400 at once (`tools`: answered at once, as a model
    with tools would); any other is held until `let_go`."""

    def __init__(self, tools: bool = False) -> None:
        self.tools = tools
        self.calls: Counter[str] = Counter()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.runner: web.AppRunner | None = None
        self.held = asyncio.Event()
        #: what `GET /api/tags` lists (a test takes the model away, as `ollama rm` does)
        self.models = ["notools"]

    async def _tags(self, _: web.Request) -> web.Response:
        return web.json_response({"models": [{"name": name, "model": name} for name in self.models]})

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("tools"):
            self.calls["tools"] += 1
            if not self.tools:
                return web.json_response({"error": "notools does not support tools"}, status=400)
        else:
            self.calls["held"] += 1
            await self.held.wait()
        return web.json_response({"model": "notools", "created_at": "2026-08-21T18:48:22Z", "done": True,
                                  "done_reason": "stop", "message": {"role": "assistant", "content": "hello"}})

    async def _start(self) -> str:
        app = web.Application()
        app.router.add_get("/api/tags", self._tags)
        app.router.add_post("/api/chat", self._chat)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    def let_go(self) -> None:
        self.loop.call_soon_threadsafe(self.held.set)

    def __enter__(self) -> str:
        self.thread.start()
        return asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    def __exit__(self, *exc: object) -> None:
        self.let_go()
        assert self.runner is not None
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


async def ask(gateway: str, body: dict[str, Any]) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.post(gateway + "/v1/chat/completions",
                                                                json=body) as resp:
        return resp.status, await resp.text()


@pytest.mark.parametrize(("stream", "other"), [(False, "busy"), (True, "busy"), (False, "gone")])
async def test_a_refusal_another_provider_might_serve_is_the_callers_400_when_none_serves_it(
        stack: Stack, stream: bool, other: str) -> None:
    """a-ollama holds a run; b-ollama refuses the tools run, which waits for a-ollama. `busy`: past
    its queue timeout (it was a 504 after the wait); `gone`: a-ollama no longer lists the model
    (a 502 saying b-ollama "could not serve the run" and no other provider is available)."""
    ollama, other_ollama = HoldingOllama(), HoldingOllama()
    with ollama as url, other_ollama as other_url:
        try:
            stack.write_config({
                "models": [{"id": "m", "providers": {"a-ollama": "notools", "b-ollama": "notools"},
                            "queue": {"queue_timeout_ms": 1000 if other == "busy" else 60_000}}],
                "nodes": [{"id": "n1", "providers": [
                    {"id": p, "type": "ollama", "base_url": base, "capacity": 1, "models": ["notools"],
                     "read_timeout_ms": 120_000} for p, base in (("a-ollama", url), ("b-ollama", other_url))]}],
                "runtime": FAST_RUNTIME,
                "queue": {"max_attempts": 3},
            })
            stack.scheduler()
            stack.worker("n1")
            gateway = stack.gateway()
            wait_available(stack.redis_url, ["a-ollama", "b-ollama"])
            chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
            busy = asyncio.create_task(ask(gateway, chat))  # (a-ollama, the first by id, holds it)
            deadline = asyncio.get_running_loop().time() + 15
            while not ollama.calls["held"]:
                assert asyncio.get_running_loop().time() < deadline, "the first run never reached the server"
                await asyncio.sleep(0.01)
            asked = asyncio.create_task(ask(gateway, {**chat, "tools": TOOLS}))
            if other == "gone":
                while not other_ollama.calls["tools"]:
                    assert asyncio.get_running_loop().time() < deadline, "the tools run never reached b-ollama"
                    await asyncio.sleep(0.01)
                ollama.loop.call_soon_threadsafe(ollama.models.clear)
            status, text = await asyncio.wait_for(asked, 30)
            assert status == 400, text
            assert json.loads(text)["error"] == {"message": "notools does not support tools",
                                                 "type": "invalid_request_error", "param": None, "code": None}
            assert (ollama.calls["tools"], other_ollama.calls["tools"]) == (0, 1)  # (a-ollama was busy all along)
            ollama.let_go()
            assert (await busy)[0] == 200
        finally:
            stack.stop_all()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_refusal_of_what_a_provider_cannot_do_uses_up_no_attempt(stack: Stack, stream: bool) -> None:
    """With `max_attempts: 1`, a tools run that a-ollama (its model without tools, the first by id)
    refused ended with that 400, though b-ollama serves tools: the refusal used up the run's one
    attempt. It only asked, so it uses up none: b-ollama serves the run (and gets its body, which
    the start of what was the last attempt had taken out of the run's record)."""
    refusing, serving = HoldingOllama(), HoldingOllama(tools=True)
    with refusing as url, serving as other_url:
        try:
            stack.write_config({
                "models": [{"id": "m", "providers": {"a-ollama": "notools", "b-ollama": "notools"}}],
                "nodes": [{"id": "n1", "providers": [
                    {"id": p, "type": "ollama", "base_url": base, "capacity": 1, "models": ["notools"],
                     "read_timeout_ms": 120_000} for p, base in (("a-ollama", url), ("b-ollama", other_url))]}],
                "runtime": FAST_RUNTIME,
                "queue": {"max_attempts": 1},
            })
            stack.scheduler()
            stack.worker("n1")
            gateway = stack.gateway()
            wait_available(stack.redis_url, ["a-ollama", "b-ollama"])
            chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream, "tools": TOOLS}
            for _ in range(2):  # (the second, too: a refusal is no strike, a-ollama is first again)
                status, text = await asyncio.wait_for(ask(gateway, chat), 30)
                assert status == 200, text
                assert "hello" in text
            assert (refusing.calls["tools"], serving.calls["tools"]) == (2, 2)
        finally:
            stack.stop_all()
