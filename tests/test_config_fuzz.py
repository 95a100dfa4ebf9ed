"""A mutation fuzzer over the example configs (a fixed seed, a bounded number of cases): whatever a
careless hand or a fuzzer makes of a config, validation raises `ConfigError` or nothing, each fault
on one line naming a place the input has (or the file, or the top level), and the work it does is
bounded by the input's size: counted (Python calls made), never timed."""

from __future__ import annotations

import copy
import math
import os
import random
import re
import sys
import unicodedata
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import yaml

from common.config import ConfigError, load_config, parse_config
from common.config_yaml import ConfigDumper, ConfigLoader
from tests.config_mutations import STRUCTURAL, textual

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = [ROOT / "examples" / "demo.yaml", ROOT / "examples" / "compose-pool.yaml",
            ROOT / "tests" / "fixtures" / "legacy.yaml"]
#: cases per example and kind: small enough for a few seconds on a slow machine
CASES = int(os.environ.get("IOP_CONFIG_FUZZ_CASES", "150"))
#: another seed explores other cases (a failure names its case, and reproduces with the same seed)
SEED = os.environ.get("IOP_CONFIG_FUZZ_SEED", "")
#: the most Python calls one validation may make: a plain 4 MiB file's work is linear in its size,
#: and these inputs are a few KB (an alias bomb's expansion is what this catches)
MOST_CALLS = 2_000_000


@contextmanager
def counted_calls() -> Iterator[list[int]]:
    """The Python functions called (and C functions called from Python) while the block runs."""
    count = [0]

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            count[0] += 1

    sys.setprofile(profile)
    try:
        yield count
    finally:
        sys.setprofile(None)


def _key_text(key: Any) -> str:
    from common.config import path_part
    return path_part(key)


def resolves(node: Any, rest: str, top: bool = True) -> bool:
    """Whether the path `rest` (`models[2].providers.vllm-a`) names a place of `node`, or a field
    missing from a mapping that is there (`nodes[0].providers[1].capacity: Field required`)."""
    if rest == "":
        return True
    if rest.endswith(" (key)"):
        rest = rest[:-len(" (key)")]
    if isinstance(node, list):
        match = re.match(r"\[(\d+)\]", rest)
        if match is None:
            return False
        return int(match[1]) < len(node) and resolves(node[int(match[1])], rest[match.end():], False)
    if isinstance(node, dict):
        body = rest if top else rest[1:] if rest.startswith(".") else None
        if body is None:
            return False
        for key, value in node.items():
            name = _key_text(key)
            if body.startswith(name) and resolves(value, body[len(name):], False):
                return True
        # a field the mapping lacks (required, or said of it): one name, nothing under it
        return re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", body) is not None
    return False


def check_faults(errors: list[str], data: Any, file: str | None) -> None:
    assert errors, "a ConfigError with no fault"
    for error in errors:
        assert "\n" not in error and "\r" not in error, repr(error)
        assert not any(unicodedata.category(ch) in ("Cc", "Zl", "Zp") for ch in error), repr(error)
        assert "Traceback" not in error and " object at 0x" not in error, error
        assert len(error) < 2_000, error[:300]
        if file is not None and error.startswith(f"{file}: "):
            continue
        if error.startswith("(top level): "):
            continue
        cuts = [m.start() for m in re.finditer(": ", error)]
        assert any(resolves(data, error[:cut]) for cut in cuts), (error, data if len(repr(data)) < 3000 else "…")


def faults_of(check: Callable[[], Any]) -> list[str]:
    """The faults `check` (a validation) raises, none when it passes; its work within `MOST_CALLS`."""
    with counted_calls() as calls:
        try:
            check()
        except ConfigError as exc:
            errors = exc.errors
        else:
            errors = []
    assert calls[0] < MOST_CALLS, calls[0]
    return errors


def validate_data(data: Any) -> None:
    errors = faults_of(lambda: parse_config(data))
    if errors:
        check_faults(errors, data, None)


def validate_file(path: Path) -> None:
    errors = faults_of(lambda: load_config(path))
    if errors:
        try:
            data = yaml.load(path.read_bytes(), Loader=ConfigLoader)  # noqa: S506 (the config's own safe loader)
        except Exception:  # noqa: BLE001 (a file YAML refuses: every fault must name the file)
            data = None
        check_faults(errors, data, str(path))


def _loaded(example: Path) -> Any:
    return yaml.load(example.read_text(), Loader=ConfigLoader)  # noqa: S506


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_the_examples_are_valid(example: Path) -> None:
    load_config(example)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_structural_mutations_are_each_a_config_error_on_one_line_naming_its_place(example: Path) -> None:
    rng = random.Random(f"structural {example.name}{SEED}")
    base = _loaded(example)
    failed: list[str] = []
    for case in range(CASES):
        data = copy.deepcopy(base)
        for _ in range(rng.choice([1, 1, 2, 3])):
            try:
                data = rng.choice(STRUCTURAL)(data, rng) if isinstance(data, dict) else data
            except (LookupError, TypeError, AttributeError, ValueError):  # (a shape an earlier mutation broke)
                pass
        try:
            validate_data(data)
        except AssertionError as exc:
            failed.append(f"case {case}: {str(exc)[:600]}")
    assert not failed, "\n".join(failed[:10])


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_textual_mutations_are_each_a_config_error_on_one_line_naming_its_place(
        example: Path, tmp_path: Path) -> None:
    rng = random.Random(f"textual {example.name}{SEED}")
    text = example.read_text()
    path = tmp_path / "c.yaml"
    failed: list[str] = []
    for case in range(CASES):
        mutated = textual(text, rng)
        if isinstance(mutated, bytes):
            path.write_bytes(mutated)
        else:
            path.write_text(mutated, encoding="utf-8", newline="")
        try:
            validate_file(path)
        except AssertionError as exc:
            failed.append(f"case {case}: {str(exc)[:600]}")
    assert not failed, "\n".join(failed[:10])


def test_mutations_written_as_yaml_and_read_back_are_refused_alike(tmp_path: Path) -> None:
    """A structural mutation, dumped and read as a file: the file's faults are the mapping's."""
    rng = random.Random(f"dumped{SEED}")
    base = _loaded(EXAMPLES[0])
    path = tmp_path / "c.yaml"
    for _ in range(CASES):
        try:
            data = rng.choice(STRUCTURAL)(copy.deepcopy(base), rng)
        except (LookupError, TypeError, AttributeError, ValueError):
            continue
        try:
            text = yaml.dump(data, Dumper=ConfigDumper, allow_unicode=True)
        except yaml.YAMLError:
            continue
        if any(isinstance(v, float) and math.isnan(v) for v in _leaves(data)):
            continue  # (nan is never equal to itself: the two runs' texts differ)
        path.write_text(text, encoding="utf-8")
        validate_file(path)


def _leaves(node: Any) -> Iterator[Any]:
    if isinstance(node, dict):
        for value in node.values():
            yield from _leaves(value)
    elif isinstance(node, list):
        for value in node:
            yield from _leaves(value)
    else:
        yield node


# --- what the fuzzer found, each on its own --------------------------------------------------------

_PROVIDER = "{id: p, type: vllm, base_url: 'http://127.0.0.1:9', capacity: 1, models: [s]}"


def _faults(path: Path, text: str) -> list[str]:
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return info.value.errors


def test_a_field_named_by_no_text_is_named_at_its_place(tmp_path: Path) -> None:
    """`true: x` at the top level was said to be at `[1]`, a list's item the file has not; `models[0]`'s
    at `models[0][1]`."""
    errors = _faults(tmp_path / "c.yaml", f"true: x\nmodels: [{{id: m, providers: {{p: s}}, 7: x}}]\n"
                                          f"nodes: [{{id: n, providers: [{_PROVIDER}]}}]\n")
    assert errors == ["models[0].7 (key): a field's name is text, got 7",
                      "true (key): a field's name is text, got true"]


def test_a_number_as_a_provider_id_in_a_models_map_is_named_as_the_maps_key(tmp_path: Path) -> None:
    """`providers: {1: s}` was said to be at `models[0].providers[1]`, a list's item."""
    errors = _faults(tmp_path / "c.yaml", f"models: [{{id: m, providers: {{1: 2}}}}]\n"
                                          f"nodes: [{{id: n, providers: [{_PROVIDER}]}}]\n")
    assert "models[0].providers.1: Input should be a valid string, got 2 (YAML reads what is written there as a " \
           "number: put it in quotes to make it text)" in errors
    assert not any("providers[1]" in e for e in errors), errors


def test_a_long_served_name_alias_or_id_is_shown_cut_short(tmp_path: Path) -> None:
    """A served name a provider lacks was shown whole: 5,000 characters on one line of every process's log."""
    long = "x" * 5000
    errors = _faults(tmp_path / "c.yaml", f"models: [{{id: m, providers: {{p: {long}}}, aliases: [{long}, {long}]}},\n"
                                          f"  {{id: {long}U, providers: {{p: s}}}},\n"
                                          f"  {{id: {long}u, providers: {{p: s}}}}]\n"
                                          f"nodes: [{{id: n, providers: [{_PROVIDER}]}}]\n"
                                          f"auth: {{keys: [{{name: k, env: K, models: [{long}]}}]}}\n")
    assert errors and all(len(e) < 600 for e in errors), [e[:100] for e in errors if len(e) >= 600]


def test_a_legacy_config_beside_a_model_whose_id_is_a_list_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    """A model's id that is no text beside `openai.model_routes` raised TypeError (unhashable type: 'list')."""
    errors = _faults(tmp_path / "c.yaml", "openai: {model_routes: [{model: m, adapter: a, target: t}]}\n"
                                          "models: [{id: [1], providers: {a: t}}]\n"
                                          "nodes: [{id: n, adapters: [{id: a, type: vllm, endpoint: 'http://h:1', "
                                          "capacity: 1}]}]\n")
    assert "models[0].id: Input should be a valid string, got [1]" in errors


def _laughs(providers: int, models: int) -> str:
    """A model of `providers` providers, named by `models` aliases in `models`: a few KB."""
    served = ", ".join(f"p{i}: s" for i in range(providers))
    return (f"m: &m {{id: m, providers: {{{served}}}}}\nmodels: [{', '.join(['*m'] * models)}]\n"
            f"nodes: [{{id: n, providers: [{_PROVIDER.replace('id: p,', 'id: p0,')}]}}]\n")


def test_aliases_of_a_valid_shape_that_repeat_a_million_values_are_refused_at_once(tmp_path: Path) -> None:
    """Each alias of an alias bomb is refused by its place's type, but a model of 1,000 providers named
    1,000 times in `models` (13 KB) is a list of valid models: validation made 1,000,000 faults (1.7 s
    of CPU; 60 KB, 25 times that), one line each in every process's log. Counted, not timed."""
    path = tmp_path / "c.yaml"
    path.write_text(_laughs(1000, 1000))
    with counted_calls() as calls, pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.errors == [f"{path}: its aliases (*name) repeat more than 100,000 values in all: not a config "
                                 "(a YAML bomb?)"]
    assert calls[0] < 200_000, calls[0]


def test_aliases_that_repeat_fewer_values_are_read_as_ever(tmp_path: Path) -> None:
    """An anchor for settings many providers share is what aliases are for: read as before."""
    errors = _faults(tmp_path / "c.yaml", _laughs(100, 100))  # (10,000 values repeated)
    assert errors[0] == "m: unknown field" and len(errors) > 100


def test_a_legacy_adapter_whose_id_is_an_alias_bomb_is_refused_at_once(tmp_path: Path) -> None:
    """`str()` of an adapter's id that named 10⁸ values hung the legacy conversion."""
    bomb = "\n".join(["b0: &b0 {" + ", ".join(f"k{j}: 1" for j in range(10)) + "}"] +
                     [f"b{i}: &b{i} {{" + ", ".join(f"k{j}: *b{i - 1}" for j in range(10)) + "}"
                      for i in range(1, 8)])
    path = tmp_path / "c.yaml"
    path.write_text(bomb + "\nopenai: {model_routes: [{model: m, adapter: a, target: t}]}\n"
                           "nodes: [{id: n, adapters: [{id: *b7, type: vllm, endpoint: 'http://h:1', capacity: 1}]}]\n")
    with counted_calls() as calls, pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.errors[0].endswith("not a config (a YAML bomb?)") and calls[0] < 200_000


def test_a_ten_megabyte_file_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(EXAMPLES[0].read_text() + "#" * 10_000_000 + "\n")
    with counted_calls() as calls, pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.errors == [f"{path}: over 4 MiB: not a config"] and calls[0] < 1_000


def _traced_steps(data: Any) -> int:
    """The lines of Python run to validate `data` (each loop's turn too): work counted, not timed."""
    steps = [0]

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        steps[0] += 1
        return trace

    sys.settrace(trace)
    try:
        parse_config(data)
    except ConfigError:
        pass
    finally:
        sys.settrace(None)
    return steps[0]


def _same_served_name_as_alias(n: int) -> dict[str, Any]:
    return {"models": [{"id": f"m{i}", "aliases": ["s"], "providers": {"p": "s"}} for i in range(n)],
            "nodes": [{"id": "n", "providers": [{"id": "p", "type": "vllm", "base_url": "http://h:1", "capacity": 1,
                                                 "models": ["s"]}]}]}


def _legacy_adapters_of_capacity_0(n: int) -> dict[str, Any]:
    return {"openai": {"model_routes": [{"model": f"m{i}", "adapter": f"a{i}", "target": "t"} for i in range(n)]},
            "nodes": [{"id": "n", "adapters": [{"id": f"a{i}", "type": "vllm", "endpoint": "http://h:1", "capacity": 0}
                                               for i in range(n)]}]}


@pytest.mark.parametrize("make", [_same_served_name_as_alias, _legacy_adapters_of_capacity_0],
                         ids=["served-name-as-every-models-alias", "legacy-adapters-of-capacity-0"])
def test_validation_work_grows_with_the_config_not_with_its_square(make: Any) -> None:
    """Four times the models or adapters, about four times the work. Each alias that was another model's
    served name listed every such model (20,000 models of one served name: 4e8 steps); each fault of a
    legacy config compiled a pattern of every path (1,000 adapters of capacity 0: 12 s of CPU, 4,000: 213 s)."""
    small, large = _traced_steps(make(100)), _traced_steps(make(400))
    assert large < 5 * small, (small, large)


def test_a_key_that_is_long_or_holds_a_line_break_is_shown_escaped_and_cut_in_a_faults_path(tmp_path: Path) -> None:
    """A key's text went into the path as it was: one holding a line break split a fault in two lines
    (an escape sequence rewrote the operator's screen), one of 200,000 characters made a line as long."""
    with pytest.raises(ConfigError) as info:
        parse_config({"models": [{"id": "m", "providers": {"p": "s"}, "y" * 200_000: 1}], "nodes": []})
    assert all(len(e) < 300 for e in info.value.errors)
    odd, long = '"a\\nb\\e[2J"', "y" * 1000  # (YAML's longest key without `? `)
    errors = _faults(tmp_path / "c.yaml", f"models: [{{id: m, providers: {{p: s, {odd}: s, {long}: s}}, {odd}: 1}}]\n"
                                          f"nodes: [{{id: n, providers: [{_PROVIDER}]}}]\n{odd}: 1\n")
    assert "models[0].'a\\nb\\x1b[2J': unknown field" in errors
    assert "'a\\nb\\x1b[2J': unknown field" in errors
    assert "models[0].providers.'a\\nb\\x1b[2J': provider 'a\\nb\\x1b[2J' is not defined by any node" in errors
    assert all("\n" not in e and "\x1b" not in e and len(e) < 300 for e in errors), errors


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/v1/chat/completions", "http://127.0.0.1:9/v1/completions/",
                                 "http://127.0.0.1:9/api/chat", "https://api.example.com/v1/embeddings"])
def test_a_base_url_that_is_an_endpoints_whole_url_is_a_config_error(url: str, tmp_path: Path) -> None:
    """An endpoint's URL pasted as base_url loaded: iop adds the API's paths to it, so every run would go to
    /v1/chat/completions/v1/chat/completions (a 404), while the probe of the host's /health passed."""
    provider = _PROVIDER.replace("http://127.0.0.1:9", url)
    errors = _faults(tmp_path / "c.yaml", f"models: [{{id: m, providers: {{p: s}}}}]\n"
                                          f"nodes: [{{id: n, providers: [{provider}]}}]\n")
    assert len(errors) == 1 and errors[0].startswith(f"nodes[0].providers[0].base_url: '{url}' ends in the endpoint /")


def test_a_list_with_every_line_under_it_commented_out_says_so(tmp_path: Path) -> None:
    errors = _faults(tmp_path / "c.yaml", "models: [{id: m, providers: {p: s}}]\nnodes:\n#  - id: n\n")
    assert errors == ["nodes: Input should be a valid list, got null (every line under it commented out? remove the "
                      "line too)"]


def test_a_legacy_route_whose_target_is_too_long_is_said_at_the_target() -> None:
    """It was said at `openai.model_routes[0].adapter` and at `nodes[0].adapters[0] (the targets routed to it)[0]`."""
    from common.config import MAX_SERVED_CHARS
    from common.legacy import MAX_TARGET_CHARS

    assert MAX_TARGET_CHARS == MAX_SERVED_CHARS
    with pytest.raises(ConfigError) as info:
        parse_config({"openai": {"model_routes": [{"model": "m", "adapter": "a", "target": "x" * 1025},
                                                  {"model": "m2", "adapter": "a", "target": "ok"}]},
                      "nodes": [{"id": "n", "adapters": [{"id": "a", "type": "vllm", "endpoint": "http://h:1",
                                                          "capacity": 1}]}]})
    assert info.value.errors == ["openai.model_routes[0].target: String should have at most 1024 characters"]
