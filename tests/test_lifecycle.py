"""`common.lifecycle.run`: a service process ends with its status once its main coroutine
returns, even while a resolver thread is still stuck (as a DNS lookup of a Redis host that has
gone away can be for tens of seconds)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT

#: The main coroutine of a service whose loop still has a thread that never comes back.
STUCK_THREAD = """
import asyncio, sys, threading
from common.lifecycle import run

async def main():
    loop = asyncio.get_running_loop()
    loop.run_in_executor(None, threading.Event().wait)  # like a lookup that gets no answer
    print("stopping", flush=True)
    {end}

run(main())
"""


def run_service(end: str) -> subprocess.CompletedProcess[str]:
    # Without the fix the process waits for the thread forever: the timeout fails the test.
    return subprocess.run([sys.executable, "-c", STUCK_THREAD.format(end=end)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("end", "status", "stderr"), [
    ("return", 0, ""),
    ("raise SystemExit(3)", 3, ""),
    ("raise SystemExit('node x is not in the config')", 1, "node x is not in the config\n"),
])
def test_the_process_exits_with_its_status_without_waiting_for_a_stuck_thread(
        end: str, status: int, stderr: str) -> None:
    done = run_service(end)
    assert (done.returncode, done.stdout, done.stderr) == (status, "stopping\n", stderr)


def test_an_unexpected_error_is_printed_and_the_status_is_1() -> None:
    done = run_service("raise RuntimeError('boom')")
    assert done.returncode == 1
    assert "Traceback" in done.stderr and "RuntimeError: boom" in done.stderr
