"""Process plumbing every service shares: logging and stopping on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from typing import Any

from common.runlog import context_of, context_text


class JsonFormatter(logging.Formatter):
    """One JSON object a line; a run's context (`common.runlog`) becomes keys of it."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **context_of(record),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


class TextFormatter(logging.Formatter):
    """`time level logger message run=… model=…`; the context only on lines about a run. A message
    stays on its line (its line breaks are shown as `\\n`); only a traceback follows on more."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = record.message.replace("\r", "\\r").replace("\n", "\\n")
        return super().formatMessage(record) + context_text(record)


def setup_logging(level: str | None = None, fmt: str | None = None) -> None:
    """Level from IOP_LOG_LEVEL (default INFO); IOP_LOG_FORMAT=json for one JSON object a line."""
    handler = logging.StreamHandler(sys.stderr)
    if (fmt or os.environ.get("IOP_LOG_FORMAT", "text")) == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel((level or os.environ.get("IOP_LOG_LEVEL", "INFO")).upper())
    logging.getLogger("arq").setLevel(logging.WARNING)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def stop_event() -> asyncio.Event:
    """An event set by the first SIGTERM or SIGINT (must be called inside the loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def run(main: Any) -> None:
    """asyncio.run with uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        asyncio.run(main)
        return
    uvloop.run(main)
