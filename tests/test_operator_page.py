"""The catalog page's operator controls and load charts in a real headless Chromium, on a real
stack with keys (as `tests/test_catalog_page.py` drives it).

An operator drains a provider under load (it shows `draining`, then `drained` once its runs
ended), undrains it, sets and clears a capacity override through the dialog (a bad value shows
the API's 400), cordons and uncordons a node, and sees each change in the audit table under its
key's name. The charts render from `/v1/catalog/history` (sampled by the scheduler) and move with
the load. Screenshots land in `test-artifacts/`.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis as sync_redis

from common.auth import hash_key, new_key
from iop.embedded_redis import RedisServer
from tests.conftest import Stack
from tests.test_catalog_page import (
    ARTIFACTS,
    QWEN,
    RUNTIME,
    WAIT_MS,
    async_api,
    hold,
    leave,
    own_redis,
    page,
    placement,
    pool,
    row,
    simulators,
)

pytestmark = pytest.mark.e2e
__all__ = ["own_redis", "page"]  # fixtures, shared with the catalog page test

OPERATOR, CALLER = new_key(), new_key()
#: samples every 200 ms over a 60 s window, so the charts fill within the test
HISTORY = {"history_interval_ms": 200, "history_retention_s": 60}


def chart(page: Any, provider_id: str) -> Any:
    return row(page, provider_id).locator("svg[data-chart='in_flight']")


async def test_an_operator_drains_overrides_and_cordons_from_the_page_and_sees_the_load_move(
        tmp_path: Path, own_redis: RedisServer, page: Any) -> None:
    expect = async_api.expect
    stack = Stack(tmp_path, own_redis.url)
    try:
        config = pool(simulators(stack))
        config["runtime"] = {**RUNTIME, **HISTORY}
        config["auth"] = {"keys": [{"name": "ops", "sha256": hash_key(OPERATOR), "role": "operator"},
                                   {"name": "team-a", "sha256": hash_key(CALLER)}]}
        stack.write_config(config)
        stack.scheduler()
        stack.worker("gpu-1")
        stack.worker("gpu-2")
        gateway = stack.gateway()

        await page.goto(gateway + "/catalog")
        await page.fill("#key-input", OPERATOR)
        await page.click("#key-form button")
        await expect(page.locator("tr[data-provider]")).to_have_count(3, timeout=WAIT_MS)
        for pid in ("vllm-a", "sglang-b"):
            await expect(row(page, pid)).to_have_attribute("data-health", "available", timeout=WAIT_MS)
            await expect(row(page, pid)).to_have_attribute("data-control-state", "active")

        # The charts render, one per provider and two per model, from the scheduler's samples.
        await expect(page.locator("tr[data-provider] svg[data-chart='in_flight']")).to_have_count(3)
        await expect(page.locator("tr[data-model] svg[data-chart='queued']")).to_have_count(2)
        await expect(page.locator("tr[data-model] svg[data-chart='oldest_wait']")).to_have_count(2)
        await expect(chart(page, "vllm-a")).to_have_attribute("data-samples", re.compile(r"^([3-9]|\d\d+)$"),
                                                              timeout=WAIT_MS)
        await expect(chart(page, "vllm-a")).to_have_attribute("data-last-capacity", "4")
        await expect(chart(page, "vllm-a")).to_have_attribute("data-last-in_flight", "0")
        await expect(chart(page, "vllm-a")).to_have_attribute("data-max-in_flight", "0")
        await expect(page.locator("th", has_text="last 1 min")).to_have_count(3)  # two nodes and the models

        # Load: 4 runs fill vllm-a, 2 fill sglang-b, 2 wait. The chart moves up with it.
        http = aiohttp.ClientSession(headers={"Authorization": f"Bearer {CALLER}"})
        running = [asyncio.create_task(hold(http, gateway, QWEN)) for _ in range(6)]
        await expect(row(page, "vllm-a")).to_have_attribute("data-in-flight", "4", timeout=WAIT_MS)
        await expect(row(page, "sglang-b")).to_have_attribute("data-in-flight", "2", timeout=WAIT_MS)
        waiting = [asyncio.create_task(hold(http, gateway, QWEN)) for _ in range(2)]
        await expect(chart(page, "vllm-a")).to_have_attribute("data-last-in_flight", "4", timeout=WAIT_MS)
        await expect(chart(page, "vllm-a")).to_have_attribute("data-max-in_flight", "4")
        await expect(page.locator(f"tr[data-model='{QWEN}'] svg[data-chart='queued']")).to_have_attribute(
            "data-last-queued", "2", timeout=WAIT_MS)
        await expect(page.locator(f"tr[data-model='{QWEN}'] svg[data-chart='oldest_wait']")).to_have_attribute(
            "data-max-oldest_wait", re.compile(r"^[1-9]\d*$"), timeout=WAIT_MS)  # waits of some ms, then more

        # A capacity override: a bad value (above the configured 2) shows the API's 400 in the dialog; a good
        # one is shown in the row.
        await row(page, "sglang-b").locator("button[data-action='capacity']").click()
        await expect(page.locator("#cap-dialog")).to_be_visible()
        await expect(page.locator("#cap-input")).to_have_value("2")
        await page.fill("#cap-input", "3")
        await page.click("#cap-set")
        await expect(page.locator("#cap-error")).to_contain_text("is above sglang-b's configured capacity 2",
                                                                 timeout=WAIT_MS)
        await page.fill("#cap-input", "1")
        await page.select_option("#cap-for", "1h")
        await page.click("#cap-set")
        await expect(page.locator("#cap-dialog")).to_be_hidden(timeout=WAIT_MS)
        await expect(page.locator("#action-status")).to_contain_text("sglang-b: capacity → 1 until")
        await expect(row(page, "sglang-b")).to_have_attribute("data-effective-capacity", "1", timeout=WAIT_MS)
        await expect(row(page, "sglang-b").locator(".override")).to_contain_text("override 1 (configured 2) until")
        await expect(row(page, "sglang-b").locator(".inflight")).to_have_text("2 / 1")  # nothing interrupted
        await expect(chart(page, "sglang-b")).to_have_attribute("data-last-capacity", "1", timeout=WAIT_MS)
        await expect(chart(page, "sglang-b")).to_have_attribute("data-max-capacity", "2")

        # Drain vllm-a with its 4 runs in flight: draining, and the model's placement says why.
        await row(page, "vllm-a").locator("button[data-action='drain']").click()
        await expect(row(page, "vllm-a")).to_have_attribute("data-control-state", "draining", timeout=WAIT_MS)
        await expect(page.locator("#action-status")).to_contain_text("provider vllm-a: drain → drained (was active)")
        await expect(placement(page, QWEN, "vllm-a")).to_contain_text("drained")
        await expect(row(page, "vllm-a")).to_have_attribute("data-in-flight", "4")
        with sync_redis.Redis.from_url(own_redis.url) as r:
            assert r.exists("iop:drain:vllm-a")
        ARTIFACTS.mkdir(exist_ok=True)
        await page.screenshot(path=str(ARTIFACTS / "catalog-operate.png"), full_page=True)

        # Its callers leave: in_flight falls to 0, it is drained, and the chart comes down (its peak stays).
        await leave(waiting)
        await leave(running)
        await http.close()
        await expect(row(page, "vllm-a")).to_have_attribute("data-control-state", "drained", timeout=WAIT_MS)
        await expect(chart(page, "vllm-a")).to_have_attribute("data-last-in_flight", "0", timeout=WAIT_MS)
        await expect(chart(page, "vllm-a")).to_have_attribute("data-max-in_flight", "4")

        await row(page, "vllm-a").locator("button[data-action='undrain']").click()
        await expect(row(page, "vllm-a")).to_have_attribute("data-control-state", "active", timeout=WAIT_MS)
        await row(page, "sglang-b").locator("button[data-action='capacity']").click()
        await page.click("#cap-clear")
        await expect(row(page, "sglang-b")).to_have_attribute("data-effective-capacity", "2", timeout=WAIT_MS)
        await expect(row(page, "sglang-b").locator(".override")).to_have_count(0)

        # Cordon gpu-2: both its providers stop taking runs; uncordon it.
        node = page.locator("section[data-node='gpu-2']")
        await node.locator("button[data-action='cordon']").click()
        await expect(node).to_have_attribute("data-cordoned", "true", timeout=WAIT_MS)
        for pid in ("sglang-b", "hosted-c"):
            await expect(row(page, pid)).to_have_attribute("data-control-state", "drained")
        await expect(placement(page, QWEN, "sglang-b")).to_contain_text("cordoned")
        await node.locator("button[data-action='uncordon']").click()
        await expect(node).to_have_attribute("data-cordoned", "false", timeout=WAIT_MS)

        # Every change is in the audit table, newest first, under the key's name.
        audit = page.locator("#audit tr[data-audit]")
        await expect(audit).to_have_count(6, timeout=WAIT_MS)
        expected = [("uncordon", "node gpu-2"), ("cordon", "node gpu-2"), ("capacity_clear", "provider sglang-b"),
                    ("undrain", "provider vllm-a"), ("drain", "provider vllm-a"), ("capacity", "provider sglang-b")]
        for i, (action, target) in enumerate(expected):
            cells = audit.nth(i).locator("td")
            await expect(cells.nth(1)).to_have_text("ops")
            await expect(cells.nth(2)).to_have_text(action)
            await expect(cells.nth(3)).to_have_text(target)
        # (its time says its zone: the terminal's `iop audit` says UTC, the page the browser's own)
        await expect(audit.nth(0).locator("td").nth(0)).to_have_text(re.compile(r"\d{2}:\d{2}:\d{2}.*[A-Z+]"))
        await page.screenshot(path=str(ARTIFACTS / "catalog-operate-after.png"), full_page=True)
    finally:
        stack.stop_all()
