"""Where each request head lies in a connection's bytes, so that it is held to its limit as it
arrives (`gateway.connections`): a head, its body by its framing (`Content-Length`, or chunked with
its trailers), the next head, and so on, as llhttp (aiohttp's parser) reads them. A reply, a
refusal or a pipelined request changes nothing: the bytes alone say where each head begins.

The scan follows well-formed HTTP/1.1 only; on anything else llhttp refuses the request and the
connection closes anyway. Where the framing cannot be known (an `Upgrade` or `CONNECT` request, a
`Transfer-Encoding` that is not chunked, a chunk size line it cannot read) the scan stops, and
only aiohttp's own bounds hold what follows: a head is never mistaken for a body or a body for a
head.
"""

from __future__ import annotations

import enum
import re

#: Headers that decide where a request's body ends (lower case, as in a lowered head).
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*([0-9]+)[ \t]*\r\n")
_TRANSFER_ENCODING = re.compile(rb"\r\ntransfer-encoding:([^\r]*)")
#: (plain searches: a regex alternation with `^` took 4.7 µs on an `openai` client's head, these 0.3)
_UPGRADE = b"\r\nupgrade:"
_CONNECT = b"connect "
#: A chunk size line longer than this is not followed (llhttp reads extensions of any length).
MAX_CHUNK_LINE = 4096
#: A chunked body of more than `FREE_CHUNKS` chunks must average at least `MIN_CHUNK_BYTES` a chunk
#: (a chunk costs this scan and aiohttp's parser ~2 µs whatever its size: an 8 MiB body in 1-byte
#: chunks took the gateway's thread 16 s, its other callers waiting; now at most ~35 ms for the free
#: chunks, and ~1 s for an 8 MiB body at the average). A body sent from a generator goes a chunk a
#: piece (`requests`, httpx, aiohttp): `json.JSONEncoder().iterencode` of a chat averages 4 to 35
#: bytes a piece, ten pieces a message, so the free chunks are many.
FREE_CHUNKS = 16_384
MIN_CHUNK_BYTES = 16
_HEX = frozenset(b"0123456789abcdefABCDEF")
_BLANK_LINE = b"\r\n\r\n"


class Mode(enum.Enum):
    HEAD = "head"  # a head, or the CR/LF llhttp skips before one
    BODY = "body"  # `_left` bytes of a body
    CHUNK_LINE = "chunk line"  # a chunk's size line
    CHUNK_DATA = "chunk data"  # `_left` bytes: a chunk and its CRLF
    TRAILERS = "trailers"  # after the last chunk: trailer lines up to a blank line
    LOST = "lost"  # framing unknown: nothing more is scanned


#: What follows a head: a body of so many bytes, a chunked one, or what the scan cannot follow.
CHUNKED = -1
UNKNOWN = -2


def framing(head: bytes) -> int:
    """What follows a whole request head (its request line up to its blank line): the length of
    its body (0 for none), `CHUNKED`, or `UNKNOWN`."""
    low = head.lower()
    if _UPGRADE in low or low.startswith(_CONNECT):
        return UNKNOWN
    codings = b",".join(_TRANSFER_ENCODING.findall(low))
    if codings:
        chunked = codings.rpartition(b",")[2].strip(b" \t") == b"chunked" and b"\r\ncontent-length:" not in low
        return CHUNKED if chunked else UNKNOWN  # (llhttp refuses a request with both)
    length = _CONTENT_LENGTH.search(low)
    return int(length.group(1)) if length is not None else 0


class HeadScanner:
    """Follows one connection's bytes (`feed`, in the order they came) and counts each head's."""

    __slots__ = ("_limit", "_mode", "_left", "_count", "_tail", "_head", "heads", "starts", "_chunks", "_chunk_bytes",
                 "chunks_refused")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        #: heads read whole so far
        self.heads = 0
        #: where heads began in the bytes of the last `feed`
        self.starts: list[int] = []
        self._mode = Mode.HEAD
        self._left = 0
        #: bytes of the current head (or trailers) so far, past the CR/LF skipped before it
        self._count = 0
        #: the last (up to) three bytes seen of the current head or trailers: its blank line may
        #: straddle two reads
        self._tail = b""
        #: the current head so far, when it began in an earlier read (at most `limit` bytes)
        self._head = bytearray()
        #: the chunks of the current chunked body so far, and their bytes
        self._chunks = 0
        self._chunk_bytes = 0
        #: the last head's chunked body came in chunks too small (`MIN_CHUNK_BYTES`): `feed` stopped
        #: before the chunk that showed it, and nothing more is scanned
        self.chunks_refused = False

    @property
    def in_trailers(self) -> bool:
        """A chunked body's last chunk came, and the blank line that ends its trailers has not."""
        return self._mode is Mode.TRAILERS

    @property
    def in_head(self) -> bool:
        """A head has begun and its blank line has not come."""
        return self._mode is Mode.HEAD and self._count > 0

    def feed(self, data: bytes) -> int:
        """Scan the next bytes; how many of them may be parsed: all, or those before a head (or a
        trailer section) that passed the limit, or before a chunk of a body whose chunks are too
        small (`chunks_refused`), when one did (nothing more is to be scanned)."""
        i, n = 0, len(data)
        self.starts = []
        while i < n:
            mode = self._mode
            if mode is Mode.BODY or mode is Mode.CHUNK_DATA:
                take = min(self._left, n - i)
                self._left -= take
                i += take
                if self._left == 0:
                    self._mode = Mode.HEAD if mode is Mode.BODY else Mode.CHUNK_LINE
            elif mode is Mode.HEAD or mode is Mode.TRAILERS:
                i, over = self._section(data, i)
                if over:
                    return i
            elif mode is Mode.CHUNK_LINE:
                at, i = i, self._chunk_line(data, i)
                if self.chunks_refused:
                    return at
            else:  # LOST
                break
        return n

    def _section(self, data: bytes, i: int) -> tuple[int, bool]:
        """Read a head or the trailers from `data[i:]` up to its blank line: where the scan goes
        on, or (when it passed the limit) where its bytes in `data` begin, and True."""
        n = len(data)
        if self._mode is Mode.HEAD and self._count == 0:
            while i < n and data[i] in b"\r\n":  # (llhttp skips these between requests)
                i += 1
            if i == n:
                return n, False
            self.starts.append(i)
        start, tail = i, self._tail
        end = -1
        if tail:
            joined = tail + data[i:i + 3]
            k = joined.find(_BLANK_LINE)
            if k >= 0:
                end = i + k + 4 - len(tail)
        if end < 0:
            k = data.find(_BLANK_LINE, i)
            end = k + 4 if k >= 0 else -1
        if end < 0:
            self._count += n - start
            if self._count > self._limit:
                return start, True
            self._tail = (tail + data[start:])[-3:]
            if self._mode is Mode.HEAD:
                self._head += data[start:]
            return n, False
        self._count += end - start
        if self._count > self._limit:
            return start, True
        if self._mode is Mode.TRAILERS:
            self._mode = Mode.HEAD
        else:
            head = bytes(self._head) + data[start:end] if self._head else data[start:end]
            self._head.clear()
            self.heads += 1
            self._follow(framing(head))
        self._count, self._tail = 0, b""
        return end, False

    def _follow(self, body: int) -> None:
        if body == CHUNKED:
            self._mode, self._chunks, self._chunk_bytes = Mode.CHUNK_LINE, 0, 0
        elif body == UNKNOWN:
            self._mode = Mode.LOST
        elif body > 0:
            self._mode, self._left = Mode.BODY, body
        # else: no body; the next head follows

    def _chunk_line(self, data: bytes, i: int) -> int:
        """Read a chunk's size line: its chunk follows, or after the last one its trailers."""
        k = data.find(b"\n", i)
        if k < 0:
            self._head += data[i:]
            if len(self._head) > MAX_CHUNK_LINE:
                self._head.clear()
                self._mode = Mode.LOST
            return len(data)
        line = bytes(self._head) + data[i:k] if self._head else data[i:k]
        self._head.clear()
        digits = line.partition(b";")[0].strip(b" \t\r")
        if not digits or len(digits) > 16 or not _HEX.issuperset(digits):
            self._mode = Mode.LOST
        elif (size := int(digits, 16)) == 0:
            self._mode, self._count, self._tail = Mode.TRAILERS, 0, b"\r\n"
        else:
            self._chunks += 1
            self._chunk_bytes += size
            if self._chunks > FREE_CHUNKS and self._chunk_bytes < self._chunks * MIN_CHUNK_BYTES:
                self._mode, self.chunks_refused = Mode.LOST, True
            else:
                self._mode, self._left = Mode.CHUNK_DATA, size + 2
        return k + 1
