"""The YAML loader of config files: PyYAML's safe loader, with YAML 1.2's plain scalars where YAML
1.1's surprise. PyYAML reads `no`, `yes`, `on` and `off` as booleans (a model named `no`, a served
name `on`, became `false` and `true`), `1:30` as the number 90 (base 60) and `010` as 8 (octal).
Here `true` and `false` (in any of their YAML 1.2 cases) are the only booleans, `1:30` is text, and
a number with a leading zero is decimal; `0x1F`, `0o17`, `0b101`, `1_000` and `1.5` read as before,
and so do `1e3`, `1.5e4` and `-.5E+2` (YAML 1.1 wanted a dot and a signed exponent: they were text).
A date (`2026-12-05`) is text too, as in YAML 1.2: no config value is a date, and one that is not a
day of the calendar (`2026-13-45`) stopped PyYAML with a traceback."""

from __future__ import annotations

import re

import yaml

BOOL_TAG = "tag:yaml.org,2002:bool"
INT_TAG = "tag:yaml.org,2002:int"
FLOAT_TAG = "tag:yaml.org,2002:float"
TIMESTAMP_TAG = "tag:yaml.org,2002:timestamp"

_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_INT = re.compile(r"^(?:[-+]?0b_*[01][01_]*|[-+]?0o_*[0-7][0-7_]*|[-+]?0x_*[0-9a-fA-F][0-9a-fA-F_]*"
                  r"|[-+]?[0-9][0-9_]*)$")
_FLOAT = re.compile(r"^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?"
                    r"|[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+"
                    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")
_BASES = {"0b": 2, "0o": 8, "0x": 16}


#: libyaml's parser where PyYAML has it (its wheels do): PyYAML's own, in Python, took 0.4 s of CPU
#: for a config of 300 models and 100 providers (2.5 s for 1,000 of each) in every process at its start
#: (20 workers, 2 schedulers and 2 gateways: 10 s of a 2-core machine's CPU); libyaml a sixth of that.
#: Its error positions count bytes, not characters (`config.read_yaml`). Only a libyaml that stops at a
#: nesting depth of its own is used: Debian's python3-yaml over libyaml 0.2.5 has none, and a config
#: nested 50,000 deep (100 KB) took the process down with SIGSEGV; PyYAML's own parser stops with a
#: RecursionError, which `config.read_yaml` reports.
NESTING_PROBE = "[" * 1100 + "]" * 1100


def bounds_nesting(loader: type[yaml.SafeLoader] | type[yaml.CSafeLoader]) -> bool:
    """Whether `loader` refuses a document nested past its depth limit (libyaml's is 1,000 levels)
    with an error of its own, rather than reading on as deep as the document goes."""
    parser = loader(NESTING_PROBE)
    try:
        parser.get_single_node()
    except yaml.YAMLError as exc:
        return "maximum nesting depth" in str(getattr(exc, "problem", ""))
    finally:
        parser.dispose()
    return False


FAST = hasattr(yaml, "CSafeLoader") and bounds_nesting(yaml.CSafeLoader)
_BASE: type[yaml.SafeLoader] = yaml.CSafeLoader if FAST else yaml.SafeLoader  # type: ignore[assignment]


class ConfigLoader(_BASE):  # type: ignore[valid-type,misc]
    """`yaml.SafeLoader` (libyaml's where there is one) with the plain scalars above."""


ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (BOOL_TAG, INT_TAG, FLOAT_TAG, TIMESTAMP_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
ConfigLoader.add_implicit_resolver(BOOL_TAG, _BOOL, list("tTfF"))
ConfigLoader.add_implicit_resolver(INT_TAG, _INT, list("-+0123456789"))
ConfigLoader.add_implicit_resolver(FLOAT_TAG, _FLOAT, list("-+0123456789."))


def _construct_int(loader: yaml.SafeLoader, node: yaml.Node) -> int:
    text = str(loader.construct_scalar(node)).replace("_", "")  # type: ignore[arg-type]
    sign = -1 if text.startswith("-") else 1
    digits = text.lstrip("+-")
    base = _BASES.get(digits[:2], 10)
    return sign * int(digits[2:] if base != 10 else digits, base)


ConfigLoader.add_constructor(INT_TAG, _construct_int)


class ConfigDumper(yaml.SafeDumper):
    """`yaml.SafeDumper` that quotes text either reading would take for something else: YAML 1.1's
    (PyYAML's own: `yes`, `010`) and this loader's (`1e5`, a number to YAML 1.2 that 1.1 leaves
    plain), so a file it writes (`iop config migrate`) reads back as it was, here and elsewhere."""


_YAML_1_1, _HERE = yaml.SafeDumper.yaml_implicit_resolvers, ConfigLoader.yaml_implicit_resolvers
ConfigDumper.yaml_implicit_resolvers = {first: [*_YAML_1_1.get(first, []), *_HERE.get(first, [])]
                                        for first in {*_YAML_1_1, *_HERE}}
