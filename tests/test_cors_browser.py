"""A page of another site calling the gateway from a real headless Chromium (CORS), on a real
stack: the page of a listed site reads a completion and a stream with its key; the page of a site
not listed cannot read anything (the browser refuses, as it does for the preflight)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from common.auth import hash_key
from tests.conftest import Stack
from tests.test_catalog_page import page as page  # (the browser; skips this module as it skips that one)
from tests.test_e2e import pool_config, wait_available

pytestmark = pytest.mark.e2e

KEY = "sk-browser-5e1d7c"
ASK = """async ([gateway, key]) => {
  const ask = (stream) => fetch(gateway + "/v1/chat/completions", {method: "POST",
    headers: {"Authorization": "Bearer " + key, "Content-Type": "application/json"},
    body: JSON.stringify({model: "qwen3.6:35b", max_tokens: 3, stream,
                          messages: [{role: "user", content: "hi"}]})});
  try {
    const whole = await ask(false);
    const answer = await whole.json();
    const streamed = await ask(true);
    let text = "";
    const reader = streamed.body.getReader();
    const decoder = new TextDecoder();
    for (;;) { const {done, value} = await reader.read(); if (done) break; text += decoder.decode(value); }
    return {status: whole.status, content: answer.choices[0].message.content,
            requestId: whole.headers.get("X-Request-Id"), stream: text};
  } catch (e) { return {error: String(e)}; }
}"""


async def empty_page(request: web.Request) -> web.Response:
    return web.Response(text="<!doctype html><title>app</title>", content_type="text/html")


async def site() -> TestServer:
    """A site of its own (its own port: its own origin) serving an empty page."""
    app = web.Application()
    app.router.add_get("/", empty_page)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    return server


@pytest.fixture
async def sites() -> AsyncIterator[tuple[TestServer, TestServer]]:
    listed, other = await site(), await site()
    yield listed, other
    await listed.close()
    await other.close()


async def test_a_listed_site_s_page_reads_answers_and_streams_and_another_s_cannot(
        stack: Stack, page: Any, sites: tuple[TestServer, TestServer]) -> None:
    listed, other = sites
    origin = str(listed.make_url("")).rstrip("/")
    url = stack.simulator(["vllm-a-served"])
    config = pool_config({"vllm-a": ("node-a", url, 2)})
    config["runtime"]["cors_origins"] = [origin]
    config["auth"] = {"keys": [{"name": "web", "sha256": hash_key(KEY)}]}
    stack.write_config(config)
    stack.scheduler()
    stack.worker("node-a")
    gateway = stack.gateway()
    wait_available(stack.redis_url, ["vllm-a"])

    await page.goto(origin + "/")
    got = await page.evaluate(ASK, [gateway, KEY])
    assert got.get("status") == 200 and got["content"] == "tok0 tok1 tok2 ", got
    assert got["requestId"].startswith("run_")  # an exposed header
    assert "tok2" in got["stream"] and got["stream"].rstrip().endswith("data: [DONE]")

    await page.goto(str(other.make_url("/")))
    refused = await page.evaluate(ASK, [gateway, KEY])
    assert "error" in refused and "Failed to fetch" in refused["error"], refused
