"""Reading a server-sent event stream in tests: one message at a time, fields parsed."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import aiohttp


@dataclass(frozen=True)
class Message:
    id: str | None
    event: str | None
    data: Any


def parse(block: str) -> Message:
    fields: dict[str, list[str]] = {}
    for line in block.splitlines():
        if line and not line.startswith(":"):
            name, _, value = line.partition(":")
            fields.setdefault(name, []).append(value.removeprefix(" "))
    data = "\n".join(fields.get("data", []))
    return Message(fields.get("id", [None])[-1], fields.get("event", [None])[-1],
                   json.loads(data) if data else None)


async def next_message(resp: aiohttp.ClientResponse) -> Message | None:
    """The next message, or None at the end of the stream."""
    lines: list[str] = []
    while True:
        raw = await resp.content.readline()
        if not raw:
            return parse("\n".join(lines)) if lines else None
        line = raw.decode().rstrip("\r\n")
        if line == "":
            if lines:
                return parse("\n".join(lines))
            continue
        lines.append(line)


async def read_all(resp: aiohttp.ClientResponse) -> list[Message]:
    out = []
    while (msg := await next_message(resp)) is not None:
        out.append(msg)
    return out
