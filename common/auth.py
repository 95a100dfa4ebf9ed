"""Who may call: API keys, their roles, the models they may use and their limits.

The config holds a key's SHA-256 (or the name of an environment variable holding the key
itself), never the key. `KeyRing` answers who a presented key belongs to, looking its digest
up among the configured keys' (never the key itself). Validation (`check_auth`) and resolution
(`KeyRing.from_config`, given an environment mapping) are pure.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, StringConstraints, Tag

from common.shown import shown
from common.strict import Strict

#: A key's name is shown in logs, metrics and usage, and is part of Redis key names.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
#: The name runs are counted under when the gateway serves without keys.
ANONYMOUS = "anonymous"


class Role(StrEnum):
    CALLER = "caller"  # runs its models, sees its runs and its usage
    OPERATOR = "operator"  # everything, and the operator routes (catalog, metrics, admin)


#: The largest either limit of a key may be (within what Redis counts; `bench.py` sets one so high it
#: is never reached).
MAX_KEY_LIMIT = 1_000_000_000


class KeyLimits(Strict):
    max_in_flight: int | None = Field(None, ge=1, le=MAX_KEY_LIMIT,
                                      description="the key's runs queued or running at once")
    requests_per_minute: int | None = Field(None, ge=1, le=MAX_KEY_LIMIT,
                                            description="runs accepted in any 60 s window")


#: A key's SHA-256 in hex, and the name of an environment variable.
SHA256_PATTERN = r"^[0-9a-fA-F]{64}$"
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
#: The most secrets one key may have at once (`sha256` as a list: the new one and the old during a
#: rotation, each letting its holder in as the same key)
MAX_KEY_SECRETS = 4

Sha256 = Annotated[str, StringConstraints(pattern=SHA256_PATTERN)]
#: the names of `sha256`'s two forms, which pydantic puts in an error's path (a config error's path
#: leaves them out: `auth.keys[0].sha256`, `auth.keys[0].sha256[1]`)
SECRET_FORMS = ("one-sha256", "sha256-list")


def _secret_form(value: Any) -> str:
    return SECRET_FORMS[1] if isinstance(value, list) else SECRET_FORMS[0]


class ApiKeyConfig(Strict):
    name: str = Field(pattern=NAME_PATTERN)
    sha256: Annotated[Annotated[Sha256, Tag(SECRET_FORMS[0])] | Annotated[list[Sha256], Tag(SECRET_FORMS[1])],
                      Discriminator(_secret_form)] | None = Field(
        None, description="hex SHA-256 of the key; or a list of them (at most 4), each a secret of the same key, "
                          "as while it is rotated")
    env: str | None = Field(None, pattern=ENV_NAME_PATTERN,
                            description="an environment variable holding the key itself")
    role: Literal["caller", "operator"] = "caller"
    models: list[str] | None = Field(None, description="the model ids it may use; absent = every model")
    limits: KeyLimits = KeyLimits()

    def digests(self) -> list[str]:
        """Its secrets' SHA-256s, in hex (none for an `env` key)."""
        return [] if self.sha256 is None else [self.sha256] if isinstance(self.sha256, str) else self.sha256


class AuthConfig(Strict):
    keys: list[ApiKeyConfig] = Field(min_length=1)


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def check_auth(auth: Any, model_ids: Collection[str], aliases: Mapping[str, str] | None = None) -> list[str]:
    """Rules of `auth` the schema cannot express, on the raw mapping. Pure; every fault, with its path."""
    if not isinstance(auth, Mapping):
        return []
    errors: list[str] = []
    seen: dict[str, str] = {}
    hashes: dict[str, str] = {}
    for i, key in enumerate(_list(auth.get("keys"))):
        if not isinstance(key, Mapping):
            continue
        path = f"auth.keys[{i}]"
        if ("sha256" in key) == ("env" in key):
            errors.append(f"{path}: give the key's sha256 or the env variable holding it (one of the two)")
        name = key.get("name")
        if isinstance(name, str):
            if name in seen:
                errors.append(f"{path}.name: duplicate key name {shown(name)} (first at {seen[name]})")
            elif name == ANONYMOUS:  # (it would take over the usage and audit entries of callers before keys came)
                errors.append(f"{path}.name: {ANONYMOUS!r} is what iop calls every caller when the config has no "
                              "keys; give this key a name of its own")
            seen.setdefault(name, path)
        given = key.get("sha256")
        if isinstance(given, list) and not 1 <= len(given) <= MAX_KEY_SECRETS:
            errors.append(f"{path}.sha256: a list of 1 to {MAX_KEY_SECRETS} SHA-256s (the secrets of one key, as "
                          f"while it is rotated), not {len(given)}")
        listed = given[:MAX_KEY_SECRETS] if isinstance(given, list) else [given]
        for j, digest in enumerate(listed):
            if isinstance(digest, str):  # (one of a list is named by its place; a key of one secret by its entry)
                here = f"{path}.sha256[{j}]" if isinstance(given, list) else f"{path}.sha256"
                if digest.lower() in hashes:
                    errors.append(f"{here}: the same key as {hashes[digest.lower()]}")
                hashes.setdefault(digest.lower(), here if isinstance(given, list) else path)
        for j, model in enumerate(_list(key.get("models"))):
            if isinstance(model, str) and (of := (aliases or {}).get(model)) is not None:
                errors.append(f"{path}.models[{j}]: {shown(model)} is an alias of model {shown(of)}; a key's models "
                              f"name model ids: write {shown(of)}")
            elif isinstance(model, str) and model_ids and model not in model_ids:
                errors.append(f"{path}.models[{j}]: model {shown(model)} is not defined in models[]")
    return errors


def _digest(key: str) -> bytes:
    """A key's SHA-256, of its bytes as they came (a header's or the environment's bytes that are
    not UTF-8 come as surrogates: hashed as they came, such a key is still one key)."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def _unpresentable(key: str) -> str | None:
    """Why no request could ever present `key`, or None: the gateway strips the key a request
    sends, and no HTTP header carries a control character."""
    if key != key.strip():
        return ("holds a key that starts or ends with whitespace (a line end of the file it came from?); "
                "a request's key never does, so it would match none: remove it")
    if any((ch < " " and ch != "\t") or ch == "\x7f" for ch in key):  # (a header may carry a tab inside)
        return "holds a key with a control character, which no HTTP header can carry: it would match no request"
    return None


def hash_key(key: str) -> str:
    """The hex SHA-256 the config holds for `key`."""
    return _digest(key).hex()


def new_key() -> str:
    """A fresh random key: `iop-` and 43 characters of a 256-bit secret."""
    return "iop-" + secrets.token_urlsafe(32)


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request comes from."""

    name: str
    role: Role
    #: the model ids it may use; None = every model
    models: frozenset[str] | None = None
    max_in_flight: int | None = None
    requests_per_minute: int | None = None

    @property
    def operator(self) -> bool:
        return self.role is Role.OPERATOR

    def may_use(self, model_id: str) -> bool:
        return self.models is None or model_id in self.models

    def may_see_run(self, owner: str | None) -> bool:
        return self.operator or owner == self.name


#: The principal of every request when the gateway serves without keys.
ANYONE = Principal(ANONYMOUS, Role.OPERATOR)


class UnresolvedKeys(Exception):
    """A key the config names cannot be resolved; `errors` name their paths."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


class KeyRing:
    """The configured keys, by digest."""

    def __init__(self, entries: list[tuple[bytes, Principal]]) -> None:
        self.entries = entries
        self.principals = {p.name: p for _, p in entries}
        #: each key's principal by its digest (`lookup`)
        self.by_digest = dict(entries)

    @classmethod
    def from_config(cls, auth: AuthConfig, environ: Mapping[str, str]) -> KeyRing:
        """Resolve every key (an `env` key is read from `environ`); raise UnresolvedKeys naming each
        variable that is not set, and each key that resolves to the same key as an earlier one."""
        entries: list[tuple[bytes, Principal]] = []
        errors: list[str] = []
        first: dict[bytes, str] = {}  # digest -> the path of the first key that has it
        for i, key in enumerate(auth.keys):
            path = f"auth.keys[{i}]"
            if key.env is not None:
                secret = environ.get(key.env)
                if not secret:
                    state = "not set" if secret is None else f"empty (`{key.env}=` left unfilled in an env file?)"
                    errors.append(f"{path}.env: the environment variable {key.env} is {state}")
                    continue
                unusable = _unpresentable(secret)
                if unusable:
                    errors.append(f"{path}.env: the environment variable {key.env} {unusable}")
                    continue
                digests = [(_digest(secret), path)]
            else:  # (one of a list is named by its place in it; a key of one secret by its entry, as before)
                digests = [(bytes.fromhex(d), f"{path}.sha256[{j}]" if isinstance(key.sha256, list) else path)
                           for j, d in enumerate(key.digests())]
            principal = Principal(key.name, Role(key.role), None if key.models is None else frozenset(key.models),
                                  key.limits.max_in_flight, key.limits.requests_per_minute)
            for digest, at in digests:
                if digest in first:  # one key, two names (and maybe two roles): which would it be?
                    field = at if at != path else f"{path}.{'env' if key.env is not None else 'sha256'}"
                    errors.append(f"{field}: the same key as {first[digest]} (each key must be different)")
                    continue
                first[digest] = at
                entries.append((digest, principal))
        if errors:
            raise UnresolvedKeys(errors)
        return cls(entries)

    def replace(self, other: KeyRing) -> None:
        """Take `other`'s keys in place of these, at once (the requests that come after are let in, or
        not, by them; one already in keeps the principal it was let in as)."""
        self.entries, self.principals, self.by_digest = other.entries, other.principals, other.by_digest

    def lookup(self, presented: str) -> Principal | None:
        """The principal of a presented key, or None: its SHA-256 looked up among the keys'. What the
        time of that look could tell is of the digest, never of the key (finding a key from its digest
        is what SHA-256 makes infeasible). Comparing the digest with every key's took 0.5 ms a request
        with 10,000 keys, on the gateway's one event loop."""
        return self.by_digest.get(_digest(presented))
