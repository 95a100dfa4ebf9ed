"""The compat layer for legacy configs (S05): pure conversion into the pool shape (D01).

The legacy shape routed each model to one adapter instance and one target:

    openai:
      model_routes:
        - {model: "qwen3.6:35b", adapter: vllm-a, target: "Qwen/Qwen3.6-35B-A3B"}
    nodes:
      - id: gpu-1
        adapters:
          - {id: vllm-a, type: vllm, endpoint: "http://gpu-1:8000", capacity: 4}

`migrate` turns it into the new shape that routes exactly the same way: every route becomes
a `models[]` entry with one provider (`{id: model, providers: {adapter: target}}`), every
adapter instance a `nodes[].providers[]` entry (`endpoint` becomes `base_url`; its `models`
are the targets routed to it). Any other provider field (`api_key_env`, `command`,
timeouts, `category`, `lifecycle_capabilities`) is carried over as it is.

Both shapes may be mixed in one file as long as they do not define the same thing twice:
a model id in both `models[]` and `openai.model_routes[]`, or a provider id in both
`nodes[].providers[]` and `nodes[].adapters[]`, is an error that names both places. Faults
found later by the new-shape validation are reported at their legacy paths
(`Migration.legacy_path`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from common.shown import shown

ROUTE_FIELDS = ("model", "adapter", "target")
#: Fields of the new provider shape that a legacy adapter instance may not carry.
ADAPTER_FORBIDDEN = {
    "base_url": "unknown field (a legacy adapter names its URL `endpoint`)",
    "models": "unknown field (a legacy adapter serves the targets its routes name)",
}


def is_legacy(data: Mapping[str, Any]) -> bool:
    """Whether the mapping uses any part of the legacy shape."""
    nodes = data.get("nodes")
    return "openai" in data or (
        isinstance(nodes, list) and any(isinstance(n, Mapping) and "adapters" in n for n in nodes)
    )


@dataclass
class Migration:
    """The new-shape mapping, the legacy faults found on the way, and where things came from."""

    data: dict[str, Any]
    errors: list[str] = field(default_factory=list)
    #: what the conversion left out on purpose (an adapter no route uses), for `iop config migrate`
    notes: list[str] = field(default_factory=list)
    #: new path -> legacy path, for reporting later faults where the operator wrote them
    origins: dict[str, str] = field(default_factory=dict)
    _heads: tuple[int, frozenset[str]] | None = field(default=None, init=False, repr=False, compare=False)

    def legacy_path(self, error: str) -> str:
        """Rewrite every new-shape path in an error message into its legacy path: from left to right,
        the longest that starts where no word, `.` or `]` goes before it and ends the text or before
        one of `.[:)` or white space. (Looked up, not matched as a pattern of every path: that was
        compiled for each error, 12 s of CPU for 1,000 adapters of capacity 0, 213 s for 4,000.)"""
        if not self.origins:
            return error
        if self._heads is None:  # (the paths' first characters; asked once all are known)
            head = min(6, *(len(p) for p in self.origins))
            self._heads = head, frozenset(p[:head] for p in self.origins)
        head, heads = self._heads
        ends = [i for i, ch in enumerate(error) if ch in ".[:)" or ch.isspace()] + [len(error)]
        out, i = [], 0
        while i < len(error):
            if error[i:i + head] in heads and (i == 0 or not (error[i - 1].isalnum() or error[i - 1] in "_.]")):
                end = next((e for e in reversed(ends) if e > i and error[i:e] in self.origins), None)
                if end is not None:
                    out.append(self.origins[error[i:end]])
                    i = end
                    continue
            out.append(error[i])
            i += 1
        return "".join(out)


#: the longest target, a served name (`common.config.MAX_SERVED_CHARS`, which this module cannot import)
MAX_TARGET_CHARS = 1024


def _part(key: Any) -> str:
    """A mapping's key as a part of a path, as `common.config.path_part` writes it: text as it is when
    short and printable, else quoted, escaped and cut."""
    if isinstance(key, str) and key and len(key) <= 80 and key.isprintable():
        return key
    return shown(key)


def _str(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


def _routes(data: Mapping[str, Any], mig: Migration) -> list[tuple[int, Mapping[str, Any]]]:
    openai = data.get("openai")
    if openai is None:
        return []
    if not isinstance(openai, Mapping):
        mig.errors.append("openai: expected a mapping with `model_routes`")
        return []
    mig.errors += [f"openai.{_part(k)}: unknown field" for k in openai if k != "model_routes"]
    routes = openai.get("model_routes")
    if not isinstance(routes, list) or not routes:
        mig.errors.append("openai.model_routes: expected a non-empty list of routes")
        return []
    valid = []
    for r, route in enumerate(routes):
        path = f"openai.model_routes[{r}]"
        if not isinstance(route, Mapping):
            mig.errors.append(f"{path}: expected a mapping with {', '.join(ROUTE_FIELDS)}")
            continue
        faults = [f"{path}.{_part(k)}: unknown field" for k in route if k not in ROUTE_FIELDS]
        faults += [f"{path}.{k}: required, a non-empty string" for k in ROUTE_FIELDS if not _str(route.get(k))]
        target = route.get("target")
        if isinstance(target, str) and len(target) > MAX_TARGET_CHARS:  # (said here: else at two paths, neither it)
            faults.append(f"{path}.target: String should have at most {MAX_TARGET_CHARS} characters")
        mig.errors += faults
        if not faults:
            valid.append((r, route))
    return valid


def _convert_models(data: Mapping[str, Any], routes: list[tuple[int, Mapping[str, Any]]],
                    mig: Migration) -> Any:
    raw = data.get("models", [])
    if not isinstance(raw, list):
        return raw  # the new-shape validation reports it
    models = list(raw)
    # (an id that is not text is the schema's to report: a list there is no key of a dict)
    defined = {m["id"]: i for i, m in enumerate(models) if isinstance(m, Mapping) and isinstance(m.get("id"), str)}
    first_route: dict[str, int] = {}
    for r, route in routes:
        path = f"openai.model_routes[{r}]"
        model_id = route["model"]
        if model_id in defined:
            mig.errors.append(f"{path}.model: model {shown(model_id)} is also defined at models[{defined[model_id]}]; "
                              "define a model in one shape only")
            continue
        if model_id in first_route:
            mig.errors.append(f"{path}.model: duplicate model id {shown(model_id)} (first at "
                              f"openai.model_routes[{first_route[model_id]}].model); a legacy route has one "
                              "adapter, list several providers under `models[]` instead")
            continue
        first_route[model_id] = r
        n = len(models)
        models.append({"id": model_id, "providers": {route["adapter"]: route["target"]}})
        mig.origins[f"models[{n}].id"] = f"{path}.model"
        mig.origins[f"models[{n}].providers.{_part(route['adapter'])}"] = f"{path}.adapter"
        mig.origins[f"models[{n}]"] = path
    return models


def _served_by(models: list[Any]) -> dict[str, list[str]]:
    """provider id -> served names that models[] send to it, in order, without repeats."""
    served: dict[str, list[str]] = {}
    for m in models:
        providers = m.get("providers") if isinstance(m, Mapping) else None
        if isinstance(providers, Mapping):
            for pid, name in providers.items():
                names = served.setdefault(str(pid), [])
                if isinstance(name, str) and name not in names:
                    names.append(name)
    return served


def _provider_places(nodes: list[Any]) -> dict[str, str]:
    places: dict[str, str] = {}
    for i, node in enumerate(nodes):
        providers = node.get("providers") if isinstance(node, Mapping) else None
        for j, p in enumerate(providers if isinstance(providers, list) else []):
            if isinstance(p, Mapping) and "id" in p:
                places.setdefault(str(p["id"]), f"nodes[{i}].providers[{j}]")
    return places


def _convert_adapter(adapter: Mapping[str, Any], path: str, new_path: str, served: dict[str, list[str]],
                     mig: Migration) -> dict[str, Any] | None:
    """The provider for a legacy adapter instance; None for one that no route uses (it took no
    runs before either, and a provider must serve at least one model)."""
    names = served.get(str(adapter.get("id")), [])
    if not names:
        mig.notes.append(f"{path}: adapter {shown(adapter.get('id'))} serves no route; left out")
        return None
    provider: dict[str, Any] = {}
    for key, value in adapter.items():
        if key in ADAPTER_FORBIDDEN:
            mig.errors.append(f"{path}.{key}: {ADAPTER_FORBIDDEN[key]}")
        elif key == "endpoint":
            provider["base_url"] = value
        else:
            provider[key] = value
    mig.origins[f"{new_path}.base_url"] = f"{path}.endpoint"
    provider["models"] = names
    mig.origins[f"{new_path}.models"] = f"{path} (the targets routed to it)"
    mig.origins[new_path] = path
    return provider


def _convert_nodes(data: Mapping[str, Any], served: dict[str, list[str]], mig: Migration) -> Any:
    nodes = data.get("nodes")
    if not isinstance(nodes, list):
        return nodes
    places = _provider_places(nodes)
    out = []
    for i, node in enumerate(nodes):
        if not isinstance(node, Mapping) or "adapters" not in node:
            out.append(node)
            continue
        new_node = {k: v for k, v in node.items() if k != "adapters"}
        raw = node.get("providers", [])
        if not isinstance(raw, list):
            mig.errors.append(f"nodes[{i}].providers: expected a list")
            continue
        providers = list(raw)
        adapters = node["adapters"]
        if not isinstance(adapters, list):
            mig.errors.append(f"nodes[{i}].adapters: expected a list of adapter instances")
            adapters = []
        for j, adapter in enumerate(adapters):
            path = f"nodes[{i}].adapters[{j}]"
            if not isinstance(adapter, Mapping):
                mig.errors.append(f"{path}: expected a mapping with id, type, endpoint, capacity")
                continue
            other = places.get(str(adapter.get("id")))
            if other is not None:
                mig.errors.append(f"{path}.id: provider id {shown(adapter.get('id'))} is also defined at {other}; "
                                  "define a provider in one shape only")
                continue
            converted = _convert_adapter(adapter, path, f"nodes[{i}].providers[{len(providers)}]", served, mig)
            if converted is not None:
                providers.append(converted)
        new_node["providers"] = providers
        out.append(new_node)
    return out


def migrate(data: Mapping[str, Any]) -> Migration:
    """Convert a (partly) legacy mapping into the new shape. Pure; never raises."""
    mig = Migration(data={})
    routes = _routes(data, mig)
    models = _convert_models(data, routes, mig)
    nodes = _convert_nodes(data, _served_by(models) if isinstance(models, list) else {}, mig)
    mig.data = {"models": models}
    if "nodes" in data:
        mig.data["nodes"] = nodes
    mig.data.update({k: v for k, v in data.items() if k not in ("openai", "models", "nodes")})
    return mig
