"""An HTTP/1.1 server on raw sockets (port 0), for answers no well-behaved server gives: a
subclass's `handle` serves each connection as it likes."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


@dataclass
class RawHttp:
    server: asyncio.Server | None = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    url: str = ""

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self.url

    async def stop(self) -> None:
        """Stop listening, and end the connections still served."""
        assert self.server is not None
        self.server.close()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            await self.handle(reader, writer)
        finally:
            writer.close()
            self.tasks.discard(task)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError
