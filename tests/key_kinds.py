"""What a key table's type cell says of a key: its Redis type, and whether it has a TTL."""

from __future__ import annotations

import re
from typing import Literal

Ttl = Literal["always", "when given", "never"]

#: the table's words for a type -> what Redis's TYPE answers (None: not a key: a group, a channel, none)
REDIS_TYPES: dict[str, str | None] = {
    "sorted set": "zset", "string": "string", "hash": "hash", "stream": "stream", "list": "list", "set": "set",
    "consumer group": None, "pub/sub channel": None, "none: never written": None,
}
_KIND = re.compile(r"^(?P<type>" + "|".join(sorted(map(re.escape, REDIS_TYPES), key=len, reverse=True)) +
                   r")(?P<ttl> \+ TTL| \(\+ TTL)?")


def kind_of(cell: str) -> tuple[str, Ttl]:
    """(`sorted set`, `always`) of `sorted set + TTL (…)`; (`string`, `when given`) of `string (+ TTL …)`."""
    found = _KIND.match(cell.strip())
    assert found is not None, f"no type in {cell!r}"
    ttl = found.group("ttl")
    return found.group("type"), "never" if ttl is None else "always" if ttl == " + TTL" else "when given"
