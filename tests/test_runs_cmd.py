"""`iop runs show ID` reads a run's record and events from a real Redis."""

from __future__ import annotations

import json

import pytest
import redis as sync_redis

from common import keys
from common.codec import event_fields
from iop.cli import main

RUN = "run_0123abcd"


def write_run(url: str) -> list[str]:
    r = sync_redis.Redis.from_url(url)
    r.hset(keys.run_record(RUN), mapping={
        "model": "qwen3.6:35b", "kind": "chat", "stream": "1", "body": b"\x80", "state": "failed",
        "created_ms": 1_700_000_000_000, "dispatched_ms": 1_700_000_000_012, "started_ms": 1_700_000_000_015,
        "finished_ms": 1_700_000_000_900, "attempts": 3, "unable": 1, "max_attempts": 2,
        "tried": "vllm-a,ollama-c,sglang-b", "unable_by": "ollama-c", "elsewhere": "vllm-a",
        "provider": "sglang-b", "node": "gpu-2",
        "target": "qwen3.6-35b-a3b", "error_code": "provider_error", "error_message": "boom"})
    ids = [r.xadd(keys.run_events(RUN), event_fields(t, d)).decode() for t, d in (
        ("dispatched", {"provider": "sglang-b", "node": "gpu-2", "target": "qwen3.6-35b-a3b"}),
        ("started", {"attempt": 2}),
        ("delta", {"chunks": [{"choices": []}, {"choices": []}]}),
        ("failed", {"code": "provider_error", "message": "boom"}),
    )]
    r.close()
    return ids


def run_cli(*argv: str) -> int:
    with pytest.raises(SystemExit) as done:
        main(list(argv))
    return int(done.value.code or 0)


def test_show_prints_the_record_and_one_line_per_event(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    ids = write_run(redis_url)
    assert run_cli("runs", "show", RUN, "--redis", redis_url) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["run", RUN]
    head = lines[:lines.index("events (4):")]
    fields = dict(line.split(None, 1) for line in head)
    assert fields["state"] == "failed" and fields["kind"] == "chat (stream)"
    assert fields["provider"] == "sglang-b" and fields["target"] == "qwen3.6-35b-a3b"
    # (one attempt a provider refused as unable to do what was asked: not counted against max_attempts)
    assert fields["attempts"] == ("3 (tried vllm-a, ollama-c, sglang-b; max_attempts 2; "
                                  "1 refused as unable, not counted; "
                                  "never again: ollama-c (unable), vllm-a (failed it))")
    assert fields["created"] == "2023-11-14T22:13:20.000Z"
    assert fields["finished"] == "2023-11-14T22:13:20.900Z  (+900 ms)"
    assert fields["error"] == "provider_error: boom"
    assert "events (4):" in out
    event_lines = lines[lines.index("events (4):") + 1:]
    assert [line.split()[:2] for line in event_lines] == [
        [ids[0], "dispatched"], [ids[1], "started"], [ids[2], "delta"], [ids[3], "failed"]]
    assert "2 chunk(s)" in event_lines[2]


def test_show_json_is_the_runs_api_view_with_its_events(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    ids = write_run(redis_url)
    assert run_cli("runs", "show", RUN, "--redis", redis_url, "--json") == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["state"] == "failed" and shown["tried"] == ["vllm-a", "ollama-c", "sglang-b"]
    assert (shown["attempts"], shown["unable"], shown["max_attempts"]) == (3, 1, 2)
    assert shown["error"] == {"code": "provider_error", "message": "boom"}
    assert [e["id"] for e in shown["events"]] == ids
    assert shown["events"][0]["data"]["provider"] == "sglang-b"


def test_an_unknown_run_exits_1(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli("runs", "show", "run_missing", "--redis", redis_url) == 1
    assert "run 'run_missing' is not in Redis" in capsys.readouterr().err


@pytest.mark.parametrize("which", ["record", "events"])
def test_a_run_s_key_of_another_type_exits_1_saying_so_not_a_traceback(
        redis_url: str, capsys: pytest.CaptureFixture[str], which: str) -> None:
    """`SET iop:run:{run} x` (or its events) by hand: `iop runs show` raised WRONGTYPE, a traceback."""
    write_run(redis_url)
    key = keys.run_record(RUN) if which == "record" else keys.run_events(RUN)
    r = sync_redis.Redis.from_url(redis_url)
    r.delete(key)
    r.set(key, "x")
    r.close()
    assert run_cli("runs", "show", RUN, "--redis", redis_url) == 1
    assert "holds another type" in capsys.readouterr().err


def test_an_unreachable_redis_exits_1_as_for_every_command_that_reads_redis(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli("runs", "show", RUN, "--redis", "redis://127.0.0.1:1/0") == 1
    assert "unreachable" in capsys.readouterr().err


@pytest.mark.parametrize("as_json", [False, True], ids=["lines", "json"])
def test_events_that_are_not_iop_s_writing_are_shown_not_a_traceback(
        redis_url: str, capsys: pytest.CaptureFixture[str], as_json: bool) -> None:
    """A delta whose chunks are no list, one holding bytes (written by another program): `iop runs
    show` died with a traceback (a review)."""
    import msgpack

    write_run(redis_url)
    r = sync_redis.Redis.from_url(redis_url)
    r.xadd(keys.run_events(RUN), {"type": "delta", "data": msgpack.packb({"chunks": 5})})
    r.xadd(keys.run_events(RUN), {"type": "started", "data": msgpack.packb({"attempt": b"x"}, use_bin_type=True)})
    r.close()
    assert run_cli("runs", "show", RUN, "--redis", redis_url, *(["--json"] if as_json else [])) == 0
    out = capsys.readouterr().out
    if as_json:
        assert json.loads(out)["events"][-1]["data"] == {"attempt": "b'x'"}
    else:
        assert "0 chunk(s)" in out.splitlines()[-2]


@pytest.mark.parametrize("as_json", [False, True], ids=["lines", "json"])
def test_event_data_keyed_by_bytes_is_shown_not_a_traceback(
        redis_url: str, capsys: pytest.CaptureFixture[str], as_json: bool) -> None:
    """A map keyed by bytes (msgpack bin: another program's writing), at the top of an event's data
    or in a chunk: `iop runs show --json` died with a TypeError (`default=repr` sees no key)."""
    import msgpack

    write_run(redis_url)
    r = sync_redis.Redis.from_url(redis_url)
    r.xadd(keys.run_events(RUN), {"type": "started", "data": msgpack.packb({b"note": 1}, use_bin_type=True)})
    r.xadd(keys.run_events(RUN), {"type": "delta", "data": msgpack.packb({"chunks": [{b"x": b"y"}]},
                                                                          use_bin_type=True)})
    r.close()
    assert run_cli("runs", "show", RUN, "--redis", redis_url, *(["--json"] if as_json else [])) == 0
    out = capsys.readouterr().out
    if as_json:
        assert [e["data"] for e in json.loads(out)["events"][-2:]] == [{"b'note'": 1}, {"chunks": [{"b'x'": "b'y'"}]}]
    else:
        assert "1 chunk(s)" in out.splitlines()[-1]
