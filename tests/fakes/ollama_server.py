"""A fake Ollama server speaking the native API (`/api/tags`, `/api/chat`, `/api/generate`
streaming NDJSON, `/api/embed`), for adapter tests (in process, port 0) and end-to-end
tests (`python -m tests.fakes.ollama_server --port 0 --models a,b [--hold]`).

Output is deterministic: `tok0 tok1 ...` (`tokens` of them, fewer with `num_predict`, then
`done_reason: length`). Knobs on `FakeState` make it fail, hang, hold runs until released,
or stop listing models. `GET /fake/stats` shows what it was asked; `POST /fake/release`
lets held runs go on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.fakes.serving import stop_runner

Json = dict[str, Any]


@dataclass
class FakeState:
    models: list[str] = field(default_factory=lambda: ["llama3:latest"])
    tokens: int = 4
    #: output words are f"{word}{i} "
    word: str = "tok"
    #: status of /api/tags (200 = healthy)
    tags_status: int = 200
    #: answer /api/chat and /api/generate with this status before any output
    fail_status: int | None = None
    #: the `Retry-After` header of that answer
    fail_retry_after: str | None = None
    #: send an {"error": ...} line after this many tokens
    error_after: int | None = None
    #: stop sending (but keep the connection) after this many tokens
    hang_after: int | None = None
    #: hold every run before its first token until `release()`
    hold: bool = False
    records: list[Json] = field(default_factory=list)
    #: the `Authorization` of each /api/tags request (a server behind a proxy that wants a token)
    tags_authorizations: list[str | None] = field(default_factory=list)
    released: asyncio.Event = field(default_factory=asyncio.Event)
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)

    def held(self) -> int:
        return sum(1 for r in self.records if r.get("held"))


STATE = web.AppKey("state", FakeState)


def _words(body: Json) -> int:
    if "messages" in body:
        return sum(len(str(m.get("content", "")).split()) for m in body["messages"])
    return len(str(body.get("prompt", "")).split())


def _line(obj: Json) -> bytes:
    return json.dumps(obj).encode() + b"\n"


async def _generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await request.json()
    chat = request.path == "/api/chat"
    record: Json = {"path": request.path, "model": body.get("model"), "stream": body.get("stream", True),
                    "body": body, "disconnected": False, "completed": False, "held": False,
                    "request_id": request.headers.get("X-Request-Id"),
                    "authorization": request.headers.get("Authorization")}
    state.records.append(record)
    if body.get("model") not in state.models:
        return web.json_response({"error": f"model '{body.get('model')}' not found"}, status=404)
    if state.fail_status is not None:
        return web.json_response({"error": "the fake is failing on purpose"}, status=state.fail_status,
                                 headers={"Retry-After": state.fail_retry_after} if state.fail_retry_after else None)
    options = body.get("options") or {}
    limit = options.get("num_predict")
    n = min(state.tokens, limit) if isinstance(limit, int) else state.tokens
    done_reason = "length" if isinstance(limit, int) and limit < state.tokens else "stop"
    tool_calls = None
    if chat and body.get("tools"):
        name = body["tools"][0]["function"]["name"]
        tool_calls = [{"function": {"name": name, "arguments": {"city": "Paris"}}}]

    top = body.get("top_logprobs") or 0

    def logprob(text: str, i: int) -> Json:
        """As Ollama 0.12.11+ writes a token's (`bytes` its UTF-8; `top_logprobs` left out when none
        was asked for)."""
        out: Json = {"token": text, "logprob": -0.25 * (i + 1), "bytes": list(text.encode())}
        if top:
            alternatives = [(text, out["logprob"]), ("other", -4.0), ("else", -5.0)][:top]
            out["top_logprobs"] = [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in alternatives]
        return out

    def piece(text: str, done: bool = False, i: int = 0) -> Json:
        out: Json = {"model": body["model"], "created_at": "2024-01-01T00:00:00Z", "done": done}
        if chat:
            out["message"] = {"role": "assistant", "content": text}
        else:
            out["response"] = text
        if body.get("logprobs") and text:
            out["logprobs"] = [logprob(text, i)]
        return out

    final = piece("", done=True)
    final.update({"done_reason": done_reason, "prompt_eval_count": _words(body), "eval_count": n,
                  "total_duration": 1000})
    try:
        if state.hold:
            record["held"] = True
            await state.released.wait()
            record["held"] = False
        if not body.get("stream", True):
            whole = piece("".join(f"{state.word}{i} " for i in range(n)))
            if body.get("logprobs"):
                whole["logprobs"] = [logprob(f"{state.word}{i} ", i) for i in range(n)]
            if tool_calls:
                whole["message"]["tool_calls"] = tool_calls
            final.update({k: v for k, v in whole.items() if k in ("message", "response", "logprobs")})
            record["completed"] = True
            return web.json_response(final)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        for i in range(n):
            if state.error_after is not None and i == state.error_after:
                await resp.write(_line({"error": "the model runner crashed"}))
                await resp.write_eof()
                return resp
            if state.hang_after is not None and i == state.hang_after:
                await asyncio.Event().wait()
            await resp.write(_line(piece(f"{state.word}{i} ", i=i)))
            await asyncio.sleep(0)
        if tool_calls:
            call = piece("")
            call["message"]["tool_calls"] = tool_calls
            await resp.write(_line(call))
        await resp.write(_line(final))
        await resp.write_eof()
        record["completed"] = True
        return resp
    except (asyncio.CancelledError, ConnectionResetError):
        record["disconnected"] = True
        state.disconnected.set()
        raise


async def _embed(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await request.json()
    state.records.append({"path": request.path, "model": body.get("model"), "body": body, "stream": False})
    if body.get("model") not in state.models:
        return web.json_response({"error": f"model '{body.get('model')}' not found"}, status=404)
    inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
    vectors = [[float(len(text)), 0.5, -0.25, 1.0] for text in inputs]
    return web.json_response({"model": body["model"], "embeddings": vectors,
                              "prompt_eval_count": sum(len(t.split()) for t in inputs)})


async def _tags(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.tags_authorizations.append(request.headers.get("Authorization"))
    if state.tags_status != 200:
        return web.json_response({"error": "not now"}, status=state.tags_status)
    return web.json_response({"models": [{"name": m, "model": m, "size": 1} for m in state.models]})


async def _stats(request: web.Request) -> web.Response:
    state = request.app[STATE]
    records = [{k: v for k, v in r.items() if k != "body"} for r in state.records]
    return web.json_response({"records": records, "held": state.held()})


async def _release(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.released.set()
    state.released = asyncio.Event()  # runs that come later are held again
    return web.json_response({"ok": True})


def build_app(state: FakeState) -> web.Application:
    app = web.Application()
    app[STATE] = state
    app.router.add_get("/api/tags", _tags)
    app.router.add_post("/api/chat", _generate)
    app.router.add_post("/api/generate", _generate)
    app.router.add_post("/api/embed", _embed)
    app.router.add_get("/fake/stats", _stats)
    app.router.add_post("/fake/release", _release)
    return app


class FakeOllama:
    """The fake, in process, on a free port (or the given one)."""

    def __init__(self, state: FakeState | None = None) -> None:
        self.state = state or FakeState()
        self.runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, port: int | None = None) -> str:
        self.runner = web.AppRunner(build_app(self.state), handler_cancellation=True, access_log=None,
                                    shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port if port is None else port)
        await site.start()
        self.port = int(self.runner.addresses[0][1])
        return self.url

    async def stop(self) -> None:
        if self.runner is not None:
            await stop_runner(self.runner)
            self.runner = None


async def _serve(args: argparse.Namespace) -> None:
    state = FakeState(models=[m for m in args.models.split(",") if m], hold=args.hold)
    fake = FakeOllama(state)
    url = await fake.start(args.port)
    print(f"fake ollama listening on {url}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await fake.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description="a fake Ollama server")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--models", default="llama3:latest")
    parser.add_argument("--hold", action="store_true", help="hold each run until POST /fake/release")
    try:
        asyncio.run(_serve(parser.parse_args()))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
