"""A TCP relay to a server that can turn its open connections into black holes: both ends stay
up, and whatever either side sends from then on is dropped without a word, as when a NAT or a load
balancer forgets an idle connection's mapping or a network path is cut. Connections made after
that go through as before. It can also hold back what a connection sends from a given command on
(`hold`), as a slow path would, till `release`. It keeps what clients sent (`received`): in front of an HTTP server
that takes absolute-form requests (aiohttp's does), it is a forward proxy that shows what came
through it. It runs on threads of its own, so a test may block meanwhile."""

from __future__ import annotations

import socket
import threading
from typing import Any


class Blackhole:
    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        #: the connections relayed, each with whether it is cut
        self.pairs: list[dict[str, Any]] = []
        #: every byte clients sent through it, in the order it came (a test's traffic is small)
        self.received = bytearray()
        self.closed = False
        #: what a connection's client sends that makes the relay hold it (`hold`), and the gate
        #: the held ones wait on
        self.holding: bytes | None = None
        self.gate = threading.Event()
        threading.Thread(target=self._accept, name="blackhole-accept", daemon=True).start()

    def url(self, scheme: str = "redis") -> str:
        return f"{scheme}://127.0.0.1:{self.port}"

    def cut(self) -> int:
        """Every connection open now drops all it gets from here on; returns how many there are."""
        with self.lock:
            live = [pair for pair in self.pairs if not pair["done"]]
            for pair in live:
                pair["cut"] = True
            return len(live)

    def hold(self, containing: bytes) -> None:
        """From now on, a connection whose client sends `containing` relays nothing more it sends
        (that included; it is kept, in order) till `release`."""
        with self.lock:
            self.gate = threading.Event()
            self.holding = containing

    def release(self) -> None:
        """What the held connections kept goes on to the server, and so does all they send after."""
        with self.lock:
            self.holding = None
            self.gate.set()

    def close(self) -> None:
        """Stop relaying: the listener and every connection closed, and none accepted after."""
        self.closed = True
        try:  # (wakes the accepting thread: a close alone leaves its accept() taking connections)
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        with self.lock:
            for pair in self.pairs:
                for sock in pair["socks"]:
                    _close(sock)

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.closed:
                _close(client)
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                _close(client)
                continue
            pair: dict[str, Any] = {"cut": False, "done": False, "socks": (client, upstream)}
            with self.lock:
                if self.closed:  # (closed while this one was being made: `close` went past it)
                    _close(client)
                    _close(upstream)
                    return
                self.pairs.append(pair)
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(pair, src, dst), name="blackhole-pump", daemon=True).start()

    def _pump(self, pair: dict[str, Any], src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if src is pair["socks"][0]:
                    with self.lock:
                        self.received += data
                        gate = self.gate if self.holding is not None and self.holding in data else None
                    while gate is not None and not gate.wait(0.1) and not self.closed:
                        pass
                if not pair["cut"]:
                    dst.sendall(data)
        except OSError:
            pass
        if not pair["cut"]:  # (a cut connection never ends by itself: only `close` ends it)
            pair["done"] = True
            for sock in pair["socks"]:
                _close(sock)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
