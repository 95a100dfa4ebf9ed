"""The config schema (D01) and its validation.

Validation is pure: `parse_config(mapping)` returns a `Config` or raises `ConfigError`
carrying every fault, each prefixed with the exact path at fault
(`models[1].providers.vllm-a: ...`). `load_config(path)` only adds YAML reading.
"""

from __future__ import annotations

import difflib
import math
import re
import typing
import unicodedata
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, Field, PrivateAttr, ValidationError

from common.auth import ENV_NAME_PATTERN, NAME_PATTERN, SECRET_FORMS, SHA256_PATTERN, AuthConfig, check_auth
from common.config_yaml import FAST, ConfigLoader
from common.legacy import is_legacy
from common.legacy import migrate as migrate_legacy

# Per-type defaults live in `common.provider_types`; re-exported here for callers of the config.
from common.provider_types import CATEGORIES as CATEGORIES
from common.provider_types import DEFAULT_CATEGORY as DEFAULT_CATEGORY
from common.provider_types import LOADS_FIRST, default_lifecycle
from common.provider_types import PROVIDER_TYPES as PROVIDER_TYPES
from common.provider_types import Category as Category
from common.provider_types import LifecycleFlag as LifecycleFlag
from common.provider_types import ProviderType as ProviderType
from common.strict import Strict

#: An id is a non-empty string without whitespace (it becomes part of Redis keys).
ID_PATTERN = r"^\S+$"
#: a provider's id: no comma either (a run's `tried` providers are a comma-separated list in Redis)
PROVIDER_ID_PATTERN = r"^[^\s,]+$"
#: the most `aliases` a model may have, and the longest one
MAX_ALIASES = 64
MAX_ALIAS_CHARS = 256
#: the longest model, node or provider id (each is part of Redis keys and of every run's record)
MAX_ID_CHARS = 256
#: the longest `display_name` (it goes out with every /v1/models and catalog answer), the longest
#: served name (a llama.cpp model's file path, say), and the most served names of one provider
MAX_DISPLAY_NAME_CHARS = 256
MAX_SERVED_CHARS = 1024
MAX_SERVED_NAMES = 1000
#: the largest config file read
MAX_CONFIG_BYTES = 4 * 2**20
#: the most values a config's aliases may add to those it writes out (`values_aliases_add`)
MAX_ALIAS_VALUES = 100_000
#: the largest `max_tokens` a model may set
MAX_TOKENS = 10_000_000
#: A site as a browser names it in `Origin` (scheme, host and port; no path), or `*` for any.
CORS_ORIGIN_PATTERN = r"^(\*|https?://[^/\s?#]+)$"
#: A path on a provider's host; the API's under `base_url` may be empty, and holds no query or fragment
#: (iop adds the API's paths to it: after a `?` they were in the query, and every request went to the path before it).
PATH_PATTERN = r"^/\S*$"
API_PATH_PATTERN = r"^(/[^\s?#]*)?$"
#: A host name as `Host` sends it, without a port, or `*` for any.
HOST_NAME_PATTERN = r"^(\*|[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?)$"
#: A header a provider's requests carry from the config (`headers`, `api_key_header`): its name an
#: HTTP token, its value printable ASCII without line breaks; at most `MAX_HEADERS` of them.
HEADER_NAME_PATTERN = r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$"
HEADER_VALUE_PATTERN = r"^[\x20-\x7e]*$"
MAX_HEADERS = 32
MAX_HEADER_NAME_CHARS = 64
MAX_HEADER_VALUE_CHARS = 1024
#: Headers the worker sets on a provider's requests itself (lower case), and why.
IOP_HEADERS = {"host": "from base_url", "content-length": "the body's", "content-type": "the body's",
               "transfer-encoding": "the body's", "connection": "the connection's", "keep-alive": "the connection's",
               "upgrade": "the connection's", "te": "the connection's", "trailer": "the body's",
               "expect": "the request's", "proxy-authorization": "from the proxy's URL",
               "x-request-id": "the run's UUID", "accept-encoding": "the reader's"}
#: The most load samples the history may hold (`runtime.history_retention_s` / `history_interval_ms`).
MAX_HISTORY_SAMPLES = 20_000

# Upper bounds of the config's numbers. Each is far beyond any sane setting, and keeps what is
# derived from it (slot counts, deadlines in ms since the epoch, TTLs) a signed 64-bit integer,
# which is what Redis takes: a worker given `capacity: 99999999999999999999999` ran nothing.
#: The most concurrent runs one provider may take (`nodes[].providers[].capacity`).
MAX_CAPACITY = 1_000_000
#: The longest duration in ms anywhere in the config: 7 days, arq's job timeout, which bounds a run.
MAX_DURATION_MS = 7 * 24 * 3600 * 1000
#: The longest `runtime.run_ttl_s`: 30 days (it must outlast queue_timeout_ms + execution_timeout_ms).
MAX_RUN_TTL_S = 30 * 24 * 3600
#: The most bytes of any size limit: 512 MiB, the largest value Redis holds (proto-max-bulk-len).
MAX_BYTES = 512 * 1024 * 1024
#: The most runs a model's queue may hold (`queue.max_queue`).
MAX_QUEUE = 1_000_000
#: The most tries of one run (`queue.max_attempts`).
MAX_ATTEMPTS = 100
#: The longest a streamed run's output may be held to go out with what comes after it.
MAX_STREAM_BATCH_MS = 10_000
#: The most events one run's stream may hold (`runtime.max_events_per_run`).
MAX_EVENTS_PER_RUN = 10_000_000
#: The most client connections a gateway may hold (`runtime.max_connections`).
MAX_CONNECTIONS = 1_000_000
#: The largest Redis connection pool of a gateway (`runtime.redis_max_connections`).
MAX_REDIS_CONNECTIONS = 100_000
#: The paths of the APIs' endpoints, which a `base_url` never ends in: iop adds them to it.
API_ENDPOINTS = ("/chat/completions", "/completions", "/embeddings", "/responses", "/v1/models", "/api/chat",
                 "/api/generate", "/api/embed", "/api/embeddings", "/api/tags")
#: The schemes a provider's `base_url` may have.
URL_SCHEMES = ("http", "https")
#: Longest a value is shown in a message.
_SHOWN_CHARS = 80


class QueuePolicy(Strict):
    """How long and how many runs may wait for a model, and how long one may run."""

    max_queue: int = Field(64, ge=0, le=MAX_QUEUE, description="waiting runs a model's queue holds; more get 429")
    queue_timeout_ms: int = Field(30_000, ge=1, le=MAX_DURATION_MS,
                                  description="a run waiting this long fails with 504")
    execution_timeout_ms: int = Field(600_000, ge=1, le=MAX_DURATION_MS,
                                      description="a run executing this long is aborted")
    max_attempts: int = Field(3, ge=1, le=MAX_ATTEMPTS, description="tries of a run that fails before any output")


class QueueOverride(Strict):
    """Per-model override of `QueuePolicy`; unset fields keep the default."""

    max_queue: int | None = Field(None, ge=0, le=MAX_QUEUE)
    queue_timeout_ms: int | None = Field(None, ge=1, le=MAX_DURATION_MS)
    execution_timeout_ms: int | None = Field(None, ge=1, le=MAX_DURATION_MS)
    max_attempts: int | None = Field(None, ge=1, le=MAX_ATTEMPTS)


HeaderName = Annotated[str, Field(pattern=HEADER_NAME_PATTERN, max_length=MAX_HEADER_NAME_CHARS)]
HeaderValue = Annotated[str, Field(pattern=HEADER_VALUE_PATTERN, max_length=MAX_HEADER_VALUE_CHARS)]


#: `load_timeout_ms`'s default: Ollama's own load timeout (`OLLAMA_LOAD_TIMEOUT`, envconfig/config.go:146-164)
LOAD_TIMEOUT_MS = 300_000


class ProviderConfig(Strict):
    id: str = Field(pattern=PROVIDER_ID_PATTERN, max_length=MAX_ID_CHARS)
    type: ProviderType
    category: Category | None = None
    base_url: str | None = None
    api_key_env: str | None = Field(None, pattern=ENV_NAME_PATTERN,
                                    description="name of the env var holding the API key")
    api_key_header: str | None = Field(None, pattern=HEADER_NAME_PATTERN, max_length=MAX_HEADER_NAME_CHARS,
                                       description="over HTTP: the header that carries the key as it is "
                                                   "(default: Authorization: Bearer <key>)")
    headers: dict[HeaderName, HeaderValue] | None = Field(
        None, max_length=MAX_HEADERS, description="over HTTP: headers sent with every request (not secrets)")
    capacity: int = Field(ge=1, le=MAX_CAPACITY)
    models: list[Annotated[str, Field(max_length=MAX_SERVED_CHARS)]] = Field(min_length=1, max_length=MAX_SERVED_NAMES)
    connect_timeout_ms: int = Field(5_000, ge=1, le=MAX_DURATION_MS)
    read_timeout_ms: int = Field(120_000, ge=1, le=MAX_DURATION_MS,
                                 description="longest silence while reading a response")
    load_timeout_ms: int = Field(LOAD_TIMEOUT_MS, ge=0, le=MAX_DURATION_MS,
                                 description="ollama, lemonade, llamacpp: how much longer than read_timeout_ms the "
                                             "answer's head may take (they load the model before they answer "
                                             "anything; llama-server as a router)")
    probe_timeout_ms: int = Field(2_000, ge=1, le=MAX_DURATION_MS,
                                  description="a health probe without an answer by then failed")
    probe_interval_ms: int | None = Field(None, ge=10, le=MAX_DURATION_MS,
                                          description="least time between probes (runtime default)")
    probe_path: str | None = Field(None, pattern=PATH_PATTERN,
                                   description="OpenAI family: the health endpoint on the provider's host")
    api_path: str | None = Field(None, pattern=API_PATH_PATTERN,
                                 description="OpenAI family: path of the API under base_url (default by type)")
    models_listed: bool = Field(True, description="openai_api: false when its model list does not name every "
                                                  "name it takes (Azure's deployments, OpenRouter's :nitro): the "
                                                  "list is read for health only")
    command: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, min_length=1, description="cli: the argv to run (never through a shell)")
    lifecycle_capabilities: list[LifecycleFlag] | None = Field(None, description="overrides the type's flags")

    @property
    def effective_category(self) -> Category:
        return self.category or DEFAULT_CATEGORY[self.type]

    @property
    def head_wait_s(self) -> float | None:
        """How long a run's answer may take to begin, in seconds, when that is longer than
        `read_timeout_ms` (a type that loads the model first, `LOADS_FIRST`); else None."""
        if self.type not in LOADS_FIRST or not self.load_timeout_ms:
            return None
        return (self.read_timeout_ms + self.load_timeout_ms) / 1000

    @property
    def effective_lifecycle(self) -> list[LifecycleFlag]:
        flags = default_lifecycle(self.type) if self.lifecycle_capabilities is None else self.lifecycle_capabilities
        return list(dict.fromkeys(flags))


class NodeConfig(Strict):
    id: str = Field(pattern=ID_PATTERN, max_length=MAX_ID_CHARS)
    providers: list[ProviderConfig] = Field(default_factory=list)


class ModelConfig(Strict):
    id: str = Field(pattern=ID_PATTERN, max_length=MAX_ID_CHARS)
    display_name: str | None = Field(None, max_length=MAX_DISPLAY_NAME_CHARS)
    #: other names callers may ask for the model by (`chat-default`, an old id kept for a rename)
    aliases: list[Annotated[str, Field(pattern=ID_PATTERN, max_length=MAX_ALIAS_CHARS)]] = Field(
        default_factory=list, max_length=MAX_ALIASES)
    #: the most tokens a run may generate (`common.token_cap`); None: as the caller and the server say
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    providers: dict[str, Annotated[str, Field(max_length=MAX_SERVED_CHARS)]] = Field(
        min_length=1, description="provider id -> served name")
    queue: QueueOverride | None = None

    @property
    def title(self) -> str:
        return self.display_name or self.id


class RuntimeConfig(Strict):
    """Timings and limits shared by every process (the gateway's own limits too). Tests shrink them."""

    heartbeat_interval_ms: int = Field(2_000, ge=10, le=MAX_DURATION_MS)
    heartbeat_ttl_ms: int = Field(6_000, ge=20, le=MAX_DURATION_MS)
    probe_interval_ms: int = Field(5_000, ge=10, le=MAX_DURATION_MS)
    # A provider benched for a model's runs' failures (common.policy.BLAME_RUNS) takes none of them
    # for this long; 0: never benched.
    bench_ms: int = Field(30_000, ge=0, le=MAX_DURATION_MS)
    lease_ttl_ms: int = Field(15_000, ge=50, le=MAX_DURATION_MS)
    scheduler_liveness_ms: int = Field(3_000, ge=50, le=MAX_DURATION_MS)
    gateway_liveness_ms: int = Field(10_000, ge=100, le=MAX_DURATION_MS)
    run_ttl_s: int = Field(3_600, ge=1, le=MAX_RUN_TTL_S)
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024, le=MAX_BYTES)
    # Deeper than 256 would come close to the recursion limits of Python's json (~1000) and of
    # msgpack (512), which are what the limit keeps requests away from.
    max_json_depth: int = Field(64, ge=2, le=256, description="request bodies nested deeper get 400")
    # Parsing and checking a body costs the gateway's one thread ~3.5 µs an array or object on a
    # slow machine: a few MiB of `[]` (a few KiB gzipped) held it for seconds.
    max_json_containers: int = Field(20_000, ge=16, le=1_000_000,
                                     description="request bodies holding more JSON arrays and objects get 400")
    # What one request may ask a provider to make (common.choices): OpenAI's own limits by default.
    max_choices: int = Field(128, ge=1, le=10_000,
                             description="a request's n (a legacy completion's best_of) above this gets 400")
    max_inputs: int = Field(2_048, ge=1, le=1_000_000,
                            description="a legacy completion's or an embeddings request's list of more gets 400")
    # The gateway's connections (gateway.connections); each is documented in the README.
    header_timeout_ms: int = Field(10_000, ge=10, le=MAX_DURATION_MS,
                                   description="a request head must arrive within this")
    body_timeout_ms: int = Field(60_000, ge=10, le=MAX_DURATION_MS,
                                 description="a request body must arrive within this after its head")
    idle_timeout_ms: int = Field(75_000, ge=10, le=MAX_DURATION_MS,
                                 description="a kept-alive connection without a request is closed")
    max_connections: int = Field(4_096, ge=1, le=MAX_CONNECTIONS, description="connections the gateway serves at once")
    redis_max_connections: int = Field(64, ge=2, le=MAX_REDIS_CONNECTIONS,
                                       description="the gateway's Redis connection pool")
    # What one run may make a worker read and keep (workers.runner, the adapters); see the README.
    max_output_bytes: int = Field(16 * 1024 * 1024, ge=1024, le=MAX_BYTES,
                                  description="a run's streamed output (stored events) beyond this ends it")
    max_events_per_run: int = Field(100_000, ge=10, le=MAX_EVENTS_PER_RUN, description="events a run's stream may hold")
    max_response_bytes: int = Field(16 * 1024 * 1024, ge=1024, le=MAX_BYTES,
                                    description="the largest whole (non-stream) answer read from a provider")
    max_line_bytes: int = Field(1024 * 1024, ge=1024, le=MAX_BYTES,
                                description="the longest SSE or NDJSON line a provider may send")
    max_error_chars: int = Field(500, ge=50, le=10_000, description="a provider's error text is cut to this")
    stream_keepalive_ms: int = Field(10_000, ge=100, le=MAX_DURATION_MS,
                                     description="a stream silent this long gets an SSE keep-alive comment")
    stream_batch_ms: int = Field(0, ge=0, le=MAX_STREAM_BATCH_MS,
                                 description="after a stream's first output, what comes goes out at most this often")
    # The catalog's charts (common.history): how often the schedulers sample the load, and for how long.
    history_interval_ms: int = Field(5_000, ge=100, le=600_000, description="one load sample per this")
    history_retention_s: int = Field(3_600, ge=60, le=86_400, description="load samples are kept this long")
    # The gateway's answers to browsers of other sites (gateway.cors): none unless listed.
    cors_origins: list[Annotated[str, Field(pattern=CORS_ORIGIN_PATTERN)]] = Field(
        default_factory=list, max_length=100, description="sites whose pages may call the gateway; * for any")
    allowed_hosts: list[Annotated[str, Field(pattern=HOST_NAME_PATTERN)]] = Field(
        default_factory=list, max_length=100,
        description="names a gateway without keys answers to over loopback besides localhost and addresses; * for any")


class Config(Strict):
    models: list[ModelConfig] = Field(min_length=1)
    nodes: list[NodeConfig] = Field(min_length=1)
    queue: QueuePolicy = QueuePolicy()
    runtime: RuntimeConfig = RuntimeConfig()
    auth: AuthConfig | None = None

    _models: dict[str, ModelConfig] = PrivateAttr(default_factory=dict)
    _names: dict[str, ModelConfig] = PrivateAttr(default_factory=dict)
    _providers: dict[str, ProviderConfig] = PrivateAttr(default_factory=dict)
    _node_of: dict[str, str] = PrivateAttr(default_factory=dict)
    #: derived once (a config is never changed after it is made): they are asked for on every run
    _queues: dict[str, QueuePolicy] = PrivateAttr(default_factory=dict)
    _models_of: dict[str, list[str]] = PrivateAttr(default_factory=dict)
    _types_of: dict[str, frozenset[str]] = PrivateAttr(default_factory=dict)

    def model_post_init(self, __context: Any) -> None:
        self._models = {m.id: m for m in self.models}
        self._names = {**{a: m for m in self.models for a in m.aliases}, **self._models}
        for node in self.nodes:
            for p in node.providers:
                self._providers[p.id] = p
                self._node_of[p.id] = node.id
        for m in self.models:
            self._queues[m.id] = (self.queue if m.queue is None
                                  else self.queue.model_copy(update=m.queue.model_dump(exclude_none=True)))
            for provider_id in m.providers:
                self._models_of.setdefault(provider_id, []).append(m.id)
            self._types_of[m.id] = frozenset(self._providers[p].type for p in m.providers if p in self._providers)

    # The lookups below are made several times a run in every process: they read the derived
    # dicts straight from pydantic's private store (`self._models` goes through pydantic's
    # `__getattr__`, ~1.4 us a read against ~0.05).
    def _private(self, name: str) -> Any:
        return self.__pydantic_private__[name]  # type: ignore[index]

    def model(self, model_id: str) -> ModelConfig | None:
        return self._private("_models").get(model_id)  # type: ignore[no-any-return]

    def model_named(self, name: str) -> ModelConfig | None:
        """The model a caller asks for by its id or one of its `aliases`."""
        return self._private("_names").get(name)  # type: ignore[no-any-return]

    def provider(self, provider_id: str) -> ProviderConfig:
        return self._private("_providers")[provider_id]  # type: ignore[no-any-return]

    def node_of(self, provider_id: str) -> str:
        return self._private("_node_of")[provider_id]  # type: ignore[no-any-return]

    def node(self, node_id: str) -> NodeConfig | None:
        return next((n for n in self.nodes if n.id == node_id), None)

    def models_of(self, provider_id: str) -> list[str]:
        """The ids of the models a provider serves (a slot freed there may serve any of them)."""
        return list(self._private("_models_of").get(provider_id, ()))

    def provider_types(self, model_id: str) -> frozenset[str]:
        """The `type`s of the model's providers."""
        return self._private("_types_of").get(model_id, frozenset())  # type: ignore[no-any-return]

    def queue_for(self, model: ModelConfig) -> QueuePolicy:
        """The model's queue policy: the config's, with the model's own overrides."""
        queue: QueuePolicy | None = self._private("_queues").get(model.id)
        if queue is None:  # a model that is not one of this config's
            return self.queue if model.queue is None else self.queue.model_copy(
                update=model.queue.model_dump(exclude_none=True))
        return queue


class ConfigError(Exception):
    """Every fault of a config, each naming its path."""

    def __init__(self, errors: Sequence[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = list(errors)


def format_path(loc: Sequence[Any], data: Any = None) -> str:
    """('models', 1, 'providers', 'vllm-a') -> 'models[1].providers.vllm-a'.

    pydantic marks a bad mapping key with a trailing '[key]': ('providers', 1, '[key]') is
    the key 1 of `providers`, shown as 'providers.1 (key)'. A number is a list's index, unless
    `data` (the input) has a mapping there: `{1: 2}` under `providers` is 'providers.1', not
    'providers[1]' (and a key `true`, which pydantic writes as 1, is 'providers.true')."""
    out = ""
    if len(loc) >= 2 and loc[-1] == "[key]":
        return (f"{format_path(loc[:-2], data)}.{path_part(loc[-2])} (key)" if len(loc) > 2
                else f"{path_part(loc[0])} (key)")
    node = data
    for part in loc:
        if isinstance(node, Mapping) and not isinstance(part, str):
            part = next((k for k in node if k == part and type(k) is not str), part)  # (its own key: `true`, not 1)
            out += f".{path_part(part)}" if out else path_part(part)
        elif isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{path_part(part)}" if out else path_part(part)
        try:
            node = node[part] if isinstance(node, Mapping | list) else None
        except (LookupError, TypeError):
            node = None
    return out or "(top level)"


def shown(value: Any) -> str:
    """A value of a config, for a message, as YAML writes it: `true`, `null`, `.inf`, `1.5`,
    `[1, 'a']`; text quoted (`'x'`). Never as Python writes it (`True`, `None`, `inf`). Cut short
    when long: written only as far as it is shown (a 10 KB alias bomb of 10⁹ leaves, or a list
    nested 400 deep, was written whole first: a hang, a RecursionError)."""
    parts: list[str] = []
    _write(value, parts, [_SHOWN_CHARS + 1])
    text = "".join(parts)
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS - 1] + "…"


def _write(value: Any, out: list[str], left: list[int]) -> None:
    """`shown`'s text of `value` added to `out` until `left[0]` characters are written (each
    level of nesting writes one at least, so the depth is bounded too)."""
    if left[0] <= 0:
        return
    items: Iterator[tuple[Any, Any]]
    if isinstance(value, list | tuple):
        opening, items, closing = "[", ((None, v) for v in value), "]"
    elif isinstance(value, Mapping):
        opening, items, closing = "{", iter(value.items()), "}"
    else:
        text = _scalar(value, left[0])
        out.append(text)
        left[0] -= len(text)
        return
    out.append(opening)
    left[0] -= 1
    for i, (key, item) in enumerate(items):
        if left[0] <= 0:
            return
        if i:
            out.append(", ")
            left[0] -= 2
        if key is not None or opening == "{":
            _write(key, out, left)
            out.append(": ")
            left[0] -= 2
        _write(item, out, left)
    out.append(closing)
    left[0] -= 1


def _scalar(value: Any, most: int) -> str:
    if isinstance(value, str):
        return repr(value[:most])
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float) and not math.isfinite(value):
        return ".nan" if math.isnan(value) else (".inf" if value > 0 else "-.inf")
    if isinstance(value, int | float):
        return repr(value)
    return str(value)[:most]  # what else YAML makes: a date, bytes (!!binary)


def path_part(key: Any) -> str:
    """A mapping's key as a part of a path in a message: text as it is when it is short and printable;
    else as `shown` writes it, quoted, escaped and cut (a key of 200,000 characters made a line as long,
    and one holding a line break or a terminal's escape split the fault's line or rewrote the screen)."""
    if isinstance(key, str) and key and len(key) <= _SHOWN_CHARS and key.isprintable():
        return key
    return shown(key)


def _key(value: Any) -> str:
    """A mapping key as part of a path: text as it is, anything else as YAML writes it."""
    return value if isinstance(value, str) else shown(value)


#: pydantic errors whose message does not say what the value was: it is added (`, got true`).
_SAY_INPUT = frozenset({"literal_error", "string_type", "int_type", "int_parsing", "bool_type", "bool_parsing",
                        "list_type", "dict_type", "float_type"})


def _looks_like_a_number(value: Any) -> bool:
    """Text that YAML 1.1 left as text though a person meant a number (`1e12`, `1.5e3`)."""
    if not isinstance(value, str):
        return False
    try:
        float(value)
    except ValueError:
        return False
    return "e" in value.lower()


#: what an id's pattern asks, in words
_PATTERN_SAID = {ID_PATTERN: "must be one word (no spaces)",
                 HEADER_NAME_PATTERN: "must be an HTTP header name (letters, digits, - and !#$%&'*+.^_`|~)",
                 HEADER_VALUE_PATTERN: "must be printable ASCII on one line",
                 PROVIDER_ID_PATTERN: "must be one word, without spaces or commas",
                 CORS_ORIGIN_PATTERN: "must be a site as a browser's Origin names it (https://app.example.com, "
                                      "http://localhost:5173: no path) or *",
                 HOST_NAME_PATTERN: "must be a host name (iop.example.com: no scheme, no port) or *",
                 PATH_PATTERN: "must be a path that starts with / (no spaces)",
                 API_PATH_PATTERN: "must be empty or a path that starts with / (no spaces, no ? or #: iop adds the "
                                   "API's paths to it)",
                 NAME_PATTERN: "must be 1 to 64 letters, digits, '_', '.' or '-', the first a letter or digit",
                 SHA256_PATTERN: "must be the key's SHA-256 in 64 hex digits (iop keys new prints it)",
                 ENV_NAME_PATTERN: "must be the name of an environment variable (letters, digits, _)"}
#: the patterns of fields whose wrong value may be a secret (a key pasted as its hash, or as the
#: variable's name), not echoed
_SECRET_PLACES = frozenset({SHA256_PATTERN, ENV_NAME_PATTERN})


def _model_at(loc: Sequence[Any]) -> type[BaseModel] | None:
    """The config model a location lies in (`("nodes", 0, "providers", 1)`: ProviderConfig), or
    None where it is no model's (a map's entry)."""
    cls: type[BaseModel] = Config
    for part in loc:
        if isinstance(part, int):  # (an item of a list: the list's model, as its field said)
            continue
        field = cls.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return None
        found = _model_in(field.annotation)
        if found is None:
            return None
        cls = found
    return cls


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The config model an annotation holds: itself, or inside `X | None`, `list[X]`, `Annotated[X, …]`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


#: what an unknown field may have been meant as, where no spelling is close
_MEANT = {"api_key": "an API key never goes in the config: name the environment variable that holds it in "
                     "api_key_env"}


def _unknown_field(loc: Sequence[Any]) -> str:
    """`unknown field`, with the field of that place a typo was likely meant as (`timeout_ms` in
    `queue`: `queue_timeout_ms`)."""
    name = loc[-1] if loc else None
    cls = _model_at(loc[:-1])
    if not isinstance(name, str) or cls is None:
        return "unknown field"
    if name in _MEANT and "api_key_env" in cls.model_fields:
        return f"unknown field ({_MEANT[name]})"
    scored = sorted(((difflib.SequenceMatcher(None, name, f).ratio(), f) for f in cls.model_fields), reverse=True)
    # (the closest, and the next only when it is nearly as close: `model` is models, not nodes)
    close = [f for score, f in scored[:2] if score >= 0.6 and score >= scored[0][0] - 0.15]
    return f"unknown field (did you mean {' or '.join(close)}?)" if close else "unknown field"


def _schema_errors(exc: ValidationError, data: Any = None) -> list[str]:
    errors = []
    for err in exc.errors():
        loc: list[Any] = [p for p in err["loc"] if not (isinstance(p, str) and (p.startswith("function-")
                                                                                 or p in SECRET_FORMS))]
        if len(loc) >= 2 and loc[-1] == "[key]":
            loc[-2] = err["input"]  # the key itself: pydantic writes None as 'None' and true as 1
        msg = err["msg"]
        if err["type"] == "invalid_key":  # (a field's name that is not text: pydantic puts 1 for `true` in the path)
            loc = [*loc[:-1], err["input"], "[key]"]
            msg = f"a field's name is text, got {shown(err['input'])}"
        if err["type"] == "extra_forbidden":
            msg = _unknown_field(loc)
        elif (err["type"] == "string_pattern_mismatch" and err.get("ctx", {}).get("pattern") in _SECRET_PLACES
              and not str(err["input"]).startswith("$")):  # (`$KEY`, a shell's way to name it, is shown)
            # (what is there may be the secret itself, pasted where its hash or its variable's name
            # belongs: never echoed, for the message goes to logs, a reloading gateway's too)
            msg = f"{_PATTERN_SAID[err['ctx']['pattern']]}, got {len(err['input'])} characters " \
                  "(not shown: they may be the secret itself)"
        elif err["type"] == "string_pattern_mismatch" and err.get("ctx", {}).get("pattern") in _PATTERN_SAID:
            msg = f"{_PATTERN_SAID[err['ctx']['pattern']]}, got {shown(err['input'])}"
        elif err["type"] == "model_type":  # (pydantic names its class: "... or instance of QueuePolicy")
            msg = f"Input should be a mapping (`field: value` lines), got {shown(err['input'])}"
            if err["input"] is None:
                msg += " (every line under it commented out? remove the line too)"
        elif err["type"] in _SAY_INPUT:
            msg = f"{msg}, got {shown(err['input'])}"
            if err["type"] in ("list_type", "dict_type") and err["input"] is None:  # (`nodes:` with nothing under it)
                msg += " (every line under it commented out? remove the line too)"
            if err["type"] in ("int_parsing", "int_type") and _looks_like_a_number(err["input"]):
                msg += " (YAML reads that as text, not a number: write the number out in digits)"
            elif err["type"] == "int_type" and isinstance(err["input"], float) and err["input"].is_integer():
                msg += " (a number with a dot or an exponent is a fraction to YAML: write it out in digits)"
            elif err["type"] == "string_type" and isinstance(err["input"], bool | int | float):
                # (a name such as `3.5`, `2024` or `1e3`: the operator wrote a name, YAML read a number)
                kind = "a boolean" if isinstance(err["input"], bool) else "a number"
                msg += f" (YAML reads what is written there as {kind}: put it in quotes to make it text)"
        errors.append(f"{format_path(loc, data)}: {msg}")
    return errors


def _duplicates(items: Sequence[tuple[str, Any]], kind: str) -> list[str]:
    """items: (path, id). Reports each repeated id at its later path (ids of another type than
    text are the schema's to report; they are compared as YAML shows them)."""
    seen: dict[str, str] = {}
    errors = []
    for path, ident in items:
        key = _key(ident)
        if key in seen:
            errors.append(f"{path}: duplicate {kind} id {shown(ident)} (first at {seen[key]})")
        else:
            seen[key] = path
    return errors


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def check_references(cfg: Config | Mapping[str, Any]) -> list[str]:
    """Cross-field rules the schema alone cannot express. Pure; returns every fault.

    Works on a raw mapping too, skipping parts of the wrong shape, so that reference faults
    are reported alongside schema faults."""
    data = cfg.model_dump() if isinstance(cfg, Config) else cfg
    models = [_map(m) for m in _list(data.get("models"))]
    nodes = [_map(n) for n in _list(data.get("nodes"))]
    model_paths = [(f"models[{i}].id", m.get("id")) for i, m in enumerate(models) if "id" in m]
    node_paths = [(f"nodes[{i}].id", n.get("id")) for i, n in enumerate(nodes) if "id" in n]
    errors = _duplicates(model_paths, "model")
    errors += _case_twins(model_paths, "model", "callers")
    errors += _alias_faults(models)
    errors += _duplicates(node_paths, "node")
    errors += _case_twins(node_paths, "node", "operators")
    providers: dict[str, Mapping[str, Any]] = {}
    provider_paths = []
    for i, node in enumerate(nodes):
        for j, p in enumerate(_map(x) for x in _list(node.get("providers"))):
            path = f"nodes[{i}].providers[{j}]"
            if "id" in p:
                provider_paths.append((f"{path}.id", p["id"]))
                providers.setdefault(_key(p["id"]), p)  # the first definition is the one in force
            if p.get("type") in PROVIDER_TYPES and p.get("type") != "cli" and not p.get("base_url"):
                errors.append(f"{path}.base_url: required for type {p['type']}")
            elif (fault := base_url_fault(p.get("base_url"))) is not None:
                errors.append(f"{path}.base_url: {fault}")
            errors += _type_specific(p, path)
            served = [(f"{path}.models[{k}]", x) for k, x in enumerate(_list(p.get("models")))]
            errors += _duplicates(served, "served model")
    errors += _duplicates(provider_paths, "provider")
    errors += _case_twins(provider_paths, "provider", "operators")
    errors += _unprintable_ids(model_paths + node_paths + provider_paths)
    errors += _dot_segment_ids(model_paths + node_paths + provider_paths)
    # Where the nodes themselves are malformed, which providers exist is not known: say
    # nothing about references rather than something false.
    nodes_known = bool(nodes) and all(isinstance(n.get("providers", []), list) for n in nodes)
    for i, model in enumerate(models):
        for provider_id, served_name in _map(model.get("providers")).items():
            path = f"models[{i}].providers.{path_part(provider_id)}"
            provider = providers.get(_key(provider_id))
            served_known = _list(provider.get("models")) if provider else []
            if provider is None:
                if nodes_known:
                    errors.append(f"{path}: provider {shown(provider_id)} is not defined by any node")
            elif (isinstance(served_name, str) and served_known and all(isinstance(x, str) for x in served_known)
                  and served_name not in served_known):
                errors.append(
                    f"{path}: served model {shown(served_name)} is not in provider {path_part(provider_id)}'s models "
                    f"{shown(_list(provider.get('models')))}"
                )
    model_ids = {str(m["id"]) for m in models if "id" in m}
    aliases = {a: str(m["id"]) for m in models if "id" in m for a in _list(m.get("aliases")) if isinstance(a, str)}
    if "auth" in data and data["auth"] is None and not isinstance(cfg, Config):  # (a file's `auth:` with nothing
        # under it: not "no auth section", which serves anyone; a Config without keys dumps `auth` as None)
        errors.append("auth: empty (every key under it commented out?): list the keys under auth.keys, or remove "
                      "the auth section to serve without keys")
    return errors + check_auth(data.get("auth"), model_ids, aliases)


def _case_twins(ids: Sequence[tuple[str, Any]], kind: str, who: str) -> list[str]:
    """Ids (path, value) of one kind that differ only in case or Unicode form (`Qwen3` and `qwen3`,
    `gpu-1` and `GPU-1`): `who` would take one for the other (an operator's `iop provider drain P1`
    drained another box than p1). (The same id twice is `_duplicates`' to report.)"""
    first: dict[str, tuple[str, str]] = {}
    errors = []
    for path, ident in ids:
        if not isinstance(ident, str):
            continue
        seen = first.setdefault(folded_name(ident), (ident, path))
        if seen[0] != ident:
            errors.append(f"{path}: {shown(ident)} differs from the {kind} id {shown(seen[0])} (at {seen[1]}) only in "
                          f"case or Unicode form: {who} would take one for the other")
    return errors


def _alias_faults(models: Sequence[Mapping[str, Any]]) -> list[str]:
    """An alias names one model: not a model's id, not another alias (nor the same twice), nor
    one that differs from another model's name only in case or Unicode form, nor another model's
    served name (a caller who knows that server's name would get this model); it is printable."""
    names = {_key(m["id"]): (f"models[{i}].id", i) for i, m in enumerate(models) if "id" in m}
    folded = {folded_name(name): where for name, where in names.items()}
    served: dict[str, list[tuple[int, Any]]] = {}
    for i, m in enumerate(models):
        for provider, name in _map(m.get("providers")).items():
            if isinstance(name, str):
                served.setdefault(name, []).append((i, provider))
    errors = []
    for i, model in enumerate(models):
        for j, alias in enumerate(_list(model.get("aliases"))):
            if not isinstance(alias, str):
                continue  # (the schema's to report)
            path = f"models[{i}].aliases[{j}]"
            fold = folded_name(alias)
            if alias in names:
                errors.append(f"{path}: {shown(alias)} already names a model (at {names[alias][0]}); an alias names "
                              "one model")
            elif fold in folded and folded[fold][1] != i:
                errors.append(f"{path}: {shown(alias)} differs from another model's name only in case or Unicode form "
                              f"(at {folded[fold][0]}): callers would take one for the other")
            # (the first other model only: listing them all made 20,000 models of one served name, each its
            # alias, 4e8 steps; a model's own entries of a name are together, so this stops soon)
            elif other := next(((k, p) for k, p in served.get(alias, ()) if k != i), None):
                errors.append(f"{path}: {shown(alias)} is model models[{other[0]}]'s served name on provider "
                              f"{path_part(other[1])}: a caller who knows that name would get this model")
            elif (bad := _unprintable(alias)) is not None:
                errors.append(f"{path}: {shown(alias)} holds {bad}; an alias is printable text")
            else:
                names[alias] = (path, i)
                folded.setdefault(fold, (path, i))
    return errors


def _unprintable_ids(ids: Sequence[tuple[str, Any]]) -> list[str]:
    """A model's, node's or provider's id (path, value) is printable text: a control or format
    character (a zero-width space) makes two ids that look alike, and goes raw into logs and the catalog."""
    return [f"{path}: {shown(value)} holds {bad}; an id is printable text"
            for path, value in ids if isinstance(value, str) and (bad := _unprintable(value)) is not None]


def _dot_segment_ids(ids: Sequence[tuple[str, Any]]) -> list[str]:
    """No id is `.` or `..`: in a URL's path (`/v1/models/{id}`, `/v1/admin/providers/{id}/drain`)
    a client takes it for the path's own step, not a name (the catalog page's drain of provider `..`
    went to another path)."""
    return [f"{path}: {value!r} is a step of a URL's path, not a name a URL can carry; an id is another word"
            for path, value in ids if value in (".", "..")]


def folded_name(name: str) -> str:
    """`name` as two names that callers would take one for the other share: in one Unicode
    form (NFKC), case folded."""
    return unicodedata.normalize("NFKC", name).casefold()


#: The most characters NFKC composes into one: the longest canonical decomposition (U+1FAF's, a
#: Greek capital and three marks). Case folding never shortens a name, so one that folds to a name
#: of n characters holds at most this many times n (`may_fold_to`).
MOST_COMPOSED = 4


def may_fold_to(name: str, longest: int) -> bool:
    """Whether `name` is short enough to fold to a name of at most `longest` characters folded;
    one that is not need not be folded (NFKC can make a name 18 times longer: U+FDFA is 18 letters)."""
    return len(name) <= MOST_COMPOSED * longest


def _unprintable(name: str) -> str | None:
    """What in `name` is not printable text (a control or format character: a NUL, a zero-width
    space), if anything is."""
    for ch in name:
        if unicodedata.category(ch) in ("Cc", "Cf", "Co", "Cn", "Cs"):
            return f"the character U+{ord(ch):04X}"
    return None


def base_url_fault(value: Any) -> str | None:
    """What is wrong with a provider's `base_url` (None: nothing, or it is not text, which the schema
    reports): it must be an http:// or https:// URL naming a host, with a port number if any."""
    if not isinstance(value, str) or not value:
        return None
    example = "such as http://gpu-1:8000 or https://api.example.com/v1"
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 -- raises ValueError for a port that is not a number in 0..65535
    except ValueError as exc:
        return f"{shown(value)} is not a usable URL ({exc})"
    if parts.scheme.lower() not in URL_SCHEMES or not value.partition(":")[2].startswith("//"):
        said = f"scheme {parts.scheme + '://'!r}" if parts.scheme and parts.netloc else "no http:// or https://"
        return f"{shown(value)} has {said}; write an http:// or https:// URL, {example}"
    if not parts.hostname:
        return f"{shown(value)} names no host; write a URL {example}"
    if any(c.isspace() for c in value):
        return f"{shown(value)} is not a URL (it has white space); write one {example}"
    # (iop adds the API's paths to base_url: after a query or a fragment they were part of it, so every
    # probe and run went to the path before it, `/v1?api-version=…/v1/models`, and the probe's reason
    # named `/v1/models`, which the server does serve; past the host, the first `?` or `#` starts one)
    if (start := min((i for i in (value.find("?"), value.find("#")) if i >= 0), default=-1)) >= 0:
        kind = "query" if value[start] == "?" else "fragment"
        return (f"{shown(value)} has a {kind} ({shown(value[start:])}): iop adds the API's paths to base_url, "
                f"so it can hold none; write the URL without it, {example}")
    # (an endpoint's whole URL pasted: iop adds the API's paths to it, so every run would go to
    # /v1/chat/completions/v1/chat/completions, a 404, while the probe of the host's /health passes)
    endpoint = next((e for e in API_ENDPOINTS if parts.path.rstrip("/").lower().endswith(e)), None)
    if endpoint is not None:
        return (f"{shown(value)} ends in the endpoint {endpoint}: iop adds the API's paths to base_url; write "
                f"the server's URL or its API root, {example}")
    return None


def _has_credentials(url: Any) -> bool:
    """Whether a URL holds `user:password@` (one that cannot be read holds none: `base_url_fault` says why)."""
    try:
        return isinstance(url, str) and "@" in urlsplit(url).netloc
    except ValueError:
        return False


def _type_specific(p: Mapping[str, Any], path: str) -> list[str]:
    """Fields some provider types require, and those only some types read (`command`, `base_url`,
    `api_path`, `probe_path`), and the headers of a provider served over HTTP."""
    errors: list[str] = []
    kind = p.get("type")
    if kind == "cli" and p.get("command") is None:  # (an empty one is the schema's to say)
        errors.append(f"{path}.command: required for type cli (the argv to run)")
    # (a field its type never reads is a mistake, often a type changed without it: said, not ignored)
    if kind in PROVIDER_TYPES and kind != "cli" and p.get("command") is not None:
        errors.append(f"{path}.command: only for type cli; type {kind} is served over HTTP at base_url")
    if kind == "cli" and p.get("base_url") is not None:
        errors.append(f"{path}.base_url: not for type cli, which runs its command")
    for field in ("api_path", "probe_path"):
        if kind in ("cli", "ollama") and p.get(field) is not None:
            errors.append(f"{path}.{field}: not for type {kind}; only the OpenAI family's types "
                          f"({', '.join(t for t in PROVIDER_TYPES if t not in ('cli', 'ollama'))}) read it")
    # (only one other than the default: a config checked again from its parsed form has it on every provider)
    if kind in PROVIDER_TYPES and kind not in LOADS_FIRST and p.get("load_timeout_ms") not in (None, LOAD_TIMEOUT_MS):
        errors.append(f"{path}.load_timeout_ms: only for types that load a model a run names before they answer "
                      f"({', '.join(sorted(LOADS_FIRST))}); type {kind} answers within read_timeout_ms")
    if kind in PROVIDER_TYPES and kind != "openai_api" and p.get("models_listed") is False:
        errors.append(f"{path}.models_listed: only for type openai_api (a hosted API); a server of type {kind} "
                      "lists every name it takes")
    for field in ("headers", "api_key_header"):
        if p.get(field) is not None and p.get("type") == "cli":
            errors.append(f"{path}.{field}: only for a provider served over HTTP, not type cli")
    key_in = p.get("api_key_header")
    if (p.get("api_key_env") and (key_in is None or str(key_in).lower() == "authorization")
            and _has_credentials(p.get("base_url"))):
        # (both go in the Authorization header: no request could be sent, and every probe raised)
        errors.append(f"{path}.api_key_env: its key goes in Authorization, as base_url's user:password@ does; "
                      "keep one of the two, or name the key's own header in api_key_header")
    if p.get("api_key_header") is not None and not p.get("api_key_env"):
        errors.append(f"{path}.api_key_header: names the header of the key in api_key_env, which is not given")
    key_header = p.get("api_key_header")
    if isinstance(key_header, str) and key_header.lower() in IOP_HEADERS:
        errors.append(f"{path}.api_key_header: {key_header} is set by iop itself ({IOP_HEADERS[key_header.lower()]}); "
                      "the key cannot go in it")
    headers = p.get("headers")
    if isinstance(headers, Mapping):
        key_header = str(p.get("api_key_header") or "Authorization").lower() if p.get("api_key_env") else None
        seen: dict[str, str] = {}
        for name in headers:
            if not isinstance(name, str):
                continue
            lower, at = name.lower(), f"{path}.headers.{path_part(name)}"
            if lower in seen:
                errors.append(f"{at}: the same header as {path_part(seen[lower])} (names ignore case)")
            elif lower in IOP_HEADERS:
                errors.append(f"{at}: set by iop itself ({IOP_HEADERS[lower]}), not by the config")
            elif lower == key_header or lower == "authorization":
                errors.append(f"{at}: credentials never go in the config: give the key's variable "
                              "in api_key_env (and its header in api_key_header), or user:password@ in base_url")
            seen.setdefault(lower, name)
    return errors


def parse_config(data: Any) -> Config:
    """Validate a mapping (parsed YAML) into a Config, or raise ConfigError with every fault.

    A config in the legacy shape (`openai.model_routes`, `nodes[].adapters`) is converted
    first by `common.legacy`; its faults are reported at their legacy paths."""
    if not isinstance(data, Mapping):
        raise ConfigError([f"(top level): expected a mapping, got {_kind(data)}"])
    if is_legacy(data):
        migration = migrate_legacy(data)
        try:  # (what the conversion found wrong, and then the rest: every fault at once)
            cfg = _parse_new_shape(migration.data)
        except ConfigError as exc:
            found = [migration.legacy_path(e) for e in exc.errors]
            if migration.errors:  # a fault at a place the file does not have follows from one reported
                found = [e for e in found if re.split(r"[.\[:]", e, maxsplit=1)[0] in data]
            raise ConfigError(migration.errors + found) from None
        if migration.errors:
            raise ConfigError(migration.errors)
        return cfg
    return _parse_new_shape(data)


def _kind(value: Any) -> str:
    """What a YAML document that is not a mapping holds, in YAML's words."""
    if value is None:
        return "null (an empty document)"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return f"the text {shown(value)}"
    return shown(value)


def _parse_new_shape(data: Mapping[str, Any]) -> Config:
    errors = check_references(data)
    try:
        cfg = Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_schema_errors(exc, data) + errors + _runtime_timings_of(data)) from None
    errors += check_timings(cfg)
    if errors:
        raise ConfigError(errors)
    return cfg


def _runtime_timings_of(data: Mapping[str, Any]) -> list[str]:
    """The faults of `check_runtime_timings` in a config whose other parts have faults of their
    own, when its `runtime` section is valid by itself (so that every fault shows at once)."""
    try:
        rt = RuntimeConfig.model_validate(data.get("runtime") or {})
    except ValidationError:
        return []  # (its faults are among the schema's)
    return check_runtime_timings(rt)


def check_runtime_timings(rt: RuntimeConfig) -> list[str]:
    """Runtime settings that only make sense together. Pure; returns every fault."""
    errors = []
    if rt.heartbeat_ttl_ms <= rt.heartbeat_interval_ms:
        errors.append(f"runtime.heartbeat_ttl_ms: must exceed runtime.heartbeat_interval_ms "
                      f"({rt.heartbeat_ttl_ms} <= {rt.heartbeat_interval_ms}), or healthy providers turn unknown")
    if rt.gateway_liveness_ms < rt.scheduler_liveness_ms:
        errors.append(f"runtime.gateway_liveness_ms: must be at least runtime.scheduler_liveness_ms "
                      f"({rt.gateway_liveness_ms} < {rt.scheduler_liveness_ms}), or a Redis that stalls briefly "
                      "could make a scheduler take live gateways for dead ones and cancel their callers' runs")
    samples = rt.history_retention_s * 1000 // rt.history_interval_ms
    if samples > MAX_HISTORY_SAMPLES:
        errors.append(f"runtime.history_retention_s: {rt.history_retention_s} s of samples every "
                      f"{rt.history_interval_ms} ms is {samples} samples, more than {MAX_HISTORY_SAMPLES}")
    return errors


def check_timings(cfg: Config) -> list[str]:
    """Timings that only make sense together. Pure; returns every fault."""
    rt = cfg.runtime
    errors = check_runtime_timings(rt)
    for i, model in enumerate(cfg.models):
        policy = cfg.queue_for(model)
        longest_ms = policy.queue_timeout_ms + policy.execution_timeout_ms
        if rt.run_ttl_s * 1000 <= longest_ms:
            where = f"models[{i}].queue" if model.queue else "queue"
            errors.append(f"runtime.run_ttl_s: {rt.run_ttl_s} s does not outlast a run of model {model.id!r} "
                          f"({where}: queue_timeout_ms + execution_timeout_ms = {longest_ms} ms)")
    return errors


def read_yaml(path: str | Path) -> Any:
    """The YAML document of a config file, not yet validated. Raises ConfigError, one line naming
    the file, for a file that cannot be read, is not UTF-8 text, or is not YAML."""
    try:
        with Path(path).open("rb") as file:
            raw = file.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read: {exc.strerror or exc}"]) from None
    if len(raw) > MAX_CONFIG_BYTES:  # (`--config /dev/zero` took all memory; 20 MB took 6 s to read)
        raise ConfigError([f"{path}: over {MAX_CONFIG_BYTES // 2**20} MiB: not a config"])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{path}: not UTF-8 text (byte {exc.start} is 0x{raw[exc.start]:02x})"]) from None
    loader: ConfigLoader | None = None
    try:
        loader = ConfigLoader(text)  # (as yaml.safe_load does, the document checked between its two steps)
        node = loader.get_single_node()
        # (only a text with a `*` can hold an alias: the count took a fifth more than reading a 4 MiB file)
        if "*" in text and values_aliases_add(node) > MAX_ALIAS_VALUES:
            raise ConfigError([f"{path}: its aliases (*name) repeat more than {MAX_ALIAS_VALUES:,} values in all: "
                               "not a config (a YAML bomb?)"])
        repeated = repeated_keys(node)
        if repeated:
            raise ConfigError(repeated)
        return loader.construct_document(node) if node is not None else None
    except yaml.reader.ReaderError as exc:  # (a character YAML does not allow: NUL, most control characters)
        # (libyaml's position counts the bytes of the text as UTF-8, PyYAML's own its characters)
        line = (raw.count(b"\n", 0, exc.position) if FAST else text.count("\n", 0, exc.position)) + 1
        said = f"character U+{exc.character:04X} is not allowed (line {line})"
        raise ConfigError([f"{path}: not valid YAML: {said}"]) from None
    except yaml.YAMLError as exc:
        if "maximum nesting depth" in str(getattr(exc, "problem", "")):  # (libyaml's own limit: 1,000 levels)
            raise ConfigError([f"{path}: not valid YAML: nested too deeply"]) from None
        raise ConfigError([f"{path}: not valid YAML: {yaml_fault(exc)}"]) from None
    except RecursionError:  # (PyYAML reads nested collections by recursion: some hundred levels)
        raise ConfigError([f"{path}: not valid YAML: nested too deeply"]) from None
    except (ValueError, OverflowError, LookupError, AttributeError, TypeError) as exc:
        # (a value its explicit tag cannot make: `!!float x`, `!!bool maybe`, `!!timestamp soon`)
        raise ConfigError([f"{path}: not valid YAML: a value its tag cannot make ({type(exc).__name__}: {exc})"]) \
            from None
    finally:
        if loader is not None:
            loader.dispose()


def values_aliases_add(root: yaml.Node | None) -> int:
    """How many values the document's aliases add to what it writes out, once each alias is read as
    what it names (the count stops a little past `MAX_ALIAS_VALUES`). The nodes are walked once
    each: a 10 KB document of aliases of aliases (`[*a, *a, …]`, "billion laughs") names 10⁹ values,
    and a model's map of 1,000 providers named by 1,000 aliases in `models` made 1,000,000 faults."""
    if root is None:
        return 0
    sizes: dict[int, int] = {}  # a node -> the values it holds once expanded, itself included
    todo: list[tuple[yaml.Node, bool]] = [(root, False)]
    while todo:
        node, children_done = todo.pop()
        if id(node) in sizes and not children_done:
            continue
        children = [c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode) else \
            node.value if isinstance(node, yaml.SequenceNode) else []
        if children_done:  # (a child still on the way down is an alias of an ancestor: a cycle, counted once)
            sizes[id(node)] = min(1 + sum(sizes.get(id(c), 1) for c in children), 2 * MAX_ALIAS_VALUES + len(sizes))
            continue
        sizes[id(node)] = 1
        todo.append((node, True))
        todo.extend((c, False) for c in children if id(c) not in sizes)
    return max(0, sizes[id(root)] - len(sizes))


def repeated_keys(root: yaml.Node | None) -> list[str]:
    """Each key given twice in one mapping, by its path (`models[0].providers.vllm-a`) and lines:
    PyYAML keeps the last silently (a second `models:` would drop every model of the first)."""
    faults: list[tuple[int, str]] = []
    todo: list[tuple[yaml.Node, str]] = [(root, "")] if root is not None else []
    seen: set[int] = set()
    while todo:
        node, where = todo.pop()
        if id(node) in seen:  # (an alias: its node was walked once)
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            lines: dict[str, int] = {}
            for key, value in node.value:
                name = key.value if isinstance(key, yaml.ScalarNode) else None
                at = f"{where}.{path_part(name)}" if where else path_part(name)
                if name is not None:  # (a merge key `<<` too: of two, the last won, silently)
                    line = key.start_mark.line + 1
                    if name in lines:
                        where_said = f"twice on line {line}" if lines[name] == line else \
                            f"twice (lines {lines[name]} and {line})"
                        faults.append((line, f"{at}: given {where_said}; YAML would keep only the last"))
                    lines.setdefault(name, line)
                todo.append((value, at))
        elif isinstance(node, yaml.SequenceNode):
            todo.extend((item, f"{where}[{i}]") for i, item in enumerate(node.value))
    return [fault for _, fault in sorted(faults)]


def yaml_fault(exc: yaml.YAMLError) -> str:
    """PyYAML's error on one line: what is wrong and where (its own text quotes the lines, on several)."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem:
        said = f"{exc.context}: {exc.problem}" if exc.context else exc.problem
        mark = exc.problem_mark
        return f"{said} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else said
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def load_config(path: str | Path) -> Config:
    """Read and validate a YAML config file."""
    return parse_config(read_yaml(path))
