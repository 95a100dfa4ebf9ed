"""OpenAI's Responses API (`POST /v1/responses`) end to end: real processes (gateway, scheduler,
workers, simulators) on a real Redis, driven with the official `openai` client, every answer and
event checked against OpenAI's own schemas."""

from __future__ import annotations

import json
import re
import urllib.request

import openai
import pytest

from tests.conftest import Stack, wait_until
from tests.openapi import validate
from tests.test_e2e import start_pool

pytestmark = pytest.mark.e2e

MODEL = "qwen3.6:35b"


def test_responses_whole_and_streamed_with_the_openai_client(stack: Stack) -> None:
    gateway, _ = start_pool(stack, {"vllm-a": 2})
    client = stack.openai(gateway)

    raw = client.responses.with_raw_response.create(model=MODEL, input="hello there", max_output_tokens=4,
                                                    instructions="be brief", metadata={"ticket": "7"})
    response = raw.parse()
    validate("Response", json.loads(raw.text))
    assert response.id == "resp_" + raw.headers["x-iop-run-id"].removeprefix("run_")
    # (cut at max_output_tokens: incomplete, as OpenAI says it)
    assert response.model == MODEL and response.status == "incomplete"
    assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == "tok0 tok1 tok2 tok3 "
    assert response.instructions == "be brief" and response.metadata == {"ticket": "7"}
    assert response.usage is not None and response.usage.output_tokens == 4
    assert response.usage.total_tokens == response.usage.input_tokens + 4

    # (the simulator's `tokens`: it stops on its own after three)
    events = list(client.responses.create(model=MODEL, input=[{"role": "user", "content": "hi"}],
                                          max_output_tokens=10, stream=True, extra_body={"sim": {"tokens": 3}}))
    for event in events:
        validate("ResponseStreamEvent", event.model_dump(exclude_unset=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "tok0 tok1 tok2 "
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == "tok0 tok1 tok2 " and final.usage is not None and final.usage.output_tokens == 3

    # the client's own stream helper, which checks the order of the events as it builds the Response
    with client.responses.stream(model=MODEL, input="say", extra_body={"sim": {"tokens": 2}}) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        built = stream.get_final_response()
    assert "".join(texts) == "tok0 tok1 " and built.output_text == "tok0 tok1 "

    # (measured under their own endpoint label, once the gateway has ended the request (a caller can
    # have read the whole stream first); a streamed one's time to first token too)
    def exposition() -> str:
        with urllib.request.urlopen(gateway + "/metrics") as resp:
            return str(resp.read().decode())

    wait_until(lambda: re.search(r'^iop_gateway_requests_total\{endpoint="responses",model="qwen3.6:35b",'
                                 r'status="200"\} 3\.0$', exposition(), re.M), what="three responses requests counted")
    assert re.search(r'^iop_gateway_time_to_first_token_seconds_count\{model="qwen3.6:35b"\} 2\.0$', exposition(),
                     re.M)


def test_responses_errors_keep_their_status_or_end_the_stream(stack: Stack) -> None:
    gateway, _ = start_pool(stack, {"vllm-a": 2})
    client = stack.openai(gateway)

    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model="no-such-model", input="x")
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as stateful:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_1")
    assert stateful.value.param == "previous_response_id" and "send the whole conversation" in stateful.value.message
    validate("ErrorResponse", stateful.value.response.json())
    with pytest.raises(openai.BadRequestError) as builtin:
        client.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}])
    assert builtin.value.param == "tools[0].type"

    # (a stored Response asked for: none is kept, but the run that made it is, under the same hex)
    made = client.responses.create(model=MODEL, input="x", extra_body={"sim": {"tokens": 1}})
    run_id = "run_" + made.id.removeprefix("resp_")
    for call in (lambda: client.responses.retrieve(made.id), lambda: client.responses.delete(made.id),
                 lambda: client.responses.cancel(made.id), lambda: client.responses.input_items.list(made.id)):
        with pytest.raises(openai.NotFoundError) as gone:
            call()
        assert gone.value.code == "not_found" and f"GET /v1/runs/{run_id}" in gone.value.message, gone.value.message
        validate("ErrorResponse", gone.value.response.json())
    with urllib.request.urlopen(f"{gateway}/v1/runs/{run_id}") as resp:
        assert json.loads(resp.read())["state"] == "completed"

    # the provider fails after two tokens: the stream ends with `error` and `response.failed`
    events = list(client.responses.create(model=MODEL, input="x", max_output_tokens=10, stream=True,
                                          extra_body={"sim": {"fail_after_tokens": 2}}))
    for event in events:
        validate("ResponseStreamEvent", event.model_dump(exclude_unset=True))
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2].code == "provider_error"  # type: ignore[union-attr]
    failed = events[-1].response  # type: ignore[union-attr]
    assert failed.status == "failed" and failed.error is not None and failed.error.code == "server_error"
    # (the simulator breaks its connection off after the tokens: the last may be lost with it)
    sent = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert sent in ("tok0 ", "tok0 tok1 ")
    assert [getattr(item, "status", None) for item in failed.output] == ["incomplete"]
    assert failed.output[0].model_dump()["content"][0]["text"] == sent
