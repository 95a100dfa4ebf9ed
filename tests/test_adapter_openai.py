"""The OpenAI-compatible family (vLLM, SGLang, Lemonade, openai_api) against the simulator and
small fakes on port 0: where each type's API and probes live, streaming, pass-through of
unknown fields and tool-call deltas, errors, cancellation, health transitions, and an API
key that never shows in errors."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from common.config import ProviderConfig
from common.policy import Health
from common.wire import RunKind, upstream_request_id
from iop.simulator import SimOptions, start_server
from tests.conftest import async_wait_until as until
from tests.fakes.local_servers import LocalServers
from workers.adapters.base import LastRead, ProviderError, Retry
from workers.adapters.openai_compat import (
    OpenAICompatAdapter,
    api_root,
    for_llamacpp,
    schema_as_json_object,
    server_root,
)
from workers.adapters.reading import without_traceback
from workers.heartbeat import probe_evidence

FAMILY = ("vllm", "sglang", "lemonade", "openai_api")
SERVED = "Qwen/Qwen3.6-35B-A3B"
KEY = "sk-test-7f3a9c1e5b"


class Sim:
    """The simulator in process; can be stopped and started again on the same port."""

    def __init__(self) -> None:
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self, port: int = 0) -> str:
        self.runner, self.url = await start_server(SimOptions(port=port, models=(SERVED, "embed-small")))
        return self.url

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


@pytest.fixture
async def sim() -> AsyncIterator[Sim]:
    s = Sim()
    await s.start()
    yield s
    if s.runner is not None:
        await s.runner.cleanup()


async def stats(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url + "/stats") as resp:
        data: dict[str, Any] = await resp.json()
        return data


def provider(ptype: str, url: str, **extra: Any) -> ProviderConfig:
    return ProviderConfig.model_validate(
        {"id": f"{ptype}-a", "type": ptype, "base_url": url, "capacity": 2, "models": [SERVED], **extra})


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": SERVED, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, **extra}




@pytest.mark.parametrize(("ptype", "base_url", "api_path", "api", "health"), [
    ("vllm", "http://h:8000", None, "http://h:8000/v1", "http://h:8000/health"),
    ("vllm", "http://h:8000/v1/", None, "http://h:8000/v1", "http://h:8000/health"),
    ("sglang", "http://h:30000", None, "http://h:30000/v1", "http://h:30000/health"),
    ("lemonade", "http://h:8000", None, "http://h:8000/api/v1", "http://h:8000/api/v1/health"),
    ("lemonade", "http://h:8000/api/v1", None, "http://h:8000/api/v1", "http://h:8000/api/v1/health"),
    ("lemonade", "http://h:8000/v1", None, "http://h:8000/v1", "http://h:8000/v1/health"),
    ("openai_api", "https://api.example.com/v1", None, "https://api.example.com/v1", None),
    ("openai_api", "https://example.com", "/openai/v1", "https://example.com/openai/v1", None),
    ("vllm", "http://h:8000/prefix", "", "http://h:8000/prefix", "http://h:8000/prefix/health"),
])
def test_where_each_type_serves_its_api(ptype: str, base_url: str, api_path: str | None, api: str,
                                        health: str | None) -> None:
    assert api_root(base_url, ptype, api_path) == api
    if health is not None:
        adapter = OpenAICompatAdapter(provider(ptype, base_url, api_path=api_path), None)  # type: ignore[arg-type]
        assert adapter.health_url == health
    assert server_root("http://h:8000/v1") == "http://h:8000"


@pytest.mark.parametrize("ptype", FAMILY)
async def test_each_type_streams_completes_and_embeds_via_the_simulator(
        ptype: str, sim: Sim, session: aiohttp.ClientSession) -> None:
    adapter = OpenAICompatAdapter(provider(ptype, sim.url), session)
    probe = await adapter.probe()
    assert probe.health is Health.AVAILABLE and probe.models == [SERVED, "embed-small"]

    reads = [r async for r in adapter.stream(RunKind.CHAT, chat(stream=True, stream_options={"include_usage": True}),
                                             "run_s")]
    chunks = [c for r in reads for c in r]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "tok0 tok1 tok2 "
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    # from the read with the finish_reason on, nothing but the end may come: each is a LastRead
    finishing = next(n for n, r in enumerate(reads) if any(c["choices"] and c["choices"][0]["finish_reason"]
                                                            for c in r))
    assert [isinstance(r, LastRead) for r in reads] == [n >= finishing for n in range(len(reads))]

    answer = await adapter.complete(RunKind.COMPLETION, {"model": SERVED, "prompt": "x", "max_tokens": 2}, "run_c")
    assert answer["choices"][0]["text"] == "tok0 tok1 "
    embedded = await adapter.complete(RunKind.EMBEDDING, {"model": "embed-small", "input": ["a", "b"]}, "run_e")
    assert [d["index"] for d in embedded["data"]] == [0, 1]

    seen = await stats(session, sim.url)
    prefix = "/api/v1" if ptype == "lemonade" else "/v1"
    assert [r["path"] for r in seen["requests"]] == [
        f"{prefix}/chat/completions", f"{prefix}/completions", f"{prefix}/embeddings"]
    assert [r["request_id"] for r in seen["requests"]] == [upstream_request_id(r) for r in ("run_s", "run_c", "run_e")]
    assert seen["by_model"] == {SERVED: 2, "embed-small": 1}


async def test_probe_transitions_available_unavailable_available(sim: Sim, session: aiohttp.ClientSession) -> None:
    adapter = OpenAICompatAdapter(provider("vllm", sim.url), session)
    assert (await adapter.probe()).health is Health.AVAILABLE
    port = sim.port
    await sim.stop()
    probe = await adapter.probe()
    assert probe.health is Health.UNAVAILABLE and probe.reason == "GET /health: connection refused"
    await sim.start(port)
    assert (await adapter.probe()).health is Health.AVAILABLE


class Fake:
    """A scripted OpenAI-compatible server: records every request, answers what a test sets."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str], Any]] = []
        self.status: dict[str, int] = {}
        #: the status of a request for a whole answer (not a stream) to a path, where it differs
        self.whole_status: dict[str, int] = {}
        #: set: a request for a whole answer waits for it before it is answered
        self.whole_held: asyncio.Event | None = None
        self.body: dict[str, Any] = {}
        #: the headers of an answer to a path (an error's `Retry-After`, say)
        self.headers: dict[str, dict[str, str]] = {}
        self.stream_lines: list[bytes] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        payload = await request.json() if request.method == "POST" else None
        self.requests.append((request.path, dict(request.headers), payload))
        status = self.status.get(request.path, 200)
        if isinstance(payload, dict) and not payload.get("stream"):
            status = self.whole_status.get(request.path, status)
            if self.whole_held is not None:
                await self.whole_held.wait()
        if status != 200 or request.method == "GET" or not (payload or {}).get("stream"):
            return web.json_response(self.body.get(request.path, {}), status=status,
                                     headers=self.headers.get(request.path))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for line in self.stream_lines:
            await resp.write(line)
        return resp

    async def start(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self.url


@pytest.fixture
async def fake() -> AsyncIterator[Fake]:
    f = Fake()
    await f.start()
    yield f
    assert f.runner is not None
    await f.runner.cleanup()


async def test_unknown_fields_and_tool_call_deltas_pass_through(fake: Fake, session: aiohttp.ClientSession) -> None:
    fake.stream_lines = [
        b'data: {"id":"c1","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":'
        b'{"role":"assistant","tool_calls":[{"index":0,"id":"call_1","type":"function","function":'
        b'{"name":"weather","arguments":""}}]},"finish_reason":null}]}\n\n',
        b'data: {"id":"c1","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":'
        b'{"tool_calls":[{"index":0,"function":{"arguments":"{\\"city\\": \\"Oslo\\"}"}}]},'
        b'"finish_reason":"tool_calls"}],"x_vendor":1}\n\n',
        b"data: [DONE]\n\n",
    ]
    adapter = OpenAICompatAdapter(provider("openai_api", fake.url), session)
    body = chat(stream=True, tools=[{"type": "function", "function": {"name": "weather"}}], logprobs=True,
                response_format={"type": "json_object"}, vendor_knob={"a": [1, 2]})
    chunks = [c for r in [r async for r in adapter.stream(RunKind.CHAT, body, "run_t")] for c in r]
    assert fake.requests[-1][2] == body
    assert chunks[0]["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] == "weather"
    assert chunks[1]["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
    assert chunks[1]["x_vendor"] == 1 and chunks[1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(("ptype", "health_path", "models_path"), [
    ("vllm", "/health", "/v1/models"), ("sglang", "/health", "/v1/models"),
    ("lemonade", "/api/v1/health", "/api/v1/models"), ("openai_api", None, "/v1/models")])
async def test_each_type_probes_its_own_endpoints(ptype: str, health_path: str | None, models_path: str,
                                                  fake: Fake, session: aiohttp.ClientSession) -> None:
    fake.body[models_path] = {"object": "list", "data": [{"id": SERVED}, {"id": "other"}, {"id": [[1]]}, {"id": 5}]}
    fake.status["/is_sleeping"] = 404  # (vLLM outside dev mode: asked once, then never)
    adapter = OpenAICompatAdapter(provider(ptype, fake.url), session)
    probe = await adapter.probe()
    assert probe.health is Health.AVAILABLE and probe.models == [SERVED, "other"]  # (ids that are not text: left out)
    sleep = ["/is_sleeping"] if ptype == "vllm" else []
    assert [path for path, _, _ in fake.requests] == ([health_path] if health_path else []) + sleep + [models_path]
    if health_path:
        fake.status[health_path] = 503
        probe = await adapter.probe()
        assert probe.health is Health.UNAVAILABLE and probe.reason == f"GET {health_path} answered 503"
        fake.status.pop(health_path)
    fake.body[models_path] = {"unexpected": True}
    probe = await adapter.probe()
    assert probe.health is Health.UNKNOWN and "not with a model list" in probe.reason


@pytest.mark.parametrize(("body", "reason"), [
    # llama.cpp's llama-server while it loads its model
    ({"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}},
     "GET /health answered 503 (Loading model)"),
    ({"message": "warming up\n  (2 of 3 shards)"}, "GET /health answered 503 (warming up (2 of 3 shards))"),
    ({"error": "x" * 300}, "GET /health answered 503 (" + "x" * 99 + "…)"),
    ({}, "GET /health answered 503"),  # (an empty object says nothing)
])
async def test_a_failed_probe_says_what_the_server_said(fake: Fake, session: aiohttp.ClientSession,
                                                         body: dict[str, Any], reason: str) -> None:
    """The catalog's reason of a provider that is down carries a few words of its answer."""
    fake.status["/health"], fake.body["/health"] = 503, body
    probe = await OpenAICompatAdapter(provider("llamacpp", fake.url), session).probe()
    assert probe.health is Health.UNAVAILABLE and probe.reason == reason


async def test_a_probe_answered_429_is_a_sign_of_life(fake: Fake, session: aiohttp.ClientSession) -> None:
    """A hosted API's rate limit covers its model list too: busy is not down (found by an audit:
    one 429 took every provider of the key down at once), and it answered with iop's key: alive
    (a provider whose probes all answered 429 stayed `not probed yet`, no run ever sent: a
    hosted-API audit)."""
    fake.status["/v1/models"] = 429
    probe = await OpenAICompatAdapter(provider("openai_api", fake.url), session).probe()
    assert probe.health is Health.UNKNOWN and probe.busy
    assert probe.reason == "GET /v1/models answered 429 (rate limited)"
    assert probe_evidence(probe, busy=False) == ("ok", 0)


@pytest.mark.parametrize(("listing", "expected"), [
    ([{"id": "m-a", "object": "model"}, {"id": "m-b", "object": "model"}], ["m-a", "m-b"]),  # Together AI's
    ({"object": "list", "data": [{"id": "m-a"}], "has_more": True}, None),  # a page: not all it serves
    ({"object": "list", "data": [{"id": "m-a"}], "has_more": False}, ["m-a"]),
], ids=["bare-array", "first-page", "last-page"])
async def test_a_model_list_as_hosted_apis_give_it(fake: Fake, session: aiohttp.ClientSession,
                                                   listing: Any, expected: list[str] | None) -> None:
    """A bare array was `not a model list` (the provider never took a run); a first page was taken
    for all it serves (a model on the next page was `missing the model`): a hosted-API audit."""
    fake.body["/v1/models"] = listing
    probe = await OpenAICompatAdapter(provider("openai_api", fake.url), session).probe()
    assert (probe.health, probe.models) == (Health.AVAILABLE, expected)


async def test_a_provider_without_a_model_list_is_alive_by_its_probe_path(
        fake: Fake, session: aiohttp.ClientSession) -> None:
    """A hosted API without `GET /models` (404): with a `probe_path` that answers 200, it is alive
    and lists nothing (its served names are the config's); it could never be used."""
    fake.status["/v1/models"] = 404
    bare = await OpenAICompatAdapter(provider("openai_api", fake.url), session).probe()
    assert bare.health is Health.UNAVAILABLE  # (no probe_path: a wrong base_url looks the same)
    fake.status["/status"], fake.body["/status"] = 200, {"ok": True}
    probed = await OpenAICompatAdapter(provider("openai_api", fake.url, probe_path="/status"), session).probe()
    assert (probed.health, probed.models) == (Health.AVAILABLE, None)
    # a server's own (vLLM's) has a model list: its 404 there is a wrong base_url, probe_path or not
    wrong = await OpenAICompatAdapter(provider("vllm", fake.url, probe_path="/status"), session).probe()
    assert wrong.health is Health.UNAVAILABLE and wrong.reason == "GET /v1/models answered 404"


async def test_the_api_key_is_sent_but_never_shown(fake: Fake, session: aiohttp.ClientSession,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IOP_TEST_API_KEY", KEY)
    adapter = OpenAICompatAdapter(provider("openai_api", fake.url, api_key_env="IOP_TEST_API_KEY"), session)
    echo = {"error": {"message": f"Incorrect API key provided: {KEY}.", "type": "invalid_request_error",
                      "param": None, "code": "invalid_api_key"}}
    fake.status["/v1/chat/completions"] = 401
    fake.body["/v1/chat/completions"] = echo
    for call in (adapter.complete(RunKind.CHAT, chat(), "r"),
                 _drain(adapter.stream(RunKind.CHAT, chat(stream=True), "r"))):
        with pytest.raises(ProviderError) as err:
            await call
        # (iop's credentials refused: the pool's fault, tried elsewhere, a strike; not the caller's 401)
        assert err.value.status == 401 and err.value.retry is Retry.ELSEWHERE and err.value.strikes == 1
        assert err.value.detail is None
        assert KEY not in err.value.message
        assert err.value.message == ("provider openai_api-a answered 401: Incorrect API key provided: [redacted]. "
                                     "(it refused iop's credentials: check the provider's api_key_env)")
    assert fake.requests[-1][1]["Authorization"] == f"Bearer {KEY}"

    fake.status["/v1/models"] = 401
    probe = await adapter.probe()
    assert probe.health is Health.UNAVAILABLE and KEY not in probe.reason
    assert fake.requests[-1][1]["Authorization"] == f"Bearer {KEY}"


async def test_a_key_echoed_percent_encoded_is_redacted_too(fake: Fake, session: aiohttp.ClientSession,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A server (or a proxy before it) that echoes the key as a URL writes it (`/`, `+`, `=`
    percent-encoded), or as JSON in a text (`\\/`), showed it to the caller, the catalog and the log."""
    key = "sk-Az/9+q=="
    forms = ["sk-Az%2F9%2Bq%3D%3D", "sk-Az/9%2Bq%3D%3D", "sk-Az%2f9%2bq%3d%3d", "sk-Az\\/9+q=="]
    monkeypatch.setenv("IOP_TEST_API_KEY", key)
    adapter = OpenAICompatAdapter(provider("openai_api", fake.url, api_key_env="IOP_TEST_API_KEY"), session)
    fake.status["/v1/chat/completions"] = 400
    fake.body["/v1/chat/completions"] = {"error": {"message": "bad key " + " ".join(forms), "param": forms[0]}}
    with pytest.raises(ProviderError) as err:
        await adapter.complete(RunKind.CHAT, chat(), "r")
    shown = f"{err.value.message} {err.value.detail}"
    assert not any(form in shown for form in forms) and "[redacted] [redacted] [redacted] [redacted]" in shown, shown
    fake.status["/v1/models"] = 500
    fake.body["/v1/models"] = {"error": {"message": "bad key " + " ".join(forms)}}
    probe = await adapter.probe()
    assert probe.health is Health.UNAVAILABLE and not any(form in probe.reason for form in forms), probe.reason


@pytest.mark.parametrize("echo", ["{key}", "Bearer {key}", "Authorization: Bearer {key}\r\n", "{{\"k\": \"{key}\"}}"])
async def test_a_key_echoed_in_base64_is_redacted_too(fake: Fake, session: aiohttp.ClientSession,
                                                       monkeypatch: pytest.MonkeyPatch, echo: str) -> None:
    """A server (or a debugging proxy) that echoes the request's headers in base64 showed the key to
    the caller, the catalog and the log: at any of the three offsets it may start at in the base64
    text, in either alphabet."""
    key = "sk-proj-Qx7/vB+9zT3kLm0nP4rS8uW2yA6cE1gH"
    said = base64.b64encode(echo.format(key=key).encode())
    forms = [said.decode(), base64.urlsafe_b64encode(echo.format(key=key).encode()).decode()]
    monkeypatch.setenv("IOP_TEST_API_KEY", key)
    adapter = OpenAICompatAdapter(provider("openai_api", fake.url, api_key_env="IOP_TEST_API_KEY"), session)
    fake.status["/v1/chat/completions"] = 400
    fake.body["/v1/chat/completions"] = {"error": {"message": "you sent " + " ".join(forms)}}
    with pytest.raises(ProviderError) as err:
        await adapter.complete(RunKind.CHAT, chat(), "r")
    shown = err.value.message
    assert shown.count("[redacted]") == 2, shown

    def runs(text: str, size: int = 8) -> set[str]:
        return {text[i:i + size] for i in range(len(text) - size + 1)}

    # (no 8 characters in a row made of the key's bytes alone, at any offset, in either alphabet)
    of_key = [base64.b64encode(b"\0" * offset + key.encode()).decode()[3:-3] for offset in range(3)]
    assert not runs(shown) & set().union(*(runs(t) | runs(t.replace("+", "-").replace("/", "_")) for t in of_key))


async def test_the_config_s_headers_and_a_key_in_its_own_header_go_with_runs_and_probes(
        fake: Fake, session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch) -> None:
    """Azure's OpenAI service takes its key in `api-key`, not `Authorization: Bearer`."""
    monkeypatch.setenv("IOP_TEST_API_KEY", KEY)
    adapter = OpenAICompatAdapter(provider("openai_api", fake.url, api_key_env="IOP_TEST_API_KEY",
                                           api_key_header="api-key", headers={"X-Title": "iop"}), session)
    fake.body["/v1/chat/completions"] = {"object": "chat.completion", "model": SERVED, "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]}
    await adapter.complete(RunKind.CHAT, chat(), "run_1")
    await adapter.probe()
    for path, headers, _ in fake.requests[-2:]:
        assert headers["api-key"] == KEY and headers["X-Title"] == "iop" and "Authorization" not in headers, path
    fake.status["/v1/chat/completions"] = 401
    fake.body["/v1/chat/completions"] = {"error": {"message": f"bad key {KEY}"}}
    with pytest.raises(ProviderError) as err:
        await adapter.complete(RunKind.CHAT, chat(), "run_2")
    assert KEY not in err.value.message  # (redacted, whichever header carried it)


async def test_a_passed_through_4xx_keeps_the_provider_s_fields_on_one_line(
        fake: Fake, session: aiohttp.ClientSession) -> None:
    """The caller gets the provider's error object (its type, param, code), its message one line
    and cut at `error_chars`, as every provider text iop passes on (it kept the newlines; found by a
    hostile-provider audit)."""
    adapter = OpenAICompatAdapter(provider("vllm", fake.url), session)
    fake.status["/v1/chat/completions"] = 400
    fake.body["/v1/chat/completions"] = {"error": {"message": "bad\nrequest:\r\n  " + "x" * 600, "type": "BadRequest",
                                                   "param": "messages", "code": "too_long"}}
    with pytest.raises(ProviderError) as err:
        await adapter.complete(RunKind.CHAT, chat(), "r")
    detail = err.value.detail
    assert detail is not None and (detail["type"], detail["param"], detail["code"]) == ("BadRequest", "messages",
                                                                                        "too_long")
    assert detail["message"].startswith("bad request: xxx") and "\n" not in detail["message"]
    assert len(detail["message"]) <= 500 and err.value.retry is Retry.NO and err.value.status == 400


async def test_a_4xx_message_that_is_not_text_is_shown_as_json_never_a_repr(
        fake: Fake, session: aiohttp.ClientSession) -> None:
    adapter = OpenAICompatAdapter(provider("vllm", fake.url), session)
    fake.status["/v1/chat/completions"] = 400
    fake.body["/v1/chat/completions"] = {"error": {"message": {"nested": [1, 2]}, "type": 123}}
    with pytest.raises(ProviderError) as err:
        await adapter.complete(RunKind.CHAT, chat(), "r")
    assert err.value.message == 'provider vllm-a answered 400: {"nested": [1, 2]}'
    assert err.value.detail is not None and err.value.detail["message"] == '{"nested": [1, 2]}'


async def _drain(stream: AsyncIterator[Any]) -> None:
    async for _ in stream:
        pass


async def test_errors_say_whether_another_attempt_could_succeed(sim: Sim, session: aiohttp.ClientSession) -> None:
    adapter = OpenAICompatAdapter(provider("vllm", sim.url), session)
    with pytest.raises(ProviderError) as err:
        await adapter.complete(RunKind.CHAT, chat(sim={"fail_status": 503}), "r")
    assert err.value.status == 503 and err.value.retryable
    with pytest.raises(ProviderError) as err:
        await _drain(adapter.stream(RunKind.CHAT, chat(stream=True, sim={"fail_status": 400}), "r"))
    assert err.value.status == 400 and not err.value.retryable and err.value.detail is not None
    with pytest.raises(ProviderError) as err:
        await _drain(adapter.stream(RunKind.CHAT, chat(stream=True, max_tokens=8, sim={"fail_after_tokens": 2}), "r"))
    assert err.value.retryable
    port = sim.port
    await sim.stop()
    with pytest.raises(ProviderError) as err:
        await adapter.complete(RunKind.CHAT, chat(), "r")
    assert err.value.retryable and err.value.status is None
    await sim.start(port)


async def test_cancelling_a_stream_disconnects_from_the_provider(sim: Sim, session: aiohttp.ClientSession) -> None:
    adapter = OpenAICompatAdapter(provider("sglang", sim.url), session)
    first = asyncio.Event()

    async def consume() -> None:
        body = chat(stream=True, max_tokens=1000, sim={"itl_ms": 60_000})
        async for _ in adapter.stream(RunKind.CHAT, body, "run_x"):
            first.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    async def disconnected() -> bool:
        return any(r["disconnected"] for r in (await stats(session, sim.url))["requests"])

    await until(disconnected)


ROLE_LINE = (b'data: {"id":"c1","object":"chat.completion.chunk","model":"m","choices":[{"index":0,'
             b'"delta":{"role":"assistant"},"finish_reason":null}]}\n\n')


async def test_runs_carry_a_uuid_request_id_and_probes_none(fake: Fake, session: aiohttp.ClientSession) -> None:
    fake.body["/v1/models"] = {"object": "list", "data": [{"id": SERVED}]}
    fake.body["/v1/chat/completions"] = {"object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]}
    adapter = OpenAICompatAdapter(provider("llamacpp", fake.url), session)
    await adapter.probe()
    await adapter.complete(RunKind.CHAT, chat(), "run_0123456789abcdef0123456789abcdef")
    probes = [headers for path, headers, _ in fake.requests if path in ("/health", "/v1/models")]
    assert probes and all("x-request-id" not in {k.lower() for k in h} for h in probes)
    run = next(headers for path, headers, _ in fake.requests if path == "/v1/chat/completions")
    assert {k.lower(): v for k, v in run.items()}["x-request-id"] == "01234567-89ab-cdef-0123-456789abcdef"


async def test_a_server_without_a_health_endpoint_is_judged_by_its_model_list(
        fake: Fake, session: aiohttp.ClientSession) -> None:
    fake.status["/health"] = 404  # llama-cpp-python's server has none
    fake.status["/is_sleeping"] = 404  # (nor has vLLM outside dev mode its sleep state)
    fake.body["/v1/models"] = {"object": "list", "data": [{"id": SERVED}]}
    for ptype in ("vllm", "llamacpp"):
        fake.requests.clear()
        adapter = OpenAICompatAdapter(provider(ptype, fake.url), session)
        assert (await adapter.probe()).health is Health.AVAILABLE
        assert (await adapter.probe()).health is Health.AVAILABLE
        # the missing endpoints are asked for once, then the model list alone decides
        sleep = ["/is_sleeping"] if ptype == "vllm" else []
        assert [path for path, _, _ in fake.requests] == ["/health", *sleep, "/v1/models", "/v1/models"]


async def test_a_vllm_asleep_or_paused_is_unavailable(fake: Fake, session: aiohttp.ClientSession) -> None:
    """vLLM asleep (`POST /sleep`) or paused answers `/health` 200 and lists its model, and holds
    every request until it is woken: its `/is_sleeping` (dev mode) decides."""
    fake.body["/v1/models"] = {"object": "list", "data": [{"id": SERVED}]}
    fake.body["/is_sleeping"] = {"is_sleeping": True}
    adapter = OpenAICompatAdapter(provider("vllm", fake.url), session)
    probe = await adapter.probe()
    assert probe.health is Health.UNAVAILABLE and probe.reason.startswith("GET /is_sleeping: it is asleep or paused")
    fake.body["/is_sleeping"] = {"is_sleeping": False}  # woken: asked at every probe still
    assert (await adapter.probe()).health is Health.AVAILABLE
    fake.body["/is_sleeping"] = {"is_sleeping": True}
    assert (await adapter.probe()).health is Health.UNAVAILABLE
    fake.status["/is_sleeping"] = 500  # (an answer it cannot give: as if it had none, this time)
    assert (await adapter.probe()).health is Health.AVAILABLE


async def test_probe_path_names_the_health_endpoint(fake: Fake, session: aiohttp.ClientSession) -> None:
    fake.body["/v1/models"] = {"object": "list", "data": [{"id": SERVED}]}
    adapter = OpenAICompatAdapter(provider("openai_api", fake.url + "/v1", probe_path="/ready"), session)
    assert (await adapter.probe()).health is Health.AVAILABLE
    fake.status["/ready"] = 404  # a health endpoint the operator named is not a thing to fall back from
    probe = await adapter.probe()
    assert probe.health is Health.UNAVAILABLE and probe.reason == "GET /ready answered 404"
    assert [path for path, _, _ in fake.requests] == ["/ready", "/v1/models", "/ready"]


async def test_a_stream_cut_short_is_an_error_not_an_empty_answer(fake: Fake, session: aiohttp.ClientSession) -> None:
    # what llama-cpp-python sends to a stream another request interrupted
    fake.stream_lines = [ROLE_LINE, b"data: [DONE]\n\n"]
    adapter = OpenAICompatAdapter(provider("llamacpp", fake.url), session)
    with pytest.raises(ProviderError) as err:
        await _drain(adapter.stream(RunKind.CHAT, chat(stream=True), "run_c"))
    assert err.value.message == "provider llamacpp-a: the stream was cut short ([DONE] without a finish_reason)"
    assert err.value.retry is Retry.ANY


@pytest.mark.parametrize(("status", "header", "expected"), [
    (429, "7", 7), (503, "  12 ", 12), (429, "86400", 60), (429, None, None), (503, "soon", None),
    (500, "7", None),  # (a server error is not a busy provider: it says nothing of when)
])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_busy_provider_s_retry_after_is_kept_in_seconds(
        fake: Fake, session: aiohttp.ClientSession, status: int, header: str | None, expected: int | None,
        stream: bool) -> None:
    fake.status["/v1/chat/completions"] = status
    fake.body["/v1/chat/completions"] = {"error": {"message": "slow down", "type": "rate_limit"}}
    if header is not None:
        fake.headers["/v1/chat/completions"] = {"Retry-After": header}
    adapter = OpenAICompatAdapter(provider("vllm", fake.url), session)
    with pytest.raises(ProviderError) as err:
        if stream:
            await _drain(adapter.stream(RunKind.CHAT, chat(stream=True), "run_r"))
        else:
            await adapter.complete(RunKind.CHAT, chat(), "run_r")
    assert (err.value.status, err.value.retry_after_s, err.value.retry) == (status, expected, Retry.ELSEWHERE)


async def test_a_multi_line_server_error_is_one_line_and_goes_elsewhere(
        fake: Fake, session: aiohttp.ClientSession) -> None:
    fake.status["/v1/chat/completions"] = 500
    fake.body["/v1/chat/completions"] = {"error": {
        "message": "1 validation error:\n  {'type': 'float_parsing'}\n\n  File \"app.py\", line 376, in create\n",
        "type": "internal_server_error", "param": None, "code": None}}
    adapter = OpenAICompatAdapter(provider("llamacpp", fake.url), session)
    with pytest.raises(ProviderError) as err:
        await adapter.complete(RunKind.CHAT, chat(), "run_e")
    # (without its traceback: the server's files and code are none of its callers' business)
    assert err.value.message == "provider llamacpp-a answered 500: 1 validation error: {'type': 'float_parsing'}"
    assert err.value.retry is Retry.ELSEWHERE and err.value.strikes is None and err.value.detail is None
    fake.status["/v1/chat/completions"] = 400  # (passed through to the caller, without it too)
    fake.body["/v1/chat/completions"] = {"error": {"message": "bad\nTraceback (most recent call last):\n  x",
                                                   "type": "t"}}
    with pytest.raises(ProviderError) as err:
        await adapter.complete(RunKind.CHAT, chat(), "run_f")
    assert err.value.detail is not None and err.value.detail["message"] == "bad"
    fake.body["/v1/chat/completions"] = {"detail": "boom\nTraceback (most recent call last):\n  File \"/srv/a.py\", "
                                                   "line 1, in g\nKeyError: 3"}
    with pytest.raises(ProviderError) as err:  # (FastAPI's error shape: its text)
        await adapter.complete(RunKind.CHAT, chat(), "run_g")
    assert err.value.message == "provider llamacpp-a answered 400: boom KeyError: 3"


@pytest.mark.parametrize(("text", "said"), [
    ("Traceback (most recent call last):\n  File \"/srv/secret/app.py\", line 42, in f\n    x()\nValueError: bad",
     "ValueError: bad"),  # (nothing but a traceback: the exception it ends with)
    ("Traceback (most recent call last):\n  File \"a.py\", line 1, in <module>\n",
     "an error with a traceback (left out: the server's log has it)"),
    ("bad\r  File \"/srv/secret/x.py\", line 3, in f", "bad"),  # (after a lone \r)
    ("bad\n\u00a0 File \"/srv/secret/x.py\", line 3, in f", "bad"),  # (after a no-break space)
    ('{"detail":"boom\\nTraceback (most recent call last):\\n  File \\"/srv/a.py\\", line 1, in g"}',
     '{"detail":"boom\\n'),  # (inside JSON text that is not read as JSON: cut, never shown)
    ("Invalid input.\nFile \"data.csv\", line 12: unexpected comma",
     "Invalid input.\nFile \"data.csv\", line 12: unexpected comma"),  # (a file's line named: no frame)
    ("plain", "plain"),
    ("starting\nTraceback (most recent call last):\n  File \"/opt/tool.py\", line 9, in main\n    raise X(2)\n"
     "json.decoder.JSONDecodeError: Expecting value: line 1",
     "starting\njson.decoder.JSONDecodeError: Expecting value: line 1"),  # (what came before, and the exception)
])
def test_a_traceback_in_a_providers_error_text_is_left_out(text: str, said: str) -> None:
    assert without_traceback(text) == said


async def test_credentials_in_the_url_are_never_shown(fake: Fake, session: aiohttp.ClientSession) -> None:
    url = fake.url.replace("http://", "http://svc-user:pw-9d1c7e@")
    fake.status["/v1/chat/completions"] = 401
    fake.body["/v1/chat/completions"] = {"error": {"message": "bad login svc-user:pw-9d1c7e", "type": "x"}}
    adapter = OpenAICompatAdapter(provider("openai_api", url), session)
    with pytest.raises(ProviderError) as err:
        await adapter.complete(RunKind.CHAT, chat(), "r")
    shown = err.value.message + str(err.value.detail)
    assert "pw-9d1c7e" not in shown and "svc-user" not in shown and "[redacted]:[redacted]" in shown
    assert fake.requests[-1][1]["Authorization"].startswith("Basic ")  # they are still used
    fake.status["/v1/models"] = 500
    probe = await adapter.probe()
    assert "pw-9d1c7e" not in probe.reason and "127.0.0.1" not in probe.reason


FINISH_LINE = (b'data: {"id":"c1","object":"chat.completion.chunk","model":"m","choices":[{"index":0,'
               b'"delta":{"content":"hi"},"finish_reason":"stop"}]}\n\n')


async def test_a_stream_that_ends_after_its_finish_reason_without_done_is_whole(
        fake: Fake, session: aiohttp.ClientSession) -> None:
    """The answer came whole (a finish_reason), only the `[DONE]` line did not: the caller keeps
    it (it was an error, and a strike against the provider). Without a finish_reason it is still
    an error."""
    adapter = OpenAICompatAdapter(provider("vllm", fake.url), session)
    fake.stream_lines = [ROLE_LINE, FINISH_LINE]
    reads = [chunks async for chunks in adapter.stream(RunKind.CHAT, chat(stream=True), "run_d")]
    assert [c["choices"][0]["finish_reason"] for read in reads for c in read][-1] == "stop"
    fake.stream_lines = [ROLE_LINE]
    with pytest.raises(ProviderError) as err:
        await _drain(adapter.stream(RunKind.CHAT, chat(stream=True), "run_e"))
    assert err.value.message == "provider vllm-a: the stream ended before [DONE]" and err.value.strikes == 1


def test_a_json_schema_format_goes_to_llamacpp_as_json_object_with_its_schema() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    body: dict[str, Any] = {"model": "m", "response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": schema, "strict": True}}}
    assert schema_as_json_object(body) == {"model": "m", "response_format": {"type": "json_object", "schema": schema}}
    assert body["response_format"]["type"] == "json_schema"  # (the run's own body is not changed)
    for other in ({"model": "m"}, {"response_format": {"type": "json_object"}},
                  {"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}},
                  {"response_format": "json_schema"}):
        assert schema_as_json_object(other) is other


def test_max_completion_tokens_goes_to_llamacpp_as_max_tokens_too() -> None:
    """llama-cpp-python ignores `max_completion_tokens` (the official clients' name for the limit)."""
    body: dict[str, Any] = {"model": "m", "max_completion_tokens": 3}
    assert for_llamacpp(body) == {"model": "m", "max_completion_tokens": 3, "max_tokens": 3}
    assert body == {"model": "m", "max_completion_tokens": 3}  # (the run's own body is not changed)
    for other in (None, 5):  # (it wins, as vLLM reads the two; an unset max_tokens comes as null)
        assert for_llamacpp({"max_completion_tokens": 3, "max_tokens": other}) == {
            "max_completion_tokens": 3, "max_tokens": 3}
    for unchanged in ({"max_tokens": 5}, {"max_completion_tokens": None, "max_tokens": 5},
                      {"max_completion_tokens": 3, "max_tokens": 3}):
        assert for_llamacpp(unchanged) is unchanged
    schema = {"type": "object"}
    assert for_llamacpp({"max_completion_tokens": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}) == {
        "max_completion_tokens": 2, "max_tokens": 2, "response_format": {"type": "json_object", "schema": schema}}


def test_developer_messages_go_to_llamacpp_as_system_ones() -> None:
    """llama-cpp-python refuses the `developer` role (OpenAI's newer name for `system`)."""
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "developer", "content": "Be brief."},
                                                      {"role": "user", "content": "hi"}]}
    assert for_llamacpp(body)["messages"] == [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "hi"}]
    assert body["messages"][0]["role"] == "developer"  # (the run's own body is not changed)
    for other in ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, {"prompt": "x"},
                  {"messages": "not a list"}, {"messages": ["not an object"]}):
        assert for_llamacpp(other) is other


async def test_a_llamacpp_stream_ended_before_any_event_gets_the_servers_refusal_if_it_has_one(
        fake: Fake, session: aiohttp.ClientSession) -> None:
    """llama-cpp-python answers 200 and no event to a stream whose prompt is beyond its context, and
    a 400 to the same asked for whole: the adapter asks so, for one token, and the 400 is the
    caller's (a 5xx says what failed). A whole answer to that (or another type of server) leaves the
    stream's own error."""
    fake.stream_lines = []
    fake.whole_status["/v1/chat/completions"] = 400
    fake.body["/v1/chat/completions"] = {"error": {
        "message": "This model's maximum context length is 2048 tokens", "type": "invalid_request_error",
        "param": "messages", "code": "context_length_exceeded"}}
    body = chat(stream=True, stream_options={"include_usage": True}, max_completion_tokens=50)
    adapter = OpenAICompatAdapter(provider("llamacpp", fake.url), session)
    with pytest.raises(ProviderError) as err:
        await _drain(adapter.stream(RunKind.CHAT, body, "run_long"))
    assert (err.value.status, err.value.retry) == (400, Retry.NO)
    assert err.value.detail is not None and err.value.detail["code"] == "context_length_exceeded"
    asked = fake.requests[-1][2]
    assert asked["max_tokens"] == 1 and not {"stream", "stream_options", "max_completion_tokens"} & set(asked)
    assert asked["messages"] == body["messages"]

    fake.whole_status["/v1/chat/completions"] = 200  # (it answers whole: the stream's error stands)
    with pytest.raises(ProviderError, match="the stream ended before any event"):
        await _drain(adapter.stream(RunKind.CHAT, body, "run_long2"))
    fake.whole_status["/v1/chat/completions"] = 500  # (its 5xx says what failed, and goes elsewhere as before)
    fake.body["/v1/chat/completions"] = {"error": {"message": "invalid literal for int() with base 10: 'abc'"}}
    with pytest.raises(ProviderError) as err:
        await _drain(adapter.stream(RunKind.CHAT, body, "run_long3"))
    assert err.value.message == "provider llamacpp-a answered 500: invalid literal for int() with base 10: 'abc'"
    assert (err.value.retry, err.value.strikes) == (Retry.ELSEWHERE, None)
    fake.whole_held = asyncio.Event()  # (a server that does not answer it: waited on no longer than a read)
    quick = OpenAICompatAdapter(provider("llamacpp", fake.url, read_timeout_ms=200), session)
    with pytest.raises(ProviderError, match="the stream ended before any event"):
        await _drain(quick.stream(RunKind.CHAT, body, "run_held"))
    fake.whole_held.set()
    asked_before = len(fake.requests)
    with pytest.raises(ProviderError, match="the stream ended before any event"):  # (not llama.cpp: not asked)
        await _drain(OpenAICompatAdapter(provider("vllm", fake.url), session).stream(RunKind.CHAT, body, "run_v"))
    assert len(fake.requests) == asked_before + 1


async def test_a_key_with_a_line_end_from_an_env_file_is_sent_without_it_and_said_at_start(
        fake: Fake, session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a review: `KEY\\r` (a Windows env file) made every request fail in aiohttp ('the probe
    failed in the worker (ValueError)'), and nothing said why."""
    from workers.service import key_warnings

    monkeypatch.setenv("IOP_TEST_API_KEY", KEY + "\r")
    config = provider("openai_api", fake.url, api_key_env="IOP_TEST_API_KEY")
    fake.body["/v1/models"] = {"object": "list", "data": [{"id": SERVED, "object": "model"}]}
    probe = await OpenAICompatAdapter(config, session).probe()
    assert probe.health is Health.AVAILABLE, probe.reason
    assert fake.requests[-1][1]["Authorization"] == f"Bearer {KEY}"
    missing = provider("openai_api", fake.url, api_key_env="IOP_TEST_UNSET_KEY").model_copy(update={"id": "b"})
    assert key_warnings([config, missing], {"IOP_TEST_API_KEY": KEY + "\r"}) == [
        "provider openai_api-a: its api_key_env IOP_TEST_API_KEY holds a key with whitespace at its start or end (a "
        "line end of the file it came from?); it is sent without it",
        "provider b: its api_key_env IOP_TEST_UNSET_KEY is not set in this worker's environment; its requests go "
        "without an API key"]
    # set but empty (`KEY=` left unfilled in an env file): it said 'not set' while `env` showed it
    assert key_warnings([missing], {"IOP_TEST_UNSET_KEY": ""}) == [
        "provider b: its api_key_env IOP_TEST_UNSET_KEY is empty (or only whitespace) in this worker's environment; "
        "its requests go without an API key"]


async def test_a_key_with_a_line_break_inside_goes_unsent_and_is_said_at_start(
        fake: Fake, session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch) -> None:
    """A key with a CR or LF inside (two lines pasted into one variable): aiohttp refused every
    request, which failed as "the answer was not valid JSON" (no strike) and the probe as an ERROR
    traceback (a hosted-API audit). Sent without it, the API's 401 says what is wrong; the worker
    warns at its start."""
    from workers.service import key_warnings

    broken = KEY[:10] + "\n" + KEY[10:]
    monkeypatch.setenv("IOP_TEST_API_KEY", broken)
    config = provider("openai_api", fake.url, api_key_env="IOP_TEST_API_KEY")
    fake.status["/v1/models"] = 401
    probe = await OpenAICompatAdapter(config, session).probe()
    assert probe.health is Health.UNAVAILABLE and probe.reason.startswith("GET /v1/models answered 401")
    assert "Authorization" not in fake.requests[-1][1]
    assert key_warnings([config], {"IOP_TEST_API_KEY": broken}) == [
        "provider openai_api-a: its api_key_env IOP_TEST_API_KEY holds a key with a character no header can carry "
        "(a line break inside it?); its requests go without an API key"]


async def test_a_llama_server_router_without_autoload_lists_only_the_models_it_has_loaded(
        session: aiohttp.ClientSession) -> None:
    """`--no-models-autoload`: its `/v1/models` lists every model it has, each with its `status`, and
    it refuses a run of one it has not loaded. Only those it serves as they are count as listed
    (loaded, or asleep: a run wakes it); whether it loads is asked of its `/props` at each probe
    (it may have been started anew with its default)."""
    with LocalServers() as servers:
        router = servers.routers["router-manual"]
        adapter = OpenAICompatAdapter(provider("llamacpp", f"{servers.url}/router-manual"), session)
        assert (await adapter.probe()).models == ["router-warm", "router-asleep"]
        router.models["router-cold"] = "loading"  # (its server answers 503 until it is ready)
        assert (await adapter.probe()).models == ["router-warm", "router-asleep"]
        router.models["router-cold"] = "loaded"
        assert (await adapter.probe()).models == ["router-warm", "router-cold", "router-asleep"]
        router.models["router-warm"] = "unloaded"  # (`POST /models/unload`)
        assert (await adapter.probe()).models == ["router-cold", "router-asleep"]
        assert servers.calls["router-manual"]["GET /props"] == 4, servers.calls  # (it might load them anew)


async def test_a_llama_server_that_loads_what_it_is_asked_for_lists_every_model(
        session: aiohttp.ClientSession) -> None:
    """A router's default (`--models-autoload`) loads a model a run names: every model it lists
    counts, loaded or not, as before. A single-model server (no `status`) is asked nothing more."""
    with LocalServers() as servers:
        servers.routers["router"].models["router-gone"] = "unloaded"
        adapter = OpenAICompatAdapter(provider("llamacpp", f"{servers.url}/router"), session)
        for _ in range(2):
            assert (await adapter.probe()).models == ["router-ok", "router-gone"]
        single = OpenAICompatAdapter(provider("llamacpp", f"{servers.url}/single-a"), session)
        for _ in range(2):
            assert (await single.probe()).models == ["chat-default", "qwen3-8b"]
        assert servers.calls["router"]["GET /props"] == 1 and servers.calls["single-a"]["GET /props"] == 0, \
            servers.calls


async def test_a_router_started_anew_without_autoload_is_known_by_a_run_it_refuses(
        session: aiohttp.ClientSession) -> None:
    """A router asked once loaded models on its own, then was started anew with
    `--no-models-autoload` between two probes: a run it refuses as not loaded says so (no request
    more), and the next probe lists only what it has loaded. A probe that fails (the server
    stopped) forgets what it said: the next router found there is asked again."""
    with LocalServers() as servers:
        router = servers.routers["router"]
        adapter = OpenAICompatAdapter(provider("llamacpp", f"{servers.url}/router"), session)
        assert (await adapter.probe()).models == ["router-ok", "router-gone"]
        router.autoload = False
        router.models["router-gone"] = "unloaded"
        with pytest.raises(ProviderError) as err:
            await adapter.complete(RunKind.CHAT, {**chat(), "model": "router-gone"}, upstream_request_id("r1"))
        assert err.value.retry is Retry.ELSEWHERE and err.value.message.endswith("model is not loaded")
        assert (await adapter.probe()).models == ["router-ok"]
        assert servers.calls["router"]["GET /props"] == 2, servers.calls
    assert (await adapter.probe()).health is not Health.AVAILABLE
    assert adapter.router_autoload is None


@pytest.mark.parametrize(("props", "none"), [
    ({"role": "router", "models_autoload": False, "max_instances": 4}, True),
    ({"role": "router", "models_autoload": True}, False),
    ({"role": "router", "models_autoload": "false"}, False),  # (not the server's own answer: its default)
    ({"models_autoload": False}, False),  # (not a router's)
    ({"role": "router"}, False),
    (None, False),
    ([], False),
])
def test_what_a_router_s_props_say_of_loading_models(props: Any, none: bool) -> None:
    from workers.adapters.openai_compat import loads_none

    assert loads_none(props) is none


async def test_a_router_started_anew_with_autoload_lists_every_model_again(
        session: aiohttp.ClientSession) -> None:
    """A router started with `--no-models-autoload` was started anew with its default between two
    probes (a restart that no probe saw fail): every model it lists is served again, loaded or not
    (a run loads it). Held as it was, the models it had not loaded stayed unlisted until a probe
    failed, and nothing would ever send a run that loads them."""
    with LocalServers() as servers:
        router = servers.routers["router-manual"]
        adapter = OpenAICompatAdapter(provider("llamacpp", f"{servers.url}/router-manual"), session)
        assert (await adapter.probe()).models == ["router-warm", "router-asleep"]
        router.autoload = True
        router.models.update({name: "unloaded" for name in router.models})  # (a restart loads none)
        assert (await adapter.probe()).models == ["router-warm", "router-cold", "router-asleep"]
        assert adapter.router_autoload is True
        for _ in range(2):  # (a router that loads models is not asked again)
            assert (await adapter.probe()).models == ["router-warm", "router-cold", "router-asleep"]
        assert servers.calls["router-manual"]["GET /props"] == 2, servers.calls


async def test_a_router_that_loads_none_is_held_so_while_its_props_answer_an_error(
        session: aiohttp.ClientSession) -> None:
    """A router that said it loads no model, whose `/props` then answers an error (once, or a
    proxy's 502): what it said holds, and only its loaded models are listed; taken as loading
    models, those it has not loaded were listed, each run of them refused."""
    with LocalServers() as servers:
        router = servers.routers["router-manual"]
        adapter = OpenAICompatAdapter(provider("llamacpp", f"{servers.url}/router-manual"), session)
        assert (await adapter.probe()).models == ["router-warm", "router-asleep"]
        router.props_status = 503
        assert (await adapter.probe()).models == ["router-warm", "router-asleep"]
        assert adapter.router_autoload is False
        router.props_status = 200
        router.autoload = True
        assert (await adapter.probe()).models == ["router-warm", "router-cold", "router-asleep"]


@pytest.mark.parametrize(("ptype", "answered"), [("lemonade", True), ("vllm", False)])
async def test_lemonade_s_head_may_take_the_load_timeout_more(session: aiohttp.ClientSession, ptype: str,
                                                              answered: bool) -> None:
    """Lemonade loads the model a run names in its handler, before it answers anything (server.cpp
    `handle_chat_completions`: `auto_load_model_if_needed`, then the answer): its head may take
    `load_timeout_ms` more than `read_timeout_ms`, as Ollama's may. Not a vLLM's, which serves the
    models it was started with: there a head that did not come within `read_timeout_ms` is waited for
    only while its health check passes (this server has none)."""
    async def chat_handler(request: web.Request) -> web.Response:
        await asyncio.sleep(0.4)  # (the server's load of the model: nothing goes out meanwhile)
        return web.json_response({"id": "c", "object": "chat.completion", "created": 1, "model": SERVED,
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                               "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    app = web.Application()
    for path in ("/api/v1/chat/completions", "/v1/chat/completions"):
        app.router.add_post(path, chat_handler)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        adapter = OpenAICompatAdapter(provider(ptype, url, read_timeout_ms=100), session)
        if answered:
            answer = await adapter.complete(RunKind.CHAT, chat(), "r")
            assert answer["choices"][0]["message"]["content"] == "hi"
        else:
            with pytest.raises(ProviderError, match="sent nothing of its answer for 100 ms or more, and its health "
                               r"check then failed \(GET /v1/models answered 404"):
                await adapter.complete(RunKind.CHAT, chat(), "r")
    finally:
        await runner.cleanup()


async def test_a_llama_server_router_s_head_may_take_the_load_timeout_more(session: aiohttp.ClientSession) -> None:
    """A llama-server router that loads models itself (its default) loads the model a run names before
    it answers anything: `router_validate_model` calls `ensure_model_ready`, which starts the load and
    waits on its condition variable, without a timeout and whatever the client does, until the model's
    status is no longer `loading`; only then is the request proxied to the model's server
    (tools/server/server-models.cpp at llama.cpp 00dd08161, `ensure_model_ready`, `proxy_post`). This
    fake does the same: nothing, not even the head, until its load is done. So a `llamacpp` provider's
    head may take `load_timeout_ms` more than `read_timeout_ms`, as Lemonade's and Ollama's may."""
    async def chat_handler(request: web.Request) -> web.Response:
        await asyncio.sleep(0.4)  # (`ensure_model_ready`'s wait for the load: nothing goes out meanwhile)
        return web.json_response({"id": "c", "object": "chat.completion", "created": 1, "model": SERVED,
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                               "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat_handler)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        adapter = OpenAICompatAdapter(provider("llamacpp", url, read_timeout_ms=100), session)
        answer = await adapter.complete(RunKind.CHAT, chat(), "r")
        assert answer["choices"][0]["message"]["content"] == "hi"
    finally:
        await runner.cleanup()


def test_a_llamacpp_provider_takes_a_load_timeout() -> None:
    """`load_timeout_ms` is a `llamacpp` provider's too (a router loads a model before it answers)."""
    config = provider("llamacpp", "http://h:8080", read_timeout_ms=1_000, load_timeout_ms=9_000)
    assert config.head_wait_s == 10.0
