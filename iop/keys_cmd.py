"""`iop keys new --name N [--role operator]`: a fresh key, shown once (on stderr), and the config
entry that holds only its hash (on stdout)."""

from __future__ import annotations

import re
import sys

import yaml

from common.auth import ANONYMOUS, NAME_PATTERN, hash_key, new_key
from common.config_yaml import ConfigDumper

#: the entry's indent: as under `auth:` and `keys:` (the README's), so that with `auth.keys` last in the
#: file, `>> iop.yaml` adds it to them
ENTRY_INDENT = "    "


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
    # (the key on stderr, the entry alone on stdout: `iop keys new … >> iop.yaml` wrote the key itself into
    # the config, a line that broke it, and showed the key nowhere)
    print(f"# the key of {name}: shown this once, never stored by iop; hand it over and keep no copy", file=sys.stderr)
    print(key, file=sys.stderr, flush=True)
    # (a line end first: appended to a file whose last line had none, the `#` line joined that line and
    # broke the config)
    print(f"\n# the entry of {name} for the config, under auth.keys (it holds only the key's hash):")
    print("".join(ENTRY_INDENT + line for line in entry.splitlines(keepends=True)), end="")
    return 0
