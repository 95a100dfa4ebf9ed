"""`common.failover.FailoverWatch`'s decisions, against sentinels that answer what each test says.
(The whole of it, with real sentinels and a failover asked for, is in `test_sentinel.py`.)"""

from __future__ import annotations

from typing import Any

import pytest

from common.failover import FailoverWatch, _names

OLD, NEW = ("10.0.0.1", 6379), ("10.0.0.2", 6379)


class Sentinel:
    """Answers `SENTINEL MASTER` with what it is told."""

    def __init__(self, address: tuple[str, int], epoch: int, flags: str = "master") -> None:
        self.address, self.epoch, self.flags = address, epoch, flags

    async def sentinel_master(self, master: str) -> dict[str, Any]:
        assert master == "mymaster"
        return {"ip": self.address[0], "port": self.address[1], "config-epoch": self.epoch,
                "is_master": "master" in self.flags, "is_sdown": "s_down" in self.flags,
                "is_odown": "o_down" in self.flags}


class Pool:
    def __init__(self) -> None:
        self.address: tuple[str, int] | None = OLD
        self.switches: list[tuple[str, int]] = []

    async def switch(self, address: tuple[str, int]) -> None:
        self.switches.append(address)
        self.address = address


def watch_of(pool: Pool) -> FailoverWatch:
    return FailoverWatch("mymaster", [], lambda: pool.address, pool.switch)


async def test_a_sentinel_naming_another_primary_moves_the_pool_there_once() -> None:
    pool = Pool()
    watch = watch_of(pool)
    await watch._check(Sentinel(OLD, 0))
    assert pool.switches == []
    ahead = Sentinel(NEW, 1)
    await watch._check(ahead)
    await watch._check(ahead)
    assert pool.switches == [NEW]


async def test_connections_are_moved_even_when_a_new_connection_already_found_the_new_primary() -> None:
    """redis-py moves the pool's `master_address` when a new connection asks the sentinels, and
    closes only the idle connections then: the watch goes by where it sent them, not by that."""
    pool = Pool()
    watch = watch_of(pool)
    await watch._check(Sentinel(OLD, 0))
    pool.address = NEW  # (a connection made just now asked a sentinel that knew)
    await watch._check(Sentinel(NEW, 1))
    assert pool.switches == [NEW]


async def test_a_new_connection_goes_where_the_watch_went_not_where_a_sentinel_behind_says() -> None:
    pool = Pool()
    watch = watch_of(pool)
    assert watch.primary(OLD) == OLD  # (no answer yet: the pool's own)
    await watch._check(Sentinel(OLD, 0))
    await watch._check(Sentinel(NEW, 1))
    assert watch.primary(OLD) == NEW


async def test_a_sentinel_that_has_not_heard_of_the_failover_is_not_followed_back() -> None:
    pool = Pool()
    watch = watch_of(pool)
    await watch._check(Sentinel(NEW, 3))
    assert pool.address == NEW
    await watch._check(Sentinel(OLD, 2))  # behind: its config epoch is older
    assert pool.switches == [NEW]


@pytest.mark.parametrize("flags", ["master,s_down", "master,o_down"])
async def test_a_primary_its_sentinel_thinks_down_is_not_moved_to(flags: str) -> None:
    pool = Pool()
    await watch_of(pool)._check(Sentinel(NEW, 1, flags))
    assert pool.switches == []


async def test_a_pool_that_has_not_connected_yet_has_nothing_to_move() -> None:
    pool = Pool()
    pool.address = None
    await watch_of(pool)._check(Sentinel(NEW, 1))
    assert pool.switches == []


def test_only_announcements_about_its_own_primary_are_heard() -> None:
    assert _names({"data": b"mymaster 10.0.0.1 6379 10.0.0.2 6379"}, "mymaster")
    assert not _names({"data": b"mymaster2 10.0.0.1 6379 10.0.0.2 6379"}, "mymaster")
    assert not _names({"data": 1}, "mymaster")
