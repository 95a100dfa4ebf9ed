"""What an embeddings answer must hold for the caller's client to take it.

A provider's answer with fewer vectors than inputs, `data` that is not a list of objects, or an
`embedding` that is neither a list of (finite) numbers (or of lists of them) nor base64 text of
32-bit floats (its bytes a multiple of 4) would reach the caller as a 200 its client then fails on
(`'str' object has no attribute 'embedding'`, "Incorrect padding", "bytes length not a multiple of
item size"): it is the provider's error instead.

A caller that asked for `encoding_format: base64` gets base64 whatever the provider sent:
llama-cpp-python's server ignores the field and answers numbers (`in_base64`); one that asked for
numbers gets numbers (`in_numbers`). An answer base64 cannot carry is no answer to such a caller
(`in_base64` says why): the official Node.js client asks for base64 unless told, and reads each
embedding as base64 without looking, so numbers became an empty or wrong vector, silently.
"""

from __future__ import annotations

import base64
import binascii
import math
import struct
from typing import Any

#: the bytes of each number of a base64 embedding (OpenAI's: little-endian 32-bit floats)
FLOAT_BYTES = 4


def count_problem(count: int, asked: int) -> str | None:
    """What is wrong with `count` embeddings for `asked` inputs (None: nothing)."""
    return f"with {count} embeddings for {asked} inputs" if count != asked else None


def embeddings_problem(answer: dict[str, Any], asked: int, decoded: dict[int, bytes] | None = None) -> str | None:
    """What is wrong with an embeddings answer for `asked` inputs (None: nothing). `decoded`: given,
    it gets the bytes of each base64 embedding, by its place in `data` (for `in_numbers`, which would
    decode it again)."""
    data = answer.get("data")
    if not isinstance(data, list) or not all(isinstance(d, dict) for d in data):
        return "whose data is not a list of objects"
    if len(data) != asked:
        return count_problem(len(data), asked)
    for place, item in enumerate(data):
        vector = item.get("embedding")
        if isinstance(vector, str):
            try:
                packed = binascii.a2b_base64(vector, strict_mode=True)
            except ValueError:
                return "with an embedding that is neither numbers nor base64"
            if len(packed) % FLOAT_BYTES:  # ("AAA=": 2 bytes; the openai client's default call raised ValueError)
                return f"with a base64 embedding of {len(packed)} bytes, not 32-bit floats"
            if decoded is not None:
                decoded[place] = packed
        elif not isinstance(vector, list) or not (are_numbers(vector)
                                                  or all(is_number(x) or _are_numbers(x) for x in vector)):
            return "with an embedding that is neither numbers nor base64"
    return None


def is_number(value: Any) -> bool:
    """A number a caller's client takes: finite (a provider's `NaN`, `Infinity` or `1e400`, which
    JSON has not and Python reads, reached the caller as null, or as NaN inside base64), and within
    a double (an integer of 401 digits came back as it was: a client's float() of it fails)."""
    try:
        return type(value) in _NUMBERS and math.isfinite(value)
    except OverflowError:  # (an int beyond a double)
        return False


#: the types of a number in a provider's JSON (not bool, which is an int to Python)
_NUMBERS = frozenset({int, float})


def are_numbers(vector: list[Any]) -> bool:
    """`is_number` of each, at C's pace (a check per number in Python took ~360 ms for 1,000
    vectors of 4,096, on the worker's event loop)."""
    try:
        return set(map(type, vector)) <= _NUMBERS and all(map(math.isfinite, vector))
    except OverflowError:  # (an int beyond a double)
        return False


def _are_numbers(value: Any) -> bool:
    """A vector of numbers: llama-cpp-python's server gives one for each token of an input when its
    model does no pooling, a list of them where OpenAI's has numbers."""
    return isinstance(value, list) and are_numbers(value)


def base64_vector(vector: list[float]) -> str:
    """A vector as OpenAI's base64 embedding: little-endian 32-bit floats. ValueError when a
    number is beyond what a 32-bit float holds."""
    try:
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    except (OverflowError, struct.error):
        raise ValueError("an embedding beyond 32-bit floats") from None


def in_numbers(answer: dict[str, Any], decoded: dict[int, bytes] | None = None) -> None:
    """Write the embeddings of a checked answer (`embeddings_problem`) that came as base64 as numbers,
    in place, for a caller that asked for numbers (OpenAI's default): a server that answers base64
    whatever it is asked handed such a caller a string where its client's type has a list of floats.
    One holding a NaN or an infinity (which JSON cannot carry) stays as it came. `decoded`: the bytes
    `embeddings_problem` decoded, by place (those it lacks are decoded here)."""
    for place, item in enumerate(answer["data"]):
        vector = item["embedding"]
        if isinstance(vector, str):
            packed = decoded[place] if decoded is not None and place in decoded else base64.b64decode(vector)
            numbers = list(struct.unpack(f"<{len(packed) // FLOAT_BYTES}f", packed))
            if all(map(math.isfinite, numbers)):
                item["embedding"] = numbers


#: `in_base64`'s reasons, as the words after "answered": one vector per token (a model without
#: pooling), and numbers no 32-bit float holds
PER_TOKEN = "one vector per token of each input"
BEYOND_FLOATS = "embeddings beyond 32-bit floats (base64's numbers)"


def in_base64(answer: dict[str, Any]) -> str | None:
    """Write the embeddings of a checked answer (`embeddings_problem`) that came as numbers in
    base64, in place. None when each now is, else why one cannot be (`PER_TOKEN`, `BEYOND_FLOATS`):
    the answer is then left as it came."""
    encoded: list[tuple[dict[str, Any], str]] = []
    for item in answer["data"]:
        vector = item["embedding"]
        if isinstance(vector, str):
            continue
        if not are_numbers(vector):  # (checked: lists of numbers, one a token)
            return PER_TOKEN
        try:
            encoded.append((item, base64_vector(vector)))
        except ValueError:
            return BEYOND_FLOATS
    for item, text in encoded:
        item["embedding"] = text
    return None
