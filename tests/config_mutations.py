"""Mutations of a config for `tests/test_config_fuzz.py`: each takes the parsed example (a fresh copy)
and a seeded `random.Random`, and returns the mutated mapping (structural mutations) or YAML text
(textual ones: tabs, a BOM, anchors, repeated keys)."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from typing import Any

#: values of every wrong kind a careless hand or a fuzzer puts anywhere
HOSTILE: list[Any] = [
    None, "", " ", [], {}, [None], {"": None}, 0, -1, 1.5, 4.0, -0.0, float("inf"), float("nan"), True, False,
    2**63, -(2**63) - 1, 10**30, "4", "1e3", "x" * 5000, "a\nb", "a\x00b", "\u200b", "\u202e", "é", "Ｑwen",
    "\t", "a b", "a,b", "http://", "ftp://x", "http://u:p@h:1/", "http://h:99999", "http://h/?q=1", "//h",
    "h:80", ["a", "a"], {"k": {"k": {"k": []}}}, [[[[[]]]]], {1: 2}, {None: 1}, {True: "x"}, {1.5: "x"},
    b"bytes", 10**40,
]

#: fields an operator might misspell (and typos of them)
TYPOS = ["capcity", "base-url", "baseurl", "model", "provider", "api_key", "maxqueue", "queue_timeout", "Id",
         "timeout_ms", "runtim", "aliasses", "max_token", "displayname", "nodes ", " id", "\u200bid"]


def paths(node: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a parsed config: each mapping's keys and each list's items."""
    found = [at]
    if isinstance(node, dict):
        for key, value in node.items():
            found += paths(value, (*at, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += paths(value, (*at, i))
    return found


def get(node: Any, at: tuple[Any, ...]) -> Any:
    for part in at:
        node = node[part]
    return node


def _set(data: Any, at: tuple[Any, ...], value: Any) -> Any:
    if not at:
        return value
    get(data, at[:-1])[at[-1]] = value
    return data


def replace_value(data: dict[str, Any], rng: random.Random) -> Any:
    at = rng.choice(paths(data))
    return _set(data, at, copy.deepcopy(rng.choice(HOSTILE)))


def drop(data: dict[str, Any], rng: random.Random) -> Any:
    places = [p for p in paths(data) if p]
    at = rng.choice(places)
    parent = get(data, at[:-1])
    del parent[at[-1]]
    return data


def unknown_key(data: dict[str, Any], rng: random.Random) -> Any:
    maps = [p for p in paths(data) if isinstance(get(data, p), dict)]
    get(data, rng.choice(maps))[rng.choice(TYPOS)] = rng.choice([1, "x", None, True])
    return data


def rename_key(data: dict[str, Any], rng: random.Random) -> Any:
    """A key renamed as a typo would: `capacity` -> `capcity`, a provider id in a model's map to another."""
    maps = [p for p in paths(data) if isinstance(get(data, p), dict) and get(data, p)]
    target = get(data, rng.choice(maps))
    old = rng.choice(list(target))
    new = rng.choice([*TYPOS, "nope", "VLLM-A", "vllm-a\u200b", "vllm a", 1, None, True, "", "a\nb", "\x1b[2J",
                      "k" * 5000, "a: b", "a.b", "a[0]"])
    target[new] = target.pop(old)
    return data


def duplicate_item(data: dict[str, Any], rng: random.Random) -> Any:
    """A list's item twice: duplicate models, nodes, providers, served names, keys."""
    lists = [p for p in paths(data) if isinstance(get(data, p), list) and get(data, p)]
    items = get(data, rng.choice(lists))
    items.append(copy.deepcopy(rng.choice(items)))
    return data


def case_twin(data: dict[str, Any], rng: random.Random) -> Any:
    """An id changed to differ from another only in case or Unicode form, or to hold a control character."""
    ids = [p for p in paths(data) if p and p[-1] == "id" and isinstance(get(data, p), str)]
    at = rng.choice(ids)
    value = get(data, at)
    changed = rng.choice([value.upper(), value + "\u200b", "\u0000" + value, value.replace("a", "\u0430"),
                          value + "\u202e", value + "\x1b[2J", "\ufeff" + value, value * 100])
    return _set(data, at, changed)


def provider_twice(data: dict[str, Any], rng: random.Random) -> Any:
    """A provider listed under two nodes."""
    nodes = data.get("nodes") or []
    if len(nodes) >= 2:
        nodes[1]["providers"].append(copy.deepcopy(rng.choice(nodes[0]["providers"])))
    return data


def unknown_provider(data: dict[str, Any], rng: random.Random) -> Any:
    """A model names a provider no node defines, or a served name its provider lacks."""
    model = rng.choice(data["models"])
    if rng.random() < 0.5:
        model["providers"][rng.choice(["ghost", "VLLM-A", "vllm-a ", 7])] = "x"
    else:
        provider = rng.choice(list(model["providers"]))
        model["providers"][provider] = rng.choice(["not-served", "", None, 1, ["a"]])
    return data


def bad_url(data: dict[str, Any], rng: random.Random) -> Any:
    provider = rng.choice([p for n in data["nodes"] for p in n["providers"]])
    provider["base_url"] = rng.choice([
        "127.0.0.1:8000", "gpu-1:8000", "http://", "http:///v1", "http://u:p@h:1", "http://h:1/v1?key=x",
        "http://h:1/#frag", "ftp://h", "http://h:port", "http://h:-1", "http://[::1", "http:// h", "HTTP://H:1",
        "http://h:1/a/b/c/", "javascript:alert(1)", "file:///etc/passwd", "http://\u0000h", "http://h\u200b:1",
        "http://h:1/" + "a" * 10_000, "https://" + "x." * 200 + "com"])
    return data


def huge_number(data: dict[str, Any], rng: random.Random) -> Any:
    numbers = [p for p in paths(data) if type(get(data, p)) is int]
    numbers += [("runtime",), ("queue",)]
    at = rng.choice(numbers)
    value = rng.choice([-1, 0, 2**31, 2**63, 10**19, 10**100, -(10**100), 1.0, 0.5, True, "8", float("inf")])
    if at in (("runtime",), ("queue",)):
        section = data.setdefault(at[0], {})
        if not isinstance(section, dict):
            return data
        field = rng.choice(["max_queue", "queue_timeout_ms", "execution_timeout_ms", "max_attempts"] if at == ("queue",)
                           else ["heartbeat_interval_ms", "heartbeat_ttl_ms", "run_ttl_s", "max_body_bytes",
                                 "history_interval_ms", "history_retention_s", "max_json_depth", "stream_batch_ms"])
        section[field] = value
        return data
    return _set(data, at, value)


STRUCTURAL: list[Callable[[dict[str, Any], random.Random], Any]] = [
    replace_value, drop, unknown_key, rename_key, duplicate_item, case_twin, provider_twice, unknown_provider,
    bad_url, huge_number]


def _alias_bomb(levels: int) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def _map_bomb(levels: int) -> str:
    """Mappings of aliases of mappings: 10**levels entries once expanded."""
    lines = ["b0: &b0 {k0: 1, k1: 1, k2: 1, k3: 1, k4: 1, k5: 1, k6: 1, k7: 1, k8: 1, k9: 1}"]
    lines += [f"b{i}: &b{i} {{{', '.join(f'k{j}: *b{i - 1}' for j in range(10))}}}" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def textual(text: str, rng: random.Random) -> str | bytes:
    """A mutation of the YAML text itself."""
    lines = text.splitlines()
    choice = rng.randrange(16)
    if choice == 0:  # a tab for indentation
        i = rng.randrange(len(lines))
        lines[i] = lines[i].replace("  ", "\t", 1)
    elif choice == 1:  # a BOM
        return "\ufeff" + text
    elif choice == 2:  # a line given twice (a repeated key)
        i = rng.randrange(len(lines))
        lines.insert(i, lines[i])
    elif choice == 3:  # a line dropped
        del lines[rng.randrange(len(lines))]
    elif choice == 4:  # an alias bomb in a place a string or list or mapping belongs
        bomb = rng.choice([_alias_bomb(9), _map_bomb(8)])
        name = "*a8" if bomb.startswith("a0") else "*b7"
        i = rng.randrange(len(lines))
        if ":" in lines[i]:
            head = lines[i].split(":", 1)[0]
            lines[i] = f"{head}: {name}"
        return bomb + "\n".join(lines) + "\n"
    elif choice == 5:  # anchors and merge keys
        return ("base: &base {type: vllm, capacity: 1}\n" + text.replace("type: vllm", "<<: *base"))
    elif choice == 6:  # a control character
        i = rng.randrange(len(text))
        return text[:i] + rng.choice(["\x00", "\x07", "\x1b", "\x7f", "\x85", "\u2028", "\ufffe"]) + text[i:]
    elif choice == 7:  # not UTF-8
        data = text.encode()
        i = rng.randrange(len(data))
        return data[:i] + rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80"]) + data[i:]
    elif choice == 8:  # truncated
        return text[:rng.randrange(len(text))]
    elif choice == 9:  # a top level that is no mapping
        return rng.choice(["", "---\n", "- a\n- b\n", "42\n", "'x'\n", "null\n", "!!binary aGk=\n",
                           "--- 1\n--- 2\n", "~\n", "[\n", "{a: [}\n"])
    elif choice == 10:  # deep nesting
        depth = rng.choice([100, 999, 1001, 5000])
        return "models: " + "[" * depth + "]" * depth + "\n" + "\n".join(lines[1:]) + "\n"
    elif choice == 11:  # explicit tags
        tag = rng.choice(["!!float x", "!!int 1.5", "!!bool maybe", "!!timestamp soon", "!!python/object:os.system x",
                          "!!set {a, b}", "!!omap [a: 1]", "!!binary '@@'", "!!str 4", "!!map [1]", "!custom x"])
        i = rng.randrange(len(lines))
        if ": " in lines[i]:
            lines[i] = lines[i].split(": ", 1)[0] + ": " + tag
    elif choice == 12:  # a complex key, a null key
        return text + rng.choice(["? [a, b]\n: 1\n", "~: 1\n", "? {a: 1}\n: 2\n", "1: 2\n", "true: x\n"])
    elif choice == 13:  # CRLF line ends and trailing white space
        return text.replace("\n", "\r\n").replace(": ", ":  ") + "   \t\n"
    elif choice == 14:  # many documents
        return text + "---\n" + text
    else:  # windows-1252 in the middle
        return text.replace("Qwen", "Qwen\u00e9\u00ff")
    return "\n".join(lines) + "\n"
