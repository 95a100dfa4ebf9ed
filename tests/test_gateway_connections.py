"""Connection hygiene of the real `iop gateway` process (port 0), driven with raw sockets:
idle connections, slow request heads and bodies, the connection limit (and /healthz while it
holds), and the bounded Redis pool that shrinks back. Limits are small; nothing waits a fixed
time for something: every wait is for an answer or a close, with a deadline."""

from __future__ import annotations

import json
import re
import select
import socket
import time
import weakref
from collections import Counter
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis as sync_redis
from prometheus_client.parser import text_string_to_metric_families

from common.auth import hash_key
from gateway.heads import FREE_CHUNKS, MIN_CHUNK_BYTES
from tests.conftest import Proc, Stack, wait_until

MODEL = "m"
#: Longest any single wait in these tests may take; far above the limits under test.
DEADLINE_S = 20.0
#: A limit long enough never to fire during a test.
NEVER_MS = 120_000


def config(auth: dict[str, Any] | None = None, **runtime: Any) -> dict[str, Any]:
    return {**({"auth": auth} if auth else {}),
        "models": [{"id": MODEL, "providers": {"p": "p-served"}}],
        "nodes": [{"id": "n1", "providers": [{"id": "p", "type": "vllm", "base_url": "http://127.0.0.1:9",
                                              "capacity": 1, "models": ["p-served"]}]}],
        "runtime": {"header_timeout_ms": NEVER_MS, "body_timeout_ms": NEVER_MS, "idle_timeout_ms": NEVER_MS,
                    **runtime},
    }


class Gateway:
    def __init__(self, stack: Stack, auth: dict[str, Any] | None = None, **runtime: Any) -> None:
        stack.write_config(config(auth, **runtime))
        url = urlsplit(stack.gateway())
        assert url.hostname is not None and url.port is not None
        self.address = (url.hostname, url.port)
        self.proc: Proc = stack.procs[-1]
        self.sockets: list[socket.socket] = []

    def connect(self) -> socket.socket:
        sock = socket.create_connection(self.address, timeout=DEADLINE_S)
        self.sockets.append(sock)
        return sock

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


@pytest.fixture
def gateways(stack: Stack) -> Iterator[list[Gateway]]:
    started: list[Gateway] = []
    yield started
    for gw in started:
        gw.close()


def start(stack: Stack, gateways: list[Gateway], auth: dict[str, Any] | None = None, **runtime: Any) -> Gateway:
    gw = Gateway(stack, auth, **runtime)
    gateways.append(gw)
    return gw


def request(method: str, path: str, body: bytes = b"", **headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: localhost",
             *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items())]
    if body:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class Response:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def error(self) -> dict[str, Any]:
        assert self.headers.get("content-type", "").startswith("application/json"), self.headers
        err: dict[str, Any] = json.loads(self.body)["error"]
        assert set(err) == {"message", "type", "param", "code"}
        return err


#: What a socket received beyond the response `read_response` returned (the next one's start).
_AHEAD: weakref.WeakKeyDictionary[socket.socket, bytes] = weakref.WeakKeyDictionary()


def read_response(sock: socket.socket) -> Response:
    """One whole HTTP/1.1 response with a Content-Length (or none, for no body); what came after
    it is kept for the next call (two answers may arrive in one read)."""
    sock.settimeout(DEADLINE_S)
    data = _AHEAD.pop(sock, b"")
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a whole response head: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    length = int(headers.get("content-length", "0"))  # (none on a 204)
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed inside a response body"
        rest += chunk
    if rest[length:]:
        _AHEAD[sock] = rest[length:]
    return Response(int(status_line.split()[1]), headers, rest[:length])


def closed_by_peer(sock: socket.socket) -> bool:
    """Wait (up to the deadline) for the gateway to close the connection, dropping what it sends."""
    sock.settimeout(DEADLINE_S)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def drip_until_answered(sock: socket.socket, drops: list[bytes]) -> bytes:
    """Send `drops` one by one, each as soon as the last is out, until the gateway answers or
    closes; returns what it sent. The gateway's own deadline ends this, not ours."""
    deadline = time.monotonic() + DEADLINE_S
    for drop in drops:
        readable, _, _ = select.select([sock], [], [], 0.05)
        if readable:
            break
        try:
            sock.sendall(drop)
        except (BrokenPipeError, ConnectionResetError):
            break
    else:
        raise AssertionError("ran out of bytes to drip before the gateway answered")
    return rest_until_closed(sock, max(deadline - time.monotonic(), 0.1))


def metric(gw: Gateway, name: str, **labels: str) -> float:
    """One sample of the gateway's /metrics."""
    sock = gw.connect()
    sock.sendall(request("GET", "/metrics"))
    text = read_response(sock).body.decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    raise AssertionError(f"no sample {name}{labels}")


def has_its_own_request_id(resp: Response) -> bool:
    """Every answer has an `X-Request-Id` (`req_` and 32 hex digits), as OpenAI's do: those written
    before any handler ran too (a review found a 417, 408 and 400s without one)."""
    return re.fullmatch(r"req_[0-9a-f]{32}", resp.headers.get("x-request-id", "")) is not None


def parse(raw: bytes) -> Response:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    return Response(int(status_line.split()[1]), headers, body)


def test_an_idle_kept_alive_connection_is_closed_after_idle_timeout(stack: Stack, gateways: list[Gateway]) -> None:
    gw = start(stack, gateways, idle_timeout_ms=300)
    sock = gw.connect()
    sock.sendall(request("GET", "/healthz"))
    assert read_response(sock).status == 200  # kept alive: HTTP/1.1 without Connection: close
    assert closed_by_peer(sock)  # the head and body timeouts are far off: this is the idle timeout


def test_a_connection_that_sends_nothing_is_closed_after_header_timeout(
        stack: Stack, gateways: list[Gateway]) -> None:
    gw = start(stack, gateways, header_timeout_ms=300)
    sock = gw.connect()
    sock.settimeout(DEADLINE_S)
    assert sock.recv(65536) == b""  # closed without an answer: no request had begun


def test_a_request_head_sent_slowly_gets_408_and_the_connection_closes(
        stack: Stack, gateways: list[Gateway]) -> None:
    gw = start(stack, gateways, header_timeout_ms=300)
    sock = gw.connect()
    drops = [b"POST /v1/chat/completions HTTP/1.1\r\n"] + [f"X-Drip-{i}: {i}\r\n".encode() for i in range(100_000)]
    resp = parse(drip_until_answered(sock, drops))
    assert resp.status == 408 and has_its_own_request_id(resp)
    err = resp.error()
    assert err["code"] == "request_timeout" and "runtime.header_timeout_ms" in err["message"]
    assert metric(gw, "iop_gateway_connections_closed_total", reason="head_timeout") == 1


def test_a_late_head_s_408_reaches_a_client_that_goes_on_sending(stack: Stack, gateways: list[Gateway]) -> None:
    """The 408 went out and the connection closed with the client's next bytes unread: the reset
    that sends could reach the client before the 408, which it then never read (a flaky CI run)."""
    gw = start(stack, gateways, header_timeout_ms=300)
    sock = gw.connect()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nX-Partial: ")
    readable, _, _ = select.select([sock], [], [], DEADLINE_S)  # the 408 is there, unread
    assert readable
    try:  # more of the head, as a slow client keeps sending; then the reset would have come
        sock.sendall(b"x" * 65536)
        sock.shutdown(socket.SHUT_WR)  # (the gateway drops what came, sees the end, and closes)
    except (BrokenPipeError, ConnectionResetError):
        pass
    sock.settimeout(DEADLINE_S)
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    assert parse(received).status == 408


def test_a_client_that_goes_on_sending_after_a_late_head_s_408_is_closed_after_the_linger(
        stack: Stack, gateways: list[Gateway]) -> None:
    """What a client still sends after the 408 is dropped for at most `LINGER_S` (2 s), then the
    connection closes: a slow client cannot hold it for longer."""
    gw = start(stack, gateways, header_timeout_ms=300)
    sock = gw.connect()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nX-Partial: ")
    readable, _, _ = select.select([sock], [], [], DEADLINE_S)
    assert readable
    deadline = time.monotonic() + DEADLINE_S
    closed = False
    while time.monotonic() < deadline and not closed:
        try:
            sock.sendall(b"x" * 1024)  # (blocks while the socket's buffers are full: the gateway's pace)
        except (BrokenPipeError, ConnectionResetError):
            closed = True
    assert closed, "the gateway kept taking bytes after its 408 for longer than the test's deadline"


def test_a_refused_expect_then_an_open_connection_is_no_late_head(stack: Stack, gateways: list[Gateway]) -> None:
    """An `Expect` refused (413) is answered before the request counts as begun; while the gateway
    then drops what the client still sends, no head deadline may fire on it (it wrote a 408 after
    the end it had sent, logged a RuntimeError traceback and counted a head timeout; found by a
    review)."""
    gw = start(stack, gateways, header_timeout_ms=300)
    sock = gw.connect()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 999999999999\r\nExpect: 100-continue\r\n\r\n")
    assert read_response(sock).status == 413
    assert closed_by_peer(sock)  # its end at once; what the client sends is dropped until the lingering ends
    deadline = time.monotonic() + DEADLINE_S
    with pytest.raises(OSError):  # (BrokenPipe or reset: the gateway closed, 10 s on, its head timer long past)
        while time.monotonic() < deadline:
            sock.sendall(b"x" * 1024)
            select.select([], [], [], 0.05)  # (a pace for the bytes, not a wait for the close)
    assert metric(gw, "iop_gateway_connections_closed_total", reason="head_timeout") == 0
    assert "Traceback" not in gw.proc.output(200) and "RuntimeError" not in gw.proc.output(200)


def test_a_request_body_sent_slowly_gets_408_and_nothing_is_queued(
        stack: Stack, gateways: list[Gateway], redis_url: str) -> None:
    gw = start(stack, gateways, body_timeout_ms=300)
    client = sync_redis.Redis.from_url(redis_url)
    client.hset("iop:provider:p", mapping={"health": "available", "capacity": 1})  # it would be queued
    sock = gw.connect()
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 100_000}]}).encode()
    head = request("POST", "/v1/chat/completions", Content_Type="application/json").removesuffix(b"\r\n")
    head += f"Content-Length: {len(body)}\r\n\r\n".encode()
    resp = parse(drip_until_answered(sock, [head] + [body[i:i + 1] for i in range(len(body))]))
    assert resp.status == 408
    err = resp.error()
    assert err["code"] == "request_timeout" and "runtime.body_timeout_ms" in err["message"]
    assert client.keys("iop:run:*") == [] and client.xlen(f"iop:runs:{MODEL}") == 0
    client.close()


def test_at_the_limit_a_new_connection_takes_the_place_of_the_longest_idle_one(
        stack: Stack, gateways: list[Gateway]) -> None:
    gw = start(stack, gateways, max_connections=3)
    held = [gw.connect() for _ in range(3)]
    for sock in held:  # each answered, then idle (kept alive): held[0] has been idle longest
        sock.sendall(request("GET", "/healthz"))
        assert read_response(sock).status == 200

    new = gw.connect()
    new.sendall(request("GET", "/v1/models"))
    assert read_response(new).status == 200
    assert closed_by_peer(held[0])
    for sock in held[1:]:  # the others are still served
        sock.sendall(request("GET", "/healthz"))
        assert read_response(sock).status == 200
    gw.proc.wait_for_line(r"WARNING .*connection limit reached .*1 idle connections closed to make room")


def wait_for_run(sock: socket.socket, redis_url: str, runs: int) -> None:
    """Send a chat request whose run will wait (no scheduler runs): the connection stays busy."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    sock.sendall(request("POST", "/v1/chat/completions", body, Content_Type="application/json"))
    client = sync_redis.Redis.from_url(redis_url)
    wait_until(lambda: client.xlen(f"iop:runs:{MODEL}") == runs, timeout=DEADLINE_S, what=f"{runs} queued runs")
    client.close()


def test_when_every_connection_is_busy_a_request_gets_503_while_healthz_answers(
        stack: Stack, gateways: list[Gateway], redis_url: str) -> None:
    gw = start(stack, gateways, max_connections=3)
    client = sync_redis.Redis.from_url(redis_url)
    client.hset("iop:provider:p", mapping={"health": "available", "capacity": 1})
    client.close()
    callers = [gw.connect() for _ in range(3)]
    for i, sock in enumerate(callers):
        wait_for_run(sock, redis_url, i + 1)

    over = gw.connect()
    over.sendall(request("POST", "/v1/chat/completions", b"{}", Content_Type="application/json"))
    resp = read_response(over)
    assert resp.status == 503 and resp.headers.get("retry-after") == "1" and has_its_own_request_id(resp)
    err = resp.error()
    assert err["code"] == "service_unavailable" and "runtime.max_connections" in err["message"]
    assert closed_by_peer(over)
    gw.proc.wait_for_line(r"WARNING .*connection limit reached .*1 connections answered 503")

    def healthz_answers() -> None:
        probe = gw.connect()
        probe.sendall(request("GET", "/healthz"))
        health = read_response(probe)
        assert health.status == 200 and json.loads(health.body) == {"status": "ok"}
        assert closed_by_peer(probe)

    for _ in range(3):  # health answers while the limit holds, each time on a new connection
        healthz_answers()
    # Connections that connect and send nothing fill every triage slot: health still answers,
    # taking the place of the one silent longest.
    silent = [gw.connect() for _ in range(70)]
    healthz_answers()
    assert closed_by_peer(silent[0])

    callers.pop().close()  # a caller left: the next connection is served again

    def served() -> bool:
        sock = gw.connect()
        sock.sendall(request("GET", "/v1/models"))
        return read_response(sock).status == 200

    wait_until(served, timeout=DEADLINE_S, what="a connection to be served once one closed")
    assert metric(gw, "iop_gateway_connections_closed_total", reason="refused") == 1
    assert metric(gw, "iop_gateway_connections_closed_total", reason="evicted") >= 1  # silent ones in triage
    assert metric(gw, "iop_gateway_connections", slot="served") == 3


def test_waiting_callers_hold_no_redis_connection_and_the_pool_is_bounded_and_shrinks(
        stack: Stack, gateways: list[Gateway], redis_url: str) -> None:
    gw = start(stack, gateways, redis_max_connections=3, idle_timeout_ms=500)
    client = sync_redis.Redis.from_url(redis_url)
    client.hset("iop:provider:p", mapping={"health": "available", "capacity": 1})

    def gateway_connections() -> Counter[str]:
        """The gateway's connections by name: its pool's (`iop-gateway`), its inbox listener's and
        its scripts' (`common.redisline`)."""
        return Counter(c["name"] for c in client.client_list() if c["name"].startswith("iop-gateway"))

    def most_seen(seconds: float) -> Counter[str]:
        """The most of each kind seen over a window (a window to observe, not an event to wait for)."""
        most: Counter[str] = Counter()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            most |= gateway_connections()
            time.sleep(0.01)
        return most

    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    callers = [gw.connect() for _ in range(10)]
    for sock in callers:  # no scheduler runs: each one's run waits in the queue, its caller follows it
        sock.sendall(request("POST", "/v1/chat/completions", body, Content_Type="application/json"))
    wait_until(lambda: client.xlen(f"iop:runs:{MODEL}") == 10, timeout=DEADLINE_S, what="ten queued runs")
    # ten callers wait: the listener and the scripts' line, whatever the pool did to queue them
    most = most_seen(3.0)
    assert most["iop-gateway:inbox"] == 1 and most["iop-gateway:scripts"] == 1
    assert most["iop-gateway"] <= 3

    # requests that need the pool (the catalog's reads): at most its 3 connections at once
    readers = [gw.connect() for _ in range(20)]
    for sock in readers:
        sock.sendall(request("GET", "/v1/catalog"))
    busy = most_seen(1.0)
    assert all(read_response(sock).status == 200 for sock in readers)
    assert 1 <= busy["iop-gateway"] <= 3
    for sock in readers + callers:  # the callers leave: their runs are cancelled, the followers end
        sock.close()
    wait_until(lambda: client.xlen(f"iop:runs:{MODEL}") == 0, timeout=DEADLINE_S, what="the runs to be dropped")
    # the pool's connections are closed once idle; what stays is the listener and the scripts' line
    wait_until(lambda: gateway_connections() == Counter({"iop-gateway:inbox": 1, "iop-gateway:scripts": 1}),
               timeout=DEADLINE_S, what="the gateway's idle Redis connections to be closed")
    gw.proc.wait_for_line(r"closed \d+ idle Redis connections")
    client.close()


@pytest.mark.parametrize("raw", [
    b"GARBAGE\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Long: " + b"a" * 9000 + b"\r\n\r\n",
], ids=["not-http", "header-too-long"])
def test_a_request_aiohttp_cannot_parse_gets_an_openai_shaped_400(
        stack: Stack, gateways: list[Gateway], raw: bytes) -> None:
    gw = start(stack, gateways)
    sock = gw.connect()
    sock.sendall(raw)
    resp = read_response(sock)
    assert resp.status == 400 and has_its_own_request_id(resp)
    err = resp.error()
    assert err["code"] == "invalid_request_error" and err["message"].startswith("the request could not be parsed")
    assert closed_by_peer(sock)


def test_an_expectation_other_than_100_continue_gets_417(stack: Stack, gateways: list[Gateway]) -> None:
    gw = start(stack, gateways)
    sock = gw.connect()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 2\r\nExpect: foo\r\n\r\n")
    resp = read_response(sock)
    assert resp.status == 417 and has_its_own_request_id(resp) and resp.error()["param"] == "Expect"
    assert closed_by_peer(sock)


def test_a_request_head_over_64_kib_gets_a_400_before_it_ends(stack: Stack, gateways: list[Gateway]) -> None:
    """Each of its lines within aiohttp's 8 KiB, under its 128 headers, and no key: a hostile
    caller's 300 such heads, never ended, held 1.9 MB of the gateway a connection. The head is
    answered once it passes 64 KiB, without waiting for its end; a head of 60 KiB is served."""
    gw = start(stack, gateways)
    sock = gw.connect()
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n")
    for i in range(100):  # (100 KB in all; never a blank line)
        sock.sendall(b"X-Pad-%d: %s\r\n" % (i, b"a" * 1000))
    resp = read_response(sock)
    assert resp.status == 400
    err = resp.error()
    assert err["code"] == "invalid_request_error" and err["message"] == "the request head is over 64 KiB"
    assert closed_by_peer(sock)
    sock = gw.connect()
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n" + b"".join(
        b"X-Pad-%d: %s\r\n" % (i, b"a" * 1000) for i in range(60)) + b"\r\n")
    assert read_response(sock).status == 200


#: A head of 100 KB that never ends, each line within aiohttp's bounds.
ENDLESS_HEAD = b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n" + b"".join(
    b"X-Pad-%d: %s\r\n" % (i, b"a" * 1000) for i in range(100))
KEYS = {"keys": [{"name": "a", "sha256": hash_key("sk-right")}]}


def assert_large_head_answer(sock: socket.socket) -> None:
    resp = read_response(sock)
    assert resp.status == 400 and resp.error()["message"] == "the request head is over 64 KiB"
    assert b'": ' not in resp.body  # (compact JSON, as every other answer)
    assert has_its_own_request_id(resp)
    assert closed_by_peer(sock)


@pytest.mark.parametrize(("before", "auth"), [
    (b"\r\n\r\n", None),
    (request("GET", "/healthz"), None),
    (request("POST", "/v1/chat/completions", b"{}"), KEYS),
], ids=["blank-lines", "behind-a-request", "behind-a-refused-key"])
def test_a_head_over_64_kib_is_counted_wherever_it_begins(
        stack: Stack, gateways: list[Gateway], before: bytes, auth: dict[str, Any] | None) -> None:
    """(a review: a head behind blank lines (which llhttp skips), behind another request in the
    same write, or after an answer given before a body was read, went uncounted)"""
    gw = start(stack, gateways, auth)
    sock = gw.connect()
    sock.sendall(before + ENDLESS_HEAD)
    if before.strip():
        assert read_response(sock).status == (401 if auth else 200)  # (its answer first, then the 400)
    assert_large_head_answer(sock)


@pytest.mark.parametrize("bad", [
    b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nX-Long: " + b"a" * 9000 + b"\r\n\r\n",
    b"NOT HTTP AT ALL\r\n\r\n",
], ids=["a-line-over-8-kib", "not-http"])
def test_requests_before_a_head_the_parser_refuses_are_answered_first(stack: Stack, gateways: list[Gateway],
                                                                     bad: bytes) -> None:
    """(a review: sent in one write behind a request, a head aiohttp's parser refuses took the
    requests before it along: only the 400 came)"""
    gw = start(stack, gateways)
    sock = gw.connect()
    sock.sendall(request("GET", "/healthz") + request("POST", "/v1/chat/completions", b"{}") + bad)
    assert read_response(sock).status == 200
    resp = read_response(sock)
    assert resp.status == 400 and "model" in resp.error()["message"]  # (its body was read and parsed)
    resp = read_response(sock)
    assert resp.status == 400 and resp.error()["code"] == "invalid_request_error"
    assert closed_by_peer(sock)
    # the same when the bad head comes with the end of a body sent before it
    sock = gw.connect()
    whole = request("POST", "/v1/chat/completions", b'{"model": "x", "pad": "' + b"a" * 1000 + b'"}')
    sock.sendall(whole[:-100])
    sock.sendall(whole[-100:] + bad)
    resp = read_response(sock)
    assert resp.status == 400 and resp.error()["param"] == "messages", resp.body  # (its body was read whole)
    resp = read_response(sock)
    assert resp.status == 400 and resp.error()["code"] == "invalid_request_error"
    assert closed_by_peer(sock)


def test_a_body_is_never_taken_for_a_head(stack: Stack, gateways: list[Gateway]) -> None:
    """A body of 1 MB (blank lines among its JSON every 100 KB) sent behind another request in one
    write: what of it arrived after that request's answer was counted as a head and refused
    (found by a review, when the bytes came between that answer and the next request's start: a
    window this test cannot aim at; it holds the gateway to following each body's length)."""
    gw = start(stack, gateways)
    sock = gw.connect()
    body = b'{"pad": [' + b",\r\n\r\n".join([b'"' + b"a" * 100_000 + b'"'] * 10) + b"]}"
    sock.sendall(request("GET", "/healthz") + request("POST", "/v1/chat/completions", body))
    assert read_response(sock).status == 200
    resp = read_response(sock)
    assert resp.status == 400 and "model" in resp.error()["message"]  # (its body was read and parsed)
    sock.sendall(b"\r\n" + request("GET", "/healthz"))
    assert read_response(sock).status == 200


def test_a_head_sent_behind_a_request_has_its_deadline_from_that_answer(
        stack: Stack, gateways: list[Gateway]) -> None:
    """(a review: the deadline stopped for the request before it and never ran again: only the
    idle timeout ended such a head)"""
    gw = start(stack, gateways, header_timeout_ms=300)
    sock = gw.connect()
    sock.sendall(request("GET", "/healthz") + b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n")
    assert read_response(sock).status == 200
    resp = read_response(sock)
    assert resp.status == 408 and resp.error()["code"] == "request_timeout"


@pytest.mark.parametrize("refused", [
    request("POST", "/v1/chat/completions", b"{}"),
    request("OPTIONS", "/v1/chat/completions", Origin="https://app.example", Access_Control_Request_Method="POST"),
], ids=["key", "preflight"])
def test_after_an_answer_given_before_the_body_was_read_an_idle_connection_gets_no_408(
        stack: Stack, gateways: list[Gateway], refused: bytes) -> None:
    """A refused key or a preflight is answered before the body is read: the connection's head
    deadline went on running, and a kept-alive client that sent nothing more got an unprompted
    408 (found by a review). Now only the idle timeout closes it, with nothing sent."""
    gw = start(stack, gateways, KEYS, header_timeout_ms=300, idle_timeout_ms=1500,
               cors_origins=["https://app.example"])
    sock = gw.connect()
    sock.sendall(refused)
    assert read_response(sock).status in (401, 204)
    sock.settimeout(DEADLINE_S)
    assert sock.recv(65536) == b""


def test_a_transfer_coding_but_chunked_is_a_400_naming_it(stack: Stack, gateways: list[Gateway]) -> None:
    """(a hostile caller's audit: aiohttp ignores a `gzip` transfer coding, so the gzipped body was
    read as it came and refused as JSON that is not valid)"""
    import gzip

    gw = start(stack, gateways)
    body = gzip.compress(b'{"model": "m"}')
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    sock = gw.connect()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Transfer-Encoding: gzip, chunked\r\n\r\n" + chunked)
    resp = read_response(sock)
    err = resp.error()
    assert resp.status == 400 and err["param"] == "Transfer-Encoding"
    assert err["message"].startswith('Transfer-Encoding "gzip" is not supported')
    assert closed_by_peer(sock)
    sock = gw.connect()  # (chunked alone, and the obsolete identity, are read as ever)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Content-Encoding: gzip\r\nTransfer-Encoding: identity, chunked\r\n\r\n" + chunked)
    resp = read_response(sock)
    assert resp.status == 400 and "'messages' is required" in resp.error()["message"]


@pytest.mark.parametrize(("second", "fragment"), [
    ("br", 'Content-Encoding "br" is not supported'),
    ("gzip", "'model' is required"),  # (decoded: the body is {})
])
def test_content_encoding_on_two_header_lines_is_one_list(
        stack: Stack, gateways: list[Gateway], second: str, fragment: str) -> None:
    """(a hostile caller's audit: only the first line counted: `br` on a second one went unrefused,
    and a gzipped body on a second one was read as undecoded bytes)"""
    import gzip

    gw = start(stack, gateways)
    body = gzip.compress(b"{}")
    raw = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
           b"Content-Encoding: identity\r\nContent-Encoding: %s\r\nContent-Length: %d\r\n\r\n"
           % (second.encode(), len(body)) + body)
    sock = gw.connect()
    sock.sendall(raw)
    resp = read_response(sock)
    assert resp.status == 400 and fragment in resp.error()["message"], resp.error()


def test_a_gzipped_body_of_millions_of_arrays_gets_a_400_before_it_is_parsed(
        stack: Stack, gateways: list[Gateway]) -> None:
    """8 KiB gzipped, 7.7 MiB of `[]` once inflated: refused at the count of its arrays, before
    parsing (which, and the walk after it, held the gateway's one thread for seconds: a hostile
    caller's audit), with the gateway's other callers served meanwhile."""
    import gzip

    gw = start(stack, gateways)
    inner = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "x": [' + b",".join(
        [b"[]"] * 2_700_000) + b"]}"
    raw = request("POST", "/v1/chat/completions", gzip.compress(inner, 9), Content_Type="application/json",
                  Content_Encoding="gzip")
    sock = gw.connect()
    sock.sendall(raw)
    resp = read_response(sock)
    assert resp.status == 400
    err = resp.error()
    assert err["code"] == "invalid_request_error" and err["message"] == (
        "the request body holds more than 20000 JSON arrays and objects (runtime.max_json_containers)")
    sock.close()


@pytest.mark.parametrize("split", [False, True], ids=["head-and-body-together", "body-after-head"])
@pytest.mark.parametrize(("encoding", "body", "fragment"), [
    ("deflate", b"{}", "not valid deflate data"),
    ("gzip", b"\x1f\x8b\x08\x00garbage", "not valid gzip data"),
    ("br", b"{}", 'Content-Encoding "br" is not supported'),
])
def test_a_body_that_does_not_decode_gets_a_400_at_once(
        stack: Stack, gateways: list[Gateway], split: bool, encoding: str, body: bytes, fragment: str) -> None:
    gw = start(stack, gateways)  # the body timeout is far off: a body left open would show as a timeout here
    sock = gw.connect()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    raw = request("POST", "/v1/chat/completions", body, Content_Type="application/json", Content_Encoding=encoding)
    head, _, rest = raw.partition(b"\r\n\r\n")
    if split:
        sock.sendall(head + b"\r\n\r\n")
        sock.sendall(rest)
    else:
        sock.sendall(raw)
    resp = read_response(sock)
    assert resp.status == 400
    err = resp.error()
    assert err["code"] == "invalid_request_error" and fragment in err["message"]


def tiny_chunks(count: int) -> bytes:
    return b"1\r\nx\r\n" * count


CHUNKED_HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n")


@pytest.mark.parametrize("auth", [None, "Bearer sk-wrong"], ids=["with-a-key", "refused-key"])
def test_a_body_in_chunks_too_small_is_refused_and_its_connection_ends(
        stack: Stack, gateways: list[Gateway], auth: str | None) -> None:
    """A body in 1-byte chunks costs the gateway's thread ~2 µs a chunk whatever its size (8 MiB
    of them: 16 s, every other caller waiting); a request refused before its body was read (a
    wrong key) had aiohttp read and drop its body chunk by chunk for up to 10 s, then the client
    reconnected. Past 16,384 chunks, they must average 16 bytes: the request is answered 400 (or
    keeps its 401) and the connection ends; the rest of its bytes, and a request sent behind them,
    are dropped, where the old code served that request once the body had ended."""
    gw = start(stack, gateways, KEYS if auth else None)
    sock = gw.connect()
    head = CHUNKED_HEAD + (f"Authorization: {auth}\r\n".encode() if auth else b"") + b"\r\n"
    sock.sendall(head + b"1\r\n{\r\n" + tiny_chunks(FREE_CHUNKS + 100))
    resp = read_response(sock)
    if auth:
        assert resp.status == 401 and resp.error()["code"] == "invalid_api_key"
    else:
        assert resp.status == 400 and resp.error()["message"] == (
            "the request body came in chunks too small: more than 16384 of them must average at least 16 "
            "bytes; send it in larger chunks, or with a Content-Length")
    try:  # (the gateway may have closed already: a write then fails)
        sock.sendall(tiny_chunks(100) + b"0\r\n\r\n" + request("GET", "/healthz"))
    except OSError:
        pass
    assert _AHEAD.get(sock, b"") + rest_until_closed(sock) == b""  # (nothing after the answer: no 200)


#: A chunked body's last chunk, then trailers of 100 KB (each line within aiohttp's bounds).
LARGE_TRAILERS = b"2\r\n{}\r\n0\r\n" + b"".join(b"X-Pad-%d: %s\r\n" % (i, b"a" * 1000) for i in range(100)) + b"\r\n"


@pytest.mark.parametrize("auth", [None, "Bearer sk-wrong"], ids=["with-a-key", "refused-key"])
def test_trailers_over_64_kib_are_refused_at_once_and_the_connection_ends(
        stack: Stack, gateways: list[Gateway], auth: str | None) -> None:
    """Trailers (the header lines after a chunked body's last chunk) are held to a head's 64 KiB:
    past it, none of their bytes reached aiohttp, so the request waited for the end of its body
    until `runtime.body_timeout_ms` (60 s), and then heard 408 "the request body did not arrive".
    Its body is refused at once now (400; a refused key keeps its 401), the connection ends, and
    a request sent behind is dropped."""
    gw = start(stack, gateways, KEYS if auth else None)
    sock = gw.connect()
    head = CHUNKED_HEAD + (f"Authorization: {auth}\r\n".encode() if auth else b"") + b"\r\n"
    sock.sendall(head + LARGE_TRAILERS)
    resp = read_response(sock)
    if auth:
        assert resp.status == 401 and resp.error()["code"] == "invalid_api_key"
    else:
        assert resp.status == 400 and resp.error()["message"] == (
            "the request's trailers (the header lines after its chunked body) are over 64 KiB")
    try:  # (the gateway may have closed already: a write then fails)
        sock.sendall(request("GET", "/healthz"))
    except OSError:
        pass
    assert _AHEAD.get(sock, b"") + rest_until_closed(sock) == b""  # (nothing after the answer: no 200)


def rest_until_closed(sock: socket.socket, within_s: float = DEADLINE_S) -> bytes:
    """What the gateway sends until it closes the connection (a reset ends it too)."""
    sock.settimeout(within_s)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    return got


def test_a_chunked_body_of_fair_chunks_is_read_whole(stack: Stack, gateways: list[Gateway]) -> None:
    """A body sent from a generator, a chunk a piece: `requests`, httpx and aiohttp send each piece
    `json.JSONEncoder().iterencode` yields as a chunk, here 15,000 of 4.4 bytes on average (refused
    at first, after 1,024 chunks with a floor of 256 bytes: found by a review)."""
    gw = start(stack, gateways)
    messages = [{"role": "user", "content": f"message {i}"} for i in range(1500)]
    pieces = [p.encode() for p in json.JSONEncoder().iterencode({"model": "nope", "messages": messages}) if p]
    assert 10_000 < len(pieces) <= FREE_CHUNKS and sum(map(len, pieces)) / len(pieces) < MIN_CHUNK_BYTES
    sock = gw.connect()
    sock.sendall(CHUNKED_HEAD + b"\r\n" + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n")
    resp = read_response(sock)
    assert resp.status == 404 and resp.error()["code"] == "model_not_found"  # (read and parsed: the model is unknown)


def test_a_body_in_chunks_too_small_after_its_answer_ends_the_connection_without_a_traceback(
        stack: Stack, gateways: list[Gateway]) -> None:
    """A refused key is answered at once; its chunks come after the 401, while aiohttp reads and
    drops the body. When they show themselves too small, the connection ends as for any refused
    body (what still comes is dropped, then it closes): closing it at once left aiohttp's lingering
    read to find the connection gone, logged as an "Unhandled exception" with a RuntimeError
    traceback (at ERROR, once for every such client; found by a review)."""
    gw = start(stack, gateways, KEYS)
    sock = gw.connect()
    sock.sendall(CHUNKED_HEAD + b"Authorization: Bearer sk-wrong\r\n\r\n1\r\n{\r\n")
    assert read_response(sock).status == 401  # (answered before its body came)
    for _ in range(11):  # (in pieces: the gateway reads them as they come, some after the refusal)
        try:
            sock.sendall(tiny_chunks(100))
        except OSError:
            break
        select.select([], [], [], 0.01)  # (a pace for the bytes, not a wait for something)
    assert rest_until_closed(sock) == b""
    # a later line of the gateway's: whatever the refused connection logged came before it
    other = gw.connect()
    other.sendall(b"NOT HTTP\r\n\r\n")
    assert read_response(other).status == 400
    gw.proc.wait_for_line(r"unparsable request")
    assert "Traceback" not in gw.proc.output(200) and "Unhandled exception" not in gw.proc.output(200)


def test_a_chunked_body_left_unread_by_its_answer_is_dropped_unparsed_and_the_connection_ends(
        stack: Stack, gateways: list[Gateway]) -> None:
    """A refused key is answered before its body is read: aiohttp read the rest of a chunked body
    through its parser, chunk by chunk, for up to 10 s (a keyless client looping on such bodies cost
    the gateway ~4.5 ms a connection; found by a review), then served the request sent behind it.
    Now what still comes is dropped unparsed, and the connection ends: no answer to that request."""
    gw = start(stack, gateways, KEYS)
    sock = gw.connect()
    sock.sendall(CHUNKED_HEAD + b"Authorization: Bearer sk-wrong\r\n\r\n1\r\n{\r\n")
    assert read_response(sock).status == 401
    try:
        sock.sendall(tiny_chunks(200) + b"0\r\n\r\n" + request("GET", "/healthz"))
    except OSError:
        pass
    assert _AHEAD.get(sock, b"") + rest_until_closed(sock) == b""
