"""The gateway's aiohttp application: OpenAI routes, model list, health and readiness."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web
from redis.exceptions import RedisError

from common import capabilities, keys, token_cap
from common.auth import KeyRing
from common.config import Config, ModelConfig, folded_name, may_fold_to
from common.jsonio import json_response
from common.redisconn import REDIS_DOWN
from common.runlog import run_fields
from common.shown import quoted
from common.usage import key_names
from common.wire import ErrorCode, RunKind
from gateway import admin, catalog, cors, hosts, liveness, metrics, refusals, runs_api, usage_api
from gateway.auth import KEYRING, principal
from gateway.connections import BODY, expect_handler, forget_body
from gateway.errors import ApiError, invalid
from gateway.middleware import gateway_middleware
from gateway.redis_pool import gateway_redis, trim_forever
from gateway.requests import RESPONSES_PATH, RUN_ROUTES, ParsedRequest, parse_request, parse_responses
from gateway.responses import END_WITHIN_S, Cut, SSEStream, run_headers, stream_response, whole_response
from gateway.responses_output import ResponseShape, TooManyItems
from gateway.responses_places import caller_param
from gateway.runs import LEFT, RunClient, new_run_id
from gateway.stopping import Stopping

log = logging.getLogger("iop.gateway")

CONFIG = web.AppKey("config", Config)
RUNS = web.AppKey("runs", RunClient)
REDIS_URL = web.AppKey("redis_url", str)
STARTED = web.AppKey("started", float)
STOPPING = web.AppKey("stopping", Stopping)


def _refusing(req: ParsedRequest, model: ModelConfig, cfg: Config) -> tuple[str, ...]:
    """The model's providers whose adapter would refuse the run (`gateway.refusals`); the
    caller's 400 when all would."""
    if not refusals.MAY_REFUSE & cfg.provider_types(model.id):
        return ()
    try:
        return refusals.refusing(req.kind, req.body, req.stream,
                                 {p: cfg.provider(p).type for p in sorted(model.providers)})
    except refusals.Refusal as exc:
        raise invalid(str(exc), _field(req, exc.param)) from None


def _field(req: ParsedRequest, field: str | None) -> str | None:
    """A field of the request as its caller wrote it (a Responses request's own name for it)."""
    return caller_param(field, req.origins) if req.echo is not None and field is not None else field


def _timed_out(run_id: str) -> ApiError:
    """The gateway gave up on the run (its longest possible life passed)."""
    return ApiError(ErrorCode.EXECUTION_TIMEOUT, "the run did not finish in time", headers=run_headers(run_id))


def _model_object(name: str, model: ModelConfig, created: int) -> dict[str, Any]:
    """A model as OpenAI lists one, under `name` (its id or an alias; an alias says whose)."""
    obj = {"id": name, "object": "model", "created": created, "owned_by": "iop", "display_name": model.title}
    if name != model.id:
        obj["alias_of"] = model.id
    return obj


async def list_models(request: web.Request) -> web.Response:
    """Every model the caller may use, each followed by its aliases (as OpenAI lists `gpt-4o` next
    to the snapshot it names)."""
    cfg = request.app[CONFIG]
    created = int(request.app[STARTED])
    who = principal(request)
    data = [_model_object(name, m, created) for m in cfg.models if who.may_use(m.id) for name in (m.id, *m.aliases)]
    return json_response({"object": "list", "data": data})


def _usable(request: web.Request, name: str) -> ModelConfig | None:
    """The model named (its id or an alias), if it exists and the caller's key may use it."""
    model = request.app[CONFIG].model_named(name)
    return model if model is not None and principal(request).may_use(model.id) else None


def _model_for(request: web.Request, name: str) -> ModelConfig:
    """The model named, if the caller may use it (`_usable`); else the same 404 either way."""
    model = _usable(request, name)
    if model is None:
        near = _near(request, name)
        hint = f" (did you mean {quoted(near)}?)" if near else ""
        raise ApiError(ErrorCode.MODEL_NOT_FOUND, f"the model {quoted(name)} does not exist{hint}", param="model")
    return model


def _near(request: web.Request, name: str) -> str | None:
    """A name of a model the caller may use that `name` differs from only in case, Unicode form
    or surrounding spaces (`Qwen3.6:35B`, `qwen3.6:35b `): model ids are exact, as OpenAI's are."""
    who = principal(request)
    names = [(n, folded_name(n)) for m in request.app[CONFIG].models if who.may_use(m.id) for n in (m.id, *m.aliases)]
    asked = name.strip()
    # (a name far longer than all of them folds to none; folding it, 8 MB that NFKC makes 18 times
    # longer, held the gateway's one thread for seconds)
    if not may_fold_to(asked, max((len(f) for _, f in names), default=0)):
        return None
    want = folded_name(asked)
    return next((n for n, f in names if f == want), None)


async def get_model(request: web.Request) -> web.Response:
    name = request.match_info["model_id"]
    return json_response(_model_object(name, _model_for(request, name), int(request.app[STARTED])))


def _within_cap(req: ParsedRequest, model_id: str, cap: int) -> None:
    """The caller's 400 for a request asking for more tokens than the model's `max_tokens` (`cap`),
    or for a limit that is not a whole number from 1 to it (`token_cap.over_cap`)."""
    field = token_cap.over_cap(req.body, cap)
    if field is not None:  # (a Response's `max_output_tokens` is its chat run's `max_tokens`)
        from_output = req.echo is not None and field == "max_tokens" and req.echo.get("max_output_tokens") is not None
        param = "max_output_tokens" if from_output else field
        raise invalid(f"'{param}' must be a whole number from 1 to {cap} for the model {quoted(model_id)}", param)


def said_too_many(run_id: str, model_id: str, left: str | None, why: str) -> None:
    """A WARNING for a run whose answer would have made a Response of too many items (`why`,
    `TooManyItems`): its caller got `output_too_large`, and the run was cancelled (`left`: `ok`,
    `signalled`), or had ended before (a whole answer; a stream read after its end: the runs API says
    `completed`, the provider's answer being whole), or is cancelled once Redis answers (None)."""
    if left in ("ok", "signalled"):
        what = "the run was cancelled"
    elif left is None:
        what = "the run is cancelled once Redis answers"
    else:
        what = f"the run had ended before ({left}: the runs API says so; the provider's answer came whole)"
    log.warning("%s: its caller got output_too_large; %s", why, what, extra=run_fields(run_id, model_id))


async def run_request(request: web.Request) -> web.StreamResponse:
    """A chat completion, legacy completion, embeddings or Responses API request (the route says
    which; one handler for the four: a waiting caller holds no frame more)."""
    cfg = request.app[CONFIG]
    resource = request.match_info.route.resource
    assert resource is not None
    limits = {"max_depth": cfg.runtime.max_json_depth, "max_containers": cfg.runtime.max_json_containers}
    try:
        req = (parse_responses(request[BODY], **limits) if resource.canonical == RESPONSES_PATH
               else parse_request(RUN_ROUTES[resource.canonical], request[BODY], **limits,
                                  max_choices=cfg.runtime.max_choices, max_inputs=cfg.runtime.max_inputs))
    except ApiError as exc:  # (a bad request to a model served here is counted under the model)
        if exc.model is not None and (named := _usable(request, exc.model)) is not None:
            request[metrics.MODEL] = named.id  # (one the caller may not use: nothing says it exists)
        raise
    forget_body(request)
    model = _model_for(request, req.model)
    request[metrics.MODEL] = model.id
    if model.max_tokens is not None and req.kind is not RunKind.EMBEDDING:
        _within_cap(req, model.id, model.max_tokens)
    refused = capabilities.refused_everywhere(req.kind, req.body, model.id, cfg.provider_types(model.id))
    if refused is not None:  # (every provider would refuse it: not queued only to be refused)
        message, field = refused
        raise invalid(message, _field(req, field))
    refuse = _refusing(req, model, cfg)
    runs = request.app[RUNS]
    run_id = new_run_id()
    shape = None if req.echo is None else ResponseShape(run_id, model.id, req.echo, origins=req.origins)
    submitted = finished = False
    out: SSEStream | None = None
    why_left = LEFT  # (why its run is cancelled if it ends before the run: the caller left, or ...)
    too_many = False  # (its answer would have made a Response of too many items: `said_too_many`)
    stopping = request.app[STOPPING]
    task = stopping.add()
    try:
        # Following before the run is queued: its every event comes through the gateway's inbox.
        async with runs.follow(run_id, fresh=True) as follower:
            _, limit_headers = await runs.submit(model, req, principal(request), run_id, refuse)
            follower.queued()
            submitted, stream = True, req.stream
            del req  # the body is in the run record now: a waiting caller keeps no parsed copy of it
            with runs.deadlines.within(runs.follow_deadline_s(model.id)):
                if stream:
                    out = SSEStream(request, run_id, limit_headers, shape)
                    resp = await stream_response(request, follower, model.id, out,
                                                 cfg.runtime.stream_keepalive_ms / 1000)
                else:
                    resp = await whole_response(follower, model.id, run_id, limit_headers, shape)
        finished = True
        return resp
    except TimeoutError:
        # (a stream whose headers went out ends with the error in it: a second answer must not follow)
        ended = None if out is None else await out.fail(_timed_out(run_id), END_WITHIN_S)
        if ended is None:
            raise _timed_out(run_id) from None  # (unbound: see `stream_response`)
        return ended
    except ApiError as exc:
        finished = True
        if shape is not None:  # (a worker's refusal names the chat completion run's field)
            shape.own_names(exc)
        if submitted:
            for name, value in run_headers(run_id).items():  # a failed run can be looked up too
                exc.headers.setdefault(name, value)
        raise
    except Cut as exc:  # (its stream ended with the error: the run goes no further, as for a caller that left)
        why_left = exc.error.message
        too_many = exc.error.code is ErrorCode.OUTPUT_TOO_LARGE  # (a Response's bound: `TooManyItems`)
        assert out is not None and out.resp is not None
        return out.resp
    except TooManyItems as exc:  # (a Response's bound: the run goes no further, as for a caller that left)
        error, why_left, too_many = exc.error, exc.error.message, True
        error.headers.update(run_headers(run_id))
        ended = None if out is None else await out.fail(error, END_WITHIN_S)
        if ended is None:
            raise error from None
        return ended
    except Exception as exc:
        if not submitted or isinstance(exc, (RedisError, *REDIS_DOWN, OSError, web.HTTPException)):
            raise  # (Redis away, the caller gone: `gateway.errors.error_response` answers them)
        # A bug, or a provider's answer that nothing foresaw, met while shaping the answer: the
        # caller hears so (a stream whose headers went out, in the stream), and the run goes no further.
        log.exception("the answer of run %s could not be shaped", run_id)
        error = ApiError(ErrorCode.PROVIDER_ERROR, f"the gateway could not shape the run's answer "
                         f"({type(exc).__name__}); its log says why", headers=run_headers(run_id))
        ended = None if out is None else await out.fail(error, END_WITHIN_S)
        if ended is None:
            raise error from None
        return ended
    except asyncio.CancelledError:
        if stopping.cut_after_s is None:  # (the caller left)
            raise
        # The gateway is stopping and its grace ran out: the caller hears so (and sends the request
        # again, to another gateway); the run is cancelled below, as for a caller that left.
        current = asyncio.current_task()
        if current is not None:
            current.uncancel()
        why_left = "the gateway stopped before the run ended"
        headers = run_headers(run_id) if submitted else {}
        if submitted and not finished:
            stopping.cancelled.add(run_id)
        ended = None if out is None else await out.fail(stopping.error(headers), END_WITHIN_S)
        if ended is None:
            raise stopping.error(headers) from None  # (unbound: see `stream_response`)
        return ended
    finally:
        stopping.discard(task)
        if submitted and not finished:
            # The caller left (or the gateway gave up): the run must not go on without it. (One that
            # left while its run was being queued: `submit` takes the run back once it is queued.)
            if stopping.cut_after_s is not None:  # (the grace ran out: its caller is answered first)
                stopping.leave_after(runs.leave(run_id, model.id, why_left))
            else:
                left = await asyncio.shield(runs.leave(run_id, model.id, why_left))
                if too_many:
                    said_too_many(run_id, model.id, left, why_left)


async def stored_response(request: web.Request) -> web.Response:
    """A stored Response asked for (`client.responses.retrieve`, `delete`, `cancel`,
    `input_items.list`): iop keeps none; the run that made one is kept, under the same hex."""
    response_id = request.match_info["rest"].split("/", 1)[0]
    if not response_id.startswith("resp_"):  # (not a Response's id: an endpoint iop has not, such as
        raise web.HTTPNotFound()                # `/v1/responses/compact`: "Invalid URL", as for any other)
    hexpart = response_id.removeprefix("resp_")
    where = (f"; the run that made it is kept for runtime.run_ttl_s: GET /v1/runs/run_{hexpart}"
             if len(hexpart) == 32 and all(c in "0123456789abcdef" for c in hexpart) else "")
    raise ApiError(ErrorCode.NOT_FOUND, f"iop keeps no responses (each it gives is store: false): "
                   f"{quoted(response_id)} is not kept{where}")


#: OpenAI's path of chat completions, under which it serves the stored ones (`store: true`)
CHAT_PATH = "/v1/chat/completions"


async def stored_chat_completion(request: web.Request) -> web.Response:
    """Stored chat completions asked for (`client.chat.completions.list`, `retrieve`, `update`,
    `delete`, `messages.list`): iop keeps none, whatever a request's `store` said (it goes to the
    provider as it came); the run that made one is kept, under the id of its answer's X-Request-Id.
    (The list was a 405 "it takes POST", which OpenAI's path does not say; the others "Invalid URL".)"""
    rest = request.match_info.get("rest")
    what = "GET /v1/chat/completions lists none" if rest is None else f"{quoted(rest.split('/', 1)[0])} is not kept"
    raise ApiError(ErrorCode.NOT_FOUND, "iop keeps no chat completions (it stores none, whatever a request's store "
                   f"says): {what}; the run that made one is kept for runtime.run_ttl_s: GET /v1/runs/{{id}}, "
                   "the id its answer's X-Request-Id gives")


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """200 when Redis answers, else 503; why not is logged (the address it could not reach, or Redis's
    error), not told."""
    try:
        async with asyncio.timeout(1.0):
            await request.app[RUNS].redis.ping()
            # (and may run a script on iop's keys: an ACL user without that passed, then refused every run)
            await request.app[RUNS].scripts.call("ready", [keys.READY_PROBE], [])
    except (TimeoutError, *REDIS_DOWN) as exc:
        log.warning("not ready: Redis is unreachable: %s", str(exc) or "no answer within 1 s")
        raise ApiError(ErrorCode.UNAVAILABLE, "not ready: Redis is unreachable") from None
    except RedisError as exc:  # such as a user without the right to PING
        log.warning("not ready: Redis answered with an error: %s", exc)
        raise ApiError(ErrorCode.UNAVAILABLE, "not ready: Redis answered with an error (the gateway's log "
                       "has it)") from None
    return web.json_response({"status": "ready", "models": len(request.app[CONFIG].models)})


async def _redis_ctx(app: web.Application) -> AsyncIterator[None]:
    rt = app[CONFIG].runtime
    redis, pool = gateway_redis(app[REDIS_URL], rt.redis_max_connections)
    app[RUNS] = RunClient(redis, app[CONFIG])  # with the gateway's one event reader
    gateway_id = app[RUNS].hub.gateway_id
    trimmer = asyncio.create_task(trim_forever(pool, rt.idle_timeout_ms / 1000))
    beating = asyncio.create_task(liveness.beat_forever(redis, gateway_id, rt.gateway_liveness_ms))
    yield
    trimmer.cancel()
    beating.cancel()
    await asyncio.gather(trimmer, beating, return_exceptions=True)
    if app[STOPPING].unsent or len(app[RUNS].take_back):
        # (cancels Redis did not take: named, with a key that lapses, the gateway's runs are cancelled
        # by a scheduler as a dead gateway's; forgotten, they would go on for nobody. And a Redis that
        # does not answer held the stop here for its socket_timeout, past the container's stop timeout.)
        log.warning("stopping: %d runs' cancels were not taken by Redis; the gateway stays named, so a scheduler "
                    "cancels them once its liveness key lapses (runtime.gateway_liveness_ms)",
                    app[STOPPING].unsent + len(app[RUNS].take_back))
    else:
        await liveness.forget(redis, gateway_id)
    await app[RUNS].close()
    await redis.aclose()


def build_app(config: Config, redis_url: str, keyring: KeyRing | None = None) -> web.Application:
    """The gateway. With `auth` in the config, `keyring` holds its resolved keys (read from the
    environment when not given)."""
    rt = config.runtime
    stopping = Stopping()
    app = web.Application(middlewares=[gateway_middleware(rt.body_timeout_ms / 1000, rt.max_body_bytes, stopping)],
                          client_max_size=rt.max_body_bytes)
    if config.auth is not None:
        app[KEYRING] = keyring or KeyRing.from_config(config.auth, os.environ)
    app[CONFIG] = config
    app[REDIS_URL] = redis_url
    cors.setup(app, rt.cors_origins)
    hosts.setup(app, config.auth is not None, rt.allowed_hosts)
    app[STARTED] = time.time()
    app[STOPPING] = stopping
    app.on_response_prepare.append(app[STOPPING].close_after)
    app.cleanup_ctx.append(_redis_ctx)
    for path in (*RUN_ROUTES, RESPONSES_PATH):
        app.router.add_post(path, run_request)
    app.router.add_route("*", RESPONSES_PATH + "/{rest:.+}", stored_response)
    app.router.add_get(CHAT_PATH, stored_chat_completion)
    app.router.add_route("*", CHAT_PATH + "/{rest:.+}", stored_chat_completion)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get(r"/v1/models/{model_id:[\s\S]+}", get_model)  # (any name, a line break in it too)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    runs_api.setup(app, lambda: app[RUNS], app[STOPPING])
    metrics.setup(app, lambda: app[RUNS].redis, lambda: key_names(config, app.get(KEYRING)),
                  lambda: app[RUNS].take_back if RUNS in app else None)
    catalog.setup(app, config, lambda: app[RUNS].redis)
    admin.setup(app, config, lambda: app[RUNS].redis)
    usage_api.setup(app, config, lambda: app[RUNS].redis)
    expect = expect_handler(rt.max_body_bytes)
    for route in app.router.routes():  # aiohttp has no other way to set it for every route
        route._expect_handler = expect
    return app
