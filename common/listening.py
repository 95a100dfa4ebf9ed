"""A listening socket that cannot be made, said in one line (the gateway's port, a metrics port)."""

from __future__ import annotations

import os
import socket


def listen_address(host: str, port: int) -> str:
    """`host:port` as a person writes it (`[::1]:8080` for IPv6)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_reason(exc: OSError) -> str:
    """Why a listening socket could not be made, short: `Address already in use`, `Name or service
    not known` (asyncio and uvloop word the same errno differently, with the address in it)."""
    if isinstance(exc, socket.gaierror) or not exc.errno or exc.errno < 0:
        return str(exc.strerror or exc)
    return os.strerror(exc.errno)


def cannot_listen(what: str, host: str, port: int, exc: OSError) -> SystemExit:
    """The process's end, one line: `error: cannot listen on 127.0.0.1:8080: Address already in use`
    (`what`: `for metrics ` before `on`, or nothing)."""
    return SystemExit(f"error: cannot listen {what}on {listen_address(host, port)}: {bind_reason(exc)}")
