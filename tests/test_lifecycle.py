"""`common.lifecycle.run`: a service process ends with its status once its main coroutine
returns, even while a resolver thread is still stuck (as a DNS lookup of a Redis host that has
gone away can be for tens of seconds)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.faults import FaultStack

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


#: A service that reports how garbage collection is set while it runs, and whether a reference
#: cycle it made and dropped is still freed.
GC_REPORT = """
import gc, weakref
from common.lifecycle import GC_YOUNG_THRESHOLD, run

class Node:
    pass

async def main():
    a, b = Node(), Node()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    del a, b
    gc.collect()
    print(gc.get_threshold()[0] == GC_YOUNG_THRESHOLD, gc.get_freeze_count() > 1000,
          gone() is None and gc.isenabled())  # (collected, by the collector left on)

run(main())
"""


def test_a_service_runs_with_its_startup_objects_frozen_and_a_larger_young_generation() -> None:
    done = subprocess.run([sys.executable, "-c", GC_REPORT], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, "True True True\n", "")


def test_sighup_stops_each_service_as_sigterm_does(fstack: FaultStack) -> None:
    """SIGHUP (a closed terminal or ssh session, `kill -HUP` meant as a reload: iop reads its config
    only at its start) killed each service on the spot, as SIGKILL would: a gateway cut its callers
    mid-answer, a worker left its providers' heartbeats and its runs to lapse. Found by an operator
    helper with real processes."""
    fstack.add_simulator("p")
    fstack.configure({"p": ("n1", 2)})
    gateway = fstack.start("gateway", "gateway", "--host", "127.0.0.1", "--port", "0")
    gateway.wait_for_line(r"listening on (http://\S+)")
    scheduler = fstack.scheduler()
    worker = fstack.worker("n1")
    fstack.wait_health("p", "available")
    assert worker.stop(sig=signal.SIGHUP) == 0, worker.output()
    assert fstack.health("p") is None  # the last worker of its node took its heartbeat away as it left
    assert scheduler.stop(sig=signal.SIGHUP) == 0, scheduler.output()
    assert gateway.stop(sig=signal.SIGHUP) == 0, gateway.output()


#: A service's stop event under a SIGHUP its process was started ignoring (`nohup`), then a SIGUSR1:
#: both go to the loop's handlers in the order they came, so by SIGUSR1's the SIGHUP's has run if any.
HUP_IGNORED = """
import asyncio, os, signal
from common.lifecycle import stop_event

async def main():
    stop = stop_event()
    later = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, later.set)
    os.kill(os.getpid(), signal.SIGHUP)
    os.kill(os.getpid(), signal.SIGUSR1)
    await later.wait()
    print("stopped" if stop.is_set() else "running", signal.getsignal(signal.SIGHUP) is signal.SIG_IGN)

asyncio.run(main())
"""


def test_a_service_started_with_sighup_ignored_keeps_ignoring_it() -> None:
    """`nohup iop worker &` (SIGHUP ignored, so that the service outlives the ssh session it was
    started from): the handler that stops a service at SIGHUP replaced the ignore, and the session's
    end stopped it. Found in review with a real `nohup iop scheduler` and `kill -HUP`."""
    done = subprocess.run([sys.executable, "-c", HUP_IGNORED], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    assert (done.returncode, done.stdout, done.stderr) == (0, "running True\n", "")


#: What a process the suite starts finds SIGHUP set to, with the suite's module of fixtures loaded.
CHILD_HUP = """
import signal, subprocess, sys
import tests.conftest
print(subprocess.run([sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGHUP) is signal.SIG_DFL)"],
                     capture_output=True, text=True, check=True).stdout.strip())
"""


def test_a_suite_run_under_nohup_starts_its_services_with_sighup_at_its_default() -> None:
    """`nohup pytest …`: the services the suite starts inherited SIGHUP ignored and kept ignoring it,
    so `test_sighup_stops_each_service_as_sigterm_does` failed (each ran on to its SIGKILL). Found in
    review by running that test under `nohup`."""
    done = subprocess.run([sys.executable, "-c", CHILD_HUP], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    assert (done.returncode, done.stdout.strip()) == (0, "True"), done.stderr
