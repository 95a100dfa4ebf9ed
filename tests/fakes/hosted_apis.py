"""Answers of hosted OpenAI-compatible APIs, byte for byte where it matters, each service under a
path of its own on one port (a provider's `base_url` names it: `…/openai/v1`, `…/gemini` with
`api_path: /v1beta/openai`, `…/azure` with `api_path: /openai/v1`, `…/deepseek`, `…/openrouter/api/v1`,
`…/mistral`),
and each behaviour chosen by the served name a run asks for (its part before the first `@`, so that
two providers of one model can ask for the same behaviour under names of their own).

None of these services is reachable from here; what each answers was read from their documentation
and from what their users posted (the sources are named at each answer):

- OpenAI, `gpt-quota`: a key whose account has no quota left (billing): a 429 whose error's `type`
  and `code` are `insufficient_quota`, and no `Retry-After` (the 429 of a "quota, billing, spend-limit"
  case asks for a user's action, not a wait: openai/openai-openapi#564; the body as OpenHands/OpenHands#998
  and ChatGPTNextWeb/NextChat#3123 show it; OpenAI indents its error bodies by 4, as
  eryajf/chatgpt-dingtalk#35 shows). Its model list still answers 200: listing costs no quota.
- Azure OpenAI, `azure-throttled`: a deployment over its rate, a 429 that says how long in
  `retry-after-ms` only (Microsoft's Azure/azure-openai-benchmark read no other header: its issue #31;
  the official `openai` clients read `retry-after-ms` first, openai-python `_parse_retry_after_header`).
  Azure's `/openai/v1/models` lists the resource's models, not its deployments (the `listModels`
  operation of Azure/azure-rest-api-specs `specification/ai/data-plane/OpenAI.v1`, and the
  2024-10-21 `get_models.json` example: base and fine-tuned models by their own ids); a deployment
  is named by its owner (`chat-prod` here) and answers runs under that name.
- Gemini's OpenAI-compatible endpoint (`/v1beta/openai/`): an error is a JSON array of one Google error
  object, pretty-printed (n4ze3m/page-assist#406, Alishahryar1/free-claude-code#542); `gemini-busy`:
  a 429 `RESOURCE_EXHAUSTED` with no `Retry-After` header, its wait only in the body, a
  `google.rpc.RetryInfo` `retryDelay` (vercel/ai#18627, AtomicBot-ai/atomic-agent#271,
  googleapis/python-genai#2044 for the details); `gemini-unknown-field`: a 400 `INVALID_ARGUMENT` for a
  field it does not know (free-claude-code#542). Its model list names each model `models/<name>`
  (RubyLLM's Gemini provider strips that prefix from the `data` ids it lists: crmne/ruby_llm
  `lib/ruby_llm/providers/gemini/models.rb`), and its runs take the bare name (ai.google.dev/gemini-api/
  docs/openai: `model="gemini-…"`).
- DeepSeek, `deepseek-broke`: an account out of balance, a 402 (api-docs.deepseek.com error codes:
  "402 - Insufficient Balance"; the body as Aider-AI/aider#4851 shows it).
- OpenRouter, `openrouter/broke`: a key out of credits, a 402 in OpenRouter's error shape
  (openrouter.ai/docs errors: "402: Your account or API key has insufficient credits"; the body as
  Gitlawb/openclaude#43 shows it). `openrouter/afford`: a key whose credits pay for a small request but not
  for this one, a 402 for a request whose `max_tokens` (or, when it sends none, the model's own) costs
  more than is left, and a 200 for one of 1,000 or fewer ("This request requires more credits, or fewer
  max_tokens. You requested up to … tokens, but can only afford …": Gitlawb/openclaude#1125, and
  can1357/oh-my-pi#9569, where one call of 1,024 succeeded beside one without a cap refused so, on the
  same account and model at the same time). `openrouter/midstream`: a stream that keeps its connection with
  SSE comments (`: OPENROUTER PROCESSING`, openrouter.ai/docs streaming) and fails after some output
  with a chunk that carries `error` and a choice whose `finish_reason` is `"error"` (the same page,
  "Handling Errors During Streaming"). `openrouter/key-limit`: a key past the spending limit its owner
  set on it, a 403 "Key limit exceeded (monthly limit)" (gptme/gptme#1449).
- Mistral, `mistral-small-latest`: its API refuses a field it does not know with pydantic's 422,
  every such field an `extra_forbidden` entry of one error (`"object": "error"`, the detail under
  `message`): `stream_options` (avante-corp/avante.nvim#2347, dnakov/anon-kode#53: its streams carry
  their usage without being asked) and `max_completion_tokens` (editor-code-assistant/eca#231; it
  takes `max_tokens`, which LiteLLM's Mistral config maps `max_completion_tokens` to). Its last chunk
  carries `usage`. The bodies it was sent are kept (`bodies`).
- anything else: a plain answer, whole or streamed.

Calls are counted per (service, served name) (`calls`). It runs on its own event loop in a thread."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from aiohttp import web

from tests.fakes.serving import ThreadedServer

CALLS = web.AppKey("calls", Counter)
#: service -> the model ids its `GET …/models` lists
LISTED = web.AppKey("listed", dict)

OPENAI_QUOTA = {"error": {"message": "You exceeded your current quota, please check your plan and billing details. "
                                     "For more information on this error, read the docs: "
                                     "https://platform.openai.com/docs/guides/error-codes/api-errors.",
                          "type": "insufficient_quota", "param": None, "code": "insufficient_quota"}}
AZURE_THROTTLED = {"error": {"code": "429", "message": "Requests to the ChatCompletions_Create Operation under Azure "
                             "OpenAI API version v1 have exceeded call rate limit of your current OpenAI S0 pricing "
                             "tier. Please retry after 5 seconds. Please go here: https://aka.ms/oai/quotaincrease "
                             "if you would like to further increase the default rate limit."}}
GEMINI_BUSY = {"error": {
    "code": 429,
    "message": "You exceeded your current quota, please check your plan and billing details. For more information on "
               "this error, head to: https://ai.google.dev/gemini-api/docs/rate-limits. To monitor your current usage, "
               "head to: https://ai.dev/rate-limit. \n* Quota exceeded for metric: "
               "generativelanguage.googleapis.com/generate_content_free_tier_requests, limit: 10, model: "
               "gemini-2.0-flash\nPlease retry in 46.171438914s.",
    "status": "RESOURCE_EXHAUSTED",
    "details": [
        {"@type": "type.googleapis.com/google.rpc.Help",
         "links": [{"description": "Learn more about Gemini API quotas",
                    "url": "https://ai.google.dev/gemini-api/docs/rate-limits"}]},
        {"@type": "type.googleapis.com/google.rpc.QuotaFailure",
         "violations": [{"quotaMetric": "generativelanguage.googleapis.com/generate_content_free_tier_requests",
                         "quotaId": "GenerateRequestsPerMinutePerProjectPerModel-FreeTier",
                         "quotaDimensions": {"location": "global", "model": "gemini-2.0-flash"},
                         "quotaValue": "10"}]},
        {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "47s"},
    ]}}
GEMINI_UNKNOWN_FIELD = {"error": {
    "code": 400,
    "message": "Invalid JSON payload received. Unknown name \"google\": Cannot find field.",
    "status": "INVALID_ARGUMENT",
    "details": [{"@type": "type.googleapis.com/google.rpc.BadRequest",
                 "fieldViolations": [{"description": "Invalid JSON payload received. Unknown name \"google\": "
                                                     "Cannot find field."}]}]}}
DEEPSEEK_BROKE = {"error": {"message": "Insufficient Balance", "type": "unknown_error", "param": None,
                            "code": "invalid_request_error"}}
OPENROUTER_BROKE = {"error": {"message": "Insufficient credits. This account never purchased credits. Make sure your "
                                         "key is on the correct account or org, and if so, purchase more at "
                                         "https://openrouter.ai/settings/credits", "code": 402}}
#: OpenRouter's answer to a key past the spending limit its owner set on it (a 403, not a 402; the body as
#: gptme/gptme#1449 shows it: "Key limit exceeded (monthly limit)"; "(total limit)" in MCPJam/inspector#1287)
OPENROUTER_KEY_LIMIT = {"error": {"message": "Key limit exceeded (monthly limit). Manage it using "
                                             "https://openrouter.ai/settings/keys", "code": 403}}
#: what `openrouter/afford` affords (its 402 says so)
OPENROUTER_AFFORDS = 1000
OPENROUTER_MIDSTREAM = {"code": "server_error", "message": "Provider disconnected unexpectedly"}
#: what Mistral's chat API refuses of what OpenAI's takes (`mistral-small-latest`)
MISTRAL_UNKNOWN = ("stream_options", "max_completion_tokens")
BODIES = web.AppKey("bodies", list)

#: service -> (where its API is under the fake, what it lists)
SERVICES = {
    "openai": "/openai/v1",
    "azure": "/azure/openai/v1",
    "gemini": "/gemini/v1beta/openai",
    "deepseek": "/deepseek/v1",
    "openrouter": "/openrouter/api/v1",
    "mistral": "/mistral/v1",
}


def _compact(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _google(obj: object) -> bytes:
    """Gemini's OpenAI-compatible endpoint's error: the Google error, indented by 2, in an array."""
    return b"[" + json.dumps(obj, indent=2).encode() + b"\n]\n"


def _chunk(model: str, choice: dict[str, Any], **extra: Any) -> bytes:
    return b"data: " + _compact({"id": "gen-1", "object": "chat.completion.chunk", "created": 1, "model": model,
                                 **extra, "choices": [choice]}) + b"\n\n"


def _whole(model: str, content: str) -> web.Response:
    return web.Response(body=_compact({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content, "refusal": None},
                     "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}), content_type="application/json")


async def _events(request: web.Request, *parts: bytes) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for part in parts:
        await resp.write(part)
    await resp.write_eof()
    return resp


def _error(status: int, body: bytes, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


async def _models(request: web.Request) -> web.Response:
    service = request.match_info["service"]
    ids = request.app[LISTED][service]
    owner = {"openai": "system", "gemini": "google", "deepseek": "deepseek", "mistral": "mistralai"}.get(service,
                                                                                                     service)
    cards = [{"id": name, "object": "model", "created": 1, "owned_by": owner} for name in ids]
    return web.Response(body=_compact({"object": "list", "data": cards}), content_type="application/json")


async def _chat(request: web.Request) -> web.StreamResponse:
    service = request.match_info["service"]
    body = await request.json()
    served = body["model"]
    request.app[CALLS][(service, served)] += 1
    kind = served.split("@")[0]
    stream = bool(body.get("stream"))
    if kind == "gpt-quota":
        return _error(429, json.dumps(OPENAI_QUOTA, indent=4).encode() + b"\n")
    if kind == "azure-throttled":
        return _error(429, _compact(AZURE_THROTTLED), {"retry-after-ms": "5000"})
    if kind == "gemini-busy":
        return _error(429, _google(GEMINI_BUSY))
    if kind == "gemini-unknown-field":
        return _error(400, _google(GEMINI_UNKNOWN_FIELD))
    if kind == "deepseek-broke":
        return _error(402, _compact(DEEPSEEK_BROKE))
    if kind == "openrouter/broke":
        return _error(402, _compact(OPENROUTER_BROKE))
    if kind == "openrouter/key-limit":
        return _error(403, _compact(OPENROUTER_KEY_LIMIT))
    asked = body.get("max_completion_tokens") or body.get("max_tokens") or 65536
    if kind == "openrouter/afford" and asked > OPENROUTER_AFFORDS:
        return _error(402, _compact({"error": {
            "message": f"This request requires more credits, or fewer max_tokens. You requested up to {asked} tokens, "
                       f"but can only afford {OPENROUTER_AFFORDS}. To increase, visit "
                       "https://openrouter.ai/settings/credits and upgrade to a paid account",
            "code": 402, "metadata": {"provider_name": None}}, "user_id": "user_1"}))
    if kind == "mistral-small-latest":
        return await _mistral(request, body, served, stream)
    if kind == "openrouter/midstream" and stream:
        return await _events(
            request, b": OPENROUTER PROCESSING\n\n",
            _chunk(served, {"index": 0, "delta": {"role": "assistant", "content": "Half an"}, "finish_reason": None},
                   provider="OpenAI"),
            b": OPENROUTER PROCESSING\n\n",
            _chunk(served, {"index": 0, "delta": {"content": ""}, "finish_reason": "error"}, provider="OpenAI",
                   error=OPENROUTER_MIDSTREAM))
    if stream:
        return await _events(
            request, b": OPENROUTER PROCESSING\n\n" if service == "openrouter" else b"",
            _chunk(served, {"index": 0, "delta": {"role": "assistant", "content": "hello there"},
                            "finish_reason": None}),
            _chunk(served, {"index": 0, "delta": {}, "finish_reason": "stop"}), b"data: [DONE]\n\n")
    return _whole(served, "hello there")


async def _mistral(request: web.Request, body: dict[str, Any], served: str, stream: bool) -> web.StreamResponse:
    request.app[BODIES].append(body)
    extra = []
    for field in MISTRAL_UNKNOWN:
        if field in body:  # (pydantic names the innermost field it refuses: an object's unknown keys)
            value = body[field]
            inner = [(["body", field, key], item) for key, item in value.items()] if isinstance(value, dict) \
                else [(["body", field], value)]
            extra += [{"type": "extra_forbidden", "loc": loc, "msg": "Extra inputs are not permitted", "input": item}
                      for loc, item in inner]
    if extra:
        return _error(422, _compact({"object": "error", "message": {"detail": extra}, "type": "invalid_request_error",
                                     "param": None, "code": None}))
    if stream:
        usage = {"prompt_tokens": 5, "total_tokens": 7, "completion_tokens": 2}
        return await _events(
            request,
            _chunk(served, {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}),
            _chunk(served, {"index": 0, "delta": {"content": "hello there"}, "finish_reason": None}),
            _chunk(served, {"index": 0, "delta": {"content": ""}, "finish_reason": "stop"}, usage=usage),
            b"data: [DONE]\n\n")
    return _whole(served, "hello there")


class HostedApis(ThreadedServer):
    def __init__(self, listed: dict[str, list[str]]) -> None:
        """`listed`: service -> the model ids its model list names (as the service names them)."""
        super().__init__()
        self.listed = listed
        self.calls: Counter[tuple[str, str]] = Counter()
        #: the bodies Mistral's `mistral-small-latest` was sent, refused or not
        self.bodies: list[dict[str, Any]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app[CALLS] = self.calls
        app[LISTED] = self.listed
        app[BODIES] = self.bodies
        for service, path in SERVICES.items():
            app.router.add_get(f"/{{service:{service}}}{path.removeprefix('/' + service)}/models", _models)
            app.router.add_post(f"/{{service:{service}}}{path.removeprefix('/' + service)}/chat/completions", _chat)
        return app

    def base(self, service: str) -> str:
        """The base_url of a provider at `service`, as the service documents its own (Azure's and Gemini's
        take an `api_path`: `/openai/v1`, `/v1beta/openai`; DeepSeek's `/v1` is the type's default)."""
        return self.url + {"openai": "/openai/v1", "openrouter": "/openrouter/api/v1"}.get(service, f"/{service}")
