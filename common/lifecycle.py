"""Process plumbing every service shares: logging, stopping on SIGTERM/SIGINT, and exiting."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Coroutine
from typing import Any, NoReturn, TextIO

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


#: control characters as a message shows them (`\n`, `\x1b`): a caller's path or a provider's text
#: neither breaks its line nor reaches an operator's terminal as escape sequences (a caller's path
#: cleared the screen and printed a forged line in red)
_SHOWN_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if c != 0x09} | {
    0x0A: "\\n", 0x0D: "\\r"} | {
    # (line and paragraph separators: a line break to Python's `splitlines` and to JavaScript; the
    # bidirectional overrides and isolates: the rest of the line shown right to left)
    c: f"\\u{c:04x}" for c in (0x2028, 0x2029, *range(0x202A, 0x202F), *range(0x2066, 0x206A))}
_TRACEBACK_CONTROLS = {c: shown for c, shown in _SHOWN_CONTROLS.items() if c != 0x0A}


class TextFormatter(logging.Formatter):
    """`time level logger message run=… model=…`; the context only on lines about a run. A message
    stays on its line (its line breaks are shown as `\\n`, any other control character but a tab as
    `\\x..`); only a traceback follows on more, each after `| `."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = record.message.translate(_SHOWN_CONTROLS)
        return super().formatMessage(record) + context_text(record)

    def formatException(self, ei: Any) -> str:
        """A traceback keeps its lines, each after `| ` (an exception's text may hold a line break: a
        line of it must not read as a line of the log); any other control character in it is
        escaped as in a message."""
        text = super().formatException(ei).translate(_TRACEBACK_CONTROLS)
        return "\n".join(f"| {line}" for line in text.split("\n"))


class TurnHandler(logging.StreamHandler[TextIO]):
    """A stream handler that writes the lines logged during one turn of the event loop with one
    write, at the end of that turn (a scheduler dispatching a batch of runs logs a line a run: one
    system call, not one a line). While lines keep coming, it writes at most once every `HOLD_S`:
    a scheduler dispatching one run a turn at 500 runs/s spent a fifth of its CPU writing its
    lines one by one. A line at WARNING or above goes out at once, with those held before it.
    Outside the loop's thread (no running loop: startup, a CLI command, a resolver thread) a line
    is written at once; `flush` (logging's shutdown, before a service exits) writes what is held.
    At most `MAX_HELD` lines wait."""

    MAX_HELD = 256
    #: after a write, the next one waits this long (seconds) for the lines of later turns to join it
    HOLD_S = 0.02

    def __init__(self, stream: TextIO) -> None:
        super().__init__(stream)
        self.held: list[str] = []
        #: the loop time of the last write (`flush`)
        self.written_at = float("-inf")

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + self.terminator
        except Exception:  # logging's own rule: a line that cannot be made is reported, not raised
            self.handleError(record)
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._write(line)
            return
        self.held.append(line)
        if record.levelno >= logging.WARNING or len(self.held) >= self.MAX_HELD:
            self.flush()
        elif len(self.held) == 1:
            wait = self.written_at + self.HOLD_S - loop.time()
            if wait > 0:
                loop.call_later(wait, self.flush)
            else:
                loop.call_soon(self.flush)

    def flush(self) -> None:
        lock = self.lock  # logging's own (`emit` runs under it)
        assert lock is not None
        with lock:
            held, self.held = self.held, []
            if held:
                self._write("".join(held))
                try:
                    self.written_at = asyncio.get_running_loop().time()
                except RuntimeError:  # (logging's shutdown, after the loop)
                    pass

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # stderr is gone (closed, or its reader left): nowhere to say so
            pass


#: ready lines are JSON objects (`IOP_LOG_FORMAT=json`)
_json_ready = False


def ready(text: str) -> None:
    """A process's ready line on stdout (where it listens, that it runs): the text, or with
    `IOP_LOG_FORMAT=json` a JSON object as its log lines are (`msg` the text), so that a log
    pipeline reading both streams (`docker compose logs` does) gets JSON only."""
    if _json_ready:
        text = json.dumps({"ts": round(time.time(), 3), "level": "info", "logger": "iop", "msg": text})
    print(text, flush=True)


#: What `IOP_LOG_LEVEL` may say (in any case).
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def setup_logging(level: str | None = None, fmt: str | None = None) -> None:
    """Level from IOP_LOG_LEVEL (default INFO); IOP_LOG_FORMAT=json for one JSON object a line."""
    handler = TurnHandler(sys.stderr)
    form = (fmt or os.environ.get("IOP_LOG_FORMAT", "text")).strip().lower()
    if form not in ("text", "json"):
        print(f"error: IOP_LOG_FORMAT={form!r} is not a log format; use text or json", file=sys.stderr)
        raise SystemExit(2)
    global _json_ready
    _json_ready = form == "json"
    if form == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter())
    root = logging.getLogger()
    name = (level or os.environ.get("IOP_LOG_LEVEL", "INFO")).strip().upper()
    if name not in LEVELS:
        print(f"error: IOP_LOG_LEVEL={name.lower()!r} is not a log level; use one of {', '.join(LEVELS)}",
              file=sys.stderr)
        raise SystemExit(2)
    root.handlers[:] = [handler]
    root.setLevel(name)
    # No line says where in the code, which thread or which process it was logged: a record need
    # not find out (the logging HOWTO's "Optimization"; a line a dispatched run cost 7.8 µs, 6.7 so)
    logging._srcfile = None  # (that HOWTO's own name for it)
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    logging.getLogger("arq").setLevel(logging.WARNING)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def quiet_abandoned_lookups(loop: asyncio.AbstractEventLoop) -> None:
    """A name lookup that fails after its caller gave up on it (redis-py's connect timeout ran out
    while uvloop's `create_connection` waited for `getaddrinfo`, which it does not cancel) is
    logged at DEBUG, not as an ERROR "Future exception was never retrieved" with a traceback: its
    caller already reported the failed connection. A task that ended the process (a SystemExit
    such as `common.redisconn.DatabaseRefused`, whose one line the process prints as it exits) is not
    logged either. Every other unhandled error is logged as before."""
    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if isinstance(context.get("exception"), socket.gaierror) and \
                str(context.get("message", "")).startswith("Future exception was never retrieved"):
            logging.getLogger("iop").debug("a name lookup failed after its caller gave up on it: %s",
                                           context["exception"])
            return
        if isinstance(context.get("exception"), SystemExit):
            return  # the process ends with its own one line (`DatabaseRefused`): no traceback before it
        loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def stop_event() -> asyncio.Event:
    """An event set by the first SIGTERM, SIGINT or SIGHUP (must be called inside the loop). A
    SIGHUP (its terminal or ssh session closed, or a `kill -HUP` meant as a reload: a service reads
    its config only when it starts) stops it as SIGTERM does, not at once as its default would (a
    gateway's callers cut mid-answer, a worker's heartbeats and runs left to lapse). A service
    started with SIGHUP ignored (`nohup iop worker &`, so that it outlives its ssh session) keeps
    ignoring it: handled, its session's end would stop it."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        if sig is signal.SIGHUP and signal.getsignal(sig) is signal.SIG_IGN:
            continue
        loop.add_signal_handler(sig, stop.set)
    return stop


#: allocations of container objects (net of those freed) between two collections of the youngest
#: generation, against Python's 700
GC_YOUNG_THRESHOLD = 5_000


def tune_gc() -> None:
    """Garbage collection for a long-running service, done before it serves.

    What exists by now (the modules, the configuration) lives as long as the process: it is
    collected once and then left out of every later collection (`gc.freeze`), which would
    otherwise walk it all again each time the oldest generation is collected. The youngest
    generation is collected after `GC_YOUNG_THRESHOLD` allocations: most of what a request
    allocates is freed by reference counting before then and is never walked at all, where after
    700 much of what requests in flight hold was walked, moved to an older generation and walked
    again (4–7% of the gateway's CPU under load; ~0 with 5,000, and 20,000 gained nothing more).
    The price: garbage in reference cycles, and what it holds, waits up to 5,000 allocations to
    be freed instead of 700, so the paths that can make such cycles per request (an error
    answered, a script's error reply) do not make them."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def run(main: Coroutine[Any, Any, None]) -> NoReturn:
    """Run a service's main coroutine (with uvloop when it is installed), then end the process.

    When `main` returns, the service has closed all it owns, and the process exits at once
    with its status, without waiting for the event loop's resolver threads: a DNS lookup of
    a Redis host that has gone away can take tens of seconds (25 s seen under podman, once
    the Redis container had stopped), and a service told to stop would outlive its
    container's stop timeout and be killed.
    """
    async def main_then_exit() -> None:
        quiet_abandoned_lookups(asyncio.get_running_loop())
        code = 1
        try:
            await main
            code = 0
        except SystemExit as exc:  # what `sys.exit` would print and return
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
        except Exception:
            traceback.print_exc()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    tune_gc()
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        asyncio.run(main_then_exit())
    else:
        uvloop.run(main_then_exit())
    raise AssertionError("unreachable: main_then_exit ends the process")  # pragma: no cover
