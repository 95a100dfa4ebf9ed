"""A CLI tool as a provider: runs the configured argv (never through a shell) with the prompt
on stdin and streams its stdout back as deltas.

- The served name reaches the tool as `{model}` in any argv element and as `$IOP_MODEL`;
  the run id as `$IOP_REQUEST_ID`.
- Each read from stdout becomes one delta (UTF-8, split characters are kept for the next).
- A non-zero exit is a `provider_error` carrying the tail of stderr.
- The tool runs in a process group of its own; on a timeout, a cancel, a failure or a
  silence longer than `read_timeout_ms`, the whole group is killed (SIGKILL).
- Usage counts are whitespace-separated words: a CLI tool reports no tokens.
- Probe: the executable exists and may be executed. A CLI tool lists no models.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import os
import shutil
import signal
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any

from common.chunks import wants_usage
from common.config import ProviderConfig
from common.policy import Health
from common.wire import RunKind
from workers.adapters.base import DEFAULT_LIMITS, DOWN, ProbeResult, ProviderError, ReadLimits, Retry
from workers.adapters.failures import one_line
from workers.adapters.openai_shapes import Shaper, usage
from workers.adapters.prompt_text import prompt_text

Json = dict[str, Any]

READ_SIZE = 65536
STDERR_TAIL_BYTES = 2048


def argv_for(command: list[str], model: str) -> list[str]:
    return [arg.replace("{model}", model) for arg in command]


def find_executable(program: str) -> tuple[str | None, str]:
    """(the path that would run, "") or (None, why not)."""
    if os.sep in program:
        if not os.path.isfile(program):
            return None, f"executable {program!r} does not exist"
        if not os.access(program, os.X_OK):
            return None, f"{program!r} is not executable"
        return program, ""
    found = shutil.which(program)
    return (found, "") if found else (None, f"executable {program!r} not found on PATH")


class ToolRun:
    """One process of the tool: spawn, feed stdin, read stdout, keep a stderr tail, and kill
    the whole process group unless the tool ended by itself."""

    def __init__(self, provider: ProviderConfig, argv: list[str], env: dict[str, str], stdin: bytes) -> None:
        self.provider = provider
        self.argv = argv
        self.env = env
        self.stdin = stdin
        self.proc: asyncio.subprocess.Process | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stderr = bytearray()

    async def __aenter__(self) -> ToolRun:
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=self.env, start_new_session=True)
        except OSError as exc:
            raise ProviderError(f"provider {self.provider.id} could not start {self.argv[0]}: "
                                f"{(exc.strerror or 'unknown error').lower()}", retry=Retry.ANY, strikes=DOWN) from None
        self._tasks = [asyncio.create_task(self._feed()), asyncio.create_task(self._collect_stderr())]
        return self

    async def _feed(self) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.proc.stdin.write(self.stdin)
            await self.proc.stdin.drain()
            self.proc.stdin.close()

    async def _collect_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        while data := await self.proc.stderr.read(READ_SIZE):
            self._stderr += data
            del self._stderr[:-STDERR_TAIL_BYTES]

    async def reads(self) -> AsyncIterator[str]:
        """stdout as text, one piece per read, until EOF."""
        assert self.proc is not None and self.proc.stdout is not None
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        silence = self.provider.read_timeout_ms / 1000
        while True:
            try:
                # not asyncio.wait_for: on Python 3.11 it drops a cancel (the run's own deadline)
                # that arrives as the read completes, and the run would go on past its timeout
                async with asyncio.timeout(silence):
                    data = await self.proc.stdout.read(READ_SIZE)
            except TimeoutError:
                raise ProviderError(f"provider {self.provider.id} produced no output for "
                                    f"{self.provider.read_timeout_ms} ms") from None
            text = decoder.decode(data, final=not data)
            if text:
                yield text
            if not data:
                return

    async def exit_status(self, error_chars: int) -> None:
        """Wait for the tool to end; raise ProviderError (with the tail of its stderr, cut to
        `error_chars`) unless it exited with status 0."""
        assert self.proc is not None
        code = await self.proc.wait()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if code == 0:
            return
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        tail = one_line(self._stderr.decode(errors="replace"), error_chars, tail=True)
        raise ProviderError(f"provider {self.provider.id}: {self.argv[0]} {how}" + (f": {tail}" if tail else ""),
                            strikes=0)

    def kill_group(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self.proc is None:
            return
        if exc_type is not None or self.proc.returncode is None:
            self.kill_group()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.proc.wait()


class CliAdapter:
    def __init__(self, provider: ProviderConfig, secret_env: frozenset[str] = frozenset(),
                 limits: ReadLimits = DEFAULT_LIMITS) -> None:
        """`secret_env`: names of environment variables holding other providers' API keys;
        the tool does not inherit them."""
        assert provider.command
        self.provider = provider
        self.limits = limits
        self.command = list(provider.command)
        self.secret_env = secret_env

    def _run(self, kind: RunKind, body: Json, request_id: str) -> tuple[ToolRun, str]:
        try:
            prompt = prompt_text(kind, body)
        except ValueError as exc:
            detail = {"message": str(exc), "type": "invalid_request_error", "param": None, "code": None}
            raise ProviderError(f"provider {self.provider.id}: {exc}", status=400, detail=detail) from None
        model = str(body["model"])
        env = {k: v for k, v in os.environ.items() if k not in self.secret_env}
        env.update(IOP_MODEL=model, IOP_REQUEST_ID=request_id)
        return ToolRun(self.provider, argv_for(self.command, model), env, prompt.encode()), prompt

    async def complete(self, kind: RunKind, body: Json, request_id: str) -> Json:
        tool, prompt = self._run(kind, body, request_id)
        pieces: list[str] = []
        size = 0
        async with tool:
            async for piece in tool.reads():
                size += len(piece.encode())
                if size > self.limits.response_bytes:
                    raise self.limits.too_large(self.provider.id, "an answer", self.limits.response_bytes)
                pieces.append(piece)
            await tool.exit_status(self.limits.error_chars)
        text = "".join(pieces)
        shaper = Shaper(kind, request_id, str(body["model"]))
        return shaper.response(text, "stop", usage(len(prompt.split()), len(text.split())))

    async def stream(self, kind: RunKind, body: Json, request_id: str) -> AsyncIterator[list[Json]]:
        tool, prompt = self._run(kind, body, request_id)
        shaper = Shaper(kind, request_id, str(body["model"]))
        output: list[str] = []
        async with tool:
            async for piece in tool.reads():
                output.append(piece)
                yield [shaper.delta(piece)]
            await tool.exit_status(self.limits.error_chars)
        final = [shaper.delta(finish_reason="stop")]
        if wants_usage(body):
            final.append(shaper.usage_chunk(usage(len(prompt.split()), len("".join(output).split()))))
        yield final

    async def probe(self) -> ProbeResult:
        path, reason = find_executable(self.command[0])
        if path is None:
            return ProbeResult(Health.UNAVAILABLE, reason)
        return ProbeResult(Health.AVAILABLE, "")

    async def close(self) -> None:
        return None
