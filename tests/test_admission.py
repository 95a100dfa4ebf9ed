"""gateway.admission: which connections are kept at the limit, with stand-in connections."""

from __future__ import annotations

import logging

import pytest

from gateway import admission
from gateway.admission import TRIAGE_SLOTS, ConnectionGuard, ConnectionLimits, Slot
from tests.conftest import async_wait_until


class Conn:
    def __init__(self, name: str) -> None:
        self.name = name
        self.evicted = False

    def evict(self) -> None:
        self.evicted = True

    def __repr__(self) -> str:
        return self.name


def guard(max_connections: int) -> ConnectionGuard:
    return ConnectionGuard(ConnectionLimits(10.0, 60.0, 75.0, max_connections))


def connect(g: ConnectionGuard, name: str, *, idle: bool) -> tuple[Conn, Slot]:
    conn = Conn(name)
    slot = g.admit()
    if idle:
        g.idle(conn, slot)
    return conn, slot


async def test_at_the_limit_the_longest_idle_connection_gives_its_place_up() -> None:
    g = guard(3)
    a, b, c = (connect(g, n, idle=True)[0] for n in "abc")
    g.busy(a)  # a's next request arrives: it is not idle any more
    d, slot = connect(g, "d", idle=True)
    assert slot is Slot.SERVED and (a.evicted, b.evicted, c.evicted) == (False, True, False)
    assert g.served == 3
    g.idle(a, Slot.SERVED)  # a is idle again, now the most recently
    e, slot = connect(g, "e", idle=False)
    assert slot is Slot.SERVED and c.evicted and not a.evicted and not d.evicted


async def test_when_every_served_connection_is_busy_new_ones_go_to_triage_then_get_503() -> None:
    g = guard(2)
    for n in "ab":
        connect(g, n, idle=False)
    triaged = [connect(g, f"t{i}", idle=False) for i in range(TRIAGE_SLOTS)]
    assert {slot for _, slot in triaged} == {Slot.TRIAGE} and g.triaged == TRIAGE_SLOTS
    assert connect(g, "late", idle=False)[1] is Slot.NONE


async def test_a_silent_triage_connection_gives_its_place_up_to_a_newer_one() -> None:
    g = guard(1)
    connect(g, "busy", idle=False)
    silent = [connect(g, f"s{i}", idle=True)[0] for i in range(TRIAGE_SLOTS)]
    probe, slot = connect(g, "probe", idle=False)
    assert slot is Slot.TRIAGE and silent[0].evicted and not any(s.evicted for s in silent[1:])
    assert g.triaged == TRIAGE_SLOTS


async def test_released_slots_are_free_again_and_a_released_connection_is_never_evicted() -> None:
    g = guard(1)
    a, slot = connect(g, "a", idle=True)
    g.release(a, slot)
    assert g.served == 0
    b, slot = connect(g, "b", idle=False)
    assert slot is Slot.SERVED and not a.evicted
    c, slot = connect(g, "c", idle=False)
    assert slot is Slot.TRIAGE
    g.release(c, slot)
    assert g.triaged == 0


async def test_what_the_limit_did_is_logged_at_once_then_summed_up(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission, "LOG_EVERY_S", 0.2)
    caplog.set_level(logging.WARNING, "iop.gateway")
    g = guard(1)
    connect(g, "busy", idle=False)
    for i in range(TRIAGE_SLOTS):
        connect(g, f"t{i}", idle=False)
    for i in range(3):
        connect(g, f"refused{i}", idle=False)
    assert [r.getMessage() for r in caplog.records] == [
        "connection limit reached (runtime.max_connections = 1): since the last report 1 connections answered "
        "503, 0 idle connections closed to make room; 1 served, 64 in triage"]

    async def summed() -> bool:
        return len(caplog.records) == 2

    await async_wait_until(summed, timeout=10, what="the summary of the next refusals")
    assert "since the last report 2 connections answered 503" in caplog.records[1].getMessage()
