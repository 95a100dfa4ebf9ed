"""Log context of a run: every log line about a run carries its run id and model.

Pass `extra=run_fields(run_id, model_id)` to a logging call. The formatters of
`common.lifecycle` then print the fields as `run=… model=…` after the message (text) or
as keys of the JSON object (`IOP_LOG_FORMAT=json`).
"""

from __future__ import annotations

import logging

#: Context fields a log record may carry, in the order the text format prints them.
FIELDS: tuple[str, ...] = ("run", "model", "key", "provider", "node")


def run_fields(run_id: str, model_id: str | None, **more: str) -> dict[str, str]:
    """`extra` for a log call about one run; `more` may add its API key's name, provider or node."""
    fields = {"run": run_id, "model": model_id or "-"}
    fields.update({k: v for k, v in more.items() if k in FIELDS})
    return fields


def context_of(record: logging.LogRecord) -> dict[str, str]:
    """The context fields a record carries, in `FIELDS` order."""
    return {name: str(getattr(record, name)) for name in FIELDS if hasattr(record, name)}


def context_text(record: logging.LogRecord) -> str:
    """` run=… model=…` for the text format, or "" for a line about no run."""
    return "".join(f" {k}={v}" for k, v in context_of(record).items())
