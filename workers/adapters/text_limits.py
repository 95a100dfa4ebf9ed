"""A request's `max_tokens` and `stop` applied to a CLI tool's output, which the tool is not told
of. Pure.

Tokens are counted as the run's usage counts them, in whitespace-separated words: the output
ends after the `max_tokens`-th word (`finish_reason: length`). It ends before the first `stop`
string (`finish_reason: stop`), which is not sent. Text that could still turn out to be past
either limit is held back until the next piece or the end: the end of a word not yet followed by
whitespace, and the last characters that could begin a stop string. What is held is bounded by
the caller (`CliAdapter` fails a run whose held word passes `runtime.max_line_bytes`).
"""

from __future__ import annotations

import re
from typing import Any

from common import token_cap
from workers.adapters.prompt_text import MAX_STOPS

_WORD = re.compile(r"\S+")
_SPACE = re.compile(r"\s")


class TextLimits:
    __slots__ = ("max_words", "stops", "held", "words", "finish", "_one_word", "_more", "_more_chars")

    def __init__(self, max_words: int | None = None, stops: tuple[str, ...] = ()) -> None:
        self.max_words = max_words
        self.stops = tuple(s for s in stops if s)
        self.held = ""
        #: words released so far
        self.words = 0
        #: "length" or "stop" once a limit cut the output: nothing more is to be read
        self.finish: str | None = None
        #: `held` is one word that may go on (`max_words`): more of it is only added to it (`feed`),
        #: in `_more` (joined once: adding to a string copied it whole, each piece)
        self._one_word = False
        self._more: list[str] = []
        self._more_chars = 0

    @classmethod
    def of(cls, body: dict[str, Any]) -> TextLimits:
        """The limits a request asks for (`max_completion_tokens`, else `max_tokens`; `stop`, a
        string or a list of them). A field of another type is left to be the provider's
        business, as every field iop does not read."""
        found = token_cap.asked(body)
        limit = None if found is None else found[1]
        max_words = limit if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 0 else None
        stop = body.get("stop")
        if isinstance(stop, str):
            return cls(max_words, (stop,))
        stops = stop[:MAX_STOPS] if isinstance(stop, list) else []
        return cls(max_words, tuple(s for s in stops if isinstance(s, str)))

    def feed(self, text: str, final: bool = False) -> str:
        """What of the output so far may go to the caller now, given the next piece `text`
        (`final`: the output ended). Once `finish` is set, nothing more."""
        if self.finish is not None:
            return ""
        if self._one_word and not final and not _SPACE.search(text) and not self._stop_in(text):
            # (the held word goes on: none of it may go yet, and it is not read again; it was, at
            # every piece, and a tool's endless word cost time growing with its square)
            self._more.append(text)
            self._more_chars += len(text)
            return ""
        if self._more:
            self.held += "".join(self._more)
            self._more, self._more_chars = [], 0
        buf = self.held + text
        cut = len(buf)
        if self.max_words == 0:
            cut, self.finish = 0, "length"
        elif self.max_words is not None:
            for count, word in enumerate(_WORD.finditer(buf), self.words + 1):
                if count == self.max_words and (word.end() < len(buf) or final):
                    cut, self.finish = word.end(), "length"
                    break
        for stop in self.stops:
            at = buf.find(stop)
            if 0 <= at < cut:
                cut, self.finish = at, "stop"
        if self.finish is None and not final:
            cut = self._safe(buf)
        out, self.held = buf[:cut], buf[cut:]
        self._one_word = self.max_words is not None and bool(self.held) and not _SPACE.search(self.held)
        if self.max_words is not None:
            self.words += len(_WORD.findall(out))
        return out

    def held_chars(self) -> int:
        """How much text is held back (`CliAdapter` bounds it: a word that never ends)."""
        return len(self.held) + self._more_chars

    def _stop_in(self, text: str) -> bool:
        """Whether a stop string ends in `text` (begun in what is held, or in it)."""
        longest = max((len(stop) for stop in self.stops), default=0)
        seen = self._tail(longest - 1) + text
        return any(stop in seen for stop in self.stops)

    def _tail(self, n: int) -> str:
        """The last `n` characters held (without joining all of them)."""
        if n <= 0:
            return ""
        parts: list[str] = []
        size = 0
        for piece in reversed(self._more):
            parts.append(piece)
            size += len(piece)
            if size >= n:
                break
        else:
            parts.append(self.held[-n:])
        return "".join(reversed(parts))[-n:]

    def _safe(self, buf: str) -> int:
        """How much of `buf` no later text can put past a limit: not the last characters that
        could begin a stop string, nor a word that may go on."""
        safe = len(buf)
        if self.stops:
            safe -= max(len(s) for s in self.stops) - 1
        if self.max_words is not None:
            while 0 < safe and not buf[safe - 1].isspace() and (safe == len(buf) or not buf[safe].isspace()):
                safe -= 1  # (inside a word, or at the end of one that may go on)
        return max(safe, 0)
