"""Reading a provider's stream apart from sending it, for `runtime.stream_batch_ms`.

A `Pump` reads an adapter's stream in a task of its own and holds what it read; the runner takes
what is held when it is time to send (`ready`): at the first output, then at each deadline the
runner sets, and at the end. A read costs only its own parsing: the runner is not woken for each
one, and no timer is set per read. Opening chunks alone (a bare `role` delta) are not output:
they wait for the first real output, as the runner's unbatched path does, but no more than
`max_held` of them: those go out as output. A read the adapter marks as its last (`LastRead`) waits
for the end: it goes out with the run's end. At most `max_held` chunks wait: then the pump stops
reading (the provider's connection pushes back) until they are taken.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from common.chunks import is_preamble, usage_in, without_usage
from workers.adapters.base import LastRead

Chunk = dict[str, Any]


class Pump:
    def __init__(self, reads: AsyncIterator[list[Chunk]], wanted_usage: bool, max_held: int = 64) -> None:
        """`wanted_usage`: the caller asked for usage (else it is taken out of the chunks)."""
        self.held: list[Chunk] = []
        #: the last `usage` object read
        self.usage: dict[str, Any] | None = None
        #: a chunk carrying output was read
        self.output = False
        self.ended = False
        #: what ended the stream, if it did not end well
        self.error: Exception | None = None
        self.max_held = max_held
        self._wanted = wanted_usage
        #: the runner waits for the next output (not for a deadline)
        self._eager = True
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._reads = reads
        self._task = asyncio.get_running_loop().create_task(self._pump(reads), name="iop-stream-pump")

    async def _pump(self, reads: AsyncIterator[list[Chunk]]) -> None:
        try:
            async for chunks in reads:
                self.usage = usage_in(chunks) or self.usage
                self.held += chunks if self._wanted else without_usage(chunks)
                if not self.output and shows_output(self.held, self.max_held):
                    self.output = True
                if self._sendable() and (not isinstance(chunks, LastRead) or len(self.held) >= self.max_held):
                    self._wake.set()  # (a last read waits for the end, unless so many chunks wait)
                if len(self.held) >= self.max_held:
                    self._room.clear()
                    await self._room.wait()
        except Exception as exc:  # the runner raises it, after sending what came before it
            self.error = exc
        finally:
            self.ended = True
            self._wake.set()

    def _sendable(self) -> bool:
        return self.ended or (self.output and bool(self.held) and (self._eager or len(self.held) >= self.max_held))

    async def ready(self, due: float | None) -> None:
        """Return once there is output to send: at the next output read (`due` None), at `due`
        (loop time) with whatever came by then, at once when `max_held` chunks wait, and at the
        end of the stream."""
        self._eager = due is None
        if self._sendable():
            return
        self._wake.clear()
        if due is None:
            await self._wake.wait()
            return
        try:
            async with asyncio.timeout_at(due):
                await self._wake.wait()
        except TimeoutError:
            pass

    def take(self) -> list[Chunk]:
        """The output held ([] while there is none, or only opening chunks that wait for it)."""
        if not self.output:
            return []
        return self.take_all()

    def take_all(self) -> list[Chunk]:
        """Everything held, opening chunks included (at the end of the stream)."""
        held, self.held = self.held, []
        self._room.set()
        return held

    async def close(self) -> None:
        """Stop reading (a read under way is cancelled, the provider's request closed with it)."""
        if not self._task.done():
            self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await close_reads(self._reads)


def shows_output(held: list[Chunk], max_held: int) -> bool:
    """Whether held chunks may go out: one of them is output, not a bare opening (a `role`
    delta), or `max_held` openings wait (so many are output: they must not pile up)."""
    return bool(held) and (len(held) >= max_held or not all(is_preamble(c) for c in held))


async def close_reads(reads: AsyncIterator[Any]) -> None:
    """Close an adapter's stream (an async generator: its request to the provider with it), which
    a loop over it that stopped early leaves open until it is garbage."""
    aclose = getattr(reads, "aclose", None)
    if aclose is not None:
        await aclose()
