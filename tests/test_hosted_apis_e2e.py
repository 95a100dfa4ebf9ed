"""What hosted OpenAI-compatible APIs really answer (`type: openai_api`), through real iop processes and
a real Redis (`tests/fakes/hosted_apis.py` says where each answer comes from):

- a busy API's wait is honoured however it says it: Azure's `retry-after-ms`, Gemini's `retryDelay` in
  its error body (it sends no header); a caller of a model no other provider serves gets a 503 whose
  `Retry-After` says as much, and the model is benched there that long;
- an account out of quota or credits (OpenAI's 429 `insufficient_quota`, DeepSeek's and OpenRouter's
  402) is the pool's matter, not the caller's: another provider serves the run, and the API is left
  alone for the model a minute (not asked again every second, which none of these clears);
- an Azure deployment, named by its owner, and an OpenRouter routing variant (`:nitro`), which their
  model lists leave out, are served where the config says the list is not all the API takes;
- a limit named `max_completion_tokens` (the official clients' name) reaches Mistral, which refuses the
  name with a 422, as `max_tokens`;
- Gemini's errors (a JSON array of one Google error) reach the caller as an OpenAI error object, and its
  model list (`models/<name>`) lists the names its runs take;
- OpenRouter's keep-alive comments are no event, and its error chunk after output ends the stream with
  an error, not a whole answer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import openai
import pytest

from tests.conftest import Stack
from tests.fakes.hosted_apis import HostedApis
from tests.test_e2e import one_node_gateway

pytestmark = pytest.mark.e2e

#: provider id -> (service, served names)
PROVIDERS: dict[str, tuple[str, list[str]]] = {
    "oa-quota": ("openai", ["gpt-quota"]),
    "b-ok": ("openai", ["gpt-4o-mini@b"]),
    "az": ("azure", ["azure-throttled", "chat-prod@az"]),
    "gem": ("gemini", ["gemini-busy", "gemini-unknown-field", "gemini-2.0-flash"]),
    "a-gem": ("gemini", ["gemini-unknown-field@a"]),
    "ds": ("deepseek", ["deepseek-broke"]),
    "a-ds": ("deepseek", ["deepseek-broke@a"]),
    "or": ("openrouter", ["openrouter/broke", "openrouter/midstream", "openai/gpt-4o-mini", "openrouter/afford",
                          "openrouter/key-limit"]),
    "a-or": ("openrouter", ["openrouter/afford@a"]),
    # (`models_listed: false`: an Azure deployment named by its owner, an OpenRouter routing variant)
    "az-dep": ("azure", ["chat-prod"]),
    "or-var": ("openrouter", ["openai/gpt-4o-mini:nitro"]),
    "mis": ("mistral", ["mistral-small-latest"]),
}
#: providers whose model list does not name every name they take
UNLISTED = {"az-dep", "or-var"}
#: model -> provider id -> served name
MODELS: dict[str, dict[str, str]] = {
    "m-quota": {"oa-quota": "gpt-quota"},
    "m-az-throttled": {"az": "azure-throttled"},
    "m-gem-busy": {"gem": "gemini-busy"},
    "m-gem-400": {"gem": "gemini-unknown-field"},
    "m-field-pool": {"a-gem": "gemini-unknown-field@a", "b-ok": "gpt-4o-mini@b"},
    "m-gem": {"gem": "gemini-2.0-flash"},
    "m-ds-broke": {"ds": "deepseek-broke"},
    "m-ds-pool": {"a-ds": "deepseek-broke@a", "b-ok": "gpt-4o-mini@b"},
    "m-or-broke": {"or": "openrouter/broke"},
    "m-or-key-limit": {"or": "openrouter/key-limit"},
    "m-or-afford": {"or": "openrouter/afford"},
    "m-or-afford-pool": {"a-or": "openrouter/afford@a", "b-ok": "gpt-4o-mini@b"},
    "m-or-midstream": {"or": "openrouter/midstream"},
    "m-or": {"or": "openai/gpt-4o-mini"},
    "m-az-deployment": {"az-dep": "chat-prod"},
    "m-az-unlisted": {"az": "chat-prod@az"},
    "m-or-nitro": {"or-var": "openai/gpt-4o-mini:nitro"},
    "m-mistral": {"mis": "mistral-small-latest"},
}
#: what each service's model list names (Gemini's with its `models/` prefix)
LISTED = {
    "openai": ["gpt-quota", "gpt-4o-mini@b"],
    "azure": ["azure-throttled", "gpt-4o-mini"],  # (models, not deployments)
    "gemini": ["models/gemini-busy", "models/gemini-unknown-field", "models/gemini-2.0-flash",
               "models/gemini-unknown-field@a"],
    "deepseek": ["deepseek-broke", "deepseek-broke@a"],
    "openrouter": ["openrouter/broke", "openrouter/midstream", "openai/gpt-4o-mini", "openrouter/afford",
                   "openrouter/afford@a", "openrouter/key-limit"],
    "mistral": ["mistral-small-latest"],
}
#: where each service's API is below its base_url, when not the type's `/v1`
API_PATHS = {"azure": "/openai/v1", "gemini": "/v1beta/openai"}


@pytest.fixture
def apis(stack: Stack) -> Iterator[HostedApis]:
    with HostedApis(LISTED) as fake:
        yield fake
        stack.stop_all()  # (the worker goes before the server it probes)


@pytest.fixture
def gateway(stack: Stack, apis: HostedApis, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("HOSTED_TEST_KEY", "sk-test-hosted")
    providers = []
    for pid, (service, served) in PROVIDERS.items():
        entry: dict[str, Any] = {"id": pid, "type": "openai_api", "base_url": apis.base(service), "capacity": 2,
                                 "models": served, "api_key_env": "HOSTED_TEST_KEY"}
        if service in API_PATHS:
            entry["api_path"] = API_PATHS[service]
        if service == "azure":
            entry["api_key_header"] = "api-key"
        if pid in UNLISTED:
            entry["models_listed"] = False
        providers.append(entry)
    return one_node_gateway(stack, [{"id": model, "providers": served} for model, served in MODELS.items()],
                            providers)


async def ask(gateway: str, model: str, stream: bool = False) -> tuple[int, dict[str, str], str]:
    """(status, headers, the answer's text: a whole answer's body, or a stream's events)."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    async with aiohttp.ClientSession() as session, session.post(gateway + "/v1/chat/completions", json=body) as resp:
        return resp.status, dict(resp.headers), await resp.text()


@pytest.mark.parametrize(("model", "provider", "served", "wait"), [
    ("m-az-throttled", "az", "azure-throttled", 5),  # (retry-after-ms: 5000, no Retry-After)
    ("m-gem-busy", "gem", "gemini-busy", 47),  # (its RetryInfo's retryDelay: "47s", no header)
])
async def test_a_busy_apis_wait_is_honoured_however_it_says_it(stack: Stack, gateway: str, model: str, provider: str,
                                                              served: str, wait: int) -> None:
    status, headers, text = await ask(gateway, model)
    assert status == 503, text
    assert json.loads(text)["error"]["code"] == "provider_error"
    assert headers["Retry-After"] == str(wait), (headers, text)
    assert "x-should-retry" not in headers, headers  # (a wait clears a rate limit: the client may retry)
    assert stack.bench_left_s(provider, served) > wait - 3


@pytest.mark.parametrize(("model", "provider", "served"), [
    ("m-quota", "oa-quota", "gpt-quota"),  # (OpenAI's 429 insufficient_quota, no Retry-After)
    ("m-ds-broke", "ds", "deepseek-broke"),  # (DeepSeek's 402 Insufficient Balance)
    ("m-or-broke", "or", "openrouter/broke"),  # (OpenRouter's 402 Insufficient credits)
    ("m-or-key-limit", "or", "openrouter/key-limit"),  # (OpenRouter's 403 Key limit exceeded: no refused key)
])
async def test_an_account_out_of_quota_is_left_alone_a_minute_and_is_not_the_callers_fault(
        stack: Stack, apis: HostedApis, gateway: str, model: str, provider: str, served: str) -> None:
    status, headers, text = await ask(gateway, model)
    assert status == 503, text
    error = json.loads(text)["error"]
    assert error["code"] == "provider_error" and error["message"].startswith(f"provider {provider} answered"), error
    assert headers["Retry-After"] == "60", (headers, text)
    assert headers.get("x-should-retry") == "false", headers  # (no wait the official clients would make clears it)
    assert stack.bench_left_s(provider, served) > 50
    assert "api_key_env" not in error["message"], error  # (its key is not refused: no strike, no such hint)
    assert int(stack.heartbeat_field(provider, "fails") or 0) == 0
    # (benched past the run's queue timeout: the next caller is answered at once, the API not asked)
    status, headers, text = await ask(gateway, model)
    assert status == 503 and json.loads(text)["error"]["code"] == "no_available_provider", text
    assert sum(n for (_, name), n in apis.calls.items() if name == served) == 1, apis.calls


def test_the_openai_client_is_told_at_once_that_no_retry_of_its_own_pays_an_account_out_of_quota(
        stack: Stack, apis: HostedApis, gateway: str) -> None:
    """The 503 of the model's only provider out of quota said `Retry-After: 60` (`retry-after-ms: 60000`)
    alone: the official client, which retries a 503 twice and waits what it is told up to 60 s, raised
    only after two minutes, and asked the account again for nothing (OpenAI's own 429
    `insufficient_quota` it gives up on within seconds). `x-should-retry: false` tells it not to."""
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=2)
    stack.clients.append(client)
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(model="m-quota", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status_code == 503 and caught.value.code == "provider_error"
    assert caught.value.response.headers["Retry-After"] == "60"
    assert sum(n for (_, name), n in apis.calls.items() if name == "gpt-quota") == 1, apis.calls


async def test_an_account_out_of_credits_leaves_the_run_to_another_provider(apis: HostedApis, gateway: str) -> None:
    for _ in range(3):
        status, _, text = await ask(gateway, "m-ds-pool")
        assert status == 200 and "hello there" in text, text
    assert apis.calls[("deepseek", "deepseek-broke@a")] == 1, apis.calls


async def test_a_request_larger_than_the_credits_left_pay_for_is_the_callers_and_benches_nothing(
        stack: Stack, apis: HostedApis, gateway: str) -> None:
    """OpenRouter's 402 "requires more credits, or fewer max_tokens" is about the request's size: one of
    fewer tokens is served at the same time on the same account. Its caller gets it as it came, which
    says what to ask for instead, and the model is not benched for the callers whose runs it pays for
    (a minute of 503s for all, as if the account had nothing left)."""
    async with aiohttp.ClientSession() as session:
        big = {"model": "m-or-afford", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000}
        async with session.post(gateway + "/v1/chat/completions", json=big) as resp:
            status, text = resp.status, await resp.text()
        assert status == 402, text
        assert "fewer max_tokens" in json.loads(text)["error"]["message"], text
        assert stack.bench_left_s("or", "openrouter/afford") == 0
        async with session.post(gateway + "/v1/chat/completions", json={**big, "max_tokens": 100}) as resp:
            status, text = resp.status, await resp.text()
        assert status == 200 and "hello there" in text, text
    assert apis.calls[("openrouter", "openrouter/afford")] == 2, apis.calls


async def test_a_request_larger_than_one_accounts_credits_pay_for_goes_to_another_provider(
        stack: Stack, apis: HostedApis, gateway: str) -> None:
    """... which another provider of the model, whose account pays for it, serves."""
    body = {"model": "m-or-afford-pool", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000}
    async with aiohttp.ClientSession() as session:
        for _ in range(2):
            async with session.post(gateway + "/v1/chat/completions", json=body) as resp:
                status, text = resp.status, await resp.text()
            assert status == 200 and "hello there" in text, text
    assert stack.bench_left_s("a-or", "openrouter/afford@a") == 0
    assert apis.calls[("openai", "gpt-4o-mini@b")] == 2, apis.calls


@pytest.mark.parametrize("stream", [False, True])
async def test_a_field_one_api_does_not_know_leaves_the_run_to_another_provider_of_the_model(
        apis: HostedApis, gateway: str, stream: bool) -> None:
    """Gemini's 400 `Unknown name "google"` (a field of the request it does not know) says what that
    API cannot take, not what the request did wrong: another provider of the model, which knows it,
    serves the run (it was the caller's 400, a-gem the first by id); with none left, the caller gets
    it (`test_a_gemini_error_reaches_the_caller_as_an_error_object`)."""
    status, _, text = await ask(gateway, "m-field-pool", stream)
    assert status == 200 and "hello there" in text, text
    assert apis.calls[("gemini", "gemini-unknown-field@a")] == 1, apis.calls


async def test_a_gemini_error_reaches_the_caller_as_an_error_object(gateway: str) -> None:
    status, _, text = await ask(gateway, "m-gem-400")
    assert status == 400, text
    error = json.loads(text)["error"]
    assert error["message"] == "Invalid JSON payload received. Unknown name \"google\": Cannot find field.", error
    assert error["code"] == "400" and error["type"] == "invalid_request_error", error


@pytest.mark.parametrize("stream", [False, True])
async def test_a_gemini_model_is_served_under_the_name_its_runs_take(gateway: str, stream: bool) -> None:
    """Gemini lists `models/gemini-2.0-flash`; its runs take `gemini-2.0-flash`, the name served."""
    status, _, text = await ask(gateway, "m-gem", stream)
    assert status == 200 and "hello there" in text, text




@pytest.mark.parametrize("stream", [False, True])
async def test_names_an_api_takes_but_does_not_list_are_served_where_the_config_says_so(gateway: str,
                                                                                        stream: bool) -> None:
    """Azure's model list names models, not deployments; OpenRouter's leaves out routing variants
    (`:nitro`): with `models_listed: false` their served names are taken at the config's word."""
    for model in ("m-az-deployment", "m-or-nitro"):
        status, _, text = await ask(gateway, model, stream)
        assert status == 200 and "hello there" in text, (model, text)
    status, _, text = await ask(gateway, "m-az-unlisted")  # (without it, the list is read as all it takes)
    assert status == 503 and "az: missing the model" in json.loads(text)["error"]["message"], text


@pytest.mark.parametrize("stream", [False, True])
async def test_a_limit_named_as_the_official_clients_name_it_reaches_mistral_as_max_tokens(
        apis: HostedApis, gateway: str, stream: bool) -> None:
    """Mistral refuses `max_completion_tokens` (and the `stream_options` iop adds to a stream) with a
    422: the limit goes again as `max_tokens`, at once, and as `max_tokens` from then on."""
    body = {"model": "m-mistral", "messages": [{"role": "user", "content": "hi"}], "stream": stream,
            "max_completion_tokens": 5}
    sent = []
    async with aiohttp.ClientSession() as session:
        for _ in range(2):
            async with session.post(gateway + "/v1/chat/completions", json=body) as resp:
                text = await resp.text()
                assert resp.status == 200 and "hello there" in text, text
            answered = apis.bodies[-1]
            assert answered["max_tokens"] == 5 and not {"max_completion_tokens", "stream_options"} & set(answered)
            sent.append(len(apis.bodies))
    assert sent[1] == sent[0] + 1, apis.bodies  # (the second run: asked once, as Mistral takes it)


async def test_openrouters_comments_are_no_events_and_its_error_chunk_ends_the_stream_with_an_error(
        gateway: str) -> None:
    status, _, text = await ask(gateway, "m-or", stream=True)
    assert status == 200 and "hello there" in text and "OPENROUTER" not in text, text
    status, _, text = await ask(gateway, "m-or-midstream", stream=True)
    assert status == 200, text
    events = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    assert "Half an" in events[0], events
    assert "Provider disconnected unexpectedly" in json.loads(events[-2])["error"]["message"], events
    assert events[-1] == "[DONE]" and not any('"finish_reason":"stop"' in e for e in events), events
