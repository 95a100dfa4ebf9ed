"""A request's max_tokens (in words) and stop strings applied to a CLI tool's output, however the
output is split into pieces."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workers.adapters import text_limits
from workers.adapters.text_limits import TextLimits


def run(limits: TextLimits, pieces: list[str]) -> tuple[str, str | None]:
    out = ""
    for piece in pieces:
        out += limits.feed(piece)
        if limits.finish:
            return out, limits.finish
    return out + limits.feed("", final=True), limits.finish


@pytest.mark.parametrize(("body", "pieces", "expected"), [
    ({"max_tokens": 3}, ["one two three four five"], ("one two three", "length")),
    ({"max_tokens": 3}, ["one tw", "o thr", "ee", " four"], ("one two three", "length")),
    ({"max_tokens": 3}, ["one two three"], ("one two three", "length")),  # (its last word ends with the output)
    ({"max_tokens": 5}, ["one two three\n"], ("one two three\n", None)),
    ({"max_completion_tokens": 1, "max_tokens": 9}, ["a b"], ("a", "length")),
    ({"max_completion_tokens": None, "max_tokens": 1}, ["a b"], ("a", "length")),  # (an unset one: null)
    ({"max_completion_tokens": 1, "max_tokens": None}, ["a b"], ("a", "length")),
    ({"max_tokens": 0}, ["a b"], ("", "length")),
    ({"stop": "END"}, ["abc E", "ND def"], ("abc ", "stop")),
    ({"stop": ["x", "yz"]}, ["ab", "cy", "zq x"], ("abc", "stop")),
    ({"stop": "END", "max_tokens": 2}, ["a b END c"], ("a b", "length")),
    ({"stop": "END", "max_tokens": 9}, ["a bEND c"], ("a b", "stop")),
    ({"stop": "END"}, ["no stop at all EN"], ("no stop at all EN", None)),
    ({"stop": 5, "max_tokens": "3"}, ["a b c d"], ("a b c d", None)),  # (not iop's to judge: the tool's)
])
def test_the_output_ends_at_the_first_limit(body: dict[str, Any], pieces: list[str],
                                             expected: tuple[str, str | None]) -> None:
    assert run(TextLimits.of(body), pieces) == expected


@given(st.text(alphabet="ab \nS", max_size=40), st.lists(st.integers(0, 40), max_size=6),
       st.integers(0, 8), st.booleans())
def test_how_the_output_is_split_changes_nothing(text: str, cuts: list[int], max_words: int, stop: bool) -> None:
    body: dict[str, Any] = {"max_tokens": max_words, **({"stop": "bS"} if stop else {})}
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    whole = run(TextLimits.of(body), [text])
    assert run(TextLimits.of(body), pieces) == whole
    out, finish = whole
    assert len(out.split()) <= max_words and (not stop or "bS" not in out)
    assert text.startswith(out) and (finish is not None or out == text)


class CountedWords:
    """The word pattern, counting the characters each search over the held text reads."""

    def __init__(self, pattern: Any) -> None:
        self.pattern = pattern
        self.read = 0

    def finditer(self, text: str) -> Any:
        self.read += len(text)
        return self.pattern.finditer(text)

    def findall(self, text: str) -> Any:
        self.read += len(text)
        return self.pattern.findall(text)


def test_a_word_that_goes_on_is_not_read_again_at_each_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tool's endless word with `max_tokens`: every piece read the whole held word again, in
    Python, so 4 MiB took 16 s of the worker's one thread (a hostile tool). The held word now only
    grows; the text read stays a small multiple of the text fed."""
    counted = CountedWords(text_limits._WORD)
    monkeypatch.setattr(text_limits, "_WORD", counted)
    limits = TextLimits(3, ("STOP",))
    piece = "x" * 4096
    for _ in range(256):  # (1 MiB of one word)
        assert limits.feed(piece) == ""
    assert limits.held_chars() == 256 * len(piece) and counted.read <= 4 * len(piece)
    assert limits.feed(" two three four") == piece * 256 + " two three"
    assert limits.finish == "length"
