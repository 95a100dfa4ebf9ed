"""The `cli` adapter's run ends when the tool process itself exits, whatever it left behind: a
child still holding stdout or stderr open (in the tool's process group, or in a session of its
own), or the tool closing stdout and going on running. Real processes: small shell scripts."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from common.config import ProviderConfig
from common.wire import RunKind
from tests.conftest import async_wait_until
from tests.test_adapter_cli import SERVED, alive, chat, collect, read_pids, wait_file, wait_gone
from workers.adapters.base import ProviderError, ReadLimits
from workers.adapters.cli import CliAdapter

#: read_timeout_ms of these tools: the old adapter waited that long for EOF, then failed
READ_TIMEOUT_MS = 60_000
#: how long a test lets a run take: well before the read timeout would have fired
WELL_BEFORE_S = 20


def tool(tmp_path: Path, body: str, **extra: Any) -> CliAdapter:
    path = tmp_path / "tool.sh"
    path.write_text("#!/bin/sh\ncat >/dev/null\n" + body + "\n")
    path.chmod(0o755)
    return CliAdapter(ProviderConfig.model_validate(
        {"id": "cli-x", "type": "cli", "command": [str(path)], "capacity": 1, "models": [SERVED],
         "read_timeout_ms": READ_TIMEOUT_MS, **extra}))


def text_of(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])


def finish_of(chunks: list[dict[str, Any]]) -> Any:
    return [c["choices"][0].get("finish_reason") for c in chunks if c["choices"]][-1]


@pytest.fixture
def leftovers(tmp_path: Path) -> Iterator[Path]:
    """A file for the pids of processes a test's tool leaves out of the adapter's reach (in a
    session of their own); those still there are killed when the test ends, pass or fail."""
    pids = tmp_path / "leftovers"
    yield pids
    for pid in read_pids(pids) if pids.exists() else []:
        if alive(pid) and session_of(pid) == pid:
            os.kill(pid, signal.SIGKILL)


def session_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3])


def pipes_of(pid: int) -> set[str]:
    """The pipes `pid` has as stdout and stderr (`pipe:[inode]`)."""
    links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in (1, 2)}
    return {link for link in links if link.startswith("pipe:")}


def our_pipes() -> set[str]:
    links = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue  # the listing's own descriptor, gone already
    return links


@pytest.mark.parametrize("holder", [
    "sleep 3600 &",  # holds stdout and stderr
    "sleep 3600 2>/dev/null &",  # holds stdout
    "sleep 3600 >/dev/null &",  # holds stderr
])
async def test_exit_0_ends_the_run_though_a_child_holds_its_output(tmp_path: Path, holder: str) -> None:
    pids = tmp_path / "pids"
    cli = tool(tmp_path, f"{holder}\necho $! > {pids}\nprintf 'the answer'")
    async with asyncio.timeout(WELL_BEFORE_S):
        chunks = await collect(cli, chat(stream=True))
    assert text_of(chunks) == "the answer" and finish_of(chunks) == "stop"
    wait_gone(read_pids(pids))  # the child in the tool's group was killed with it
    async with asyncio.timeout(WELL_BEFORE_S):
        answer = await cli.complete(RunKind.CHAT, chat(), "r")
    assert answer["choices"][0]["message"]["content"] == "the answer"
    assert answer["choices"][0]["finish_reason"] == "stop"
    wait_gone(read_pids(tmp_path / "pids"))


async def test_a_child_well_out_of_the_group_does_not_keep_the_run_or_its_pipes(
        tmp_path: Path, leftovers: Path) -> None:
    if shutil.which("setsid") is None:
        pytest.skip("no setsid here")
    cli = tool(tmp_path, f"setsid sleep 3600 &\necho $! > {leftovers}\nprintf 'the answer'")
    async with asyncio.timeout(WELL_BEFORE_S):
        chunks = await collect(cli, chat(stream=True))
    [child] = read_pids(leftovers)
    assert text_of(chunks) == "the answer" and finish_of(chunks) == "stop"
    # out of the process group's reach, the child lives on (the tool's doing), but holds
    # pipes nobody reads any more: the run closed its ends
    assert alive(child) and session_of(child) == child
    held = pipes_of(child)
    assert held and not held & our_pipes()


async def test_a_child_left_writing_is_read_for_no_more_than_a_pipe_holds(tmp_path: Path) -> None:
    """A tool printed its answer and exited, leaving `yes` writing to its stdout: what the child
    wrote was read until `read_timeout_ms` (never waiting, so the 200 ms of waiting never ran out),
    and the run failed as an answer over `max_response_bytes` (a hostile tool). After the exit, no
    more than a pipe holds is read."""
    from workers.adapters.cli import AFTER_EXIT_BYTES

    cli = tool(tmp_path, "printf 'parent'\nyes &")
    async with asyncio.timeout(WELL_BEFORE_S):
        answer = await cli.complete(RunKind.CHAT, chat(), "r")
    text = answer["choices"][0]["message"]["content"]
    # (and what was read before the worker saw the exit: a read or two)
    assert text.startswith("parent") and len(text) < 2 * AFTER_EXIT_BYTES, len(text)
    assert answer["choices"][0]["finish_reason"] == "stop"


#: A worker's stand-in: runs a tool through the adapter under uvloop, as the services run, until killed.
RUNS_A_TOOL = """
import asyncio, sys, uvloop
from common.config import ProviderConfig
from common.wire import RunKind
from workers.adapters.cli import CliAdapter
cli = CliAdapter(ProviderConfig.model_validate({"id": "cli-x", "type": "cli", "command": [sys.argv[1]],
                                                "capacity": 1, "models": ["m"]}))
uvloop.run(cli.complete(RunKind.CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}]}, "r"))
"""


def test_a_tool_dies_with_its_worker_however_the_worker_dies(tmp_path: Path) -> None:
    """A worker killed outright (SIGKILL, the OOM killer) left its tools running past every
    timeout, and the run its lease then put back in the queue ran twice at once (a hostile tool)."""
    pids = tmp_path / "pids"
    path = tmp_path / "tool.sh"
    path.write_text(f"#!/bin/sh\necho $$ > {pids}\nexec sleep 3600\n")
    path.chmod(0o755)
    worker = subprocess.Popen([sys.executable, "-c", RUNS_A_TOOL, str(path)], cwd=Path(__file__).parent.parent)
    try:
        wait_file(pids)
        [tool_pid] = read_pids(pids)
        assert alive(tool_pid)
        worker.kill()
        worker.wait(10)
        wait_gone([tool_pid])
    finally:
        worker.kill()
        worker.wait(10)


async def test_a_tool_that_closes_stdout_and_goes_on_running_fails_and_is_killed(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    cli = tool(tmp_path, f"echo $$ > {pids}\nprintf 'partial'\nexec >&-\nsleep 3600 &\necho $! >> {pids}\nwait",
               read_timeout_ms=500)
    got: list[dict[str, Any]] = []
    with pytest.raises(ProviderError) as err:
        async with asyncio.timeout(WELL_BEFORE_S):
            async for read in cli.stream(RunKind.CHAT, chat(stream=True), "r"):
                got.extend(read)
    assert text_of(got) == "partial"
    assert err.value.message == ("provider cli-x: tool.sh closed its output but did not exit "
                                 "within 500 ms")
    wait_gone(read_pids(tmp_path / "pids"))


async def test_a_failure_with_a_child_holding_stderr_carries_the_stderr_tail(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    cli = tool(tmp_path, f"echo 'model file missing' >&2\nsleep 3600 &\necho $! > {pids}\nexit 3")
    with pytest.raises(ProviderError) as err:
        async with asyncio.timeout(WELL_BEFORE_S):
            await cli.complete(RunKind.CHAT, chat(), "r")
    assert err.value.message == "provider cli-x: tool.sh exited with status 3: model file missing"
    wait_gone(read_pids(tmp_path / "pids"))


async def test_a_consumer_slower_than_the_tool_still_gets_the_whole_answer(tmp_path: Path) -> None:
    # The tool exits with its answer unread, in asyncio's buffer and in the pipe, behind a child
    # that keeps the pipe open. Not more than asyncio buffers (128 KiB before it stops reading
    # the pipe) and the smallest pipe (4 KiB) hold, or the tool could not finish writing.
    size = 135_000
    pids = tmp_path / "pids"
    cli = tool(tmp_path, f"sleep 3600 &\necho $$ $! > {pids}\nhead -c {size} /dev/zero | tr '\\0' a")
    text: list[str] = []
    async with asyncio.timeout(WELL_BEFORE_S):
        async for read in cli.stream(RunKind.CHAT, chat(stream=True), "r"):
            text.append(text_of(read))
            if len(text) == 1:
                tool_pid = read_pids(pids)[0]
                await asyncio.to_thread(wait_gone, [tool_pid])  # the tool is done before we go on
    assert "".join(text) == "a" * size
    wait_gone(read_pids(tmp_path / "pids"))


async def test_a_python_tool_s_traceback_is_left_out_of_its_error_but_its_exception_is_not(tmp_path: Path) -> None:
    """Its frames name the machine's files (found: `File "/root/.pyenv/.../json/decoder.py"` in a 502)."""
    cli = tool(tmp_path, f"{sys.executable} -c 'import json; json.loads(\"{{bad\")'")
    with pytest.raises(ProviderError) as err:
        async with asyncio.timeout(WELL_BEFORE_S):
            await cli.complete(RunKind.CHAT, chat(), "r")
    assert err.value.message.startswith("provider cli-x: tool.sh exited with status 1: json.decoder.JSONDecodeError: ")
    assert "File" not in err.value.message and "Traceback" not in err.value.message


@pytest.mark.parametrize("limits", [{"max_tokens": 100}, {"stop": "zz"}, {}])
async def test_what_was_held_for_the_limits_goes_out_before_the_tool_s_failure(
        tmp_path: Path, limits: dict[str, Any]) -> None:
    """A tool printed `hello partial-word` and failed: a stream's caller got `hello ` (with a
    `max_tokens` far from reached) or `hello partial-w` (with a stop string), what was held back in
    case the limits cut it lost with the failure (a hostile tool)."""
    cli = tool(tmp_path, "printf 'hello partial-word'\nexit 3")
    seen: list[dict[str, Any]] = []
    with pytest.raises(ProviderError, match="exited with status 3"):
        async for read in cli.stream(RunKind.CHAT, chat(stream=True, **limits), "r"):
            seen += read
    assert text_of(seen) == "hello partial-word"


async def test_all_a_tool_wrote_before_it_exited_is_read_however_large_its_pipe(tmp_path: Path) -> None:
    """What is unread when the tool exits is its pipe, which it may make hold up to pipe-max-size,
    and what the worker read and had not taken: the bound on what is read after the exit cut a
    tool's own answer whose caller was slow (a review)."""
    from workers.adapters.cli import AFTER_EXIT_BYTES, _pipe_max_bytes

    total = _pipe_max_bytes() + 200 * 1024
    assert total < AFTER_EXIT_BYTES
    done = tmp_path / "written"
    script = tmp_path / "writer.py"
    script.write_text("import fcntl, os\n"
                      f"fcntl.fcntl(1, 1031, {_pipe_max_bytes()})  # F_SETPIPE_SZ, allowed unprivileged\n"
                      f"view = memoryview(b'abcdefg\\n' * ({total} // 8))\n"
                      "while view:\n"
                      "    view = view[os.write(1, view):]\n"
                      f"open({str(done)!r}, 'w').close()\n")
    cli = tool(tmp_path, f"exec {sys.executable} {script}")
    stream = cli.stream(RunKind.CHAT, chat(stream=True), "r")
    seen = await anext(stream)  # (the tool began; the caller takes nothing more until it exited)

    async def written() -> bool:
        return done.exists()

    await async_wait_until(written, what="the tool to write everything")
    async for read in stream:
        seen += read
    assert len(text_of(seen)) == total and finish_of(seen) == "stop"


def limited_tool(tmp_path: Path, body: str, limits: ReadLimits) -> CliAdapter:
    path = tmp_path / "tool.sh"
    path.write_text("#!/bin/sh\ncat >/dev/null\n" + body + "\n")
    path.chmod(0o755)
    return CliAdapter(ProviderConfig.model_validate(
        {"id": "cli-x", "type": "cli", "command": [str(path)], "capacity": 1, "models": [SERVED]}), limits=limits)


async def test_a_whole_answer_s_caller_is_told_the_tool_s_failure_not_a_limit_the_held_text_passed(
        tmp_path: Path) -> None:
    """What was held for the limits went into a whole answer too, where it tipped it over
    max_response_bytes: the caller heard output_too_large, not the tool's failure (a review)."""
    cli = limited_tool(tmp_path, "i=0; while [ $i -lt 500 ]; do printf 'a '; i=$((i+1)); done\n"
                                 "printf 'longlonglonglonglonglonglonglonglonglonglonglong'\n"
                                 "echo 'the real reason' >&2\nexit 3", ReadLimits(response_bytes=1024))
    with pytest.raises(ProviderError, match="exited with status 3: the real reason"):
        await cli.complete(RunKind.CHAT, chat(max_tokens=100_000), "r")


async def test_a_stop_string_held_back_with_a_word_is_not_a_word_over_the_line_limit(tmp_path: Path) -> None:
    """With max_tokens, what is held is the start of a stop string and the word it began in: a stop
    of 1024 characters, accepted, failed the run as "a word over max_line_bytes" at its least, 1024
    (a review)."""
    cli = limited_tool(tmp_path, "i=0; while [ $i -lt 300 ]; do printf 'hello world '; i=$((i+1)); done",
                       ReadLimits(line_bytes=1024))
    answer = await cli.complete(RunKind.CHAT, chat(max_tokens=100_000, stop="Z" * 1024), "r")
    assert answer["choices"][0]["message"]["content"] == "hello world " * 300


#: The adapter under uvloop, as the services run it: prints how a tool's run ended.
RUNS_A_TOOL_TO_ITS_END = """
import asyncio, sys, uvloop
from common.config import ProviderConfig
from common.wire import RunKind
from workers.adapters.base import ProviderError
from workers.adapters.cli import CliAdapter
cli = CliAdapter(ProviderConfig.model_validate({"id": "cli-x", "type": "cli", "command": [sys.argv[1]],
                                                "capacity": 1, "models": ["m"], "read_timeout_ms": 1000}))
async def main() -> None:
    try:
        async with asyncio.timeout(20):
            await cli.complete(RunKind.CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}]}, "r")
    except ProviderError as exc:
        print(exc.message)
uvloop.run(main())
"""


#: A tool that writes which descriptors it has (fstat opens none) and its pid, closes stdout, runs on.
OPEN_FDS_THEN_CLOSE_STDOUT = """import os, pathlib, time
def is_open(fd):
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True
here = pathlib.Path(__file__).parent
(here / "fds").write_text(" ".join(str(fd) for fd in range(4096) if is_open(fd)))
(here / "pids").write_text(str(os.getpid()))
os.close(1)
time.sleep(3600)
"""


def test_under_uvloop_a_tool_has_only_its_stdio_and_its_closed_stdout_is_seen(tmp_path: Path) -> None:
    """uvloop gave the tool a second copy of each end of its stdio (and the worker's own inherited
    descriptors): a tool that closed stdout and ran on still held it, and its run ended in
    read_timeout_ms's silence instead of the "closed its output" failure."""
    path = tmp_path / "tool.py"
    path.write_text(f"#!{sys.executable}\n{OPEN_FDS_THEN_CLOSE_STDOUT}")
    path.chmod(0o755)
    done = subprocess.run([sys.executable, "-c", RUNS_A_TOOL_TO_ITS_END, str(path)], cwd=Path(__file__).parent.parent,
                          capture_output=True, text=True, timeout=60, check=True)
    assert (tmp_path / "fds").read_text() == "0 1 2"
    assert done.stdout.strip() == "provider cli-x: tool.py closed its output but did not exit within 1000 ms"
    wait_gone(read_pids(tmp_path / "pids"))
