"""The gateway's API keys follow its config file (`gateway.keys_reload`): a key added or revoked
without the restart that cut every stream in flight after its grace (a new user's review)."""

from __future__ import annotations

import logging
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from common.auth import KeyRing, hash_key
from common.config import load_config
from gateway.keys_reload import reload_keys, settled
from tests.conftest import Stack, wait_until
from tests.test_e2e import pool_config

OLD, NEW = "sk-old-key-1b2c3d", "sk-new-key-4e5f6a"


def with_keys(*keys: dict[str, Any], **changes: Any) -> dict[str, Any]:
    config = pool_config({"p": ("n1", "http://127.0.0.1:9", 1)})
    config["auth"] = {"keys": list(keys)}
    config.update(changes)
    return config


def key(name: str, secret: str, **more: Any) -> dict[str, Any]:
    return {"name": name, "sha256": hash_key(secret), **more}


def write(path: Path, config: dict[str, Any] | str) -> None:
    """As an editor saves: a new file renamed over the old one."""
    fresh = path.with_suffix(".new")
    fresh.write_text(config if isinstance(config, str) else yaml.safe_dump(config, sort_keys=False))
    os.replace(fresh, path)


@pytest.fixture
def started(tmp_path: Path) -> tuple[Path, Any, KeyRing]:
    path = tmp_path / "iop.yaml"
    write(path, with_keys(key("team-a", OLD), key("ops", "sk-ops-9z8y7x", role="operator")))
    config = load_config(path)
    assert config.auth is not None
    return path, config, KeyRing.from_config(config.auth, {})


def test_a_key_added_and_one_revoked_take_effect_and_are_named(
        started: tuple[Path, Any, KeyRing], caplog: pytest.LogCaptureFixture) -> None:
    path, config, ring = started
    write(path, with_keys(key("team-b", NEW, models=["qwen3.6:35b"]), key("ops", "sk-ops-9z8y7x", role="caller")))
    with caplog.at_level(logging.INFO, "iop.gateway"):
        assert reload_keys(path, config, ring, {})
    assert ring.lookup(OLD) is None
    who = ring.lookup(NEW)
    assert who is not None and who.name == "team-b" and who.models == frozenset({"qwen3.6:35b"})
    assert [r.getMessage() for r in caplog.records] == [
        f"API keys reloaded from {path}: 2 keys (added: team-b; removed: team-a; changed: ops)"]


def test_a_key_given_another_secret_lets_in_only_the_new_one(started: tuple[Path, Any, KeyRing]) -> None:
    path, config, ring = started
    write(path, with_keys(key("team-a", NEW), key("ops", "sk-ops-9z8y7x", role="operator")))
    assert reload_keys(path, config, ring, {})
    assert ring.lookup(OLD) is None and ring.lookup(NEW) is not None


def test_a_key_rotated_without_a_gap_lets_in_both_secrets_then_only_the_new_one(
        started: tuple[Path, Any, KeyRing], caplog: pytest.LogCaptureFixture) -> None:
    """`sha256` as a list: the new secret and the old, each letting its holder in as the same key
    (its limits and usage one), until the old one is taken out (an operator's review: a key could
    only be given another secret at once, its holders cut off until they had the new one)."""
    path, config, ring = started
    ops = key("ops", "sk-ops-9z8y7x", role="operator")
    write(path, with_keys({"name": "team-a", "sha256": [hash_key(NEW), hash_key(OLD)]}, ops))
    with caplog.at_level(logging.INFO, "iop.gateway"):
        assert reload_keys(path, config, ring, {})
    old, new = ring.lookup(OLD), ring.lookup(NEW)
    assert old is not None and new is not None and old is new and new.name == "team-a"
    assert [r.getMessage() for r in caplog.records] == [
        f"API keys reloaded from {path}: 2 keys (added: none; removed: none; changed: team-a)"]
    write(path, with_keys({"name": "team-a", "sha256": [hash_key(NEW)]}, ops))
    assert reload_keys(path, config, ring, {})
    assert ring.lookup(OLD) is None and ring.lookup(NEW) is not None


@pytest.mark.parametrize(("secrets", "said"), [
    ([], "auth.keys[0].sha256: a list of 1 to 4 SHA-256s (the secrets of one key, as while it is rotated), not 0"),
    ([hash_key(f"sk-{i}") for i in range(5)], "auth.keys[0].sha256: a list of 1 to 4 SHA-256s"),
    ([hash_key(NEW), hash_key(NEW)], "auth.keys[0].sha256[1]: the same key as auth.keys[0].sha256[0]"),
    ([hash_key(NEW), hash_key("sk-ops-9z8y7x")], "auth.keys[1].sha256: the same key as auth.keys[0].sha256[1]"),
    ([hash_key(NEW), "sk-pasted-" + "x" * 10], "auth.keys[0].sha256[1]: must be the key's SHA-256 in 64 hex digits"),
], ids=["empty", "five", "twice", "another-key-s", "pasted"])
def test_a_rotation_s_list_of_secrets_is_checked(started: tuple[Path, Any, KeyRing],
                                                  caplog: pytest.LogCaptureFixture, secrets: list[str],
                                                  said: str) -> None:
    path, config, ring = started
    write(path, with_keys({"name": "team-a", "sha256": secrets}, key("ops", "sk-ops-9z8y7x", role="operator")))
    with caplog.at_level(logging.INFO, "iop.gateway"):
        assert not reload_keys(path, config, ring, {})
    assert said in caplog.text and "sk-pasted-" not in caplog.text
    assert ring.lookup(OLD) is not None


@pytest.mark.parametrize(("edit", "said"), [
    ("models: [oops", "is not a valid config: the API keys stay as they were:"),
    (with_keys(key("team-a", NEW, models=["nope"])), "auth.keys[0].models[0]: model 'nope' is not defined"),
    (pool_config({"p": ("n1", "http://127.0.0.1:9", 1)}), "has no auth section now: the API keys stay as they were"),
    (with_keys({"name": "team-a", "env": "IOP_TEST_UNSET_KEY"}),
     "its keys do not resolve in this gateway: the API keys stay as they were: auth.keys[0].env: the environment "
     "variable IOP_TEST_UNSET_KEY is not set"),
], ids=["not-yaml", "invalid", "no-auth", "unresolved"])
def test_a_change_that_cannot_be_taken_leaves_the_keys_and_says_why(
        started: tuple[Path, Any, KeyRing], edit: Any, said: str, caplog: pytest.LogCaptureFixture) -> None:
    path, config, ring = started
    write(path, edit)
    with caplog.at_level(logging.INFO, "iop.gateway"):
        assert not reload_keys(path, config, ring, {})
    assert ring.lookup(OLD) is not None and ring.lookup(NEW) is None
    (record,) = caplog.records
    assert record.levelname == "ERROR" and said in record.getMessage(), record.getMessage()


def test_a_change_outside_the_keys_is_said_to_wait_for_a_restart(
        started: tuple[Path, Any, KeyRing], caplog: pytest.LogCaptureFixture) -> None:
    path, config, ring = started
    write(path, with_keys(key("team-a", OLD), key("ops", "sk-ops-9z8y7x", role="operator"),
                          queue={"max_queue": 7}))
    with caplog.at_level(logging.INFO, "iop.gateway"):
        assert reload_keys(path, config, ring, {})
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", f"{path} changed outside auth.keys too: those changes take effect when the gateway restarts")]


def test_a_running_gateway_takes_a_new_key_and_drops_a_revoked_one(stack: Stack) -> None:
    """A real gateway process, its config file saved anew as an editor does."""
    stack.write_config(with_keys(key("team-a", OLD)))
    gateway = stack.gateway()
    proc = stack.procs[-1]

    def status(secret: str) -> int:
        asked = urllib.request.Request(gateway + "/v1/models", headers={"Authorization": f"Bearer {secret}"})
        try:
            with urllib.request.urlopen(asked, timeout=10) as answer:
                return int(answer.status)
        except urllib.error.HTTPError as refused:
            return refused.code

    assert (status(OLD), status(NEW)) == (200, 401)
    write(stack.config_path, with_keys(key("team-b", NEW)))
    wait_until(lambda: (status(OLD), status(NEW)) == (401, 200), what="the new key in, the old one out")
    assert proc.wait_for_line(r"API keys reloaded from \S+: 1 keys \(added: team-b; removed: team-a; changed: none\)")
    write(stack.config_path, "auth: [")
    proc.wait_for_line(r"is not a valid config: the API keys stay as they were")
    assert (status(OLD), status(NEW)) == (401, 200)


@pytest.mark.parametrize("field", ["sha256", "env"])
def test_a_key_pasted_where_its_hash_or_variable_belongs_is_not_logged(
        started: tuple[Path, Any, KeyRing], caplog: pytest.LogCaptureFixture, field: str) -> None:
    """An edit that puts the key itself where its hash (or its variable's name) belongs is refused,
    and the ERROR, which goes to the gateway's log, does not hold the key."""
    path, config, ring = started
    secret = "sk-pasted-" + "x" * 10
    write(path, with_keys({"name": "team-a", field: secret}))
    with caplog.at_level(logging.INFO, "iop.gateway"):
        assert not reload_keys(path, config, ring, {})
    assert "auth.keys[0]." + field in caplog.text and "not shown" in caplog.text
    assert secret not in caplog.text
    assert ring.lookup(OLD) is not None


def test_a_reload_of_many_keys_names_some_on_one_short_line(
        started: tuple[Path, Any, KeyRing], caplog: pytest.LogCaptureFixture) -> None:
    path, config, ring = started
    many = [key(f"k{i:04}", f"sk-many-{i:04}-abcdef") for i in range(500)]
    write(path, with_keys(*many))
    with caplog.at_level(logging.INFO, "iop.gateway"):
        assert reload_keys(path, config, ring, {})
    [line] = [r.getMessage() for r in caplog.records if "reloaded" in r.getMessage()]
    assert "k0000, k0001" in line and "(and 480 more)" in line and "k0499" not in line
    assert "removed: ops, team-a;" in line and len(line) < 1000
    assert ring.lookup("sk-many-0499-abcdef") is not None


async def test_the_file_is_read_off_the_event_loop_and_a_fault_in_reading_does_not_end_the_following(
        started: tuple[Path, Any, KeyRing], caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A file of 40,000 keys took 2.8 s to check: on the event loop every stream stalled that long.
    And an exception reload_keys does not expect (here a made-up one) ended the task that follows the
    file, silently: no edit was taken after it."""
    import asyncio
    import threading

    from gateway import keys_reload
    path, config, ring = started
    threads: list[threading.Thread] = []
    real = load_config

    def load(p: Any) -> Any:
        threads.append(threading.current_thread())
        if len(threads) == 1:
            raise RuntimeError("made up\nsecond line")
        return real(p)

    monkeypatch.setattr(keys_reload, "load_config", load)
    following = asyncio.create_task(keys_reload.follow_keys(path, config, ring, {}, every_s=0.01))
    try:
        await asyncio.sleep(0)  # (the task takes its first look at the file)
        with caplog.at_level(logging.INFO, "iop.gateway"):
            write(path, with_keys(key("team-b", NEW)))
            await wait_until_async(lambda: bool(threads))
            write(path, with_keys(key("team-c", NEW)))
            await wait_until_async(lambda: ring.lookup(NEW) is not None)
    finally:
        following.cancel()
        await asyncio.gather(following, return_exceptions=True)
    assert threading.main_thread() not in threads
    assert "reading it failed: the API keys stay as they were: RuntimeError: made up" in caplog.text
    assert "second line" not in caplog.text


async def wait_until_async(check: Any, timeout_s: float = 10.0) -> None:
    import asyncio
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not check():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_a_copy_in_place_that_keeps_the_size_and_the_time_is_seen(started: tuple[Path, Any, KeyRing]) -> None:
    """`cp -p backup iop.yaml`: the same file (inode), the same size, the source's mtime."""
    from gateway.keys_reload import seen
    path, _, _ = started
    before = path.stat()
    looked = seen(path)
    text = path.read_text()
    swapped = text.replace("team-a", "team-z")
    assert len(swapped) == len(text)
    path.write_text(swapped)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_ino == before.st_ino and path.stat().st_mtime_ns == before.st_mtime_ns
    assert seen(path) != looked


def test_a_change_is_read_once_two_looks_in_a_row_see_it_the_same() -> None:
    """A file written in two halves a few seconds apart (a keys reviewer): the first half, a valid
    config with fewer keys, was read, and the keys left out were revoked until the next look."""
    first, half, whole = (1, 10, 1, 1), (1, 20, 2, 2), (1, 40, 3, 3)
    assert settled(first, first, None) == (False, first, None)  # (nothing changed)
    assert settled(half, first, None) == (False, first, half)  # (a change: looked at again first)
    assert settled(whole, first, half) == (False, first, whole)  # (it went on changing: again)
    assert settled(whole, first, whole) == (True, whole, None)  # (the same twice: read)
    assert settled(None, whole, None) == (False, whole, None)  # (gone for a moment)
    assert settled(first, whole, first) == (True, first, None)
    assert settled(whole, whole, first) == (False, whole, None)  # (changed back before it was read)
