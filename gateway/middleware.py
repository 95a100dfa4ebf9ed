"""The gateway's one middleware: what every request goes through, in this order.

0. its connection's head deadline stopped (`gateway.connections`),
1. measured (`gateway.metrics`: run requests, by the status they finally got),
2. any error turned into its OpenAI shape (`gateway.errors`, the one place that does it),
   refused once the gateway's stop began (`gateway.stopping`: it came on a connection kept open),
   a keyless gateway's request by a name it does not answer to refused (`gateway.hosts`),
3. a listed site's CORS preflight answered, a change from a page of an unlisted site refused
   (`gateway.cors`),
4. let in by its API key (`gateway.auth`),
5. its body read within its limits (`gateway.connections`),
6. handled,
7. given an `X-Request-Id` when it has none (a run's answer has its run's id), as OpenAI gives
   every answer one (the `openai` client's `request_id`, of an error too).

One middleware rather than five: a caller waiting for its run holds each middleware's frame for
as long as it waits (about 300 bytes each, with thousands waiting).
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Middleware

from gateway import metrics
from gateway.auth import admit
from gateway.connections import body_reader, request_started
from gateway.cors import preflight, refuse_cross_site
from gateway.errors import REQUEST_ID_HEADER, Handler, error_response, new_request_id
from gateway.hosts import refuse_foreign_host
from gateway.stopping import Stopping


def gateway_middleware(body_timeout_s: float, max_body_bytes: int, stopping: Stopping) -> Middleware:
    read_body = body_reader(body_timeout_s, max_body_bytes)

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        request_started(request)
        endpoint = metrics.begin(request)
        response: web.StreamResponse | None = None
        try:
            try:
                stopping.refuse_new()
                refuse_foreign_host(request)
                response = preflight(request)
                if response is None:
                    refuse_cross_site(request)
                    admit(request)
                    await read_body(request)
                    response = await handler(request)
            except Exception as exc:
                response = error_response(request, exc)
            if not response.prepared and REQUEST_ID_HEADER not in response.headers:
                response.headers[REQUEST_ID_HEADER] = new_request_id()
            return response
        finally:
            if endpoint is not None:
                metrics.end(request, endpoint, response)

    return middleware
