"""Model aliases (`models[].aliases`): other names callers may ask for a model by. The config
refuses an alias that names two things; the real processes serve a run asked for by an alias as
the model's own, answer under the model's id (as OpenAI answers `gpt-4o` with the snapshot it
names), and list each alias in `/v1/models`."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import openai
import pytest

from common.auth import hash_key, new_key
from common.config import ConfigError, parse_config
from tests.conftest import Stack
from tests.openapi import validate
from tests.test_e2e import FAST_RUNTIME, wait_available

MODEL, ALIASES = "qwen3.6:35b", ["chat-default", "qwen3.5:35b"]
OTHER = "llama3.3:70b"
KEY, OTHER_KEY = new_key(), new_key()


def config(**model: Any) -> dict[str, Any]:
    return {
        "models": [{"id": MODEL, "providers": {"p": "p-served"}, **model},
                   {"id": OTHER, "providers": {"p": "p-other"}}],
        "nodes": [{"id": "n1", "providers": [{"id": "p", "type": "vllm", "base_url": "http://127.0.0.1:9",
                                              "capacity": 2, "models": ["p-served", "p-other"]}]}],
    }


def faults(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    return err.value.errors


def test_a_model_is_found_by_its_id_or_any_alias() -> None:
    cfg = parse_config(config(aliases=ALIASES))
    for name in (MODEL, *ALIASES):
        found = cfg.model_named(name)
        assert found is not None and found.id == MODEL
    assert cfg.model_named(OTHER) is cfg.model(OTHER)
    assert cfg.model("chat-default") is None  # (ids read from Redis are ids, never aliases)
    assert cfg.model_named("nope") is None


@pytest.mark.parametrize(("aliases", "other_aliases", "fault"), [
    ([OTHER], [], f"models[0].aliases[0]: '{OTHER}' already names a model (at models[1].id)"),
    ([MODEL], [], f"models[0].aliases[0]: '{MODEL}' already names a model (at models[0].id)"),
    (["x", "x"], [], "models[0].aliases[1]: 'x' already names a model (at models[0].aliases[0])"),
    (["x"], ["x"], "models[1].aliases[0]: 'x' already names a model (at models[0].aliases[0])"),
    (["two words"], [], "models[0].aliases[0]: must be one word (no spaces)"),
    ([7], [], "models[0].aliases[0]: Input should be a valid string, got 7"),
    ("chat-default", [], "models[0].aliases: Input should be a valid list"),
    (["x" * 257], [], "models[0].aliases[0]: String should have at most 256 characters"),
    ([f"a{i}" for i in range(65)], [], "models[0].aliases: List should have at most 64 items"),
    (["Chat"], ["chat"], "models[1].aliases[0]: 'chat' differs from another model's name only in case or Unicode "
                         "form (at models[0].aliases[0])"),
    (["\u00fc"], ["u\u0308"], "models[1].aliases[0]: 'u\u0308' differs from another model's name only in case"),
    ([OTHER.upper()], [], f"models[0].aliases[0]: '{OTHER.upper()}' differs from another model's name only"),
    (["p-other"], [], "models[0].aliases[0]: 'p-other' is model models[1]'s served name on provider p"),
    (["a\u0000b"], [], "models[0].aliases[0]: 'a\\x00b' holds the character U+0000; an alias is printable text"),
    (["m1\u200b"], [], "models[0].aliases[0]: 'm1\\u200b' holds the character U+200B"),
])
def test_an_alias_names_one_model_and_the_fault_names_its_path(aliases: Any, other_aliases: list[str],
                                                              fault: str) -> None:
    data = config(aliases=aliases)
    data["models"][1]["aliases"] = other_aliases
    found = faults(data)
    assert any(f.startswith(fault) for f in found), found


def test_an_alias_may_be_the_models_own_name_in_another_case_or_its_own_served_name() -> None:
    cfg = parse_config(config(aliases=["QWEN3.6:35B", "p-served"]))
    assert cfg.model_named("p-served") is cfg.model_named("QWEN3.6:35B") is cfg.model(MODEL)


def test_a_key_names_models_by_their_ids() -> None:
    data = config(aliases=ALIASES)
    data["auth"] = {"keys": [{"name": "a", "sha256": hash_key(KEY), "models": ["chat-default"]}]}
    assert faults(data) == [f"auth.keys[0].models[0]: 'chat-default' is an alias of model '{MODEL}'; a key's "
                            f"models name model ids: write '{MODEL}'"]


@pytest.mark.e2e
async def test_callers_use_an_alias_as_the_model_and_keys_allow_it_by_the_model(stack: Stack) -> None:
    url = stack.simulator(["p-served", "p-other"])
    data = config(aliases=ALIASES)
    data["nodes"][0]["providers"][0]["base_url"] = url
    data["runtime"] = FAST_RUNTIME
    data["auth"] = {"keys": [{"name": "qwen-only", "sha256": hash_key(KEY), "models": [MODEL]},
                             {"name": "ops", "sha256": hash_key(OTHER_KEY), "role": "operator"}]}
    stack.write_config(data)
    stack.scheduler()
    stack.worker("n1")
    gateway = stack.gateway()
    wait_available(stack.redis_url, ["p"])
    client = openai.OpenAI(base_url=gateway + "/v1", api_key=KEY, max_retries=0)
    stack.clients.append(client)

    listing = client.models.list()
    validate("ListModelsResponse", listing.model_dump(exclude_unset=True))
    assert [(m.id, getattr(m, "alias_of", None)) for m in listing.data] == [
        (MODEL, None), ("chat-default", MODEL), ("qwen3.5:35b", MODEL)]  # (the key may not use OTHER)
    assert client.models.retrieve("chat-default").id == "chat-default"

    raw = client.chat.completions.with_raw_response.create(
        model="chat-default", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    validate("CreateChatCompletionResponse", json.loads(raw.text))
    chat = raw.parse()
    assert chat.model == MODEL and chat.choices[0].message.content == "tok0 tok1 tok2 "
    streamed = list(client.chat.completions.create(
        model="qwen3.5:35b", messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True))
    assert {c.model for c in streamed} == {MODEL}
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "tok0 tok1 "
    response = client.responses.create(model="chat-default", input="hi", max_output_tokens=2)
    assert response.model == MODEL and response.output_text == "tok0 tok1 "

    # a bad body naming a model by its alias counts under the model; one naming a model its key may not
    # use counts under '-', as for a model that does not exist (metrics tell no more than the 404 would)
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as caller:
        for name in ("chat-default", OTHER):
            async with caller.post(f"{gateway}/v1/chat/completions", json={"model": name, "messages": []}) as resp:
                assert resp.status == 400

    # the run is the model's: its record, its queue, its key's usage
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {OTHER_KEY}"}) as http:
        async with http.get(f"{gateway}/metrics") as resp:
            exposition = await resp.text()
        bad = {line.split("{")[1].split("}")[0]: line.rsplit(" ", 1)[1] for line in exposition.splitlines()
               if line.startswith("iop_gateway_requests_total{") and 'status="400"' in line}
        assert bad == {f'endpoint="chat",model="{MODEL}",status="400"': "1.0",
                       'endpoint="chat",model="-",status="400"': "1.0"}, bad
        async with http.get(f"{gateway}/v1/runs/{raw.headers['x-iop-run-id']}") as resp:
            assert (await resp.json())["model"] == MODEL
        async with http.get(f"{gateway}/v1/catalog") as resp:
            catalog = await resp.json()
        assert {m["id"]: m["aliases"] for m in catalog["models"]} == {MODEL: ALIASES, OTHER: []}
        async with http.get(f"{gateway}/v1/usage", params={"key": "qwen-only"}) as resp:
            usage = await resp.json()
        # (an alias names its model in the filter too: it answered nothing)
        async with http.get(f"{gateway}/v1/usage", params={"key": "qwen-only", "model": "chat-default"}) as resp:
            by_alias = await resp.json()
    assert MODEL in json.dumps(usage) and "chat-default" not in json.dumps(usage)
    assert by_alias["data"] == usage["data"] and usage["data"], by_alias

    # a key that may not use the model may not use its alias either: the same 404 as for no model
    data["auth"]["keys"][0]["models"] = [OTHER]
    stack.write_config(data)
    other_gateway = stack.gateway()
    limited = openai.OpenAI(base_url=other_gateway + "/v1", api_key=KEY, max_retries=0)
    stack.clients.append(limited)
    for name in ("chat-default", "no-such-model"):
        with pytest.raises(openai.NotFoundError) as err:
            limited.chat.completions.create(model=name, messages=[{"role": "user", "content": "x"}])
        assert err.value.code == "model_not_found" and f'"{name}"' in err.value.message
    assert [m.id for m in limited.models.list().data] == [OTHER]
