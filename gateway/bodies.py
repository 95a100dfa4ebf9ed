"""Reading a request body within its limits: time (`runtime.body_timeout_ms`, enforced by the
caller), size (`runtime.max_body_bytes`, counted after decoding) and `Content-Encoding`. Pure.

The gateway's own connections (`gateway.connections`) are served with aiohttp's decoding off and
decode here instead: aiohttp 3.14 leaves the body of a `deflate` request open forever when its
stream breaks off after the head was already handled, so the request would wait for its body
until the body timeout. Decoding here also makes every encoding error an OpenAI-shaped 400.
"""

from __future__ import annotations

import zlib

from common.shown import quoted
from common.wire import ErrorCode
from gateway.errors import ApiError, invalid

#: zlib window bits per encoding: gzip's header, zlib's header (the RFC's "deflate").
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def too_large(limit: int, *, declared: int | None = None, sent: bool = False) -> ApiError:
    """413: the body is over `limit` bytes, as its head declares it (`declared`: refused before
    it is read), as sent (`sent`: a body of no declared length, chunked), or once decoded."""
    if declared is not None:
        return ApiError(ErrorCode.REQUEST_TOO_LARGE, f"request body is too large: its Content-Length ({declared}) "
                        f"is more than {limit} bytes (runtime.max_body_bytes)")
    return ApiError(ErrorCode.REQUEST_TOO_LARGE, f"request body is too large: more than {limit} bytes"
                    f"{'' if sent else ' once decoded'} (runtime.max_body_bytes)")


#: gzip members one body may hold (each costs a new inflater: millions of empty ones would hold
#: the gateway's thread for seconds)
MAX_GZIP_MEMBERS = 64


def _inflate(data: bytes, encoding: str, limit: int) -> bytes:
    """`data` inflated: a gzip body may hold several members one after the other (RFC 1952, as
    `cat a.gz b.gz` makes; at most `MAX_GZIP_MEMBERS`), each inflated in turn; at most `limit`
    bytes in all."""
    wbits = _WBITS[encoding]
    if encoding == "deflate" and data[:1] and data[0] & 0x0F != 8:
        wbits = -zlib.MAX_WBITS  # raw deflate without zlib's header, as some clients send it
    out = bytearray()
    for _ in range(MAX_GZIP_MEMBERS):
        inflater = zlib.decompressobj(wbits)
        try:
            out += inflater.decompress(data, limit + 1 - len(out))
        except zlib.error as exc:  # ("Error -3 while decompressing data: incorrect header check": after the colon)
            why = str(exc).rpartition(": ")[2] or "it does not decode"
            raise invalid(f"the request body is not valid {encoding} data: {why}") from None
        if len(out) > limit:
            raise too_large(limit)
        if not inflater.eof or (inflater.unused_data and wbits != _WBITS["gzip"]):
            raise invalid(f"the request body is not valid {encoding} data: it does not end where the body ends")
        data = inflater.unused_data
        if not data:
            return bytes(out)
    raise invalid(f"the request body holds more than {MAX_GZIP_MEMBERS} gzip members")


#: codings other than `identity` one body may carry: each undoes up to `limit` bytes on the
#: gateway's thread, and no client applies more than one (a body in 4,000 layers of 8 MiB held the
#: gateway for 17 s)
MAX_CODINGS = 2


def decode(data: bytes, content_encoding: str, limit: int) -> bytes:
    """`data` with the encodings of `content_encoding` undone (last applied, first undone); each
    result at most `limit` bytes (else 413), any fault 400; more than `MAX_CODINGS` codings are
    refused before any is undone."""
    encodings = [e.strip().lower() for e in content_encoding.split(",") if e.strip()]
    for encoding in encodings:  # (one it cannot undo is said first: it is what the caller must change)
        if encoding != "identity" and encoding not in _WBITS:
            raise invalid(f"Content-Encoding {quoted(encoding)} is not supported (gzip, deflate or identity)",
                          param="Content-Encoding")
    if sum(encoding != "identity" for encoding in encodings) > MAX_CODINGS:
        raise invalid(f"the request body's Content-Encoding lists more than {MAX_CODINGS} codings",
                      param="Content-Encoding")
    for encoding in reversed(encodings):
        if encoding != "identity":
            data = _inflate(data, encoding, limit)
    return data
