"""Log lines about a run carry its run id and model, in text and in JSON."""

from __future__ import annotations

import asyncio
import gc
import io
import json
import logging
import socket
import sys
from collections.abc import Iterator

import pytest

from common.lifecycle import JsonFormatter, TextFormatter, TurnHandler, quiet_abandoned_lookups, setup_logging
from common.runlog import run_fields
from tests.conftest import async_wait_until


@pytest.fixture
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def emit(formatter: logging.Formatter, msg: str, *args: object, **extra: str) -> str:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    logger = logging.getLogger("iop.test.runlog")
    logger.propagate = False
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    logger.info(msg, *args, extra=extra or None)
    return out.getvalue().rstrip("\n")


def test_text_lines_about_a_run_end_with_run_and_model() -> None:
    line = emit(TextFormatter(), "dispatched to %s", "vllm-a", **run_fields("run_1", "qwen3.6:35b"))
    assert line.endswith(" INFO iop.test.runlog dispatched to vllm-a run=run_1 model=qwen3.6:35b")


def test_text_lines_about_no_run_have_no_context() -> None:
    line = emit(TextFormatter(), "worker for queue %s started", "iop:node:gpu-1")
    assert line.endswith("worker for queue iop:node:gpu-1 started")
    assert "run=" not in line and "model=" not in line


def test_json_lines_carry_run_and_model_as_fields() -> None:
    line = emit(JsonFormatter(), "failed: %s", "boom", **run_fields("run_2", "m", provider="p"))
    obj = json.loads(line)
    assert obj["msg"] == "failed: boom"
    assert (obj["run"], obj["model"], obj["provider"]) == ("run_2", "m", "p")
    assert obj["level"] == "info" and obj["logger"] == "iop.test.runlog"
    assert "run" not in json.loads(emit(JsonFormatter(), "idle"))


def test_an_unknown_model_is_a_dash_and_unknown_fields_are_dropped() -> None:
    assert run_fields("run_3", None, colour="red") == {"run": "run_3", "model": "-"}


def test_setup_logging_picks_the_format(restore_root: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IOP_LOG_FORMAT", "json")
    setup_logging()
    assert isinstance(logging.getLogger().handlers[0].formatter, JsonFormatter)
    monkeypatch.setenv("IOP_LOG_FORMAT", "text")
    setup_logging()
    assert isinstance(logging.getLogger().handlers[0].formatter, TextFormatter)


def test_a_multi_line_message_stays_on_one_text_line() -> None:
    line = emit(TextFormatter(), "failed: %s", "provider said:\nTraceback\r\n  x", **run_fields("run_1", "m"))
    assert "\n" not in line and line.endswith("failed: provider said:\\nTraceback\\r\\n  x run=run_1 model=m")


def test_control_characters_of_a_message_reach_the_text_log_escaped() -> None:
    """A caller's path with ANSI escapes was written as it came: it cleared an operator's terminal
    and printed a forged line in red (a hostile caller). A tab stays a tab."""
    line = emit(TextFormatter(), "redis unavailable on GET %s", "/v1/runs/x\x1b[2J\x1b[31mFORGED\x00\x7f\x9b\tend")
    assert line.endswith("redis unavailable on GET /v1/runs/x\\x1b[2J\\x1b[31mFORGED\\x00\\x7f\\x9b\tend")
    assert not any(ord(c) < 0x20 and c != "\t" or 0x7F <= ord(c) < 0xA0 for c in line)


def test_line_separators_and_bidirectional_overrides_reach_the_text_log_escaped() -> None:
    """A provider's 4xx text is logged as it came, a U+202E in it too: the rest of the line showed
    right to left (a line that reads other than it is). U+2028 is a line break to a reader that
    splits as Python's `splitlines` or JavaScript does: in a caller's path, a forged line."""
    line = emit(TextFormatter(), "failed: %s", "a\u2028 2026-12-07 ERROR forged\u2029b\u202ec\u2066d\u2069")
    assert line.endswith("failed: a\\u2028 2026-12-07 ERROR forged\\u2029b\\u202ec\\u2066d\\u2069")
    assert len(line.splitlines()) == 1


def test_a_traceback_keeps_its_lines_and_escapes_any_other_control_character() -> None:
    formatter = TextFormatter()
    try:
        raise ValueError("bad path /v1/x\x1b[2J\rFORGED")
    except ValueError:
        record = logging.LogRecord("iop.test", logging.ERROR, __file__, 1, "failed", None, sys.exc_info())
    text = formatter.format(record)
    assert "\n| Traceback (most recent call last):\n| " in text
    assert text.endswith("| ValueError: bad path /v1/x\\x1b[2J\\rFORGED")
    # (a line break in an exception's text: its next line must not read as a line of the log; a review)
    try:
        raise ValueError("bad\n2026-12-06 02:00:00,000 ERROR iop.gateway admin key accepted")
    except ValueError:
        record = logging.LogRecord("iop.test", logging.ERROR, __file__, 1, "failed", None, sys.exc_info())
    lines = formatter.format(record).splitlines()
    assert all(line.startswith("| ") for line in lines[1:]) and lines[-1].startswith("| 2026-12-06"), lines


class Writes(io.StringIO):
    """A stream that keeps each write apart."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)


def turn_logger() -> tuple[logging.Logger, TurnHandler, Writes]:
    out = Writes()
    handler = TurnHandler(out)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("iop.test.turns")
    logger.propagate = False
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    return logger, handler, out


async def test_the_lines_of_one_loop_turn_go_out_in_one_write_at_its_end() -> None:
    logger, _, out = turn_logger()
    for n in range(3):
        logger.info("dispatched %d", n)
    assert out.writes == []  # held until the turn ends
    await asyncio.sleep(0)
    assert out.writes == ["dispatched 0\ndispatched 1\ndispatched 2\n"]


async def test_lines_that_keep_coming_are_written_at_most_once_every_hold() -> None:
    """After a write, the lines of the next turns wait for the rest of `HOLD_S` and go out
    together; a WARNING goes out at once, after the lines held before it."""
    logger, handler, out = turn_logger()
    logger.info("first")
    await asyncio.sleep(0)
    assert out.writes == ["first\n"]
    loop = asyncio.get_running_loop()
    handler.written_at = loop.time() + 3600  # (as if just written, for as long as the test takes)
    for n in range(3):
        logger.info("turn %d", n)
        await asyncio.sleep(0)
    assert out.writes == ["first\n"]  # held: written less than HOLD_S ago
    logger.warning("trouble")
    assert out.writes[1:] == ["turn 0\nturn 1\nturn 2\ntrouble\n"]
    handler.written_at = loop.time() - 2 * TurnHandler.HOLD_S  # (as if HOLD_S ago: the timer has passed)
    logger.info("later")
    await asyncio.sleep(0)
    assert out.writes[2:] == ["later\n"]


async def test_held_lines_go_out_when_the_hold_has_passed() -> None:
    logger, handler, out = turn_logger()
    handler.written_at = asyncio.get_running_loop().time()  # just written
    logger.info("held")
    await asyncio.sleep(0)
    assert out.writes == []
    async def written() -> bool:
        return out.writes == ["held\n"]

    await async_wait_until(written, what="the held line written")


async def test_held_lines_are_written_by_flush_and_never_more_than_max_held() -> None:
    logger, handler, out = turn_logger()
    logger.info("before an exit")
    logging.shutdown([lambda: handler])  # what a service's exit does, before the loop turns again
    assert out.writes == ["before an exit\n"]
    for n in range(TurnHandler.MAX_HELD):
        logger.info("%d", n)
    assert len(out.writes) == 2 and out.writes[1].count("\n") == TurnHandler.MAX_HELD
    await asyncio.sleep(0)
    assert len(out.writes) == 2  # nothing was left held, nothing written twice


def test_outside_a_running_loop_a_line_is_written_at_once() -> None:
    logger, _, out = turn_logger()
    logger.info("starting")
    assert out.writes == ["starting\n"]


async def test_a_lookup_abandoned_by_its_caller_is_no_error_but_other_lost_errors_are(
        caplog: pytest.LogCaptureFixture) -> None:
    """What uvloop leaves when a connect timeout gives up on its `getaddrinfo`: a future that fails
    with gaierror later, which nobody awaits any more."""
    caplog.set_level(logging.DEBUG, logger="iop")
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    quiet_abandoned_lookups(loop)
    try:
        for exc in (socket.gaierror(-3, "Temporary failure in name resolution"), RuntimeError("a bug")):
            future = loop.create_future()
            future.set_exception(exc)
            del future
            gc.collect()
    finally:
        loop.set_exception_handler(previous)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [str(r.exc_info[1]) for r in errors if r.exc_info] == ["a bug"]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG] == [
        "a name lookup failed after its caller gave up on it: [Errno -3] Temporary failure in name resolution"]
