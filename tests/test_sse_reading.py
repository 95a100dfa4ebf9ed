"""The worker's SSE reader (`SSEParser`) reads a provider's stream as the official `openai` client
does (`openai._streaming.SSEDecoder`): the same JSON chunks, however the stream's events are laid
out (one `data:` line or several, comments, `id:` fields, LF, CRLF or CR line ends) and however its
bytes are cut into reads."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from openai._streaming import SSEDecoder

from workers.adapters.base import ReadLimits
from workers.adapters.openai_compat import SSEParser

TEXT = st.text(st.characters(codec="utf-8"), max_size=12)  # (no lone surrogates)
CHUNKS = st.builds(
    lambda i, text, finish: {"id": "c1", "object": "chat.completion.chunk", "model": "m",
                             "choices": [{"index": i, "delta": {"content": text}, "finish_reason": finish}]},
    st.integers(0, 3), TEXT, st.sampled_from([None, "stop", "length"]))


@st.composite
def streams(draw: st.DrawFn) -> tuple[list[dict[str, Any]], list[bytes]]:
    """Chunks, and an SSE stream of them ending with [DONE], cut into reads."""
    chunks = draw(st.lists(CHUNKS, min_size=1, max_size=6))
    end = draw(st.sampled_from(["\n", "\r\n", "\r"]))
    events = []
    for n, chunk in enumerate(chunks):
        lines = []
        if draw(st.booleans()):
            lines.append(": ping")
        if draw(st.booleans()):
            lines.append(f"id: {n}")
        text = json.dumps(chunk, indent=draw(st.sampled_from([None, 1])), ensure_ascii=draw(st.booleans()))
        space = draw(st.sampled_from(["", " "]))
        lines += [f"data:{space}{line}" for line in text.split("\n")]
        events.append(end.join(lines) + end + end)
    stream = ("".join(events) + f"data: [DONE]{end}{end}").encode()
    cuts = sorted(draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    reads = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    return chunks, reads


@given(streams())
def test_chunks_read_as_the_openai_client_reads_them(stream: tuple[list[dict[str, Any]], list[bytes]]) -> None:
    chunks, reads = stream
    parser = SSEParser("p", ReadLimits())
    ours = [chunk for data in reads for chunk in parser.feed(data)]
    parser.end()
    theirs = [json.loads(event.data) for event in SSEDecoder().iter_bytes(iter(reads)) if event.data != "[DONE]"]
    assert ours == theirs == chunks
    assert parser.done and parser.failed is None
