"""The gateway's API keys follow its config file: an edit of `auth.keys` (a key added or revoked, its
role, models or limits changed) takes effect within two `RELOAD_EVERY_S`, on every gateway that reads
that file, without the restart that cut the streams in flight after their grace.

The file is looked at (its `stat`: a save in place, an editor's rename, a Kubernetes ConfigMap's
swapped link) every `RELOAD_EVERY_S`; once a change looks the same at two looks in a row
(`settled`), the file is read and checked whole, as at the start.
A file that is not a valid config, has no `auth` section any more, or whose keys do not resolve (an
`env` key whose variable this process lacks: its environment is the one it started with) leaves the
keys as they were, with an ERROR saying why. Only `auth.keys` is taken: a change elsewhere in the
file takes effect at the next start, and a WARNING says so."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from pathlib import Path

from common.auth import KeyRing, Principal, UnresolvedKeys
from common.config import Config, ConfigError, load_config

log = logging.getLogger("iop.gateway")

#: How often the config file is looked at for a change (a `stat`, no read)
RELOAD_EVERY_S = 2.0
#: The most errors of a changed file the ERROR line names
SHOWN_ERRORS = 5
#: The most key names the WARNING of a reload names in each of its lists
SHOWN_NAMES = 20

Seen = tuple[int, int, int, int] | None


def seen(path: Path) -> Seen:
    """What tells one version of the file from another (None: it cannot be read now)."""
    try:
        st = path.stat()
    except OSError:
        return None
    # (the ctime too: a copy that keeps its source's time, `cp -p` or `tar x` over the file in place,
    # of the same size, changes nothing else; no one can set it back)
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def reload_keys(path: Path, started: Config, ring: KeyRing, environ: Mapping[str, str]) -> bool:
    """Take the keys of the config at `path` into `ring` if it is a valid one with resolvable keys
    (`started`: the config the gateway started with, to say what else changed). Whether it did."""
    try:
        config = load_config(path)
    except ConfigError as exc:
        more = f" (and {len(exc.errors) - SHOWN_ERRORS} more)" if len(exc.errors) > SHOWN_ERRORS else ""
        log.error("%s changed, but is not a valid config: the API keys stay as they were: %s%s", path,
                  "; ".join(exc.errors[:SHOWN_ERRORS]), more)
        return False
    if config.auth is None:
        log.error("%s changed and has no auth section now: the API keys stay as they were (serving without keys "
                  "takes a restart)", path)
        return False
    try:
        keys = KeyRing.from_config(config.auth, environ)
    except UnresolvedKeys as exc:
        log.error("%s changed, but its keys do not resolve in this gateway: the API keys stay as they were: %s",
                  path, "; ".join(exc.errors[:SHOWN_ERRORS]))
        return False
    # (each name's secret and what it may do: a key given another secret is changed too, its holder's
    # old key no longer letting it in)
    before, after = _secrets_of(ring), _secrets_of(keys)
    added = sorted(after.keys() - before.keys())
    removed = sorted(before.keys() - after.keys())
    changed = sorted(n for n in before.keys() & after.keys() if before[n] != after[n])
    ring.replace(keys)
    if added or removed or changed:
        log.warning("API keys reloaded from %s: %d keys (added: %s; removed: %s; changed: %s)", path,
                    len(keys.principals), _names(added), _names(removed), _names(changed))
    if config.model_copy(update={"auth": None}) != started.model_copy(update={"auth": None}):
        log.warning("%s changed outside auth.keys too: those changes take effect when the gateway restarts", path)
    return True


def _secrets_of(ring: KeyRing) -> dict[str, tuple[frozenset[bytes], Principal]]:
    """Each key's secrets (their digests: one, or those of a rotation) and what it may do, by its name."""
    digests: dict[str, set[bytes]] = {}
    for digest, principal in ring.entries:
        digests.setdefault(principal.name, set()).add(digest)
    return {name: (frozenset(digests[name]), principal) for name, principal in ring.principals.items()}


def _names(names: list[str]) -> str:
    """Some of `names`, for the one line that says what a reload changed (a file of 40,000 new keys
    made it 300 kB long)."""
    if not names:
        return "none"
    more = f" (and {len(names) - SHOWN_NAMES} more)" if len(names) > SHOWN_NAMES else ""
    return ", ".join(names[:SHOWN_NAMES]) + more


def settled(now: Seen, last: Seen, pending: Seen) -> tuple[bool, Seen, Seen]:
    """Whether to read the file now (`now`: what `seen` says of it; `last`: of the version read last;
    `pending`: of a change seen at the look before), and the `last` and `pending` after. A change is
    read once two looks in a row see it the same: a file written in two halves was read between them,
    and its first half, a valid config with fewer keys, revoked the keys left out until the next
    look. A file gone (a save by rename) is looked at again."""
    if now is None or now == last:
        return False, last, None
    if now != pending:
        return False, last, now
    return True, now, None


async def follow_keys(path: Path, started: Config, ring: KeyRing, environ: Mapping[str, str] = os.environ,
                      every_s: float = RELOAD_EVERY_S) -> None:
    """Reload the keys whenever the file changes, until cancelled."""
    last, pending = seen(path), None
    while True:
        await asyncio.sleep(every_s)  # (a poll: nothing tells a process that a file changed)
        read, last, pending = settled(seen(path), last, pending)
        if not read:
            continue
        try:  # (read and checked off the event loop: a file of many keys took seconds, every stream stalled)
            await asyncio.to_thread(reload_keys, path, started, ring, environ)
        except Exception as exc:  # (a fault of its own must not end the following: the keys would stop changing)
            log.error("%s changed, but reading it failed: the API keys stay as they were: %s: %s", path,
                      type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
