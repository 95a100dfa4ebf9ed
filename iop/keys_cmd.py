"""`iop keys new --name N [--role operator]`: a fresh key, shown once, and the config entry that
holds only its hash."""

from __future__ import annotations

import re
import sys

import yaml

from common.auth import ANONYMOUS, NAME_PATTERN, hash_key, new_key
from common.config_yaml import ConfigDumper


def new(name: str, role: str) -> int:
    if not re.match(NAME_PATTERN, name):
        print(f"error: --name {name!r} must be 1 to 64 letters, digits, '.', '_' or '-', the first a letter or digit",
              file=sys.stderr)
        return 2
    if name == ANONYMOUS:  # (the config refuses it: the entry printed would stop the gateway)
        print(f"error: --name {name!r} is what iop calls every caller when the config has no keys; give this key "
              "a name of its own", file=sys.stderr)
        return 2
    key = new_key()
    # (ConfigDumper quotes a name the config would read as a number: `1e3`, `0o17`)
    entry = yaml.dump([{"name": name, "sha256": hash_key(key), "role": role}], Dumper=ConfigDumper, sort_keys=False)
    print(f"# the key of {name}: shown this once, never stored by iop; hand it over and keep no copy")
    print(key)
    print("# its entry for the config, under auth.keys (it holds only the key's hash):")
    print(entry, end="")
    return 0
