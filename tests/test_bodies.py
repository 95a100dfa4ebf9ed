"""gateway.bodies: request bodies decoded within the size limit, every fault a 400 (or 413)."""

from __future__ import annotations

import gzip
import zlib

import pytest

from common.wire import ErrorCode
from gateway.bodies import decode
from gateway.errors import ApiError


def gz(data: bytes) -> bytes:
    """gzip with a fixed mtime: the parameters' ids are the same at every collection (pytest-xdist's
    workers each collect them, and must agree)."""
    return gzip.compress(data, mtime=0)


BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


def raw_deflate(data: bytes) -> bytes:
    c = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return c.compress(data) + c.flush()


@pytest.mark.parametrize(("encoding", "data"), [
    ("", BODY),
    ("identity", BODY),
    ("gzip", gz(BODY)),
    ("x-gzip", gz(BODY)),
    ("GZip", gz(BODY)),
    ("deflate", zlib.compress(BODY)),
    ("deflate", raw_deflate(BODY)),  # without zlib's header, as some clients send it
    ("deflate, gzip", gz(zlib.compress(BODY))),  # applied in that order
    ("identity, gzip, identity, x-gzip", gz(gz(BODY))),  # (identity is no coding)
    ("gzip, identity", gz(BODY)),
    ("gzip", gz(BODY[:5]) + gz(BODY[5:])),  # (two members, as `cat a.gz b.gz`: it was refused)
    ("gzip", gz(b"") * 63 + gz(BODY)),
])
def test_supported_encodings_are_undone(encoding: str, data: bytes) -> None:
    assert decode(data, encoding, 4096) == BODY


def rejected(data: bytes, encoding: str, limit: int = 4096) -> ApiError:
    with pytest.raises(ApiError) as info:
        decode(data, encoding, limit)
    return info.value


@pytest.mark.parametrize(("encoding", "data", "fragment"), [
    ("br", BODY, 'Content-Encoding "br" is not supported'),
    ("zstd, gzip", gz(BODY), 'Content-Encoding "zstd" is not supported'),
    ("gzip", BODY, "the request body is not valid gzip data: incorrect header check"),  # (not zlib's "Error -3 ...")
    ("deflate", b"{}", "not valid deflate data"),
    ("gzip", gz(BODY)[:-6], "does not end where the body ends"),  # cut short
    ("deflate", zlib.compress(BODY) + b"tail", "does not end where the body ends"),
    ("gzip", gz(BODY) + b"tail", "incorrect header check"),
    ("gzip", gz(BODY) + gz(BODY)[:-6], "does not end where the body ends"),
    ("gzip", gz(b"") * 64 + gz(BODY), "holds more than 64 gzip members"),
    # (each layer undoes up to the limit: thousands of them held the gateway's thread for seconds)
    ("gzip, gzip, gzip", gz(gz(gz(BODY))), "lists more than 2 codings"),
    ("gzip, identity, deflate, gzip", gz(zlib.compress(gz(BODY))), "lists more than 2 codings"),
    ("br, br, br", BODY, 'Content-Encoding "br" is not supported'),  # (what the caller must change, first)
])
def test_faults_are_a_400_naming_them(encoding: str, data: bytes, fragment: str) -> None:
    err = rejected(data, encoding)
    assert err.status == 400 and err.code is ErrorCode.INVALID_REQUEST
    assert fragment in err.message


def test_a_body_larger_than_the_limit_once_decoded_is_a_413() -> None:
    bomb = gz(b"\0" * 1_000_000)  # about 1 KB that inflates to 1 MB
    assert len(bomb) < 4096
    err = rejected(bomb, "gzip", limit=4096)
    assert err.status == 413 and err.code is ErrorCode.REQUEST_TOO_LARGE
    assert decode(gz(b"\0" * 4096), "gzip", 4096) == b"\0" * 4096  # exactly the limit fits
    assert rejected(gz(b"\0" * 4000) * 2, "gzip", limit=4096).status == 413  # (members together)
    assert decode(gz(b"\0" * 2048) * 2, "gzip", 4096) == b"\0" * 4096
