"""Validate gateway answers against OpenAI's own OpenAPI description (../shared/openai-openapi).

The file says OpenAPI 3.1 but still uses the 3.0 keyword `nullable: true`; each use is
rewritten to `anyOf: [schema, {"type": "null"}]` before a JSON Schema 2020-12 validator
sees it. Tests skip with a reason when the file is absent.
"""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path
from typing import Any

import pytest

#: beside the checkout (`../shared/openai-openapi/`), or where IOP_OPENAPI_SPEC says (a clone elsewhere)
SPEC_PATH = Path(os.environ.get("IOP_OPENAPI_SPEC") or
                 Path(__file__).resolve().parents[2] / "shared" / "openai-openapi" / "openapi.json")


def _denull(node: Any) -> Any:
    if isinstance(node, list):
        return [_denull(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _denull(v) for k, v in node.items() if k != "nullable"}
    if node.get("nullable") is True:
        return {"anyOf": [out, {"type": "null"}]}
    return out


@cache
def _registry() -> Any:
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT202012

    spec = _denull(json.loads(SPEC_PATH.read_text()))
    resource = Resource.from_contents(spec, default_specification=DRAFT202012)
    return Registry().with_resource("openapi.json", resource)


def validate(schema_name: str, instance: Any) -> None:
    """Raise jsonschema.ValidationError unless `instance` matches components.schemas[schema_name]."""
    if not SPEC_PATH.exists():
        if os.environ.get("IOP_REQUIRE_OPENAPI") == "1":
            raise AssertionError(f"OpenAI OpenAPI description not found at {SPEC_PATH} (IOP_OPENAPI_SPEC names "
                                 "another place)")
        pytest.skip(f"OpenAI OpenAPI description not found at {SPEC_PATH} (IOP_OPENAPI_SPEC names another place)")
    from jsonschema import Draft202012Validator

    schema = {"$ref": f"openapi.json#/components/schemas/{schema_name}"}
    Draft202012Validator(schema, registry=_registry()).validate(instance)
