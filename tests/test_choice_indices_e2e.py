"""A provider that numbers its choices its own way (`"index": 5` for the one choice asked for), or
changes a stream's `id` and `created` midway, through real iop processes and a real Redis
(`tests.fakes.odd_outputs`): the caller gets choices numbered 0 to n-1 and one id and created a
stream, as the official `openai` client's stream helper needs (it raised IndexError on index 5), and
every chunk fits OpenAI's schema; a provider that sends more choices than asked for fails the run."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.conftest import Stack
from tests.fakes.odd_outputs import OddServer
from tests.test_legacy_shapes_e2e import problems_of_chat, problems_of_completion, start

pytestmark = pytest.mark.e2e

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


async def _chunks(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, list[Any]]:
    async with session.post(url, json=body) as resp:
        status, raw = resp.status, await resp.read()
    lines = [line.strip() for line in raw.split(b"\n\n") if line.startswith(b"data: ")]
    return status, [json.loads(line[6:]) for line in lines if line != b"data: [DONE]"]


def test_the_stream_helper_reads_a_choice_its_server_numbered_5_and_one_id(stack: Stack) -> None:
    with OddServer() as server:
        client = stack.openai(start(stack, server))
        for served in ("chs-index5", "chs-ids"):
            with client.chat.completions.stream(model=served, messages=MESSAGES) as stream:
                chunks = [event.chunk for event in stream if event.type == "chunk"]
                final = stream.get_final_completion()
            assert [(c.index, c.message.content, c.finish_reason) for c in final.choices] == [(0, "hello", "stop")]
            assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1, served
            assert {i.index for c in chunks for i in c.choices} == {0}
            if served == "chs-ids":
                assert final.id == "chatcmpl-a" and final.created == 1790000000
        whole = client.chat.completions.create(model="ch-index5", messages=MESSAGES)
        assert [(c.index, c.message.content) for c in whole.choices] == [(0, "hi")]
        text = client.completions.create(model="c-index5", prompt="hi")
        assert [(c.index, c.text) for c in text.choices] == [(0, "hi")]


async def test_streamed_choices_and_heads_as_the_caller_gets_them_fit_openai_s_schema(stack: Stack) -> None:
    with OddServer() as server:
        gateway = start(stack, server)
        async with aiohttp.ClientSession() as session:
            for served, chat in (("chs-index5", True), ("chs-ids", True), ("chs-azure", True), ("s-index5", False),
                                 ("s-ids", False)):
                url = gateway + ("/v1/chat/completions" if chat else "/v1/completions")
                ask = {"model": served, "stream": True, **({"messages": MESSAGES} if chat else {"prompt": "hi"})}
                status, chunks = await _chunks(session, url, ask)
                assert status == 200 and chunks, served
                found = [p for c in chunks for p in (problems_of_chat(c, chunk=True) if chat
                                                     else problems_of_completion(c, chunk=True))]
                assert found == [], (served, found)
                assert {c["index"] for ch in chunks for c in ch["choices"]} == {0}, (served, chunks)
                assert len({(c["id"], c["created"]) for c in chunks}) == 1, (served, chunks)
                assert chunks[0]["id"] and chunks[0]["created"] > 0, (served, chunks)  # (not Azure's "" and 0)
                if served.endswith("ids"):
                    assert chunks[0]["id"] in ("chatcmpl-a", "cmpl-a") and chunks[0]["created"] == 1790000000


async def test_more_choices_than_asked_for_is_the_provider_s_error(stack: Stack) -> None:
    with OddServer() as server:
        gateway = start(stack, server)
        client = stack.openai(gateway)
        for served in ("ch-extra-choice", "c-extra-choice"):
            with pytest.raises(openai.APIStatusError) as caught:
                if served.startswith("ch"):
                    client.chat.completions.create(model=served, messages=MESSAGES)
                else:
                    client.completions.create(model=served, prompt="hi")
            assert caught.value.status_code == 502 and "provider odd" in caught.value.message, served
            assert "more choices" in caught.value.message, caught.value.message
        with pytest.raises(openai.APIError) as streamed:
            with client.chat.completions.stream(model="chs-extra-choice", messages=MESSAGES) as stream:
                for _ in stream:
                    pass
        assert "provider odd" in streamed.value.message and "more choices" in streamed.value.message
        async with aiohttp.ClientSession() as session:
            status, chunks = await _chunks(session, gateway + "/v1/completions",
                                           {"model": "s-extra-choice", "prompt": "hi", "stream": True})
        errors = [c["error"] for c in chunks if "error" in c]
        assert status == 200 and len(errors) == 1 and "provider odd" in errors[0]["message"], chunks
        assert errors[0]["code"] == "provider_error" and "more choices" in errors[0]["message"]
