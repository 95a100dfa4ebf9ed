"""A run record (`keys.run_record`) as a plain JSON-able dict, for the runs API and `iop runs show`.

Pure: it takes the HGETALL reply and never touches Redis. The request body (msgpack)
is left out; every other field is a plain string in Redis and typed here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from common.wire import TERMINAL_STATES, RunField

#: Timestamps of a run's life, ms since the epoch (Redis server clock), in order.
TIMESTAMPS: tuple[RunField, ...] = (RunField.CREATED_MS, RunField.DISPATCHED_MS, RunField.STARTED_MS,
                                    RunField.FINISHED_MS)


def _text(raw: Mapping[bytes, bytes], field: RunField) -> str | None:
    value = raw.get(field.value.encode())
    return value.decode(errors="replace") if value is not None else None


def _int(raw: Mapping[bytes, bytes], field: RunField) -> int | None:
    value = _text(raw, field)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _ids(raw: Mapping[bytes, bytes], field: RunField) -> list[str]:
    """A comma-separated list of provider ids, in order ([] when unset)."""
    return [p for p in (_text(raw, field) or "").split(",") if p]


def run_view(run_id: str, raw: Mapping[bytes, bytes], *, operator: bool = True) -> dict[str, Any]:
    """The record's fields, typed: unset ones are None, `error` is None unless the run failed.
    Where the run ran inside iop (`worker`, host:pid) is for operators only."""
    code = _text(raw, RunField.ERROR_CODE)
    view: dict[str, Any] = {
        "id": run_id,
        "object": "run",
        "state": _text(raw, RunField.STATE),
        "model": _text(raw, RunField.MODEL),
        "kind": _text(raw, RunField.KIND),
        "stream": _text(raw, RunField.STREAM) == "1",
        "key": _text(raw, RunField.KEY),
        "node": _text(raw, RunField.NODE),
        "provider": _text(raw, RunField.PROVIDER),
        "target": _text(raw, RunField.TARGET),
        "worker": _text(raw, RunField.WORKER),
        "attempts": _int(raw, RunField.ATTEMPTS) or 0,
        "unable": _int(raw, RunField.UNABLE) or 0,
        "max_attempts": _int(raw, RunField.MAX_ATTEMPTS),
        "tried": _ids(raw, RunField.TRIED),
        "unable_by": _ids(raw, RunField.UNABLE_BY),
        "elsewhere": _ids(raw, RunField.ELSEWHERE),
        "output": _text(raw, RunField.OUTPUT) == "1",
    }
    view.update({field.value: _int(raw, field) for field in TIMESTAMPS})
    view["error"] = {"code": code, "message": _text(raw, RunField.ERROR_MESSAGE) or ""} if code else None
    if not operator:
        del view["worker"]
    return view


def is_terminal(view: Mapping[str, Any]) -> bool:
    return view.get("state") in {s.value for s in TERMINAL_STATES}

