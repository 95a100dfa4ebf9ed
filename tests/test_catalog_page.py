"""The catalog page in a real headless Chromium, on a real stack.

Debian's `chromium` is driven by Playwright (its own browser download is not used). The
test watches the page follow the pool: rows and health, the load bars filling under long
streamed runs, a provider turning unavailable when its server stops, and the page going
stale (keeping its data) while Redis is down, then live again. Screenshots land in
`test-artifacts/`.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis as redis_lib
from aiohttp import web

from common import keys
from common.auth import hash_key, new_key
from iop.embedded_redis import RedisServer
from tests.conftest import ROOT, Stack

pytestmark = pytest.mark.e2e

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    # .ci/run installs chromium and sets IOP_REQUIRE_BROWSER=1, so CI never skips this silently.
    if os.environ.get("IOP_REQUIRE_BROWSER") == "1":
        pytest.fail("IOP_REQUIRE_BROWSER=1 but chromium is not installed", pytrace=False)
    pytest.skip("Debian's chromium is not installed (apt-get install -y chromium)", allow_module_level=True)
async_api = pytest.importorskip("playwright.async_api", reason="playwright is not installed (pip install -e '.[test]')")

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = ROOT / "test-artifacts"
RUNTIME = {"heartbeat_interval_ms": 200, "heartbeat_ttl_ms": 1000, "probe_interval_ms": 200, "lease_ttl_ms": 2000,
           "scheduler_liveness_ms": 1000, "history_interval_ms": 500}
WAIT_MS = 20_000  # deadline of every wait on the page's state

QWEN, LLAMA = "qwen3.6:35b", "llama3.3:70b"


def pool(urls: dict[str, str]) -> dict[str, Any]:
    """Three providers on two nodes, two models; capacities 4, 2 and 1."""
    return {
        "models": [
            {"id": QWEN, "display_name": "Qwen 3.6 35B",
             "providers": {"vllm-a": "Qwen/Qwen3.6-35B-A3B", "sglang-b": "qwen3.6-35b-a3b"}},
            {"id": LLAMA, "display_name": "Llama 3.3 70B",
             "providers": {"vllm-a": "meta-llama/Llama-3.3-70B-Instruct", "hosted-c": "llama-3.3-70b"}},
        ],
        "nodes": [
            {"id": "gpu-1", "providers": [
                {"id": "vllm-a", "type": "vllm", "base_url": urls["vllm-a"], "capacity": 4,
                 "models": ["Qwen/Qwen3.6-35B-A3B", "meta-llama/Llama-3.3-70B-Instruct"]}]},
            {"id": "gpu-2", "providers": [
                {"id": "sglang-b", "type": "sglang", "base_url": urls["sglang-b"], "capacity": 2,
                 "models": ["qwen3.6-35b-a3b"]},
                {"id": "hosted-c", "type": "openai_api", "base_url": urls["hosted-c"], "capacity": 1,
                 "models": ["llama-3.3-70b"], "api_key_env": "IOP_TEST_HOSTED_KEY"}]},
        ],
        "queue": {"max_queue": 16, "queue_timeout_ms": 600_000},
        "runtime": RUNTIME,
    }


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A Redis of this test's own, so it can be stopped and started again."""
    server = RedisServer().start()
    yield server
    server.cleanup()


@pytest.fixture
async def page() -> AsyncIterator[Any]:
    async with async_api.async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield await browser.new_page(viewport={"width": 1280, "height": 760})
        finally:
            await browser.close()


#: the pool's providers: id -> the models its simulator serves
SIMULATED = {"vllm-a": "Qwen/Qwen3.6-35B-A3B,meta-llama/Llama-3.3-70B-Instruct", "sglang-b": "qwen3.6-35b-a3b",
             "hosted-c": "llama-3.3-70b"}


def simulators(stack: Stack) -> dict[str, str]:
    """A simulator for each provider of `pool`: provider id -> its URL."""
    return {pid: stack.simulator([models]) for pid, models in SIMULATED.items()}


def start_stack(stack: Stack) -> tuple[str, dict[str, Any]]:
    sims = {pid: stack.start(f"sim-{pid}", "simulator", "--port", "0", "--models", models)
            for pid, models in SIMULATED.items()}
    urls = {pid: proc.wait_for_line(r"listening on (http://\S+)").group(1) for pid, proc in sims.items()}
    stack.write_config(pool(urls))
    stack.scheduler()
    stack.worker("gpu-1")
    stack.worker("gpu-2")
    return stack.gateway(), sims


async def hold(session: aiohttp.ClientSession, gateway: str, model: str) -> None:
    """A streamed run that sits at its provider until cancelled."""
    body = {"model": model, "messages": [{"role": "user", "content": "x"}], "stream": True, "max_tokens": 1,
            "sim": {"ttft_ms": 600_000}}
    async with session.post(gateway + "/v1/chat/completions", json=body) as resp:
        await resp.read()


async def test_catalog_page_follows_the_pool(tmp_path: Path, own_redis: RedisServer, page: Any) -> None:
    expect = async_api.expect
    stack = Stack(tmp_path, own_redis.url)
    # (the page's Content-Security-Policy lets its own inline script and style run and its reads go to
    # the gateway; anything it refused would say so on the console)
    refused: list[str] = []
    page.on("console", lambda msg: refused.append(msg.text) if "Content Security Policy" in msg.text else None)
    try:
        gateway, sims = start_stack(stack)
        answer = await page.goto(gateway + "/catalog")
        assert answer is not None
        headers = await answer.all_headers()
        assert "frame-ancestors 'none'" in headers["content-security-policy"]
        assert headers["x-content-type-options"] == "nosniff" and headers["x-frame-options"] == "DENY"

        rows = page.locator("tr[data-provider]")
        await expect(rows).to_have_count(3, timeout=WAIT_MS)
        for pid in ("vllm-a", "sglang-b", "hosted-c"):
            await expect(row(page, pid)).to_have_attribute("data-health", "available", timeout=WAIT_MS)
        await expect(page.locator("#status")).to_have_attribute("data-state", "live")
        await expect(page.locator("section[data-node='gpu-1'] tr[data-provider]")).to_have_count(1)
        await expect(page.locator("section[data-node='gpu-2'] tr[data-provider]")).to_have_count(2)
        await expect(row(page, "hosted-c")).to_contain_text("api")
        await expect(row(page, "vllm-a")).to_contain_text("0 / 4")
        await expect(page.locator("tr[data-model]")).to_have_count(2)
        await expect(row(page, "vllm-a").locator("[data-flag]")).to_have_text(["list_models"])
        assert "IOP_TEST_HOSTED_KEY" not in await page.content()

        # A worker of another config beats for a provider this one lacks: the page says so, and stops once it lapses.
        banner = page.locator("#config-banner")
        await expect(banner).to_be_hidden()
        with redis_lib.Redis.from_url(own_redis.url) as r:
            r.zadd(keys.BEATING, {"vllm-z": int(time.time() * 1000) + 60_000})
            await expect(banner).to_contain_text("config does not define: vllm-z.", timeout=WAIT_MS)
            r.zrem(keys.BEATING, "vllm-z")
        await expect(banner).to_be_hidden(timeout=WAIT_MS)

        # Eight long runs of qwen: 4 fill vllm-a, 2 fill sglang-b, 2 wait in the queue.
        session = aiohttp.ClientSession()
        running = [asyncio.create_task(hold(session, gateway, QWEN)) for _ in range(6)]
        await expect(row(page, "vllm-a")).to_have_attribute("data-in-flight", "4", timeout=WAIT_MS)
        await expect(row(page, "sglang-b")).to_have_attribute("data-in-flight", "2", timeout=WAIT_MS)
        waiting = [asyncio.create_task(hold(session, gateway, QWEN)) for _ in range(2)]
        await expect(row(page, "vllm-a").locator(".bar > span")).to_have_attribute(
            "style", re.compile(r"width:\s*100%"), timeout=WAIT_MS)
        await expect(row(page, "vllm-a").locator(".inflight")).to_have_text("4 / 4")
        await expect(row(page, "sglang-b").locator(".queued")).to_have_text("2", timeout=WAIT_MS)
        await expect(placement(page, QWEN, "vllm-a")).to_have_attribute("data-selectable", "false")
        await expect(placement(page, QWEN, "vllm-a")).to_contain_text("full")

        # The hosted provider's server stops: it turns unavailable and llama runs only on vllm-a.
        sims["hosted-c"].stop()
        await expect(row(page, "hosted-c")).to_have_attribute("data-health", "unavailable", timeout=WAIT_MS)
        await expect(row(page, "hosted-c").locator(".reason")).not_to_be_empty()
        await expect(placement(page, LLAMA, "hosted-c")).to_contain_text("unavailable")
        await expect(row(page, "vllm-a")).to_have_attribute("data-health", "available")
        ARTIFACTS.mkdir(exist_ok=True)
        await page.screenshot(path=str(ARTIFACTS / "catalog.png"), full_page=True)

        # The callers leave, the waiting ones first: their runs are dropped, then the running
        # ones are cancelled and the load drains.
        await leave(waiting)
        await expect(row(page, "sglang-b").locator(".queued")).to_have_text("0", timeout=WAIT_MS)
        await leave(running)
        await session.close()
        await expect(row(page, "vllm-a")).to_have_attribute("data-in-flight", "0", timeout=WAIT_MS)
        await expect(row(page, "sglang-b")).to_have_attribute("data-in-flight", "0", timeout=WAIT_MS)

        # Redis goes away: the page keeps its rows and says since when they are stale.
        own_redis.stop()
        await expect(page.locator("#status")).to_have_attribute("data-state", "stale", timeout=WAIT_MS)
        await expect(page.locator("#stale-banner")).to_be_visible()
        await expect(page.locator("#stale-banner")).to_contain_text("503")
        await expect(page.locator("#status")).to_contain_text("stale since")
        await expect(rows).to_have_count(3)
        await page.screenshot(path=str(ARTIFACTS / "catalog-stale.png"), full_page=True)

        # Redis is back: the page is live again.
        own_redis.start()
        await expect(page.locator("#status")).to_have_attribute("data-state", "live", timeout=WAIT_MS)
        await expect(page.locator("#stale-banner")).to_be_hidden()
        await expect(row(page, "vllm-a")).to_have_attribute("data-health", "available", timeout=WAIT_MS)
        label = row(page, "vllm-a").locator(".spark-label").first
        await expect(label).to_contain_text(" now, max ", timeout=WAIT_MS)

        # No scheduler: no samples. The last one is shown with its age, not as "now" (an operator
        # read "in flight 2 now" beside a live 0 / 2).
        next(p for p in stack.procs if p.name == "scheduler").stop()
        await expect(label).to_contain_text(re.compile(r" \d+ s ago, max "), timeout=WAIT_MS)
        assert refused == [], refused
    finally:
        stack.stop_all()


async def leave(callers: list[asyncio.Task[None]]) -> None:
    for task in callers:
        task.cancel()
    await asyncio.gather(*callers, return_exceptions=True)


def row(page: Any, provider_id: str) -> Any:
    return page.locator(f"tr[data-provider='{provider_id}']")


def placement(page: Any, model_id: str, provider_id: str) -> Any:
    return page.locator(f"tr[data-model='{model_id}'] [data-placement='{provider_id}']")


async def test_with_keys_the_page_asks_for_an_operator_key_and_keeps_it_for_the_tab(
        tmp_path: Path, own_redis: RedisServer, page: Any) -> None:
    expect = async_api.expect
    operator, caller = new_key(), new_key()
    stack = Stack(tmp_path, own_redis.url)
    try:
        config = pool(simulators(stack))
        config["auth"] = {"keys": [{"name": "ops", "sha256": hash_key(operator), "role": "operator"},
                                   {"name": "team-a", "sha256": hash_key(caller)}]}
        stack.write_config(config)
        stack.scheduler()
        stack.worker("gpu-1")
        gateway = stack.gateway()

        await page.goto(gateway + "/catalog")
        form = page.locator("#key-form")
        await expect(form).to_be_visible(timeout=WAIT_MS)
        await expect(page.locator("tr[data-provider]")).to_have_count(0)

        await page.fill("#key-input", caller)
        await page.click("#key-form button")
        await expect(page.locator("#key-reason")).to_have_text("That key is not an operator key.", timeout=WAIT_MS)
        await page.fill("#key-input", "sk-not-a-key")
        await page.click("#key-form button")
        await expect(page.locator("#key-reason")).to_have_text("That key is not valid.", timeout=WAIT_MS)

        await page.fill("#key-input", operator)
        await page.click("#key-form button")
        await expect(form).to_be_hidden(timeout=WAIT_MS)
        await expect(page.locator("tr[data-provider]")).to_have_count(3, timeout=WAIT_MS)
        await expect(page.locator("#status")).to_have_attribute("data-state", "live")

        await page.reload()  # the same tab keeps its key
        await expect(page.locator("tr[data-provider]")).to_have_count(3, timeout=WAIT_MS)
        await expect(form).to_be_hidden()

        other_tab = await page.context.browser.new_page()  # another tab asks again
        await other_tab.goto(gateway + "/catalog")
        await expect(other_tab.locator("#key-form")).to_be_visible(timeout=WAIT_MS)
        assert operator not in await other_tab.content()
    finally:
        stack.stop_all()


#: what a hostile provider puts in every text it controls: a name it lists, a served name, an error
XSS = "<script>window.pwned=1</script><img src=x onerror=\"window.pwned=2\">'\"><svg onload=window.pwned=3>"


async def test_a_provider_s_text_stays_text_and_no_script_but_the_page_s_own_runs(
        tmp_path: Path, own_redis: RedisServer, page: Any) -> None:
    """A provider controls its model list and its errors (a probe failure's text is the reason the
    page shows): they are text on the page. And the page's Content-Security-Policy lets only its own
    inline script run: under `'unsafe-inline'`, markup injected into the page ran its `onerror`."""
    expect = async_api.expect

    async def models(request: web.Request) -> web.Response:
        if request.match_info["pfx"] == "down":
            return web.Response(status=500, text=f"down {XSS}")
        return web.json_response({"object": "list", "data": [{"id": n, "object": "model"} for n in ("ok", XSS)]})

    app = web.Application()
    app.router.add_get("/{pfx}/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    refused: list[str] = []
    page.on("console", lambda msg: refused.append(msg.text) if "Content Security Policy" in msg.text else None)
    stack = Stack(tmp_path, own_redis.url)
    try:
        stack.write_config({
            "models": [{"id": "m", "display_name": XSS, "providers": {"up": XSS, "down": "ok"}}],
            "nodes": [{"id": "n", "providers": [
                {"id": "up", "type": "openai_api", "base_url": url + "/up/v1", "capacity": 1, "models": ["ok", XSS]},
                {"id": "down", "type": "openai_api", "base_url": url + "/down/v1", "capacity": 1,
                 "models": ["ok"]}]}],
            "runtime": RUNTIME})
        stack.scheduler()
        stack.worker("n")
        gateway = stack.gateway()
        await page.goto(gateway + "/catalog")
        await expect(row(page, "up")).to_have_attribute("data-health", "available", timeout=WAIT_MS)
        await expect(row(page, "down")).to_have_attribute("data-health", "unavailable", timeout=WAIT_MS)
        await expect(row(page, "down").locator(".reason")).to_contain_text("<script>window.pwned=1</script>")
        await expect(page.locator("tr[data-model='m']")).to_contain_text(XSS)
        await expect(page.locator("#status")).to_have_attribute("data-state", "live")
        assert await page.evaluate("window.pwned") is None
        assert await page.evaluate("document.querySelectorAll('img, svg[onload], [onerror]').length") == 0
        assert await page.evaluate("document.scripts.length") == 1
        assert refused == [], refused  # (the page's own script and style ran: its rows are there)

        # Markup that reached the page anyway (as it would through a bug) runs no handler of its own.
        violated = await asyncio.wait_for(page.evaluate("""() => new Promise(resolve => {
            document.addEventListener("securitypolicyviolation", e => resolve(e.violatedDirective));
            document.addEventListener("pwned", () => resolve("its handler ran"));
            document.body.insertAdjacentHTML("beforeend",
              '<img src="data:," onerror="window.pwned=5; document.dispatchEvent(new Event(\\'pwned\\'))">');
        })"""), WAIT_MS / 1000)
        assert violated.startswith("script-src"), violated
        assert await page.evaluate("window.pwned") is None
    finally:
        stack.stop_all()
        await runner.cleanup()


#: every chip and served name of the page that lies outside its cell, every table wider than its box (which
#: clips it), and how far the page scrolls sideways
OVERFLOW = """() => {
  const out = [];
  for (const el of document.querySelectorAll("td .chip, td code")) {
    const cell = el.closest("td").getBoundingClientRect(), box = el.getBoundingClientRect();
    if (box.right > cell.right + 1 || box.left < cell.left - 1) out.push(el.textContent.slice(0, 40));
  }
  for (const table of document.querySelectorAll("table")) {
    if (table.scrollWidth > table.parentElement.clientWidth + 1) out.push("table " + (table.id || "of a node"));
  }
  return {outside: out, sideways: document.documentElement.scrollWidth - window.innerWidth};
}"""


async def test_long_names_stay_in_their_cells_and_short_ones_whole(
        tmp_path: Path, own_redis: RedisServer, page: Any) -> None:
    """Ids and served names may be 256 and 1,024 characters long. A model id and a served name of
    that kind ran out of their cells over the next columns (over a provider's control state), and
    widened the models table past the window: its first column shrank to a few letters, and every
    model id in it broke mid-word ("mode" / "l-1")."""
    expect = async_api.expect
    long_model, long_served, long_provider = "org/" + "long-model-name-" * 12, "served/" + "S" * 300, "p-" + "x" * 120
    stack = Stack(tmp_path, own_redis.url)
    try:
        url = stack.simulator([long_served, "short"])
        stack.write_config({
            "models": [{"id": long_model, "providers": {long_provider: long_served, "p-short": "short"}},
                       {"id": "m-1", "providers": {long_provider: "short", "p-short": long_served}}],
            "nodes": [{"id": "n", "providers": [
                {"id": pid, "type": "vllm", "base_url": url, "capacity": 2, "models": [long_served, "short"]}
                for pid in (long_provider, "p-short")]}],
            "runtime": RUNTIME})
        stack.worker("n")
        gateway = stack.gateway()
        await page.goto(gateway + "/catalog")
        for pid in (long_provider, "p-short"):
            await expect(row(page, pid)).to_have_attribute("data-health", "available", timeout=WAIT_MS)
        await expect(page.locator("tr[data-model]")).to_have_count(2)
        assert await page.evaluate(OVERFLOW) == {"outside": [], "sideways": 0}
        lines = await page.evaluate("""() => {
          const range = document.createRange();
          range.selectNodeContents(document.querySelector("tr[data-model='m-1'] .pid"));
          return range.getClientRects().length;
        }""")
        assert lines == 1, "the model id m-1 broke over lines"
        ARTIFACTS.mkdir(exist_ok=True)
        await page.screenshot(path=str(ARTIFACTS / "catalog-long-names.png"), full_page=True)
    finally:
        stack.stop_all()


async def test_a_provider_whose_heartbeat_lapsed_is_not_said_never_to_have_had_one(
        tmp_path: Path, own_redis: RedisServer, page: Any) -> None:
    """An operator paused a node's worker (SIGSTOP): 6 s later its provider's row said "heartbeat
    never", under a chart of the runs it had run a minute before. The heartbeat had lapsed; the
    catalog knows only that there is none now, as `iop catalog` says with `-`."""
    expect = async_api.expect
    stack = Stack(tmp_path, own_redis.url)
    try:
        url = stack.simulator(["m-a"])
        stack.write_config({
            "models": [{"id": "m", "providers": {"p": "m-a"}}],
            "nodes": [{"id": "n", "providers": [{"id": "p", "type": "vllm", "base_url": url, "capacity": 1,
                                                  "models": ["m-a"]}]}],
            "runtime": RUNTIME})
        worker = stack.worker("n")
        gateway = stack.gateway()
        await page.goto(gateway + "/catalog")
        await expect(row(page, "p")).to_have_attribute("data-health", "available", timeout=WAIT_MS)
        worker.stop()
        await expect(row(page, "p")).to_have_attribute("data-health", "unknown", timeout=WAIT_MS)
        await expect(row(page, "p")).to_contain_text("no heartbeat now")
        await expect(row(page, "p")).not_to_contain_text("never")
    finally:
        stack.stop_all()
