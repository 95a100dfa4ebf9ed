"""Text a caller or a user sent, as a message shows it back: quoted, cut, and escaped where it
could not be shown as it is (one place, for the gateway's errors and the CLI's)."""

from __future__ import annotations

import difflib
import json
import math
import unicodedata
from collections.abc import Sequence
from typing import Any

#: the most of a caller's text an error message shows
SHOWN_CHARS = 256
#: the longest a value (`shown`) is in a message
VALUE_CHARS = 80
#: Unicode categories a message or a terminal line never shows as they are: controls (a newline forges
#: a line, an escape sequence rewrites the screen), format characters (bidirectional overrides, and
#: the invisible ones: a zero-width space, a BOM, a soft hyphen, tag characters), halves of surrogate
#: pairs, line and paragraph separators
_HIDDEN = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def _escaped(ch: str) -> str:
    """`ch` as JSON escapes it: `\\u200b`, and a character beyond U+FFFF as its UTF-16 pair."""
    code = ord(ch)
    if code < 0x10000:
        return f"\\u{code:04x}"
    code -= 0x10000
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def _unhidden(text: str) -> str:
    """`text` with each character of a `_HIDDEN` category escaped (`str.isprintable` first: C-speed,
    and true of almost every text)."""
    if text.isprintable():
        return text
    return "".join(_escaped(ch) if unicodedata.category(ch) in _HIDDEN else ch for ch in text)


def quoted(text: str, limit: int = SHOWN_CHARS) -> str:
    """What a caller sent (a model name, a header), as an error message shows it: in double
    quotes, cut after `limit` characters (…), and what cannot be shown as it is (control
    characters, quotes, backslashes, halves of surrogate pairs, invisible format characters such as
    a zero-width space) escaped as JSON escapes it."""
    cut = text if len(text) <= limit else text[:limit] + "…"
    return _unhidden(json.dumps(cut, ensure_ascii=False))


def shown(value: Any) -> str:
    """A value a caller or an operator gave (a field's, a part's type), for a message: text quoted
    (`'2h'`), anything else as JSON (`true`, `null`, `1.5`, `[2]`), never as Python writes it
    (`True`, `None`); cut short when long."""
    if isinstance(value, str):
        text = repr(value)
    elif isinstance(value, float) and not math.isfinite(value):
        text = "a number too large for a 64-bit float" if not math.isnan(value) else "NaN"
    else:
        try:
            text = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError):  # not a JSON value (it came from Python, not from a caller)
            text = type(value).__name__
    return text if len(text) <= VALUE_CHARS else text[:VALUE_CHARS - 1] + "…"


def printable(text: str) -> str:
    """`text` for one cell of a table a terminal shows: what could forge a line, rewrite the screen
    or not be seen is escaped (`\\u000a`, `\\u200b`); the rest is as it is."""
    return _unhidden(text)


def near_name(name: str, names: Sequence[str]) -> str | None:
    """The one of `names` that `name` was likely meant as (a served name in the config against a
    server's model list): the same but for case, else a close spelling; None when none is."""
    folded = name.casefold()
    same = next((n for n in names if n.casefold() == folded), None)
    if same is not None:
        return same
    close = difflib.get_close_matches(name, list(names[:1000]), n=1, cutoff=0.85)
    return close[0] if close else None


def counted(n: int, noun: str) -> str:
    """`1 model`, `2 models` (it said `1 models`)."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
