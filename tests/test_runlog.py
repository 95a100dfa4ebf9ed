"""Log lines about a run carry its run id and model, in text and in JSON."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from common.lifecycle import JsonFormatter, TextFormatter, setup_logging
from common.runlog import run_fields


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
