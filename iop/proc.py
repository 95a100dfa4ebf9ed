"""A real `python -m iop ...` child process whose output is read line by line, so a caller
can wait for the line that says it is ready. The tests and the benchmark start iop this way."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path


class NotReady(AssertionError):
    """The process never printed the awaited line (it exited, or the deadline passed)."""


class IopProcess:
    def __init__(self, name: str, args: list[str], env: dict[str, str], *, cwd: Path | None = None,
                 keep_lines: int | None = None, python_flags: Sequence[str] = ()) -> None:
        """`keep_lines` bounds the output kept (None: all of it); `python_flags` go before `-m iop`."""
        self.name = name
        self.args = args
        self.lines: deque[str] = deque(maxlen=keep_lines)
        self._count = 0  # lines read in all, kept or not
        self._cond = threading.Condition()
        self.popen = subprocess.Popen(
            [sys.executable, *python_flags, "-m", "iop", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=env, cwd=str(cwd) if cwd else None, text=True, start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, name=f"read-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._count += 1
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    #: how long `wait_for_line` waits by default
    ready_timeout_s = 20.0

    def wait_for_line(self, pattern: str, timeout: float | None = None) -> re.Match[str]:
        """The first line, already printed or still to come, that matches `pattern`."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + (self.ready_timeout_s if timeout is None else timeout)
        with self._cond:
            seen = self._count - len(self.lines)  # lines no longer kept cannot be searched
            while True:
                unread = self._count - seen
                new = list(self.lines)[max(0, len(self.lines) - unread):] if unread else []
                seen = self._count
                for line in new:
                    m = rx.search(line)
                    if m:
                        return m
                left = deadline - time.monotonic()
                if left <= 0 or (self.popen.poll() is not None and not self._reader.is_alive()):
                    raise NotReady(f"{self.name}: no line matching {pattern!r}; output:\n" + self.output())
                self._cond.wait(min(left, 0.5))

    def output(self, last: int = 80) -> str:
        with self._cond:
            return "\n".join(list(self.lines)[-last:])

    def send(self, sig: int) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, sig)

    def stop(self, timeout: float = 15.0, sig: int = signal.SIGTERM) -> int:
        """Signal the process group, wait (SIGKILL after `timeout`), and return the exit code."""
        self.send(sig)
        try:
            code = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.send(signal.SIGKILL)
            code = self.popen.wait(timeout=5)
        self._reader.join(timeout=5)
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        return code
