"""A model's `max_tokens`: the gateway refuses a request asking for more (naming the caller's field),
and a request asking for no limit gets the model's (pure, and through the real processes)."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from common import token_cap
from common.config import ConfigError, parse_config
from common.wire import RunKind
from tests.conftest import Stack
from tests.test_e2e import FAST_RUNTIME, wait_available


@pytest.mark.parametrize(("body", "over", "capped"), [
    ({}, None, {"max_tokens": 8}),
    ({"max_tokens": None, "max_completion_tokens": None}, None,
     {"max_tokens": 8, "max_completion_tokens": None}),  # (unset ones, as clients send them)
    ({"max_tokens": 8}, None, {"max_tokens": 8}),
    ({"max_tokens": 1, "max_completion_tokens": 2}, None, {"max_tokens": 1, "max_completion_tokens": 2}),
    ({"max_tokens": 9}, "max_tokens", None),
    ({"max_completion_tokens": 9, "max_tokens": 2}, "max_completion_tokens", None),
    ({"max_completion_tokens": 2, "max_tokens": 99}, "max_tokens", None),  # (both are judged: a server reads either)
    # what servers read their own ways, several as no limit at all (found: llama-cpp-python generated
    # to the end of its context for 0, -1 and false under a cap of 64)
    ({"max_tokens": 0}, "max_tokens", None),
    ({"max_tokens": -1}, "max_tokens", None),
    ({"max_tokens": False}, "max_tokens", None),
    ({"max_tokens": True}, "max_tokens", None),
    ({"max_tokens": "4"}, "max_tokens", None),
    ({"max_tokens": 4.0}, "max_tokens", None),
    ({"max_completion_tokens": [], "max_tokens": 1000}, "max_completion_tokens", None),
    ({"max_completion_tokens": 0, "max_tokens": 8}, "max_completion_tokens", None),
    ({"max_tokens": 2**70}, "max_tokens", None),
    ({"options": {"num_predict": -1}}, "options.num_predict", None),  # (Ollama's own, which wins there)
    ({"options": {"num_predict": 8}}, None, {"options": {"num_predict": 8}, "max_tokens": 8}),
    ({"options": "not an object"}, None, {"options": "not an object", "max_tokens": 8}),
])
def test_a_limit_is_a_whole_number_within_the_cap_or_names_its_field(body: dict[str, Any], over: str | None,
                                                                      capped: dict[str, Any] | None) -> None:
    assert token_cap.over_cap(body, 8) == over
    if capped is not None:
        token_cap.with_cap(body, 8, RunKind.CHAT)
        assert body == capped


@pytest.mark.parametrize(("body", "capped"), [
    ({}, {"max_tokens": 8}),
    ({"max_tokens": 2}, {"max_tokens": 2}),
    ({"max_tokens": None}, {"max_tokens": 8}),
    # no field of a legacy completion (vLLM ignores it there): the cap goes with it, and where a
    # server reads it (llama.cpp's as max_tokens, Ollama's as num_predict), the caller's still wins
    ({"max_completion_tokens": 2}, {"max_completion_tokens": 2, "max_tokens": 8}),
    ({"max_completion_tokens": 2, "max_tokens": 5}, {"max_completion_tokens": 2, "max_tokens": 5}),
])
def test_a_legacy_completion_gets_the_cap_unless_it_names_max_tokens(body: dict[str, Any],
                                                                     capped: dict[str, Any]) -> None:
    token_cap.with_cap(body, 8, RunKind.COMPLETION)
    assert body == capped


@pytest.mark.parametrize(("cap", "fault"), [(0, "Input should be greater than or equal to 1"),
                                            (10_000_001, "Input should be less than or equal to 10000000")])
def test_the_cap_is_a_count_from_1_to_ten_million(cap: int, fault: str) -> None:
    data: dict[str, Any] = {
        "models": [{"id": "m", "providers": {"p": "s"}, "max_tokens": cap}],
        "nodes": [{"id": "n", "providers": [{"id": "p", "type": "vllm", "base_url": "http://127.0.0.1:9",
                                             "capacity": 1, "models": ["s"]}]}]}
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert err.value.errors == [f"models[0].max_tokens: {fault}"]
    data["models"][0]["max_tokens"] = 10_000_000
    assert parse_config(data).models[0].max_tokens == 10_000_000


@pytest.mark.e2e
def test_callers_get_the_models_cap_and_no_more(stack: Stack) -> None:
    url = stack.simulator(["p-served"], "--tokens", "12")
    stack.write_config({
        "models": [{"id": "capped", "providers": {"p": "p-served"}, "max_tokens": 3},
                   {"id": "free", "providers": {"p": "p-served"}}],
        "nodes": [{"id": "n1", "providers": [{"id": "p", "type": "vllm", "base_url": url, "capacity": 2,
                                              "models": ["p-served"]}]}],
        "runtime": FAST_RUNTIME,
    })
    stack.scheduler()
    stack.worker("n1")
    client = stack.openai(stack.gateway())
    wait_available(stack.redis_url, ["p"])
    hi: Any = [{"role": "user", "content": "hi"}]

    whole = client.chat.completions.create(model="capped", messages=hi)  # (no limit asked: the model's)
    assert whole.choices[0].message.content == "tok0 tok1 tok2 " and whole.choices[0].finish_reason == "length"
    streamed: list[Any] = list(client.chat.completions.create(model="capped", messages=hi, stream=True,
                                                              max_tokens=None))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "tok0 tok1 tok2 "
    assert client.completions.create(model="capped", prompt="say").choices[0].text == "tok0 tok1 tok2 "
    # (a vLLM reads no max_completion_tokens on a legacy completion, and would generate past the cap)
    assert client.completions.create(model="capped", prompt="say", extra_body={"max_completion_tokens": 2}) \
        .choices[0].text == "tok0 tok1 tok2 "
    assert client.responses.create(model="capped", input="hi").output_text == "tok0 tok1 tok2 "
    assert client.chat.completions.create(model="capped", messages=hi, max_tokens=2).choices[0].message.content \
        == "tok0 tok1 "
    free = client.chat.completions.create(model="free", messages=hi).choices[0].message.content
    assert (free or "").count("tok") == 12

    for call, field in ((lambda: client.chat.completions.create(model="capped", messages=hi, max_tokens=4),
                         "max_tokens"),
                        (lambda: client.chat.completions.create(model="capped", messages=hi,
                                                                max_completion_tokens=100, stream=True),
                         "max_completion_tokens"),
                        (lambda: client.completions.create(model="capped", prompt="x", max_tokens=10**9), "max_tokens"),
                        (lambda: client.responses.create(model="capped", input="hi", max_output_tokens=20),
                         "max_output_tokens"),
                        (lambda: client.chat.completions.create(model="capped", messages=hi, max_tokens=0),
                         "max_tokens"),
                        (lambda: client.responses.create(model="capped", input="hi",
                                                         extra_body={"max_completion_tokens": 0}),
                         "max_completion_tokens"),  # (passed through by the Responses API: judged the same)
                        (lambda: client.responses.create(model="capped", input="hi", extra_body={"max_tokens": 9}),
                         "max_tokens")):  # (the caller's own field, not max_output_tokens)
        with pytest.raises(openai.BadRequestError) as bad:
            call()
        assert bad.value.param == field, bad.value.message
        assert f"'{field}' must be a whole number from 1 to 3 for the model \"capped\"" in bad.value.message


@pytest.mark.e2e
def test_a_model_that_takes_only_max_completion_tokens_gets_every_limit_so(stack: Stack) -> None:
    """OpenAI's reasoning models refuse `max_tokens` with a 400 (the simulator's
    `--completion-tokens-only` answers as OpenAI does). The limits iop sends under that name (a
    model's cap, a Response's `max_output_tokens`) and a caller's own `max_tokens` reach such a model
    as `max_completion_tokens`: each request is answered, within its limit."""
    url = stack.simulator(["o-served"], "--tokens", "12", "--completion-tokens-only", "o-served")
    stack.write_config({
        "models": [{"id": "reasoner", "providers": {"hosted": "o-served"}, "max_tokens": 3},
                   {"id": "open", "providers": {"hosted": "o-served"}}],
        "nodes": [{"id": "n1", "providers": [{"id": "hosted", "type": "openai_api", "base_url": url, "capacity": 2,
                                              "models": ["o-served"]}]}],
        "runtime": FAST_RUNTIME,
    })
    stack.scheduler()
    stack.worker("n1")
    client = stack.openai(stack.gateway())
    wait_available(stack.redis_url, ["hosted"])
    hi: Any = [{"role": "user", "content": "hi"}]

    def text(model: str, **kwargs: Any) -> str:
        return client.chat.completions.create(model=model, messages=hi, **kwargs).choices[0].message.content or ""

    assert text("reasoner") == "tok0 tok1 tok2 "  # the model's cap
    streamed: list[Any] = list(client.chat.completions.create(model="reasoner", messages=hi, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "tok0 tok1 tok2 "
    assert text("open", max_tokens=2) == "tok0 tok1 "  # the caller's own
    assert text("open", max_completion_tokens=4) == "tok0 tok1 tok2 tok3 "
    assert text("open").count("tok") == 12
    assert client.responses.create(model="open", input="hi", max_output_tokens=2).output_text == "tok0 tok1 "
    with pytest.raises(openai.BadRequestError) as bad:  # (a limit it refuses under either name: the caller's answer)
        text("open", max_tokens=0)
    assert bad.value.param == "max_completion_tokens" and "positive" in bad.value.message


@pytest.mark.parametrize(("body", "refusal", "fitted"), [
    # SGLang's `validate_total_tokens`: prompt and limit together over its context (the room: 32768 - 30000)
    ({"max_tokens": 8192}, "Requested token count exceeds the model's maximum context length of 32768 tokens. You "
     "requested a total of 38192 tokens: 30000 tokens from the input messages and 8192 tokens for the completion. "
     "Please reduce the number of tokens in the input messages or the completion to fit within the limit.",
     {"max_tokens": 2768}),
    # SGLang's `_validate_request`: the limit over the context itself (its message has no space there)
    ({"max_tokens": 8192}, "max_completion_tokens is too large: 8192.This model supports at most 4096 completion "
     "tokens.", {"max_tokens": 4096}),
    # SGLang 0.5.2 refuses a total equal to its context too (`>= context_len`): a token less than that room
    ({"max_tokens": 2768}, "Requested token count exceeds the model's maximum context length of 32768 tokens. You "
     "requested a total of 32768 tokens: 30000 tokens from the input messages and 2768 tokens for the completion. "
     "Please reduce the number of tokens in the input messages or the completion to fit within the limit.",
     {"max_tokens": 2767}),
    # a legacy completion's `max_completion_tokens` is the caller's, and no limit there: the cap is what is cut
    ({"prompt": "p", "max_completion_tokens": 5000, "max_tokens": 8192}, "Requested token count exceeds the model's "
     "maximum context length of 32768 tokens. You requested a total of 38192 tokens: 30000 tokens from the input "
     "messages and 8192 tokens for the completion.",
     {"prompt": "p", "max_completion_tokens": 5000, "max_tokens": 2768}),
    # no room left, or more room than the cap, or another refusal: not asked again
    ({"max_tokens": 8192}, "maximum context length of 100 tokens. You requested a total of 8292 tokens: 100 tokens "
     "from the input messages", None),
    ({"max_tokens": 10}, "max_completion_tokens is too large: 10.This model supports at most 4096 completion tokens.",
     None),
    ({"max_tokens": 8192}, "temperature must be non-negative", None),
])
def test_a_cap_a_server_has_no_room_for_is_cut_to_the_room_it_said(body: dict[str, Any], refusal: str,
                                                                   fitted: dict[str, Any] | None) -> None:
    assert token_cap.fitted(body, refusal) == fitted
