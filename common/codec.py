"""msgpack codecs for request bodies, event payloads and arq job payloads."""

from __future__ import annotations

import threading
from typing import Any

import msgpack

#: How deep msgpack nests at most (its packer's own limit).
MAX_DEPTH = 1024


class Unpackable(ValueError):
    """A value msgpack cannot hold: an integer outside [-2**63, 2**64), a string that is not
    valid Unicode (a lone UTF-16 surrogate), data nested deeper than `MAX_DEPTH`. Its message is
    one plain phrase naming what, with no repr of the value ("an integer beyond 64 bits")."""


def _default(obj: Any) -> Any:
    # arq serialises exceptions into job results; msgpack cannot, so send their text.
    if isinstance(obj, BaseException):
        return f"{type(obj).__name__}: {obj}"
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    if isinstance(obj, int):  # (msgpack hands over the integers it cannot hold)
        raise Unpackable("an integer beyond 64 bits")
    raise TypeError(f"cannot serialise {type(obj).__name__}")


#: A packer kept for each thread (one packs a value at a time: its `default` may let another thread run
#: mid-way): `msgpack.packb` makes one a call, its buffer with it, ~0.4 us of a ~1 us delta event.
_packers = threading.local()
#: A packer that packed a value longer than this is let go, not kept holding its buffer (which keeps
#: the size of the largest value it packed: a prompt of megabytes); it starts with `PACKER_BUFFER_BYTES`
#: (msgpack's own 256 KiB would be held for good by every thread that packed once).
KEEP_PACKER_BYTES = 64 * 1024
PACKER_BUFFER_BYTES = 16 * 1024


def _packer() -> msgpack.Packer:
    packer = _packers.packer = msgpack.Packer(use_bin_type=True, default=_default, buf_size=PACKER_BUFFER_BYTES)
    return packer


def pack(obj: Any) -> bytes:
    """`obj` as msgpack; `Unpackable` if it holds a value msgpack cannot (TypeError for a type it
    does not know: a bug, not data)."""
    try:
        packer = _packers.packer
    except AttributeError:
        packer = _packer()
    try:
        try:
            data: bytes = packer.pack(obj)
        except BaseException:  # (it reset its buffer; that buffer may have grown as far as the value got)
            _packer()
            raise
        if len(data) > KEEP_PACKER_BYTES:
            _packer()
    except Unpackable:
        raise
    except UnicodeEncodeError as exc:
        raise Unpackable("a string holding a lone UTF-16 surrogate (such as \\ud800), which is not valid "
                         "Unicode text") from exc
    except OverflowError as exc:
        raise Unpackable("an integer beyond 64 bits") from exc
    except ValueError as exc:
        if "recursion" in str(exc):
            raise Unpackable(f"data nested deeper than {MAX_DEPTH} levels") from exc
        raise Unpackable(str(exc).rstrip(".")) from exc
    return data


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def event_fields(event_type: str, data: dict[str, Any]) -> dict[str, bytes | str]:
    """The fields of one event stream entry."""
    return {"type": event_type, "data": pack(data)}


def entry_key(entry_id: str) -> tuple[int, int]:
    """A Redis stream entry id (`ms-seq`, or `ms`) as a pair that sorts as the stream does;
    (0, 0) for text that is not one."""
    ms, _, seq = entry_id.partition("-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        return 0, 0


def decode_event(entry_id: bytes | str, fields: dict[bytes, bytes]) -> tuple[str, str, dict[str, Any]]:
    """(entry id, event type, data) of one event stream entry; data that is not msgpack (an entry
    written by something else than iop's scripts, or msgpack iop never writes: a map keyed by an
    array, which Python cannot hold) is none."""
    eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    etype = fields.get(b"type", b"").decode(errors="replace")
    raw = fields.get(b"data")
    try:
        data = unpack(raw) if raw else {}
    except (ValueError, TypeError, msgpack.UnpackException):  # (not iop's writing: `iop runs show` and the
        # runs API broke on it; TypeError: a map keyed by an array or a map, unhashable)
        data = {}
    # (a delta's `chunks` no list: not iop's writing, and its readers iterate it; what else is not
    # iop's, bytes or keys that are not text, is left to the writers of JSON: not looked for in every event)
    if not isinstance(data, dict) or not isinstance(data.get("chunks", ()), list | tuple):
        data = {}
    return eid, etype, data
