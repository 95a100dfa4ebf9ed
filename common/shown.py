"""Text a caller or a user sent, as a message shows it back: quoted, cut, and escaped where it
could not be shown as it is (one place, for the gateway's errors and the CLI's)."""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Sequence
from typing import Any

#: the most of a caller's text an error message shows
SHOWN_CHARS = 256
#: the longest a value (`shown`) is in a message
VALUE_CHARS = 80
#: what `json.dumps` leaves as it is but a message must not show as it is: DEL and the C1 controls,
#: line and paragraph separators, bidirectional overrides, halves of surrogate pairs
_UNSHOWABLE = re.compile("[\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def quoted(text: str, limit: int = SHOWN_CHARS) -> str:
    """What a caller sent (a model name, a header), as an error message shows it: in double
    quotes, cut after `limit` characters (…), and what cannot be shown as it is (control
    characters, quotes, backslashes, halves of surrogate pairs) escaped as JSON escapes it."""
    cut = text if len(text) <= limit else text[:limit] + "…"
    return _UNSHOWABLE.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(cut, ensure_ascii=False))


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


#: what a terminal line must not hold as it is: the C0 and C1 controls (a newline forges a line, an
#: escape sequence rewrites the screen), DEL, line separators, bidirectional overrides, surrogates
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def printable(text: str) -> str:
    """`text` for one cell of a table a terminal shows: what could forge a line or rewrite the
    screen is escaped (`\\u000a`); the rest is as it is."""
    return _UNPRINTABLE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def near_name(name: str, names: Sequence[str]) -> str | None:
    """The one of `names` that `name` was likely meant as (a served name in the config against a
    server's model list): the same but for case, else a close spelling; None when none is."""
    folded = name.casefold()
    same = next((n for n in names if n.casefold() == folded), None)
    if same is not None:
        return same
    close = difflib.get_close_matches(name, list(names[:1000]), n=1, cutoff=0.85)
    return close[0] if close else None
