"""A CLI tool as a provider: runs the configured argv (never through a shell) with the prompt
on stdin and streams its stdout back as deltas.

- The served name reaches the tool as `{model}` in any argv element and as `$IOP_MODEL`;
  the run id as `$IOP_REQUEST_ID`.
- Each read from stdout becomes one delta (UTF-8, split characters are kept for the next).
- The run ends when the tool process itself exits, not when its stdout closes: a child it left
  behind holding stdout or stderr open does not keep the run going (see `ToolRun.reads`).
- A non-zero exit is a `provider_error` carrying the tail of stderr.
- The tool runs in a process group of its own; on a timeout, a cancel, a failure, a silence
  longer than `read_timeout_ms`, or when something still holds its output open after it
  exited, the whole group is killed (SIGKILL) and the run's pipes are closed. A process the
  tool moved to a session of its own (`setsid`) is out of the group's reach: it is the tool's
  own doing, and it only loses its stdout/stderr (the run does not wait for it).
- Usage counts are whitespace-separated words: a CLI tool reports no tokens.
- Probe: the executable exists and may be executed. A CLI tool lists no models.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import ctypes
import os
import shutil
import signal
import sys
from collections.abc import AsyncGenerator, AsyncIterator
from types import TracebackType
from typing import Any

from common.chunks import wants_usage
from common.config import ProviderConfig
from common.policy import Health
from common.shown import quoted
from common.wire import ErrorCode, RunKind
from workers.adapters.base import DEFAULT_LIMITS, DOWN, ProbeResult, ProviderError, ReadLimits, Retry, not_taken
from workers.adapters.failures import one_line
from workers.adapters.openai_shapes import Shaper, usage
from workers.adapters.prompt_text import MAX_STOP_CHARS, NotForCli, prompt_text
from workers.adapters.reading import without_traceback
from workers.adapters.text_limits import TextLimits

Json = dict[str, Any]

READ_SIZE = 65536
STDERR_TAIL_BYTES = 2048
#: asyncio's own buffer limit for a subprocess stream (`asyncio.streams._DEFAULT_LIMIT`)
STREAM_LIMIT = 2**16
#: How long, once the tool has exited, the run still waits for output that is not there yet,
#: in seconds. Not a pause: the run ends at once at EOF, which is the usual case. It bounds only
#: the wait when something else (a child the tool left behind) still holds stdout or stderr
#: open. What the tool wrote before exiting is already in the pipe, readable at once; the
#: bound only has to outlast the event loop's latency between the exit being reported and
#: the pipe being read, which is a few milliseconds on a loaded loop. 200 ms is generous for
#: that and still too short for a caller to notice. It counts only time spent waiting for
#: data, never the time the consumer takes, so a slow consumer loses nothing.
DRAIN_S = 0.2
def _pipe_max_bytes() -> int:
    """The most an unprivileged process may make a pipe hold (Linux's `pipe-max-size`; 1 MiB)."""
    try:
        with open("/proc/sys/fs/pipe-max-size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 20


#: The most output read once the tool has exited: what it wrote before is in the pipe, which the
#: tool may make hold up to `pipe-max-size`, and in what the worker read and did not yet take (its
#: stream reader's buffer, a few hundred KiB); more comes from a child it left writing (it was read
#: until `read_timeout_ms`, up to `max_output_bytes`, failing a run the tool had ended well).
AFTER_EXIT_BYTES = _pipe_max_bytes() + (1 << 20)


#: prctl(2)'s option that has the kernel signal a process when its parent dies (Linux)
_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def _dies_with(parent: int) -> Any:
    """The tool's first act (`preexec_fn`): it is killed when its worker dies, however the worker
    dies (a SIGKILL, the OOM killer: tools ran on, and a run its lease put back in the queue ran
    twice at once). The parent that died before this could ask is seen in `getppid`. It then
    keeps no descriptor but its stdio (`_only_stdio`)."""
    def first() -> None:
        if _LIBC is not None:
            _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(1)
        _only_stdio()
    return first


def _only_stdio() -> None:
    """Every descriptor above stdio is closed when the tool's program starts. uvloop hands a child
    a second copy of each end of its stdio and does not close it (nor what the worker inherited):
    a tool that closed its stdout still held it, and ended in a silence (`read_timeout_ms`)
    instead of its EOF. They are marked close-on-exec, not closed: under uvloop the child's stdio
    is put in place after this runs, from those copies."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return  # not Linux
    for name in names:
        if int(name) > 2:
            with contextlib.suppress(OSError):  # the listing's own descriptor, closed already
                os.set_inheritable(int(name), False)


def argv_for(command: list[str], model: str) -> list[str]:
    return [arg.replace("{model}", model) for arg in command]


def find_executable(program: str) -> tuple[str | None, str]:
    """(the path that would run, "") or (None, why not)."""
    if os.sep in program:
        if not os.path.isfile(program):
            return None, f"executable {quoted(program)} does not exist"
        if not os.access(program, os.X_OK):
            return None, f"{quoted(program)} is not executable"
        return program, ""
    found = shutil.which(program)
    return (found, "") if found else (None, f"executable {quoted(program)} not found on PATH")


class _ToolProtocol(asyncio.subprocess.SubprocessStreamProtocol):
    """asyncio's protocol for a subprocess with streams, which also tells when the process
    exited (`Process.wait` waits for its pipes to close as well on Python 3.11, and a child
    that inherited them may hold them open for ever) and which of its pipes have closed."""

    def __init__(self, loop: asyncio.AbstractEventLoop, exited: asyncio.Event) -> None:
        super().__init__(limit=STREAM_LIMIT, loop=loop)
        self.exited = exited
        #: the loop's time when the process exited
        self.exited_at = 0.0
        self.closed_fds: set[int] = set()

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        self.closed_fds.add(fd)
        super().pipe_connection_lost(fd, exc)

    def process_exited(self) -> None:
        super().process_exited()
        self.exited_at = asyncio.get_running_loop().time()
        self.exited.set()


class ToolRun:
    """One process of the tool: spawn, feed stdin, read stdout, keep a stderr tail, and kill
    the whole process group unless the tool ended by itself and left nothing holding its
    output open."""

    def __init__(self, provider: ProviderConfig, argv: list[str], env: dict[str, str], stdin: bytes) -> None:
        self.provider = provider
        self.argv = argv
        self.env = env
        self.stdin = stdin
        self.proc: asyncio.subprocess.Process | None = None
        self._transport: asyncio.SubprocessTransport | None = None
        self._protocol: _ToolProtocol | None = None
        #: set once the tool process itself has exited (whatever its children do)
        self._exited = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._stderr = bytearray()

    @property
    def name(self) -> str:
        """The tool as error texts name it: its file name, not where it lives on the node."""
        return os.path.basename(self.argv[0])

    async def __aenter__(self) -> ToolRun:
        loop = asyncio.get_running_loop()
        try:
            self._transport, self._protocol = await loop.subprocess_exec(
                lambda: _ToolProtocol(loop, self._exited), *self.argv, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=self.env,
                start_new_session=True, preexec_fn=_dies_with(os.getpid()))
        except OSError as exc:
            raise ProviderError(f"provider {self.provider.id} could not start {self.name}: "
                                f"{(exc.strerror or 'unknown error').lower()}", retry=Retry.ANY, strikes=DOWN) from None
        self.proc = asyncio.subprocess.Process(self._transport, self._protocol, loop)
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

    async def _read(self, wait_s: float, *, until_exit: bool) -> bytes | None:
        """The next read from stdout (b"" at EOF), or None if `until_exit` and the tool exited
        first; TimeoutError after `wait_s` seconds of neither."""
        assert self.proc is not None and self.proc.stdout is not None
        read = asyncio.ensure_future(self.proc.stdout.read(READ_SIZE))
        waits: set[asyncio.Future[Any]] = {read}
        if until_exit:
            waits.add(asyncio.ensure_future(self._exited.wait()))
        try:
            # not asyncio.wait_for: on Python 3.11 it drops a cancel (the run's own deadline)
            # that arrives as the read completes, and the run would go on past its timeout
            await asyncio.wait(waits, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()
            # a cancelled read has given up its place (and taken no data) only once it ran
            await asyncio.wait(waits)
        if read.done() and not read.cancelled():
            return read.result()  # it may have completed while the exit was being noticed
        if until_exit and self._exited.is_set():
            return None
        raise TimeoutError

    async def reads(self) -> AsyncGenerator[str, None]:
        """stdout as text, one piece per read, until EOF or until the tool has exited and its
        output has been drained.

        Once the tool process has exited, what it wrote is in the pipe; a child it left behind
        may still hold stdout open and EOF may never come. So after the exit, reading stops at
        EOF, at the first `DRAIN_S` seconds (in all) spent waiting for more, or `read_timeout_ms`
        after the exit, or after `AFTER_EXIT_BYTES` read since (a leftover child that never stops
        writing), whichever comes first."""
        assert self.proc is not None and self.proc.stdout is not None
        loop = asyncio.get_running_loop()
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        silence = self.provider.read_timeout_ms / 1000
        drain_left = DRAIN_S
        drain_end: float | None = None  # the loop's time at which draining stops in any case
        after_exit = 0  # bytes read since the exit
        while True:
            exited = self._exited.is_set()
            if exited and drain_end is None:
                drain_end = loop.time() + silence
            wait_s = silence if drain_end is None else max(0.0, min(drain_left, drain_end - loop.time()))
            started = loop.time()
            try:
                data = await self._read(wait_s, until_exit=not exited)
            except TimeoutError:
                if exited:
                    data = b""  # drained: what is left is not the tool's
                else:
                    raise ProviderError(
                        f"provider {self.provider.id} produced no output for {self.provider.read_timeout_ms} ms",
                        code=ErrorCode.PROVIDER_TIMEOUT) from None
            if exited:
                drain_left -= loop.time() - started
            if data is None:
                continue  # the tool exited while we waited: drain what it left
            if exited:
                data = data[:max(0, AFTER_EXIT_BYTES - after_exit)]  # (past it: a child's, not the tool's)
                after_exit += len(data)
            text = decoder.decode(data, final=not data)
            if text:
                yield text
            if not data:
                return

    async def exit_status(self, error_chars: int) -> None:
        """Wait for the tool to end; raise ProviderError (with the tail of its stderr, cut to
        `error_chars`) unless it exited with status 0.

        Called once stdout ended. A tool that closed stdout but goes on running gets
        `read_timeout_ms` to exit: it can say nothing more, so this is the same silence."""
        assert self.proc is not None
        try:
            async with asyncio.timeout(self.provider.read_timeout_ms / 1000):
                await self._exited.wait()
        except TimeoutError:
            raise ProviderError(f"provider {self.provider.id}: {self.name} closed its output but did not "
                                f"exit within {self.provider.read_timeout_ms} ms", strikes=0) from None
        # the rest of stderr, within `DRAIN_S` of the exit: a child left behind may hold it open
        assert self._protocol is not None
        drain_s = self._protocol.exited_at + DRAIN_S - asyncio.get_running_loop().time()
        await asyncio.wait(self._tasks, timeout=max(drain_s, 0.001))
        code = self.proc.returncode
        assert code is not None
        if code == 0:
            return
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        tail = one_line(without_traceback(self._stderr.decode(errors="replace")), error_chars, tail=True)
        raise ProviderError(f"provider {self.provider.id}: {self.name} {how}" + (f": {tail}" if tail else ""),
                            strikes=0)

    def kill_group(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    def _output_open(self) -> bool:
        """Whether stdout or stderr is still open: something of the run still holds it."""
        return self._protocol is not None and not {1, 2} <= self._protocol.closed_fds

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self.proc is None:
            return
        if exc_type is not None or self.proc.returncode is None or self._output_open():
            # a failure, or the tool is still running, or it left something holding its output
            self.kill_group()
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)  # in case it left its group
            # before closing the transport: closing it with the process still there would reap
            # it behind the back of asyncio's child watcher
            await self._exited.wait()
        if self._transport is not None:
            # closes our ends of the pipes, so the run is over even if a process out of the
            # group's reach (a `setsid` child) still holds theirs: it only loses its output
            self._transport.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.proc.wait()


#: the worker's variables a tool does not inherit: the Redis URL may carry Redis's password, and
#: with it a tool could rewrite every queue of the pool
WORKERS_OWN_ENV = frozenset({"REDIS_URL"})


class CliAdapter:
    def __init__(self, provider: ProviderConfig, secret_env: frozenset[str] = frozenset(),
                 limits: ReadLimits = DEFAULT_LIMITS) -> None:
        """`secret_env`: names of environment variables holding other providers' API keys;
        the tool does not inherit them, nor `WORKERS_OWN_ENV`."""
        assert provider.command
        self.provider = provider
        self.limits = limits
        self.command = list(provider.command)
        self.secret_env = secret_env

    def _run(self, kind: RunKind, body: Json, request_id: str) -> tuple[ToolRun, str]:
        try:
            prompt = prompt_text(kind, body)
        except NotForCli as exc:
            raise not_taken(self.provider.id, str(exc), exc.param) from None
        model = str(body["model"])
        env = {k: v for k, v in os.environ.items() if k not in self.secret_env and k not in WORKERS_OWN_ENV}
        env.update(IOP_MODEL=model, IOP_REQUEST_ID=request_id)
        return ToolRun(self.provider, argv_for(self.command, model), env, prompt.encode()), prompt

    async def _output(self, tool: ToolRun, limits: TextLimits, streamed: bool) -> AsyncGenerator[str, None]:
        """The tool's output as it may go to the caller, cut at the request's `max_tokens` and
        `stop` (`limits.finish` says which; the tool is stopped there), else up to the tool's
        exit, which must be a success. `streamed`: what was held back for the limits goes out
        before the tool's failure (a whole answer's caller gets the failure alone)."""
        # (a word that does not end, with max_tokens; with the start of a stop string before it)
        held_most = self.limits.line_bytes + MAX_STOP_CHARS
        async with tool, contextlib.aclosing(tool.reads()) as reads:
            try:
                async for piece in reads:
                    text = limits.feed(piece)
                    if text:
                        yield text
                    if limits.finish is not None:
                        return  # (the tool, still running, is killed on leaving)
                    if limits.held_chars() > held_most:
                        raise self.limits.too_large(self.provider.id, "a word", self.limits.line_bytes)
                await tool.exit_status(self.limits.error_chars)
            except ProviderError:
                # (what was held back for the limits and is within them goes out before the error: a
                # stream's caller lost the end of the last word the tool printed before it failed)
                rest = limits.feed("", final=True) if streamed and limits.held_chars() <= held_most else ""
                if rest:
                    yield rest
                raise
        rest = limits.feed("", final=True)
        if rest:
            yield rest

    async def complete(self, kind: RunKind, body: Json, request_id: str) -> Json:
        tool, prompt = self._run(kind, body, request_id)
        limits = TextLimits.of(body)
        pieces: list[str] = []
        size = 0
        # (the tool stops with it)
        async with contextlib.aclosing(self._output(tool, limits, streamed=False)) as output:
            async for piece in output:
                size += len(piece.encode())
                if size > self.limits.response_bytes:
                    raise self.limits.too_large(self.provider.id, "an answer", self.limits.response_bytes)
                pieces.append(piece)
        text = "".join(pieces)
        shaper = Shaper(kind, request_id, str(body["model"]))
        return shaper.response(text, limits.finish or "stop", usage(len(prompt.split()), len(text.split())))

    async def stream(self, kind: RunKind, body: Json, request_id: str) -> AsyncIterator[list[Json]]:
        tool, prompt = self._run(kind, body, request_id)
        limits = TextLimits.of(body)
        shaper = Shaper(kind, request_id, str(body["model"]))
        output: list[str] = []
        # (closed with this stream: a caller that stops reading it stops the tool at once)
        async with contextlib.aclosing(self._output(tool, limits, streamed=True)) as pieces:
            async for piece in pieces:
                output.append(piece)
                yield [shaper.delta(piece)]
        final = [shaper.delta(finish_reason=limits.finish or "stop")]
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
