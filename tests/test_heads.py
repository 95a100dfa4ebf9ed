"""`gateway.heads`: where each request head lies in a connection's bytes, whatever the reads."""

from __future__ import annotations

import itertools

import pytest

from gateway.heads import CHUNKED, FREE_CHUNKS, MIN_CHUNK_BYTES, UNKNOWN, HeadScanner, framing

LIMIT = 1024


def head(path: str = "/", *lines: str) -> bytes:
    return ("\r\n".join([f"POST {path} HTTP/1.1", "Host: x", *lines]) + "\r\n\r\n").encode()


GET = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
BODY = b"{" + b"\r\n\r\n" * 700 + b"}"  # (blank lines in a body, 2,802 bytes: over the limit if taken for a head)
WITH_LENGTH = head("/a", f"Content-Length: {len(BODY)}") + BODY
CHUNKED_BODY = (head("/b", "Transfer-Encoding: gzip, chunked")
                + b"5;ext=\"a\"\r\n\r\n\r\n\r\r\n" + b"%x\r\n" % len(BODY) + BODY + b"\r\n0\r\nX-Trailer: 1\r\n\r\n")
NO_TRAILERS = head("/c", "transfer-encoding: chunked") + b"3\r\nabc\r\n0\r\n\r\n"
#: Every framing, and the CR/LF llhttp skips before a request line.
STREAM = GET + WITH_LENGTH + b"\r\n\r\n" + CHUNKED_BODY + NO_TRAILERS + GET


def scan(data: bytes, cuts: list[int], limit: int = LIMIT) -> tuple[HeadScanner, list[int]]:
    scanner = HeadScanner(limit)
    bounds = [0, *cuts, len(data)]
    return scanner, [scanner.feed(data[a:b]) for a, b in itertools.pairwise(bounds)]


def test_every_head_is_found_wherever_the_reads_cut_the_bytes() -> None:
    for cut in range(1, len(STREAM)):
        for cuts in ([cut], [cut, min(cut + 1, len(STREAM))], [cut // 2, cut]):
            scanner, taken = scan(STREAM, cuts)
            bounds = [0, *cuts, len(STREAM)]
            assert taken == [b - a for a, b in itertools.pairwise(bounds)], cuts
            assert scanner.heads == 5 and not scanner.in_head, cuts


def test_a_read_says_where_its_heads_begin() -> None:
    """(the gateway gives aiohttp's parser a pipelined read one request at a time)"""
    scanner = HeadScanner(LIMIT)
    scanner.feed(STREAM)
    chunked_at = len(GET + WITH_LENGTH) + 4  # (after the blank lines skipped before it)
    assert scanner.starts == [0, len(GET), chunked_at, chunked_at + len(CHUNKED_BODY),
                              chunked_at + len(CHUNKED_BODY + NO_TRAILERS)]
    scanner.feed(GET[:5])
    assert scanner.starts == [0]
    scanner.feed(GET[5:] + b"\r\n" + GET)  # (a head that began in an earlier read is not begun again)
    assert scanner.starts == [len(GET) - 5 + 2]


def test_a_head_is_in_progress_from_its_first_byte_to_its_blank_line() -> None:
    scanner = HeadScanner(LIMIT)
    scanner.feed(b"\r\n\r\n")
    assert not scanner.in_head  # (what llhttp skips between requests is no head)
    for i, byte in enumerate(GET):
        scanner.feed(bytes([byte]))
        assert scanner.in_head == (i < len(GET) - 1)
    scanner.feed(WITH_LENGTH[:len(WITH_LENGTH) - len(BODY) + 5])
    assert not scanner.in_head  # in its body


@pytest.mark.parametrize("before", [b"", GET, WITH_LENGTH + b"\r\n", CHUNKED_BODY, b"\r\n" * 5000],
                         ids=["first", "after-get", "after-body", "after-chunked", "after-blank-lines"])
def test_a_head_over_the_limit_is_found_where_it_begins(before: bytes) -> None:
    big = b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"a" * LIMIT + b"\r\n"
    scanner, taken = scan(before + big, [])
    assert taken == [len(before)]
    for cut in (len(before) + 10, len(before) + LIMIT - 10):  # (read in two parts: the second one is refused whole)
        scanner, taken = scan(before + big, [cut])
        assert taken == [cut, 0]


def test_a_head_at_the_limit_is_within_it() -> None:
    exact = b"GET / HTTP/1.1\r\nX: " + b"a" * (LIMIT - 23) + b"\r\n\r\n"
    assert len(exact) == LIMIT
    scanner, taken = scan(exact + exact, [LIMIT - 2])
    assert taken == [LIMIT - 2, LIMIT + 2] and scanner.heads == 2


@pytest.mark.parametrize("unframed", [
    head("/", "Upgrade: websocket", "Connection: Upgrade"),
    b"CONNECT x:443 HTTP/1.1\r\nHost: x:443\r\n\r\n",
    head("/", "Transfer-Encoding: chunked, gzip"),
    head("/", "Transfer-Encoding: chunked", "Content-Length: 3"),
    head("/", "Transfer-Encoding: chunked") + b"zz\r\n",
    head("/", "Transfer-Encoding: chunked") + b"1" * 5000,
], ids=["upgrade", "connect", "not-chunked-last", "both", "bad-size", "endless-size"])
def test_what_cannot_be_followed_stops_the_scan_and_nothing_after_it_is_refused(unframed: bytes) -> None:
    scanner, taken = scan(unframed + b"x" * (4 * LIMIT) + b"\r\n", [len(unframed)])
    assert taken == [len(unframed), 4 * LIMIT + 2] and not scanner.in_head


@pytest.mark.parametrize(("raw", "expected"), [
    (GET, 0),
    (head("/", "content-length:  12 "), 12),
    (head("/", "CONTENT-LENGTH: 7"), 7),
    (head("/", "X-Content-Length: 7"), 0),
    (head("/", "Transfer-Encoding: gzip", "Transfer-Encoding: chunked"), CHUNKED),
    (head("/", "Transfer-Encoding: chunked", "Transfer-Encoding: gzip"), UNKNOWN),
    (head("/", "Upgrade: h2c"), UNKNOWN),
])
def test_framing_follows_the_headers_as_llhttp_does(raw: bytes, expected: int) -> None:
    assert framing(raw) == expected


def chunks(sizes: list[int]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (n, b"x" * n) for n in sizes)


def test_a_chunked_body_whose_chunks_are_too_small_stops_the_scan_before_the_chunk_that_shows_it() -> None:
    """Past FREE_CHUNKS, a body's chunks must average MIN_CHUNK_BYTES (a chunk costs
    the gateway's thread the same whatever its size: 1-byte chunks made an 8 MiB body 16 s of it)."""
    start = head("/b", "Transfer-Encoding: chunked")
    first = chunks([1] * FREE_CHUNKS)
    scanner = HeadScanner(LIMIT)
    assert scanner.feed(start + first) == len(start + first) and not scanner.chunks_refused
    assert scanner.feed(b"1\r\nx\r\n") == 0 and scanner.chunks_refused
    assert scanner.feed(b"1\r\nx\r\n") == 6  # (nothing more is scanned)


@pytest.mark.parametrize("sizes", [
    [MIN_CHUNK_BYTES] * (FREE_CHUNKS + 10),  # at the average, past the free ones
    [1] * FREE_CHUNKS + [MIN_CHUNK_BYTES * (FREE_CHUNKS + 20)] + [1] * 10,  # small ones paid for by a big one
], ids=["average", "paid-for"])
def test_a_chunked_body_of_chunks_at_the_average_is_followed_whole(sizes: list[int]) -> None:
    data = head("/b", "Transfer-Encoding: chunked") + chunks(sizes) + b"0\r\n\r\n" + GET
    for cut in (7, len(data) // 2):
        scanner, taken = scan(data, [cut])
        assert sum(taken) == len(data) and not scanner.chunks_refused
        assert scanner.heads == 2


def test_each_chunked_body_is_counted_on_its_own() -> None:
    """A connection's second body starts its count afresh."""
    body = head("/b", "Transfer-Encoding: chunked") + chunks([1] * FREE_CHUNKS) + b"0\r\n\r\n"
    scanner, taken = scan(body * 3, [])
    assert taken == [len(body) * 3] and scanner.heads == 3 and not scanner.chunks_refused
