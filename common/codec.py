"""msgpack codecs for request bodies, event payloads and arq job payloads."""

from __future__ import annotations

from typing import Any

import msgpack


def _default(obj: Any) -> Any:
    # arq serialises exceptions into job results; msgpack cannot, so send their text.
    if isinstance(obj, BaseException):
        return f"{type(obj).__name__}: {obj}"
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    raise TypeError(f"cannot serialise {type(obj).__name__}")


def pack(obj: Any) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True, default=_default)
    return data


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def event_fields(event_type: str, data: dict[str, Any]) -> dict[str, bytes | str]:
    """The fields of one event stream entry."""
    return {"type": event_type, "data": pack(data)}


def decode_event(entry_id: bytes | str, fields: dict[bytes, bytes]) -> tuple[str, str, dict[str, Any]]:
    """(entry id, event type, data) of one event stream entry."""
    eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    etype = fields.get(b"type", b"").decode()
    raw = fields.get(b"data")
    data = unpack(raw) if raw else {}
    if not isinstance(data, dict):
        data = {}
    return eid, etype, data
