"""The base of every config model: unknown fields and loose types are errors."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    # strict: `capacity: "4"`, `4.0` or `true` are errors, not silently 4 or 1
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
