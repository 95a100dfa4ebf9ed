"""`common.codec.pack`: one packer kept per thread gives what `msgpack.packb` gives, also after a value
it could not pack, and does not keep a buffer grown for a big value."""

from __future__ import annotations

import threading
from typing import Any

import msgpack
import pytest

from common import codec
from common.codec import KEEP_PACKER_BYTES, Unpackable, pack, unpack

VALUES: list[Any] = [
    {"chunks": [{"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"content": "tok "}}]}], "n": 1, "a": 1},
    {"b": b"\x00\xff", "s": {1, 2}, "t": (1, "x"), "e": ValueError("no"), "big": 2**64 - 1, "neg": -2**63},
    "", 0, None, [], {},
]


def plain(value: Any) -> bytes:
    data: bytes = msgpack.packb(value, use_bin_type=True, default=codec._default)
    return data


@pytest.mark.parametrize("bad", [{"a": "x" * 5000, "b": 2**70}, {"a": "y" * 300, "b": "\ud800"},
                                 {"a": "z" * 300, "b": object()}])
def test_a_value_that_cannot_be_packed_leaves_the_packer_as_it_was(bad: dict[str, Any]) -> None:
    for value in VALUES:
        assert pack(value) == plain(value)
    with pytest.raises((Unpackable, TypeError)):
        pack(bad)
    for value in VALUES:
        assert pack(value) == plain(value)
        assert unpack(pack(value)) == unpack(plain(value))


def test_a_packer_that_packed_a_big_value_is_let_go() -> None:
    pack({})
    kept = codec._packers.packer
    big = {"s": "x" * (KEEP_PACKER_BYTES + 1)}
    assert pack(big) == plain(big)
    assert codec._packers.packer is not kept
    kept = codec._packers.packer
    assert pack(VALUES[0]) == plain(VALUES[0])
    assert codec._packers.packer is kept  # (a small value keeps it)


def test_each_thread_packs_with_its_own_packer() -> None:
    values = [{"i": i, "s": "v" * i, "set": {i}} for i in range(200)]
    failures: list[int] = []

    def packing() -> None:
        for _ in range(20):
            for i, value in enumerate(values):
                if pack(value) != plain(value):
                    failures.append(i)

    threads = [threading.Thread(target=packing) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
