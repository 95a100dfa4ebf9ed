"""What vLLM, SGLang and Lemonade really answer, through real iop processes and a real Redis
(`tests/fakes/real_servers.py` says where in each server's source every answer comes from):

- an error a server sends in its stream that says it is the caller's (vLLM's 400 naming the
  parameter, SGLang's 400 from its scheduler, Lemonade's event with the backend's `status_code`)
  is the caller's answer, as the same request's whole answer is: passed through with its status,
  not tried on every provider of the model and then turned into a 502;
- a run the server aborted itself (finish_reason `abort`: vLLM at SIGTERM, put to sleep, paused)
  is no answer: it goes to another provider, and the caller never gets an empty "completion";
- Lemonade's 409 (every slot pinned: it cannot load the model now) is the pool's matter, not the
  caller's: another provider serves the run;
- an SGLang LoRA adapter, which SGLang takes only as `base:adapter` and lists as `adapter` with
  its base as `parent`, can be served under the name SGLang takes;
- a vLLM put to sleep (or paused), whose `/health` still answers 200 and which holds every request
  it takes until it is woken, is unavailable, not sent runs that wait there for `read_timeout_ms`;
- a server that says in its stream, after its 200, that it is too busy (SGLang's 503 for a full
  queue, vLLM's 503 while paused) is busy, as when it answers so whole: benched for the model, not
  blamed, and the caller's 503 says when to try again;
- vLLM's 400 in its stream that names no `param` (a JSON schema xgrammar does not take) is tried on
  the model's other providers and then is the caller's 400, not a 502."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import redis as sync_redis

from tests.conftest import Stack, wait_until
from tests.fakes.real_servers import RealServers
from tests.test_e2e import one_node_gateway

pytestmark = pytest.mark.e2e

#: model -> [(provider id, type, served name)]; equal capacities, so ties go by provider id
MODELS: dict[str, list[tuple[str, str, str]]] = {
    "m-logprobs": [("v-a", "vllm", "vllm-logprobs@a"), ("v-b", "vllm", "vllm-logprobs@b")],
    "m-too-long": [("s-a", "sglang", "sglang-too-long@a"), ("s-b", "sglang", "sglang-too-long@b")],
    "m-ctx": [("l-ctx", "lemonade", "lemonade-ctx@a")],
    "m-pinned": [("a-pinned", "lemonade", "lemonade-pinned@a"), ("b-ok-p", "vllm", "ok")],
    "m-abort": [("a-abort", "vllm", "vllm-abort@a"), ("b-ok-a", "vllm", "ok")],
    "m-lora": [("s-lora", "sglang", "base:my-lora")],
    "m-lora-bare": [("s-lora", "sglang", "my-lora")],
    "m-asleep": [("a-asleep", "vllm", "asleep"), ("b-ok-s", "vllm", "ok")],
    "m-capped": [("s-cap", "sglang", "sglang-total@a")],
    "m-capped-052": [("s-cap-052", "sglang", "sglang-total-052@a")],
    "m-queue-full": [("s-full", "sglang", "sglang-queue-full@a"), ("t-ok-f", "vllm", "ok")],
    "m-queue-full-only": [("s-full-only", "sglang", "sglang-queue-full@b")],
    "m-paused": [("p-paused", "vllm", "vllm-paused@a"), ("q-ok-p", "vllm", "ok")],
    "m-paused-only": [("p-paused-only", "vllm", "vllm-paused@b")],
    "m-schema": [("v-sa", "vllm", "vllm-schema@a"), ("v-sb", "vllm", "vllm-schema@b")],
    "m-tools": [("v-notools", "vllm", "vllm-notools@a"), ("w-ok-t", "vllm", "ok")],
    "m-greedy": [("v-greedy", "vllm", "vllm-greedy@a"), ("w-ok-g", "sglang", "ok")],
}
#: models with a `max_tokens` cap in the config
CAPS = {"m-capped": 8192, "m-capped-052": 8192}
#: the provider on the vLLM put to sleep
SLEEPY = "a-asleep"


@pytest.fixture
def servers(stack: Stack) -> Iterator[RealServers]:
    with RealServers() as fake:
        yield fake
        stack.stop_all()  # (the worker goes before the server it probes)


@pytest.fixture
def asleep(stack: Stack, servers: RealServers) -> Iterator[RealServers]:
    with RealServers(asleep=True) as fake:
        yield fake
        stack.stop_all()


@pytest.fixture
def gateway(stack: Stack, servers: RealServers, asleep: RealServers) -> str:
    providers: dict[str, dict[str, Any]] = {}
    for entries in MODELS.values():
        for pid, ptype, served in entries:
            entry = providers.setdefault(pid, {"id": pid, "type": ptype, "capacity": 2, "models": [],
                                               "base_url": asleep.url if pid == SLEEPY else servers.url})
            entry["models"].append(served)
    return one_node_gateway(
        stack, [{"id": model, "providers": {pid: served for pid, _, served in entries},
                 **({"max_tokens": CAPS[model]} if model in CAPS else {})} for model, entries in MODELS.items()],
        list(providers.values()), [pid for pid in providers if pid != SLEEPY])


async def ask(gateway: str, model: str, stream: bool, **fields: Any) -> tuple[int, str]:
    """(status, the answer's text: a whole answer's body, or a stream's events); `fields` added to the
    request (or in place of its `messages`)."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream, **fields}
    status, text, _ = await ask_with_headers(gateway, body)
    return status, text


async def ask_with_headers(gateway: str, body: dict[str, Any]) -> tuple[int, str, dict[str, str]]:
    async with aiohttp.ClientSession() as session, session.post(gateway + "/v1/chat/completions", json=body) as resp:
        return resp.status, await resp.text(), dict(resp.headers)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("model", "served", "said"), [
    ("m-logprobs", "vllm-logprobs", "Requested sample logprobs of 25"),
    ("m-too-long", "sglang-too-long", "exceeds the maximum allowed length"),
    ("m-ctx", "lemonade-ctx", "exceeds the available context size"),
])
async def test_the_callers_error_in_a_stream_is_the_callers_answer(stack: Stack, servers: RealServers, gateway: str,
                                                                   model: str, served: str, said: str,
                                                                   stream: bool) -> None:
    status, text = await ask(gateway, model, stream)
    assert status == 400, text
    error = json.loads(text)["error"]
    assert said in error["message"]
    # one provider asked: another of the model would answer the same request the same
    assert sum(n for name, n in servers.calls.items() if name.startswith(served)) == 1, servers.calls


@pytest.mark.parametrize("stream", [False, True])
async def test_a_run_the_server_aborted_goes_to_another_provider(servers: RealServers, gateway: str,
                                                                 stream: bool) -> None:
    status, text = await ask(gateway, "m-abort", stream)
    assert status == 200, text
    assert "hello there" in text and '"abort"' not in text
    assert servers.calls["vllm-abort@a"] == 1 and servers.calls["ok"] == 1, servers.calls


async def test_lemonade_with_every_slot_pinned_leaves_the_run_to_another_provider(servers: RealServers,
                                                                                  gateway: str) -> None:
    status, text = await ask(gateway, "m-pinned", False)
    assert status == 200, text
    assert "hello there" in text
    assert servers.calls["lemonade-pinned@a"] == 1 and servers.calls["ok"] == 1, servers.calls


async def test_an_sglang_lora_adapter_is_served_as_sglang_takes_it(servers: RealServers, gateway: str) -> None:
    status, text = await ask(gateway, "m-lora", False)
    assert status == 200, text
    assert json.loads(text)["choices"][0]["message"]["content"] == "from the adapter"


async def test_an_sglang_lora_adapter_served_under_its_listed_name_is_missing_not_the_base_model(
        servers: RealServers, gateway: str) -> None:
    """SGLang lists an adapter by its own name, but runs the base model for that name (no `:`, no
    adapter): a config that serves the listed name got the base model's answers from a provider
    shown as having the model. It is missing there: the operator reads why, the caller gets no
    other model's answer."""
    status, text = await ask(gateway, "m-lora-bare", False)
    assert status == 503, text
    assert "s-lora: missing the model" in json.loads(text)["error"]["message"], text
    assert servers.calls["my-lora"] == 0, servers.calls


async def test_a_vllm_put_to_sleep_is_unavailable_and_sent_no_run(stack: Stack, asleep: RealServers,
                                                                  gateway: str) -> None:
    r = sync_redis.Redis.from_url(stack.redis_url)
    try:
        probed = wait_until(lambda: (h := r.hgetall(f"iop:provider:{SLEEPY}")).get(b"reason", b"not probed yet")
                            != b"not probed yet" and h, what="the sleeping provider probed")
        assert probed[b"health"] == b"unavailable", probed
        assert b"asleep" in probed[b"reason"], probed
    finally:
        r.close()
    status, text = await ask(gateway, "m-asleep", False)
    assert status == 200 and "hello there" in text, text
    assert asleep.calls["asleep"] == 0, asleep.calls


async def test_a_vllm_woken_takes_runs_again_and_one_put_to_sleep_takes_none(stack: Stack, asleep: RealServers,
                                                                             gateway: str) -> None:
    """In dev mode, awake: `{"is_sleeping": false}`, available; asleep again: unavailable."""
    assert asleep.asleep == [True]
    r = sync_redis.Redis.from_url(stack.redis_url)
    try:
        wait_until(lambda: r.hget(f"iop:provider:{SLEEPY}", "health") == b"unavailable", what="asleep at first")
        asleep.asleep[0] = False
        wait_until(lambda: r.hget(f"iop:provider:{SLEEPY}", "health") == b"available", what="awake")
        status, text = await ask(gateway, "m-asleep", False)  # (a tie with b-ok-s: a-asleep goes first)
        assert status == 200 and "hello there" in text, text
        assert asleep.calls["asleep"] == 1, asleep.calls
        asleep.asleep[0] = True
        probed = wait_until(lambda: (h := r.hgetall(f"iop:provider:{SLEEPY}"))[b"health"] == b"unavailable" and h,
                            what="asleep again")
        assert b"asleep" in probed[b"reason"], probed
    finally:
        r.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_model_cap_does_not_make_sglang_refuse_a_request_that_asked_no_limit(servers: RealServers,
                                                                                     gateway: str,
                                                                                     stream: bool) -> None:
    """The cap (8192) with the prompt (30000) passes SGLang's context (32768), which it refuses with a
    400 where a request without a limit generates to the end of its context: asked again with the room
    it said it has (2768), the caller that asked no limit gets its answer."""
    status, text = await ask(gateway, "m-capped", stream)
    assert status == 200, text
    assert "a long answer" in text
    assert servers.calls["sglang-total@a"] == 2, servers.calls


@pytest.mark.parametrize("stream", [False, True])
async def test_a_model_cap_is_fitted_to_an_sglang_that_refuses_a_total_equal_to_its_context(
        servers: RealServers, gateway: str, stream: bool) -> None:
    """SGLang 0.5.2 refuses a prompt and limit that together make exactly its context (`>=`, where 0.5.23
    refuses only more): the room it said it has (2768) is refused too, and the caller that asked no limit
    got a 400 for a limit of 2768 it never asked for. Found in review from SGLang 0.5.2's source."""
    status, text = await ask(gateway, "m-capped-052", stream)
    assert status == 200, text
    assert "a long answer" in text
    assert servers.calls["sglang-total-052@a"] == 3, servers.calls


async def test_lemonade_with_every_slot_pinned_is_benched_for_the_model_not_asked_first_by_every_run(
        stack: Stack, servers: RealServers, gateway: str) -> None:
    """Its 409 (every loaded model pinned) is the pool's, not the request's: the state of that server,
    which lasts until its operator unpins a model. Were it not blamed as a 5xx is, it kept every
    slot free (it answers at once), so every run of the model went there first and back to the end of
    its queue (an attempt spent, each time)."""
    r = sync_redis.Redis.from_url(stack.redis_url)
    blamed = "blame:lemonade-pinned@a"
    try:
        for i in range(6):
            status, text = await ask(gateway, "m-pinned", False)
            assert status == 200 and "hello there" in text, text
            if i < 3:  # (the worker blames it just after the answer went out: the next run waits for that)
                wait_until(lambda n=i + 1: int(r.hget("iop:provider:a-pinned", blamed) or 0) >= n  # type: ignore[misc]
                           or r.hexists("iop:provider:a-pinned", "bench:lemonade-pinned@a"),
                           what=f"blame {i + 1} recorded")
    finally:
        r.close()
    assert servers.calls["lemonade-pinned@a"] == 3, servers.calls  # (3 blames in a row: benched for the model)


@pytest.mark.parametrize(("model", "provider", "served"), [
    ("m-queue-full", "s-full", "sglang-queue-full@a"),
    ("m-paused", "p-paused", "vllm-paused@a"),
])
async def test_a_server_too_busy_in_its_stream_is_benched_busy_not_blamed(
        stack: Stack, servers: RealServers, gateway: str, model: str, provider: str, served: str) -> None:
    """SGLang's full queue and a paused vLLM say so in the stream they opened with a 200 (a 503 `code`;
    tests/fakes/real_servers.py says where): as answered whole, the provider is busy, left alone for
    the model a second, and not blamed for it (three blames bench it for 30 s, as for a broken server)."""
    r = sync_redis.Redis.from_url(stack.redis_url)
    try:
        status, text = await ask(gateway, model, True)
        assert status == 200 and "hello there" in text, text
        assert servers.calls[served] == 1 and servers.calls["ok"] == 1, servers.calls
        held = wait_until(lambda: (h := r.hgetall(f"iop:provider:{provider}")).get(f"busy:{served}".encode()) and h,
                          what="the busy provider benched")
        assert f"blame:{served}".encode() not in held, held
    finally:
        r.close()


@pytest.mark.parametrize("model", ["m-queue-full-only", "m-paused-only"])
async def test_a_server_too_busy_in_its_stream_is_a_503_for_the_caller(servers: RealServers, gateway: str,
                                                                       model: str) -> None:
    """Its only provider too busy: the caller is told to try again (503 with `Retry-After`), as when
    that server answers the whole request 503, not given a 502 (a broken provider)."""
    status, text, headers = await ask_with_headers(
        gateway, {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True})
    assert status == 503, text
    assert headers.get("Retry-After"), headers
    assert any(said in json.loads(text)["error"]["message"] for said in ("queue is full", "Generation is paused"))


@pytest.mark.parametrize("stream", [False, True])
async def test_a_vllm_400_in_its_stream_without_a_param_is_the_callers_once_no_provider_is_left(
        servers: RealServers, gateway: str, stream: bool) -> None:
    """vLLM refuses a JSON schema xgrammar does not take after its 200, with no `param`: the stream's
    error is the 400 the whole request gets. Older vLLM gave 400 to every fault of its streams, so it
    is tried on the model's other provider first (without using up an attempt), then passed through
    as the caller's 400, not turned into a 502 (which the official clients send twice more)."""
    status, text = await ask(gateway, "m-schema", stream)
    assert status == 400, text
    error = json.loads(text)["error"]
    assert "not supported by xgrammar" in error["message"], error
    asked = sum(n for name, n in servers.calls.items() if name.startswith("vllm-schema"))
    assert asked == (2 if stream else 1), servers.calls


@pytest.mark.parametrize("stream", [False, True])
async def test_a_vllm_started_without_tool_parsing_leaves_a_request_with_tools_to_another_provider(
        servers: RealServers, gateway: str, stream: bool) -> None:
    """Its 400 names the flags it was not started with: not the caller's request at fault, but that
    server's; another provider of the model serves it (the first asked, by the tie-break)."""
    status, text = await ask(gateway, "m-tools", stream, tools=[
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    assert status == 200, text
    assert "hello there" in text
    assert servers.calls["vllm-notools@a"] == 1 and servers.calls["ok"] == 1, servers.calls


async def test_a_request_vllm_refuses_whose_echo_names_a_flag_is_the_callers_400_at_once(servers: RealServers,
                                                                                        gateway: str) -> None:
    """vLLM's 400 to a request that fails its validation echoes the part at fault, here text saying
    "requires --access": the caller's words, not a flag the server lacks, so the caller's 400 at once,
    not sent to the model's other providers first. Found in review."""
    part = {"type": "input_text", "text": "npm publish requires --access public"}
    status, text = await ask(gateway, "m-tools", False, messages=[{"role": "user", "content": [part]}])
    assert status == 400, text
    assert "input_text" in text
    assert servers.calls["vllm-notools@a"] == 1 and servers.calls["ok"] == 0, servers.calls


async def test_n_over_1_at_temperature_0_that_vllm_refuses_goes_to_another_provider(servers: RealServers,
                                                                                    gateway: str) -> None:
    """vLLM refuses two greedy choices (400, no param); OpenAI and SGLang serve them: the server's
    limit, not the caller's fault, so the model's other provider is asked (the first, by the tie-break)."""
    status, text = await ask(gateway, "m-greedy", False, n=2, temperature=0)
    assert status == 200, text
    assert servers.calls["vllm-greedy@a"] == 1 and servers.calls["ok"] == 1, servers.calls
