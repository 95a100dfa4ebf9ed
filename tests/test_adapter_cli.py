"""The `cli` adapter against a small script (tests/fakes/cli_llm.py): argv without a shell,
the prompt on stdin, stdout streamed as deltas, the served name, errors with the tail of
stderr, the whole process group killed on cancel, timeout and silence, and the probe."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from common.config import ProviderConfig
from common.policy import Health
from common.wire import ErrorCode, RunKind
from tests.openapi import validate
from workers.adapters.base import ProviderError, ReadLimits, Retry
from workers.adapters.cli import CliAdapter, ToolRun, argv_for, find_executable
from workers.adapters.prompt_text import flatten_messages

SCRIPT = str(Path(__file__).resolve().parent / "fakes" / "cli_llm.py")
SERVED = "tiny-cli"


def adapter(*args: str, **extra: Any) -> CliAdapter:
    command = [sys.executable, SCRIPT, "--model", "{model}", *args]
    return CliAdapter(ProviderConfig.model_validate(
        {"id": "cli-c", "type": "cli", "command": command, "capacity": 1, "models": [SERVED], **extra}))


def chat(text: str = "hello there", **extra: Any) -> dict[str, Any]:
    return {"model": SERVED, "messages": [{"role": "user", "content": text}], **extra}


async def collect(cli: CliAdapter, body: dict[str, Any], kind: RunKind = RunKind.CHAT) -> list[dict[str, Any]]:
    return [c async for read in cli.stream(kind, body, "run_1") for c in read]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def wait_gone(pids: list[int], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            raise AssertionError(f"processes still alive: {[p for p in pids if alive(p)]}")
        time.sleep(0.02)


def wait_file(path: Path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} never appeared")
        time.sleep(0.01)


def read_pids(path: Path) -> list[int]:
    """The tool writes them before its first output, so they are there once output arrived."""
    return [int(x) for x in path.read_text().split()]


def test_prompt_flattening_and_argv() -> None:
    assert flatten_messages([{"role": "user", "content": "just this"}]) == "just this"
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert flatten_messages([{"role": "system", "content": "be brief"}, {"role": "user", "content": parts}]
                            ) == "system: be brief\n\nuser: a\nb"
    assert argv_for(["llm", "-m", "{model}", "--x={model}"], "m1") == ["llm", "-m", "m1", "--x=m1"]


@pytest.mark.parametrize(("part", "shown"), [
    ({"type": None, "text": "a"}, "not a null part"),
    ({"type": False, "text": "a"}, "not a false part"),
    ({"type": {"x": [True]}, "text": "a"}, 'not a {"x": [true]} part'),
    ({"type": "image_url"}, "not a 'image_url' part"),
])
def test_a_part_a_tool_cannot_read_is_named_as_json_not_as_python_writes_it(part: dict[str, Any], shown: str) -> None:
    """(a hostile caller's audit: `"type": null` was refused as a `'None'` part, `false` as `'False'`)"""
    from workers.adapters.prompt_text import NotForCli, message_text

    with pytest.raises(NotForCli) as err:
        message_text([{"type": "text", "text": "a"}, part])
    assert shown in str(err.value), str(err.value)
    assert err.value.param == "content[1]"


async def test_stream_deltas_finish_and_usage_with_the_served_name(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    cli = adapter("--words", "4", "--log", str(log))
    chunks = await collect(cli, chat(stream=True, stream_options={"include_usage": True}))
    for c in chunks:
        validate("CreateChatCompletionStreamResponse", c)
        assert c["model"] == SERVED
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "w0 w1 w2 w3 "
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}
    seen = json.loads(log.read_text())
    assert seen == {"model": SERVED, "env_model": SERVED, "request_id": "run_1", "prompt": "hello there"}


async def test_whole_answers_chat_and_text() -> None:
    cli = adapter("--echo")
    answer = await cli.complete(RunKind.CHAT, chat("say it back"), "run_2")
    validate("CreateChatCompletionResponse", answer)
    assert answer["choices"][0]["message"]["content"] == "say it back"
    text = await cli.complete(RunKind.COMPLETION, {"model": SERVED, "prompt": "a prompt"}, "run_3")
    validate("CreateCompletionResponse", text)
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == "a prompt"


async def test_a_prompt_full_of_shell_syntax_is_just_text(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    prompt = f"$(touch {marker}); `touch {marker}` && touch {marker} | cat > {marker}; echo $HOME '\"; exit 3"
    cli = adapter("--echo")
    answer = await cli.complete(RunKind.CHAT, chat(prompt), "r")
    assert answer["choices"][0]["message"]["content"] == prompt
    cli = CliAdapter(ProviderConfig.model_validate(
        {"id": "c", "type": "cli", "command": [sys.executable, SCRIPT, "--model", f"; touch {marker}", "--echo"],
         "capacity": 1, "models": [SERVED]}))
    await cli.complete(RunKind.CHAT, chat("x"), "r")
    assert not marker.exists()


async def test_utf8_split_across_reads_is_kept_whole() -> None:
    chunks = await collect(adapter("--split-utf8"), chat(stream=True))
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "café!"


async def test_a_non_zero_exit_is_a_provider_error_with_the_tail_of_stderr() -> None:
    cli = adapter("--exit", "3", "--stderr", "x" * 5000 + "model file missing")
    with pytest.raises(ProviderError) as err:
        await cli.complete(RunKind.CHAT, chat(), "r")
    assert "exited with status 3" in err.value.message and err.value.message.endswith("model file missing")
    assert len(err.value.message) < 600 and "\n" not in err.value.message and not err.value.retryable
    with pytest.raises(ProviderError) as err:
        await collect(cli, chat(stream=True))
    assert "model file missing" in err.value.message


async def test_what_a_tool_cannot_be_given_is_refused_for_another_provider_and_a_missing_executable_fails(
        tmp_path: Path) -> None:
    # (the caller's error names the field at fault: a hostile caller's audit found it null)
    tool = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    cases: list[tuple[RunKind, dict[str, Any], str]] = [
        (RunKind.EMBEDDING, {"model": SERVED, "input": "x"}, "model"),
        (RunKind.COMPLETION, {"model": SERVED, "prompt": ["a", "b"]}, "prompt"),
        (RunKind.CHAT, chat(tools=tool), "tools"),
        (RunKind.CHAT, chat(functions=[{"name": "f"}]), "functions"),
        (RunKind.CHAT, chat(n=2), "n"),
        (RunKind.COMPLETION, {"model": SERVED, "prompt": "a", "n": 3}, "n"),
        (RunKind.CHAT, chat(n=2.0), "n"),  # (a server reads it as 2)
        (RunKind.CHAT, chat(response_format={"type": "json_object"}), "response_format"),
        (RunKind.CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
         "response_format"),
        (RunKind.CHAT, {"model": SERVED, "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "what is it?"}, image]}]}, "messages[1].content[1]"),
        (RunKind.CHAT, {"model": SERVED, "messages": [
            {"role": "user", "content": [{"type": "text", "text": {"a": 1}}]}]}, "messages[0].content[0].text"),
        # (what the text dropped without a word, each a 200 with less than the caller sent: a hostile caller)
        (RunKind.CHAT, {"model": SERVED, "messages": [{"role": "user", "content": image}]}, "messages[0].content"),
        (RunKind.CHAT, {"model": SERVED, "messages": [{"role": "user", "content": 123}]}, "messages[0].content"),
        (RunKind.CHAT, {"model": SERVED, "messages": [
            {"role": "user", "content": [{"image_url": {"url": "data:,"}}]}]}, "messages[0].content[0]"),
        (RunKind.CHAT, {"model": SERVED, "messages": [
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                                     "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "user", "content": "go on"}]}, "messages[0].tool_calls"),
        (RunKind.CHAT, chat(stop=["a", "b", "c", "d", "e"]), "stop"),  # (a fifth was ignored)
        (RunKind.CHAT, chat(stop="s" * 1025), "stop"),  # (held back whole: blamed on the tool as a long word)
        # (ignored: the answer was not cut where the caller asked; a server answers them 400, as OpenAI)
        (RunKind.CHAT, chat(stop=5), "stop"),
        (RunKind.COMPLETION, {"model": SERVED, "prompt": "p", "stop": [1]}, "stop"),
        (RunKind.CHAT, chat(stop={"a": "b"}), "stop")]
    started = tmp_path / "started"
    for kind, body, param in cases:
        for stream in (False, True):
            with pytest.raises(ProviderError) as err:
                if stream:
                    await collect(adapter("--pid-file", str(started)), {**body, "stream": True}, kind)
                else:
                    await adapter("--pid-file", str(started)).complete(kind, body, "r")
            # (a request for another provider of the model: nothing against this one's health)
            assert err.value.status == 400 and err.value.retry is Retry.UNABLE and err.value.strikes is None
            assert err.value.detail is not None and err.value.detail["param"] == param, body
            assert err.value.detail["code"] == "invalid_request_error"
    assert not started.exists()  # the tool never ran
    # what it can carry still goes: no tools, one choice, text parts, an empty tools list, plain text
    answer = await adapter().complete(RunKind.CHAT, chat(tools=[], n=1, response_format={"type": "text"},
                                                         stop=["zz1", "zz2", "zz3", "s" * 1024]), "r")
    assert answer["choices"][0]["message"]["content"]
    gone = CliAdapter(ProviderConfig.model_validate(
        {"id": "c", "type": "cli", "command": ["iop-no-such-tool-4d1f"], "capacity": 1, "models": [SERVED]}))
    with pytest.raises(ProviderError) as err:
        await gone.complete(RunKind.CHAT, chat(), "r")
    assert err.value.retryable and "could not start" in err.value.message


async def test_cancelling_kills_the_whole_process_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    cli = adapter("--hang", "--pid-file", str(pid_file))
    first = asyncio.Event()

    async def consume() -> None:
        async for _ in cli.stream(RunKind.CHAT, chat(stream=True), "r"):
            first.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first.wait(), 10)
    pids = read_pids(pid_file)
    assert all(alive(p) for p in pids)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    wait_gone(pids)


async def test_a_timeout_kills_the_whole_process_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    cli = adapter("--hang", "--pid-file", str(pid_file))
    deadlines: list[asyncio.Timeout] = []

    async def run() -> None:  # as the runner does: the adapter call inside asyncio.timeout
        async with asyncio.timeout(None) as deadline:
            deadlines.append(deadline)
            await cli.complete(RunKind.CHAT, chat(), "r")

    task = asyncio.create_task(run())
    await asyncio.to_thread(wait_file, pid_file)  # the tool has started and left a child behind
    deadlines[0].reschedule(asyncio.get_running_loop().time())  # the run's time is up now
    with pytest.raises(TimeoutError):
        await task
    wait_gone(read_pids(pid_file))


async def test_a_cancel_as_output_arrives_is_not_lost() -> None:
    # The run's deadline cancels the read in the very step its output came. (asyncio.wait_for on
    # Python 3.11 returned the output instead and the run went on, here waiting for more forever.)
    tool = ToolRun(adapter().provider, [], {}, b"")
    stdout = asyncio.StreamReader()
    tool.proc = cast(Any, SimpleNamespace(stdout=stdout))
    got: list[str] = []

    async def consume() -> None:
        async for text in tool.reads():
            got.append(text)

    task = asyncio.create_task(consume())
    await asyncio.sleep(0)  # it waits for output
    stdout.feed_data(b"word ")
    await asyncio.sleep(0)  # the read has its data; the reader has not resumed yet
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=10)
    assert task in done and task.cancelled()


async def test_silence_longer_than_read_timeout_fails_and_kills(tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    cli = adapter("--hang", "--pid-file", str(pid_file), read_timeout_ms=300)
    with pytest.raises(ProviderError) as err:
        await collect(cli, chat(stream=True))
    assert "produced no output for 300 ms" in err.value.message
    assert err.value.code is ErrorCode.PROVIDER_TIMEOUT  # (504, not worth a retry by the caller's client)
    wait_gone(read_pids(pid_file))


async def test_probe_follows_the_executable(tmp_path: Path) -> None:
    assert (await adapter().probe()).health is Health.AVAILABLE
    assert find_executable("sh")[0] is not None
    missing = CliAdapter(ProviderConfig.model_validate(
        {"id": "c", "type": "cli", "command": ["iop-no-such-tool-4d1f"], "capacity": 1, "models": [SERVED]}))
    probe = await missing.probe()
    assert probe.health is Health.UNAVAILABLE and probe.reason == 'executable "iop-no-such-tool-4d1f" not found on PATH'

    tool = tmp_path / "my-llm"
    cli = CliAdapter(ProviderConfig.model_validate(
        {"id": "c", "type": "cli", "command": [str(tool)], "capacity": 1, "models": [SERVED]}))
    assert "does not exist" in (await cli.probe()).reason
    tool.write_text(f"#!{sys.executable}\nimport sys; sys.stdout.write(sys.stdin.read().upper())\n")
    probe = await cli.probe()
    assert probe.health is Health.UNAVAILABLE and "is not executable" in probe.reason
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    probe = await cli.probe()
    assert probe.health is Health.AVAILABLE and probe.models is None
    assert (await cli.complete(RunKind.CHAT, chat("shout"), "r"))["choices"][0]["message"]["content"] == "SHOUT"
    tool.unlink()
    assert (await cli.probe()).health is Health.UNAVAILABLE
    os.symlink(sys.executable, tool)
    assert (await cli.probe()).health is Health.AVAILABLE


async def test_the_tool_does_not_inherit_other_providers_api_keys_nor_the_redis_url(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTHER_PROVIDER_KEY", "sk-secret-value")
    monkeypatch.setenv("REDIS_URL", "redis://:redis-password@127.0.0.1:6379/0")
    monkeypatch.setenv("HARMLESS", "kept")
    script = ("import os, sys; sys.stdin.read(); print(os.environ.get('OTHER_PROVIDER_KEY', 'absent'), "
              "os.environ.get('REDIS_URL', 'absent'), os.environ['HARMLESS'], os.environ['IOP_MODEL'])")
    cli = CliAdapter(ProviderConfig.model_validate(
        {"id": "c", "type": "cli", "command": [sys.executable, "-c", script], "capacity": 1, "models": [SERVED]}),
        secret_env=frozenset({"OTHER_PROVIDER_KEY"}))
    answer = await cli.complete(RunKind.CHAT, chat("x"), "r")
    assert answer["choices"][0]["message"]["content"].split() == ["absent", "absent", "kept", SERVED]


async def test_the_tool_does_not_inherit_the_pools_caller_or_operator_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a newcomer's audit: under `iop dev` (whose services share one environment, as
    services started from one env file do) a caller's run of a tool that prints its environment
    (`command: ["env"]`) got the operator's key of `auth.keys[].env`, and every other key's."""
    import aiohttp

    from common.config import parse_config
    from workers.service import make_adapter, secret_env_names

    monkeypatch.setenv("IOP_OPERATOR_KEY", "iop-operator-secret")
    monkeypatch.setenv("TEAM_KEY", "iop-team-secret")
    monkeypatch.setenv("HOSTED_KEY", "sk-hosted-secret")
    monkeypatch.setenv("HARMLESS", "kept")
    script = ("import os, sys; sys.stdin.read(); print(*(os.environ.get(k, 'absent') for k in "
              "('IOP_OPERATOR_KEY', 'TEAM_KEY', 'HOSTED_KEY', 'HARMLESS')))")
    config = parse_config({
        "models": [{"id": "m", "providers": {"c": SERVED, "h": "gpt"}}],
        "nodes": [{"id": "n", "providers": [
            {"id": "c", "type": "cli", "command": [sys.executable, "-c", script], "capacity": 1, "models": [SERVED]},
            {"id": "h", "type": "openai_api", "base_url": "http://127.0.0.1:9/v1", "api_key_env": "HOSTED_KEY",
             "capacity": 1, "models": ["gpt"]}]}],
        "auth": {"keys": [{"name": "ops", "env": "IOP_OPERATOR_KEY", "role": "operator"},
                          {"name": "team", "env": "TEAM_KEY"}]},
    })
    async with aiohttp.ClientSession() as session:
        cli = make_adapter(config.nodes[0].providers[0], session, secret_env_names(config))
        answer = await cli.complete(RunKind.CHAT, chat("x"), "r")
    assert answer["choices"][0]["message"]["content"].split() == ["absent", "absent", "absent", "kept"]


async def test_max_tokens_and_stop_cut_the_output_and_stop_the_tool(tmp_path: Path) -> None:
    """The tool is not told of them: iop applies them to its output (tokens counted in words, as
    the usage is), with the finish_reason a server gives, and stops the tool there (they were
    dropped: a caller's max_tokens was not a bound)."""
    answer = await adapter("--words", "10").complete(RunKind.CHAT, chat(max_tokens=3), "r")
    validate("CreateChatCompletionResponse", answer)
    assert answer["choices"][0]["message"]["content"] == "w0 w1 w2"
    assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 3
    answer = await adapter("--words", "10").complete(RunKind.COMPLETION, {"model": SERVED, "prompt": "a",
                                                                          "stop": [" w4", "w7"]}, "r")
    assert answer["choices"][0]["text"] == "w0 w1 w2 w3" and answer["choices"][0]["finish_reason"] == "stop"
    answer = await adapter("--words", "2").complete(RunKind.CHAT, chat(max_tokens=5), "r")  # (under the limit)
    assert answer["choices"][0]["message"]["content"] == "w0 w1 " and answer["choices"][0]["finish_reason"] == "stop"

    # A tool that would go on for ten minutes: its first word is all it may say, and it is stopped.
    pid_file = tmp_path / "pids"
    chunks = await collect(adapter("--hang", "--pid-file", str(pid_file)),
                           chat(max_completion_tokens=1, stream=True, stream_options={"include_usage": True}))
    for c in chunks:
        validate("CreateChatCompletionStreamResponse", c)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "w0"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 1
    wait_gone(read_pids(pid_file))


async def test_a_stream_closed_by_its_reader_stops_the_tool_before_the_close_returns(tmp_path: Path) -> None:
    """(the worker closes an adapter's stream when it stops reading it: the tool must not go on)"""
    pid_file = tmp_path / "pids"
    stream = adapter("--hang", "--pid-file", str(pid_file)).stream(RunKind.CHAT, chat(stream=True), "r")
    assert "w0" in json.dumps(await stream.__anext__())
    tool_pid = read_pids(pid_file)[0]
    await cast(Any, stream).aclose()
    assert not alive(tool_pid)
    wait_gone(read_pids(pid_file))


async def test_a_word_held_for_max_tokens_is_bounded_by_the_line_limit() -> None:
    """A word is held until whitespace ends it (it may be the max_tokens-th): a tool that writes one
    that never ends fails at `runtime.max_line_bytes` (it was held whole, however large)."""
    limits = ReadLimits(line_bytes=1000)
    command = [sys.executable, SCRIPT, "--model", "{model}", "--echo"]
    cli = CliAdapter(ProviderConfig.model_validate(
        {"id": "cli-c", "type": "cli", "command": command, "capacity": 1, "models": [SERVED]}), limits=limits)
    for stream in (False, True):
        with pytest.raises(ProviderError) as err:
            if stream:
                await collect(cli, chat("x" * 5000, max_tokens=3, stream=True))
            else:
                await cli.complete(RunKind.CHAT, chat("x" * 5000, max_tokens=3), "r")
        assert err.value.code is ErrorCode.OUTPUT_TOO_LARGE
        assert err.value.message == "provider cli-c sent a word over 1000 bytes (runtime.max_line_bytes)"
    answer = await cli.complete(RunKind.CHAT, chat("x" * 5000), "r")  # (nothing held without max_tokens)
    assert answer["choices"][0]["message"]["content"] == "x" * 5000
