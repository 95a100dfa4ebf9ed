"""The `iop` command: parses arguments and starts the part asked for. No logic of its own."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, NoReturn

DEFAULT_CONFIG = "iop.yaml"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
REDIS_HELP = ("Redis URL: redis://host:6379/0, rediss://… (TLS), or Sentinel: "
              "redis+sentinel://host1:26379,host2:26379/mymaster/0 (default: $REDIS_URL, else "
              f"{DEFAULT_REDIS})")


def _service_args(p: argparse.ArgumentParser, reads_config: bool = True) -> None:
    """`--config` and `--redis`; a command that needs no config takes `--config` and reads nothing
    from it (an operator pastes the same pair to every command, as `iop dev` prints it)."""
    p.add_argument("--config", default=os.environ.get("IOP_CONFIG") or DEFAULT_CONFIG,
                   help="config file (default: $IOP_CONFIG, else iop.yaml)" if reads_config else
                   "taken as the other commands take it, and not read: this command needs no config")
    p.add_argument("--redis", default=os.environ.get("REDIS_URL") or DEFAULT_REDIS, help=REDIS_HELP)


def whole_number(text: str, what: str = "a whole number") -> int:
    """An argparse type: ASCII digits only (`int` also reads other scripts' digits, `١`), at most 9."""
    if not (text.isascii() and text.isdigit() and len(text.lstrip("0")) <= 9):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return int(text)


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free one) to 65535. Anything else is argparse's one-line
    usage error, never a port taken modulo 65536 or an OverflowError."""
    value = whole_number(text, "a port number (0 to 65535)")
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port number (0 to 65535)")
    return value


#: the longest `--grace` (a day): a worker or gateway told to stop must stop
MAX_GRACE_S = 86_400.0


def grace_seconds(text: str) -> float:
    """An argparse type: seconds from 0 to a day (not negative, not NaN or infinite)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(value) and 0 <= value <= MAX_GRACE_S):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds from 0 to {MAX_GRACE_S:.0f}")
    return value


def _http_args(p: argparse.ArgumentParser, port: int = 8080, host: str = "0.0.0.0") -> None:
    p.add_argument("--host", default=host, help=f"address to listen on (default {host})")
    p.add_argument("--port", type=port_number, default=port,
                   help=f"port to listen on (default {port}; 0 = any free)")


def _metrics_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics-port", type=port_number, default=None,
                   help="serve /metrics, /healthz and /readyz on this port (default: off; 0 = any free)")
    p.add_argument("--metrics-host", default="0.0.0.0", help="address the metrics port listens on (default 0.0.0.0)")


def installed_version() -> str:
    """The version of the installed `iop` distribution (`pyproject.toml`'s), or "unknown" when this
    code runs from a checkout that was never installed."""
    from importlib import metadata

    try:
        return metadata.version("iop")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    from iop import simulator

    parser = argparse.ArgumentParser(prog="iop", description="An open pool router for LLM serving.")
    parser.add_argument("--version", action="version", version=f"iop {installed_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("gateway", help="the OpenAI-compatible HTTP gateway")
    _service_args(p)
    _http_args(p)
    p.add_argument("--allow-anonymous", action="store_true",
                   help="serve anyone who can reach a non-loopback address when the config has no auth.keys")
    p.add_argument("--grace", type=grace_seconds, default=10.0,
                   help="seconds the run requests in flight get to end on shutdown (0 to 86400; default 10)")
    p = sub.add_parser("scheduler", help="a scheduler replica")
    _service_args(p)
    _metrics_args(p)
    p = sub.add_parser("worker", help="a worker for one node")
    _service_args(p)
    p.add_argument("--node", required=True, help="the node id this worker serves")
    p.add_argument("--grace", type=grace_seconds, default=10.0,
                   help="seconds running runs get on shutdown (0 to 86400; default 10)")
    _metrics_args(p)
    p = sub.add_parser("simulator", help="an OpenAI-compatible fake LLM server")
    simulator.add_arguments(p)
    p = sub.add_parser("dev", help="the whole stack in one command, with an embedded Redis")
    p.add_argument("--config", default=None, help="config to run (default: the demo, with simulators)")
    _http_args(p, host="127.0.0.1")

    for name, what in (("catalog", "providers and models as the catalog shows them"),
                       ("queues", "waiting runs and the oldest waiting age per model")):
        p = sub.add_parser(name, help=f"print {what} (read-only)")
        _service_args(p)
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    p = sub.add_parser("provider", help="operator control of a provider: drain, undrain, capacity (on Redis)")
    psub = p.add_subparsers(dest="provider_command", required=True)
    for name, what in (("drain", "take no new runs; running runs finish"), ("undrain", "take new runs again")):
        c = psub.add_parser(name, help=what)
        c.add_argument("provider_id")
        _service_args(c)
        c.add_argument("--json", action="store_true", help="print JSON instead of text")
    c = psub.add_parser("capacity", help="use N slots instead of the configured capacity, or `clear`")
    c.add_argument("provider_id")
    c.add_argument("value", metavar="N|clear",
                   help="the capacity to use (1 to the configured one), or `clear` to use the configured one")
    c.add_argument("--for", dest="for_", default=None, metavar="DURATION",
                   help="how long: 90s, 30m, 2h, 7d, 1h30m (at most 7d; default: until cleared)")
    _service_args(c)
    c.add_argument("--json", action="store_true", help="print JSON instead of text")

    p = sub.add_parser("node", help="operator control of a node: cordon, uncordon (on Redis)")
    nsub = p.add_subparsers(dest="node_command", required=True)
    for name, what in (("cordon", "none of its providers takes new runs; running runs finish"),
                       ("uncordon", "its providers take new runs again")):
        c = nsub.add_parser(name, help=what)
        c.add_argument("node_id")
        _service_args(c)
        c.add_argument("--json", action="store_true", help="print JSON instead of text")

    p = sub.add_parser("audit", help="operator changes, newest first (read-only)")
    _service_args(p, reads_config=False)
    p.add_argument("--limit", type=whole_number, default=50, help="how many (default 50, at most 1000)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    p = sub.add_parser("runs", help="inspect runs (read-only)")
    rsub = p.add_subparsers(dest="runs_command", required=True)
    r = rsub.add_parser("show", help="a run's record and events, from Redis")
    r.add_argument("run_id")
    _service_args(r, reads_config=False)
    r.add_argument("--json", action="store_true", help="print JSON instead of text")

    p = sub.add_parser("keys", help="API keys")
    ksub = p.add_subparsers(dest="keys_command", required=True)
    k = ksub.add_parser("new", help="print a fresh key once, and the config entry holding only its hash")
    k.add_argument("--name", required=True, help="the key's name (shown in logs, metrics and usage)")
    k.add_argument("--role", choices=("caller", "operator"), default="caller")

    p = sub.add_parser("usage", help="runs and tokens per API key, model and UTC day (read-only)")
    _service_args(p)
    p.add_argument("--key", default=None, help="only this key")
    p.add_argument("--model", default=None, help="only this model")
    p.add_argument("--since", default=None, help="first UTC day, YYYY-MM-DD (default: 30 days ago)")
    p.add_argument("--until", default=None, help="last UTC day, YYYY-MM-DD (default: today)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    p = sub.add_parser("config", help="check or convert a config file")
    csub = p.add_subparsers(dest="config_command", required=True)
    v = csub.add_parser("validate", help="print OK or every error")
    v.add_argument("file", nargs="?", default=os.environ.get("IOP_CONFIG") or DEFAULT_CONFIG,
                   help="config file (default: $IOP_CONFIG, else iop.yaml)")
    m = csub.add_parser("migrate", help="print a legacy config (openai.model_routes) in the new shape")
    m.add_argument("file")
    return parser


def _load(path: str) -> object:
    from common.config import ConfigError, load_config
    from iop.config_cmd import fault_lines

    try:
        return load_config(path)
    except ConfigError as exc:
        for line in fault_lines(path, exc.errors, always_count=False):
            print(line, file=sys.stderr)
        raise SystemExit(2) from None


def _check_redis(url: str) -> None:
    from common.redisconn import RedisUrlError, parse_redis_url

    try:
        parse_redis_url(url)
    except RedisUrlError as exc:
        print(f"error: --redis: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _serve(service: Coroutine[Any, Any, None]) -> NoReturn:
    """Run a long-running service until it ends the process (`common.lifecycle.run`).

    A database the Redis server refuses (`DatabaseRefused`, a SystemExit that no retry loop
    swallows) ends it from whichever of its tasks met it first, escaping the event loop: say its
    one line and exit at once, before tasks that still hold it are reported as never retrieved."""
    import logging

    from common.lifecycle import run
    from common.redisconn import DatabaseRefused

    try:
        run(service)
    except DatabaseRefused as exc:
        logging.shutdown()
        print(exc, file=sys.stderr, flush=True)
        os._exit(1)


def main(argv: Sequence[str] | None = None) -> None:
    """The `iop` command. Output piped to a reader that stops early (`| head`) ends the command
    quietly, not with a traceback."""
    try:
        _main(argv)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)  # (Python flushes stdout again at exit)
        os.dup2(devnull, sys.stdout.fileno())
        raise SystemExit(1) from None


def _refused(exc: Exception, url: str) -> int:
    """An operator command's one line for an error Redis answered (an ACL user without the right
    to a command iop sends, a read-only replica, a script Redis refused) or for a server that does
    not speak Redis's protocol; not a traceback. (One Redis cannot be reached is each command's own
    to say, as `cannot reach Redis`.)"""
    from redis.exceptions import InvalidResponse

    from common.redisconn import redact

    said = "does not answer as Redis does" if isinstance(exc, InvalidResponse) else "refused the command"
    print(f"error: Redis at {redact(url)} {said}: {exc}", file=sys.stderr)
    return 1


#: options whose value an operator may type with a leading `-` (`--for -5m`): argparse takes such a
#: value for an option, and said only "expected one argument"; given as `--for=-5m`, the value's own
#: check says what is wrong with it
DASHED_VALUES = ("--for",)


def _dashed_values(argv: Sequence[str]) -> list[str]:
    """`argv` with each of `DASHED_VALUES` followed by a value starting with `-` joined to it."""
    out: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg in DASHED_VALUES:
            value = next(args, None)
            if value is not None and value.startswith("-") and not value.startswith("--"):
                out.append(f"{arg}={value}")
                continue
            out.append(arg)
            if value is not None:
                out.append(value)
            continue
        out.append(arg)
    return out


def _main(argv: Sequence[str] | None) -> None:
    args = build_parser().parse_args(_dashed_values(sys.argv[1:] if argv is None else argv))
    try:
        _command(args)
    except Exception as exc:  # (a service handles its own Redis errors: only an operator command's get here)
        from redis.exceptions import RedisError

        if not isinstance(exc, RedisError):
            raise
        raise SystemExit(_refused(exc, getattr(args, "redis", None) or "")) from None


def _command(args: argparse.Namespace) -> None:
    from common.lifecycle import setup_logging

    if getattr(args, "redis", None) is not None:
        _check_redis(args.redis)

    if args.command == "runs":
        from iop.runs_cmd import show

        raise SystemExit(show(args.redis, args.run_id, args.json))
    if args.command == "config":
        from iop.config_cmd import migrate, validate

        raise SystemExit(migrate(args.file) if args.config_command == "migrate" else validate(args.file))
    if args.command == "keys":
        from iop.keys_cmd import new

        raise SystemExit(new(args.name, args.role))
    if args.command == "simulator":
        from iop import simulator

        setup_logging()
        if (args.tls_cert is None) != (args.tls_key is None):  # (each option alone is argparse's to check)
            print("iop simulator: error: --tls-cert and --tls-key go together: give both or neither", file=sys.stderr)
            raise SystemExit(2)
        _serve(simulator.serve(simulator.options_from_args(args)))
    if args.command == "dev":
        from iop.dev import run_dev

        raise SystemExit(run_dev(args.config, args.host, args.port))

    if args.command == "usage":
        from iop.usage_cmd import main as usage

        raise SystemExit(usage(_load(args.config), args.redis, args.key, args.model,  # type: ignore[arg-type]
                               args.since, args.until, args.json))
    if args.command == "audit":
        from iop.control_cmd import audit

        raise SystemExit(audit(args.redis, args.limit, args.json))
    if args.command in ("provider", "node"):
        from common.control import cli_user
        from iop.control_cmd import act

        raise SystemExit(act(_load(args.config), args.redis, args, cli_user(), args.json))  # type: ignore[arg-type]
    if args.command in ("catalog", "queues"):
        from iop.catalog_cmd import main as inspect

        raise SystemExit(inspect(args.command, _load(args.config), args.redis, args.json))  # type: ignore[arg-type]

    setup_logging()
    config = _load(args.config)
    if args.command == "gateway":
        from gateway.service import keyring_for
        from gateway.service import serve as serve_gateway

        keyring = keyring_for(config, args.host, args.allow_anonymous, os.environ)  # type: ignore[arg-type]
        _serve(serve_gateway(config, args.redis, args.host, args.port, keyring,  # type: ignore[arg-type]
                             args.grace, Path(args.config)))
    elif args.command == "scheduler":
        from scheduler.service import serve as serve_scheduler

        _serve(serve_scheduler(config, args.redis, args.metrics_port, args.metrics_host))  # type: ignore[arg-type]
    elif args.command == "worker":
        from workers.service import serve as serve_worker

        _serve(serve_worker(config, args.redis, args.node, args.grace, args.metrics_port,  # type: ignore[arg-type]
                         args.metrics_host))
