"""The worker's own Redis connection (arq's) takes what every other service takes: Redis over TLS
from the URL's parameters, and a Redis that is not up yet (it waits instead of exiting)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from iop.embedded_redis import RedisServer, free_port
from tests.conftest import Proc, Stack
from tests.test_e2e import start_pool
from tests.tls import TlsRedis

pytestmark = pytest.mark.e2e


@pytest.fixture
def tls_redis() -> Iterator[TlsRedis]:
    server = TlsRedis()
    try:
        yield server.start()
    finally:
        server.cleanup()


def ask(gateway: str) -> str:
    with openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0) as client:
        chat = client.chat.completions.create(model="qwen3.6:35b", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2)
    return chat.choices[0].message.content or ""


def test_the_whole_stack_runs_over_tls_with_the_url_naming_the_ca(tmp_path: Path, tls_redis: TlsRedis) -> None:
    stack = Stack(tmp_path, tls_redis.url)  # rediss://127.0.0.1:PORT/0?ssl_ca_certs=…/ca.crt; no plain port
    try:
        gateway, _ = start_pool(stack, {"vllm-a": 1})
        assert ask(gateway) == "tok0 tok1 "

        # Without the CA in the URL the certificate cannot be checked: the worker says so and waits.
        plain = Stack(tmp_path, tls_redis.url.split("?")[0])
        plain.config_path = stack.config_path
        unverified = plain.start("worker-without-ca", "worker", "--node", "node-vllm-a")
        stack.procs.append(unverified)
        unverified.wait_for_line(r"waiting for Redis .*certificate verify failed")
        assert unverified.popen.poll() is None
    finally:
        stack.stop_all()


def test_a_worker_started_before_redis_waits_for_it_then_serves(tmp_path: Path) -> None:
    server = RedisServer(port=free_port())
    stack = Stack(tmp_path, server.url)
    try:
        sim = stack.simulator(["vllm-a-served"])
        from tests.test_e2e import pool_config

        stack.write_config(pool_config({"vllm-a": ("node-vllm-a", sim, 1)}))
        worker = stack.start("worker-node-vllm-a", "worker", "--node", "node-vllm-a")
        # arq's own start gave up after about six seconds; this one is still waiting after seven.
        worker.wait_for_line(r"waiting for Redis for ([7-9]|[1-9][0-9]+)\.[0-9] s", timeout=60)
        assert worker.popen.poll() is None
        server.start()
        worker.wait_for_line(r"worker for queue \S+ started")
        stack.scheduler()
        gateway = stack.gateway()
        from tests.test_e2e import wait_available

        wait_available(stack.redis_url, ["vllm-a"])
        assert ask(gateway) == "tok0 tok1 "
    finally:
        stack.stop_all()
        server.cleanup()


def test_a_worker_whose_environment_lacks_a_providers_api_key_env_says_so_at_start(stack: Stack) -> None:
    from tests.test_e2e import pool_config

    config = pool_config({"vllm-a": ("node-a", "http://127.0.0.1:9", 1), "vllm-b": ("node-a", "http://127.0.0.1:9", 1)})
    config["nodes"][0]["providers"][0]["api_key_env"] = "IOP_TEST_KEY_NOBODY_SET"
    config["nodes"][0]["providers"][1]["api_key_env"] = "IOP_TEST_KEY_SET"
    stack.write_config(config)
    env = stack.env() | {"IOP_TEST_KEY_SET": "sk-test"}
    env.pop("IOP_TEST_KEY_NOBODY_SET", None)
    worker = Proc("worker-node-a", ["worker", "--node", "node-a"], env)
    stack.procs.append(worker)
    worker.wait_for_line(r"provider vllm-a: its api_key_env IOP_TEST_KEY_NOBODY_SET is not set")
    worker.wait_for_line(r"worker for queue \S+ started")
    said = worker.output()
    assert "IOP_TEST_KEY_SET is not set" not in said and "sk-test" not in said, said
