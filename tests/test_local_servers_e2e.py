"""What Ollama and llama.cpp's own `llama-server` really answer, through real iop processes and a
real Redis (`tests/fakes/local_servers.py` says where in each server's source every answer comes
from):

- Ollama ends a stream without `"done": true` when it stops a generation itself (its guard against
  a repeating token): a healthy server's answer to that request, no strike against it, as the same
  request asked for whole (a 200 that is not done) is none;
- llama-server lists one of its names (`-a a,b`) as the model's id and the others under `aliases`,
  and takes a request under any of them: a provider served under another alias has the model;
- llama-server's error event after its stream began (a prompt of a legacy completion's list over
  its context) carries the status it answers the same error with whole: a 400 of the caller's is
  the caller's answer, not tried on every provider and turned into a 502;
- llama-server in router mode answers a model it does not have (any more) with a 400 `model '…'
  not found`: the provider's matter, not the caller's; another provider serves the run;
- a router started with `--no-models-autoload` lists models it has not loaded and refuses every
  run of them (`model is not loaded`): such a model is not served there until it is loaded;
- Ollama answers a request's option of the wrong type with a 500 (`option "num_ctx" must be of type
  integer`): the caller's request, not the server's fault;
- Ollama passes llama-server's error answer on as the text of its own error (a prompt over the context,
  not truncated): the caller reads llama-server's message, not its JSON;
- Ollama answers a run of a cloud model it cannot run (not signed in to ollama.com: 401; cloud
  disabled: 403; its host not among `OLLAMA_REMOTES`: 400) as the matter of that model on that
  server: another provider serves the run, and the Ollama is not struck down for its other models;
- Ollama answers nothing, not even its head, while it loads the model a run names, and aborts the
  load when the client leaves: a load longer than `read_timeout_ms` is waited for
  (`load_timeout_ms`), not given up on and started again by every run;
- Ollama's `/api/embed` answers 400 to every failure of its runner (one that died while it embedded):
  the server's fault, tried on another provider, not the caller's 400; its 400 for an input over the
  context stays the caller's;
- Ollama embeds nothing for an empty `input` (a 200 without embeddings): the caller's 400 naming
  `input`, not a 502;
- Ollama asked for a whole answer sends nothing until it is done: a whole answer is asked for as a
  stream, so a generation longer than `read_timeout_ms` is no silent provider."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import redis as sync_redis

from tests.conftest import Stack, async_wait_until
from tests.fakes.local_servers import LocalServers
from tests.test_e2e import one_node_gateway

pytestmark = pytest.mark.e2e

#: provider id -> (server path, type, served names); equal capacities, so ties go by provider id
PROVIDERS: dict[str, tuple[str, str, list[str]]] = {
    "a-router": ("router", "llamacpp", ["router-ok", "router-gone"]),
    "l-a": ("single-a", "llamacpp", ["chat-default", "qwen3-8b"]),
    "l-b": ("single-b", "llamacpp", ["chat-default"]),
    "o-a": ("ollama", "ollama", ["repeat", "ok"]),
    "z-router": ("router", "llamacpp", ["router-ok"]),
    "b-ollama": ("ollama", "ollama", ["notools"]),
    "c-manual": ("router-manual", "llamacpp", ["router-warm", "router-cold", "router-asleep"]),
    "o-cold": ("ollama", "ollama", ["cold"]),
    "a-cloud": ("ollama", "ollama", ["cloud-signed-out", "cloud-disabled", "cloud-not-here"]),
    "a-embed": ("ollama", "ollama", ["embed-dead"]),
    "o-embed": ("ollama", "ollama", ["embed-ok"]),
    "o-slow": ("ollama", "ollama", ["slow"]),
}
#: model -> {provider id: served name}
MODELS: dict[str, dict[str, str]] = {
    "m-repeat": {"o-a": "repeat"},
    "m-ok": {"o-a": "ok"},
    "m-alias": {"l-a": "qwen3-8b"},
    "m-list": {"l-a": "chat-default", "l-b": "chat-default"},
    "m-gone": {"a-router": "router-gone", "l-b": "chat-default"},
    "m-n": {"l-a": "chat-default", "z-router": "router-ok"},
    "m-tools": {"b-ollama": "notools", "l-b": "chat-default"},
    "m-tools-one": {"b-ollama": "notools"},
    "m-warm": {"c-manual": "router-warm"},
    "m-cold": {"c-manual": "router-cold"},
    "m-asleep": {"c-manual": "router-asleep"},
    "m-loading": {"o-cold": "cold"},
    "m-cloud-signed-out": {"a-cloud": "cloud-signed-out", "l-b": "chat-default"},
    "m-cloud-disabled": {"a-cloud": "cloud-disabled", "l-b": "chat-default"},
    "m-cloud-not-here": {"a-cloud": "cloud-not-here", "l-b": "chat-default"},
    "m-cloud-one-try": {"a-cloud": "cloud-signed-out", "l-b": "chat-default"},
    "m-cloud-only": {"a-cloud": "cloud-disabled"},
    "m-embed": {"a-embed": "embed-dead", "o-embed": "embed-ok"},
    "m-embed-dead": {"a-embed": "embed-dead"},
    "m-embed-ok": {"o-embed": "embed-ok"},
    "m-slow": {"o-slow": "slow"},
}
#: model -> its queue's overrides
QUEUES: dict[str, dict[str, Any]] = {"m-cloud-one-try": {"max_attempts": 1}}
#: provider id -> fields of its config besides the common ones
EXTRA: dict[str, dict[str, Any]] = {"o-cold": {"read_timeout_ms": 500},
                                     "o-slow": {"read_timeout_ms": 1000, "load_timeout_ms": 0}}
#: providers probed only once at start (nothing else resets the evidence a test reads)
QUIET = {"o-a", "a-router"}


@pytest.fixture
def servers(stack: Stack) -> Iterator[LocalServers]:
    with LocalServers() as fake:
        yield fake
        stack.stop_all()  # (the workers go before the servers they probe)


@pytest.fixture
def gateway(stack: Stack, servers: LocalServers) -> str:
    return one_node_gateway(
        stack, [{"id": model, "providers": providers, **({"queue": QUEUES[model]} if model in QUEUES else {})}
                for model, providers in MODELS.items()],
        [{"id": pid, "type": ptype, "base_url": f"{servers.url}/{path}", "capacity": 2, "models": served,
          **({"probe_interval_ms": 600_000} if pid in QUIET else {}), **EXTRA.get(pid, {})}
         for pid, (path, ptype, served) in PROVIDERS.items()])


async def ask(gateway: str, path: str, body: dict[str, Any]) -> tuple[int, str]:
    """(status, the answer's text: a whole answer's body, or a stream's events)."""
    async with aiohttp.ClientSession() as session, session.post(gateway + path, json=body) as resp:
        return resp.status, await resp.text()


def chat(model: str, stream: bool) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream}


def evidence(stack: Stack, provider: str) -> dict[str, str]:
    r = sync_redis.Redis.from_url(stack.redis_url, decode_responses=True)
    try:
        held: dict[str, str] = r.hgetall(f"iop:provider:{provider}")
        return held
    finally:
        r.close()


@pytest.mark.parametrize("stream", [True, False])
async def test_ollama_stopping_a_generation_itself_is_no_strike(stack: Stack, servers: LocalServers,
                                                                gateway: str, stream: bool) -> None:
    """Ollama's guard against a repeating token ends the stream whole, without `done`: the caller
    reads an error (the answer is not complete), but the server is not struck for it (it was one
    strike a run: three such requests in a row took a healthy Ollama down for all its models)."""
    status, text = await ask(gateway, "/v1/chat/completions", chat("m-repeat", stream))
    if stream:
        assert status == 200 and "Sure" in text and "ended before it was done" in text, text
    else:
        assert status == 502 and "answered before it was done" in text, text
    assert servers.calls["ollama"]["repeat"] == 1, servers.calls
    held = evidence(stack, "o-a")
    assert held.get("fails", "0") == "0" and held["health"] == "available", held
    status, text = await ask(gateway, "/v1/chat/completions", chat("m-ok", stream))
    assert status == 200 and "hello" in text, text


async def test_a_llama_server_serves_a_model_under_each_of_its_aliases(servers: LocalServers, gateway: str) -> None:
    """`-a qwen3-8b,chat-default`: its `/v1/models` says `chat-default` (the smaller) as the id and
    both under `aliases`. A provider served under `qwen3-8b` was `missing the model` (a 503)."""
    status, text = await ask(gateway, "/v1/chat/completions", chat("m-alias", False))
    assert status == 200, text
    assert json.loads(text)["choices"][0]["message"]["content"] == "hello there"
    assert servers.calls["single-a"]["qwen3-8b"] == 1, servers.calls


@pytest.mark.parametrize("stream", [False, True])
async def test_a_llama_server_error_event_of_the_callers_is_the_callers_answer(servers: LocalServers,
                                                                               gateway: str, stream: bool) -> None:
    """Two prompts, the second over the context: whole, llama-server answers 400; streamed, its 200
    went out with the first prompt's opening chunk, and the error comes as an event with that same
    `code`. It was tried on the model's other llama-server (which answered the same) and the caller
    got a 502, which the official clients send twice more."""
    body = {"model": "m-list", "prompt": ["hi", "word " * 80], "max_tokens": 4, "stream": stream}
    status, text = await ask(gateway, "/v1/completions", body)
    assert status == 400, text
    error = json.loads(text)["error"]
    assert "exceeds the available context size" in error["message"], error
    asked = servers.calls["single-a"]["chat-default"] + servers.calls["single-b"]["chat-default"]
    assert asked == 1, servers.calls


async def test_a_llama_server_router_without_the_model_leaves_the_run_to_another_provider(
        servers: LocalServers, gateway: str) -> None:
    """The router listed `router-gone` when it was probed, then lost it (`DELETE /models`): it answers
    400 `model 'router-gone' not found`. That is the provider's matter (another provider has the
    model), not the caller's request: it was passed through to the caller as a 400."""
    servers.routers["router"].remove("router-gone")
    status, text = await ask(gateway, "/v1/chat/completions", chat("m-gone", False))
    assert status == 200, text
    assert json.loads(text)["choices"][0]["message"]["content"] == "hello there"
    assert servers.calls["router"]["router-gone"] == 1 and servers.calls["single-b"]["chat-default"] == 1, \
        servers.calls


async def test_an_n_over_one_llama_server_s_slots_goes_to_a_provider_that_can_serve_it(servers: LocalServers,
                                                                                       gateway: str) -> None:
    """(Its 400 `Field 'n': Value must be between 1 <= value <= 2, but got 3` was passed to the caller.)"""
    status, text = await ask(gateway, "/v1/chat/completions", {**chat("m-n", False), "n": 3})
    assert status == 200, text
    assert servers.calls["single-a"]["chat-default"] == 1 and servers.calls["router"]["router-ok"] == 1, servers.calls


async def test_an_n_over_every_llama_server_s_slots_is_the_callers_400(servers: LocalServers, gateway: str) -> None:
    status, text = await ask(gateway, "/v1/chat/completions", {**chat("m-alias", False), "n": 3})
    assert status == 400 and "Field 'n': Value must be between" in json.loads(text)["error"]["message"], text


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


async def test_an_ollama_model_without_tools_leaves_a_run_with_tools_to_another_provider(
        stack: Stack, servers: LocalServers, gateway: str) -> None:
    """Ollama's 400 `notools does not support tools` is what its build of the model lacks, not the
    caller's request: another provider of the model serves it; with none, the caller gets the 400."""
    status, text = await ask(gateway, "/v1/chat/completions", {**chat("m-tools", False), "tools": TOOLS})
    assert status == 200, text
    assert servers.calls["ollama"]["notools"] == 1 and servers.calls["single-b"]["chat-default"] == 1, servers.calls
    status, text = await ask(gateway, "/v1/chat/completions", {**chat("m-tools-one", False), "tools": TOOLS})
    assert status == 400 and json.loads(text)["error"]["message"].endswith("notools does not support tools"), text
    assert evidence(stack, "b-ollama").get("fails", "0") == "0"  # (no strike: it answered)


def observed(stack: Stack, provider: str) -> list[str]:
    listed: list[str] = json.loads(evidence(stack, provider).get("observed_models") or "[]")
    return listed


@pytest.mark.parametrize("stream", [False, True])
async def test_a_model_a_router_without_autoload_has_not_loaded_is_not_served_there_until_loaded(
        stack: Stack, servers: LocalServers, gateway: str, stream: bool) -> None:
    """`llama-server --models-dir … --no-models-autoload` lists every model it has, loaded or not,
    and answers a run of one it has not loaded with a 400 `model is not loaded`. Counted as listed,
    such a model, served only there, got a 502 for every run (the router was asked each time) until
    an operator loaded it. It is missing there (the caller's 503 says so at once, and the router is
    not asked) until the router lists it loaded; one it put to sleep is served (a run wakes it)."""
    for model in ("m-warm", "m-asleep"):
        status, text = await ask(gateway, "/v1/chat/completions", chat(model, stream))
        assert status == 200 and "hello" in text, (model, text)
    status, text = await ask(gateway, "/v1/chat/completions", chat("m-cold", stream))
    assert status == 503, text
    error = json.loads(text)["error"]
    assert error["code"] == "no_available_provider" and "c-manual: missing the model" in error["message"], error
    assert servers.calls["router-manual"]["router-cold"] == 0, servers.calls
    assert "router-cold" not in observed(stack, "c-manual")

    async with aiohttp.ClientSession() as session, \
            session.post(f"{servers.url}/router-manual/models/load", json={"model": "router-cold"}) as resp:
        assert resp.status == 200 and await resp.json() == {"success": True}

    await served_once_listed(stack, servers, gateway, stream, "the router's loaded model listed")


async def served_once_listed(stack: Stack, servers: LocalServers, gateway: str, stream: bool, what: str) -> None:
    """Once c-manual's probe lists `router-cold`, a run of `m-cold` is served there: the router's
    first call for that model."""
    async def listed() -> bool:
        return "router-cold" in observed(stack, "c-manual")

    await async_wait_until(listed, what=what)
    status, text = await ask(gateway, "/v1/chat/completions", chat("m-cold", stream))
    assert status == 200 and "hello" in text, text
    assert servers.calls["router-manual"]["router-cold"] == 1, servers.calls


async def test_a_router_started_anew_with_its_default_serves_its_unloaded_models_again(
        stack: Stack, servers: LocalServers, gateway: str) -> None:
    """A router started with `--no-models-autoload` is started anew with its default (it loads a
    model a run names) between two probes, none of which failed: the models it has not loaded are
    served there again (the first run loads one). They stayed missing there (a 503 for a model
    served only there) until a probe happened to fail, and no run would ever load them."""
    status, text = await ask(gateway, "/v1/chat/completions", chat("m-cold", False))
    assert status == 503, text
    router = servers.routers["router-manual"]
    router.autoload = True
    router.models.update({name: "unloaded" for name in router.models})  # (a router starts with none loaded)

    await served_once_listed(stack, servers, gateway, False, "the router's unloaded model listed again")


@pytest.mark.parametrize("stream", [False, True])
async def test_a_responses_run_a_worker_refuses_names_the_field_as_the_caller_wrote_it(
        gateway: str, stream: bool) -> None:
    """The arguments of an earlier function call nested deeper than Ollama's adapter takes: the
    worker refuses the run (the gateway does not parse them), naming the field of its chat
    completion run, `messages[1].tool_calls[0].function.arguments`, which a Responses caller never
    wrote: it is `input[1].arguments` (the refusal comes before a stream's first event: a 400 both
    ways; a stream's `error` event is named so too)."""
    deep = "[" * 200 + "]" * 200
    body = {"model": "m-ok", "stream": stream, "input": [
        {"role": "user", "content": "q"}, {"type": "function_call", "call_id": "c1", "name": "f", "arguments": deep},
        {"type": "function_call_output", "call_id": "c1", "output": "r"}]}
    status, text = await ask(gateway, "/v1/responses", body)
    if status == 200 and stream:  # (a stream whose headers went out before the refusal: in its events)
        events = [json.loads(line.removeprefix("data: ")) for line in text.splitlines() if line.startswith("data: ")]
        errors = [e for e in events if e.get("type") == "error"]
        assert len(errors) == 1, text
        said = errors[0]
    else:
        assert status == 400, text
        said = json.loads(text)["error"]
    assert "nest deeper than" in said["message"] and said["param"] == "input[1].arguments", said


@pytest.mark.parametrize("stream", [True, False])
async def test_ollama_loading_the_model_longer_than_the_read_timeout_is_waited_for(
        stack: Stack, servers: LocalServers, gateway: str, stream: bool) -> None:
    """`cold` takes longer to load than the provider's `read_timeout_ms` (1.5 s against 0.5 s here;
    minutes against 120 s for a large model). Ollama sends nothing meanwhile, its head included, and
    aborts the load when the client leaves: every run was a 504 `provider_timeout` after
    `read_timeout_ms`, each load aborted, so the model never loaded at all."""
    status, text = await ask(gateway, "/v1/chat/completions", chat("m-loading", stream))
    assert status == 200 and "hello" in text, text
    assert servers.loads == {"started": 1, "loaded": 1}, servers.loads
    assert evidence(stack, "o-cold").get("fails", "0") == "0"


@pytest.mark.parametrize(("extra", "param"), [
    ({"options": {"num_ctx": "8k"}}, "options.num_ctx"),
    ({"temperature": "0.5"}, "temperature"),
    ({"max_tokens": 8, "options": {"num_predict": "8"}}, "options.num_predict"),  # (the caller's options win)
])
async def test_ollama_refusing_an_option_of_the_wrong_type_is_the_callers_400(
        stack: Stack, servers: LocalServers, gateway: str, extra: dict[str, Any], param: str) -> None:
    """Ollama answers an option of the wrong type 500 (`handleScheduleError`'s default), though it is
    the request's: it was a 502 `provider_error`, tried again as the server's fault (which the
    official clients send twice more). It is tried on the model's other providers first (a server
    of the OpenAI family may take `"0.5"` as a number), then the caller's 400 naming the field as
    the request wrote it, and no strike."""
    status, text = await ask(gateway, "/v1/chat/completions", {**chat("m-ok", False), **extra})
    assert status == 400, text
    error = json.loads(text)["error"]
    assert error["param"] == param and "must be of type" in error["message"], error
    assert servers.calls["ollama"]["ok"] == 1, servers.calls
    assert evidence(stack, "o-a").get("fails", "0") == "0"


@pytest.mark.parametrize("stream", [True, False])
async def test_ollama_passing_on_llama_server_s_error_says_its_message(
        servers: LocalServers, gateway: str, stream: bool) -> None:
    """A prompt over the context that Ollama does not truncate (`"truncate": false`) is refused by its
    runner, llama-server, whose error answer Ollama passes on as the text of its own: the caller's 400
    said `{"error":{"code":400,"message":…}}` as its message."""
    body = {**chat("m-ok", stream), "truncate": False, "messages": [{"role": "user", "content": "word " * 80}]}
    status, text = await ask(gateway, "/v1/chat/completions", body)
    assert status == 400, text
    error = json.loads(text)["error"]
    assert error["message"].startswith("request (81 tokens) exceeds the available context size"), error


@pytest.mark.parametrize("served", ["cloud-signed-out", "cloud-disabled", "cloud-not-here"])
async def test_an_ollama_cloud_model_it_cannot_run_goes_to_another_provider_without_a_strike(
        stack: Stack, servers: LocalServers, gateway: str, served: str) -> None:
    """A cloud model that Ollama lists but cannot run (`a-cloud` goes first: its id is the smaller):
    its 401 (not signed in to ollama.com) and 403 (cloud disabled) were taken for a refusal of iop's
    credentials, a strike each (three such runs took the Ollama down for all its models, its local
    ones too), and its 400 (a remote host it may not use) for the caller's, who got it at once."""
    for _ in range(3):
        status, text = await ask(gateway, "/v1/chat/completions", chat(f"m-{served}", False))
        assert status == 200 and "hello" in text, text
    assert servers.calls["ollama"][served] == 3 and servers.calls["single-b"]["chat-default"] == 3, servers.calls
    held = evidence(stack, "a-cloud")
    assert held.get("fails", "0") == "0" and held["health"] == "available", held


async def test_a_caller_leaving_during_ollama_s_load_closes_the_run_s_request(
        stack: Stack, servers: LocalServers, gateway: str) -> None:
    """The head may now take `load_timeout_ms` more: a caller that leaves meanwhile must not keep the
    worker's request open for it (the run is cancelled, its request to Ollama closed: its load aborted)."""
    timeout = aiohttp.ClientTimeout(total=0.6)
    with pytest.raises(TimeoutError):
        async with aiohttp.ClientSession(timeout=timeout) as session, \
                session.post(gateway + "/v1/chat/completions", json=chat("m-loading", True)) as resp:
            await resp.read()
    async def aborted() -> bool:
        return servers.loads["aborted"] == 1

    await async_wait_until(aborted, timeout=10)
    assert servers.loads == {"started": 1, "aborted": 1}, servers.loads


async def test_an_ollama_cloud_model_it_cannot_run_uses_up_none_of_a_run_s_attempts(
        stack: Stack, servers: LocalServers, gateway: str) -> None:
    """Ollama cannot run that model at all (not signed in to ollama.com), as it cannot do tools for a
    model without them: the run goes to another provider of the model without using up one of its
    attempts. With one attempt (`max_attempts: 1`) every run that went there first (it answers at
    once, so it is the least loaded) was a 502, though another provider served the model."""
    for _ in range(2):
        status, text = await ask(gateway, "/v1/chat/completions", chat("m-cloud-one-try", False))
        assert status == 200 and "hello" in text, text
    held = evidence(stack, "a-cloud")
    assert held.get("fails", "0") == "0" and held["health"] == "available", held
    status, text = await ask(gateway, "/v1/chat/completions", chat("m-cloud-only", False))  # (none other)
    assert status == 502 and "ollama cloud is disabled" in text, text


async def test_ollama_s_400_for_a_runner_that_died_while_it_embedded_is_the_server_s_fault(
        stack: Stack, servers: LocalServers, gateway: str) -> None:
    """Ollama's `/api/embed` answers 400 to every error of an input's embedding that is not its runner's
    status, its runner dying under it among them (`do embedding request: Post "…": EOF`): that was the
    caller's 400, never tried on the model's other provider, and a sign of life. It is the server's
    fault, as its 5xx: the other provider serves the run (`a-embed` goes first: its id is the smaller),
    no strike; with none other, a 502 `provider_error` saying what Ollama said."""
    status, text = await ask(gateway, "/v1/embeddings", {"model": "m-embed", "input": ["one", "two"]})
    assert status == 200, text
    assert [d["embedding"] for d in json.loads(text)["data"]] == [[0.6, 0.8], [0.6, 0.8]], text
    assert servers.calls["ollama"]["embed-dead"] == 1 and servers.calls["ollama"]["embed-ok"] == 1, servers.calls
    assert evidence(stack, "a-embed").get("fails", "0") == "0"
    status, text = await ask(gateway, "/v1/embeddings", {"model": "m-embed-dead", "input": "one"})
    assert status == 502, text
    error = json.loads(text)["error"]
    assert error["code"] == "provider_error" and "do embedding request" in error["message"], error


async def test_ollama_s_400_for_an_embedding_input_over_the_context_stays_the_caller_s(
        servers: LocalServers, gateway: str) -> None:
    """The 400 Ollama's `/api/embed` gives an input over the context it may not truncate is the
    caller's, as before: passed through at once, not tried on another provider."""
    body = {"model": "m-embed-ok", "input": "word " * 80, "truncate": False}
    status, text = await ask(gateway, "/v1/embeddings", body)
    assert status == 400, text
    assert json.loads(text)["error"]["message"] == "the input length exceeds the context length", text
    assert servers.calls["ollama"]["embed-ok"] == 1, servers.calls


async def test_an_empty_embedding_input_is_the_caller_s_400_for_ollama(servers: LocalServers,
                                                                        gateway: str) -> None:
    """Ollama takes an empty `input` for none, and answers a 200 without embeddings: that was a 502
    `provider_error` ("with 0 embeddings for 1 inputs"). OpenAI answers it 400; so does iop, naming
    `input`, without asking Ollama."""
    status, text = await ask(gateway, "/v1/embeddings", {"model": "m-embed-ok", "input": ""})
    assert status == 400, text
    assert json.loads(text)["error"]["param"] == "input", text
    assert servers.calls["ollama"]["embed-ok"] == 0, servers.calls


async def test_an_ollama_whole_answer_longer_than_the_read_timeout_is_waited_for(
        stack: Stack, servers: LocalServers, gateway: str) -> None:
    """Ollama asked for a whole answer sends nothing, its head included, until its generation is done
    (`writeChatResponse` gathers it first): one that took longer than `read_timeout_ms` (here 1 s, its
    tokens 0.25 s apart) was a silent provider, a 504 and a strike, however steadily it generated. The
    worker asks for it as a stream and merges the lines, each within the timeout."""
    status, text = await ask(gateway, "/v1/chat/completions", chat("m-slow", False))
    assert status == 200, text
    answer = json.loads(text)
    assert answer["choices"][0]["message"]["content"] == "".join(f"t{i} " for i in range(8)), answer
    assert answer["choices"][0]["finish_reason"] == "stop" and answer["usage"]["completion_tokens"] == 8, answer
    held = evidence(stack, "o-slow")
    assert held.get("fails", "0") == "0" and held["health"] == "available", held
