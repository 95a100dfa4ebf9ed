"""How a worker reaches its providers over the network: through the HTTP proxy its environment
names (`workers.adapters.proxies`: `https_proxy` / `http_proxy`, not for a host `no_proxy` covers),
and over https to a server whose certificate a private CA signed (`SSL_CERT_FILE`)."""

from __future__ import annotations

import asyncio
import base64
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from common.config import ProviderConfig
from common.policy import Health
from common.wire import RunKind
from iop.embedded_redis import RedisServer, free_port
from tests.blackhole import Blackhole
from tests.conftest import ROOT, Proc
from tests.faults import FaultStack, chat, post_json
from tests.tls import make_certificates
from workers.adapters.base import ProviderError
from workers.adapters.openai_compat import OpenAICompatAdapter
from workers.adapters.proxies import Proxy, ProxyError, Via, bypassed, proxy_for

ENV = {"https_proxy": "http://user%40corp:p%3Ass@proxy.corp:3128", "HTTP_PROXY": "proxy.corp:8080",
       "NO_PROXY": "localhost, .internal,10.0.0.5,gpu-1:8000,::1"}


@pytest.mark.parametrize(("url", "expected"), [
    ("https://api.openai.com/v1",
     Proxy("http://proxy.corp:3128", "Basic " + base64.b64encode(b"user@corp:p:ss").decode(), "https_proxy")),
    ("http://gpu-2:8000", Proxy("http://proxy.corp:8080", None, "HTTP_PROXY")),  # (no scheme: http://)
    ("http://gpu-1:9000", Proxy("http://proxy.corp:8080", None, "HTTP_PROXY")),  # (another port than no_proxy's)
    ("http://gpu-1:8000/v1", None),
    ("http://vllm.internal:8000", None),
    ("http://internal:8000", None),
    ("http://10.0.0.5:8000", None),
    ("http://[::1]:8000", None),
    ("http://localhost:8000", None),
    ("http://127.0.0.1:8000", None),  # (loopback: never through a proxy, whatever no_proxy says)
    ("http://127.1.2.3:8000", None),
    ("http://sim.localhost:8000", None),
    ("http://192.168.1.20:8000", Proxy("http://proxy.corp:8080", None, "HTTP_PROXY")),
    ("http://0.0.0.0:8000", None),  # (this machine)
    ("http://[::ffff:127.0.0.1]:8000", None),
])
def test_the_environment_names_each_provider_s_proxy(url: str, expected: Proxy | None) -> None:
    assert proxy_for(url, ENV) == expected


def test_lower_case_names_come_first_and_nothing_named_is_no_proxy() -> None:
    both = {"http_proxy": "http://lower:1", "HTTP_PROXY": "http://upper:2"}
    assert proxy_for("http://h:8000", both) == Proxy("http://lower:1", None, "http_proxy")
    assert proxy_for("http://h:8000", {"https_proxy": "http://p:1", "http_proxy": " "}) is None
    assert proxy_for("https://h", {"http_proxy": "http://p:1"}) is None  # (https has its own)
    assert proxy_for("http://h:8000", {"http_proxy": "http://p:1", "no_proxy": "*"}) is None


NOT_A_URL = "HTTPS_PROXY is not a proxy URL: write it http://[user:password@]host:port (its password %-encoded)"


@pytest.mark.parametrize(("value", "says"), [
    ("socks5://p:1080", 'HTTPS_PROXY names a "socks5" proxy: only an http:// proxy is supported (it may tunnel '
                        "https:// requests)"),
    ("https://p:3128", 'HTTPS_PROXY names a "https" proxy: only an http:// proxy is supported'),
    ("http://p:99999", NOT_A_URL),
    ("http://:3128", NOT_A_URL),
    ("http://p:3128/path", NOT_A_URL),
    ("http://ops:Tr0ub4dor#3@p:3128x", NOT_A_URL),
])
def test_a_proxy_that_cannot_be_used_is_refused_naming_its_variable(value: str, says: str) -> None:
    with pytest.raises(ProxyError) as err:
        proxy_for("https://api.example.com", {"HTTPS_PROXY": value})
    assert str(err.value).startswith(says), str(err.value)
    assert "Tr0ub4dor" not in str(err.value)


@pytest.mark.parametrize("password", ["Tr0ub4dor#3", "a/b?c", "12345", "p@ss", "x://y"])
def test_a_password_written_without_percent_encoding_is_the_password_never_the_host_or_port(password: str) -> None:
    """Found by a review: `#`, `/` or `?` in a password split the URL there (the password then showed
    in the error), and one of digits was taken for the port (and logged as part of the proxy)."""
    for value in (f"http://ops:{password}@proxy.corp:3128", f"ops:{password}@proxy.corp:3128"):  # (no scheme: http)
        proxy = proxy_for("https://api.example.com", {"HTTPS_PROXY": value})
        assert proxy == Proxy("http://proxy.corp:3128",
                              "Basic " + base64.b64encode(f"ops:{password}".encode()).decode(), "HTTPS_PROXY")


@pytest.mark.parametrize(("host", "port", "no_proxy", "expected"), [
    ("a.example.com", 443, "example.com", True),
    ("a.example.com", 443, ".example.com", True),
    ("a.example.com", 443, "*.example.com", True),
    ("example.com", 443, ".example.com", True),
    ("badexample.com", 443, "example.com", False),
    ("a.example.com", 443, "example.com:443", True),
    ("a.example.com", 8443, "example.com:443", False),
    ("h", 80, "", False),
    ("h", 80, " , ,", False),
    ("H.Example.COM.", 80, "example.com", True),
    ("10.1.2.3", 80, "10.0.0.0/8", True),  # (a block: curl, requests and httpx read it so)
    ("192.168.7.20", 11434, "10.0.0.0/8, 192.168.0.0/16", True),
    ("172.16.0.1", 80, "10.0.0.0/8", False),
    ("10.0.0.5", 80, "0.0.5", False),  # (an address is no domain: no suffix of it matches)
    ("10.0.0.5", 80, "10.0.0.5", True),
    ("fd00::1", 8000, "[fd00::1]:8000", True),
    ("fd00::1", 9000, "[fd00::1]:8000", False),
    ("fd00::1", 9000, "fd00::/8", True),
])
def test_no_proxy_is_read_as_curl_reads_it(host: str, port: int, no_proxy: str, expected: bool) -> None:
    assert bypassed(host, port, no_proxy) is expected


def test_a_worker_whose_proxy_cannot_be_used_stops_naming_provider_and_variable(tmp_path: Path) -> None:
    config = tmp_path / "iop.yaml"
    config.write_text("""
models: [{id: m, providers: {hosted: gpt}}]
nodes:
  - id: n1
    providers: [{id: hosted, type: openai_api, base_url: "https://api.example.com/v1", capacity: 1,
                 models: [gpt]}]
""")
    done = subprocess.run([sys.executable, "-m", "iop", "worker", "--node", "n1", "--config", str(config)],
                          env={"HTTPS_PROXY": "socks5://p:1080", "PATH": "/usr/bin:/bin"}, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (
        'error: provider hosted: HTTPS_PROXY names a "socks5" proxy: only an http:// proxy is supported (it may '
        "tunnel https:// requests)"), done.stderr


def test_a_worker_sends_runs_and_probes_through_its_proxy(tmp_path: Path, own_redis: RedisServer) -> None:
    """The provider's host does not resolve: its runs get through only by the proxy (a relay to the
    simulator, which takes the proxy's absolute-form requests), with the proxy's credentials."""
    stack = FaultStack(tmp_path, own_redis)
    try:
        sim_url = stack.add_simulator("far")
        proxy = Blackhole("127.0.0.1", int(sim_url.rsplit(":", 1)[1]))
        try:
            stack.sims["far"] = f"http://gpu.invalid:{sim_url.rsplit(':', 1)[1]}"
            stack.configure({"far": ("n1", 1)})
            stack.scheduler()
            env = {**stack.env(), "HTTP_PROXY": f"http://ops:s3cret@127.0.0.1:{proxy.port}", "NO_PROXY": "localhost"}
            worker = Proc("worker-n1", ["worker", "--node", "n1"], env)
            stack.procs.append(worker)
            worker.wait_for_line(r"provider far: requests go through the proxy http://127\.0\.0\.1:\d+ \(HTTP_PROXY\)")
            gateway = stack.gateway()
            stack.wait_health("far", "available")  # (its probe went through the proxy)
            status, body, _ = post_json(gateway + "/v1/chat/completions", chat())
            assert status == 200, body
            sent = bytes(proxy.received)
            port = sim_url.rsplit(":", 1)[1]
            assert f"POST http://gpu.invalid:{port}/v1/chat/completions HTTP/1.1".encode() in sent
            assert f"GET http://gpu.invalid:{port}/health HTTP/1.1".encode() in sent
            assert b"Proxy-Authorization: Basic " + base64.b64encode(b"ops:s3cret") in sent
            assert "s3cret" not in worker.output()
        finally:
            stack.stop_all()
            proxy.close()
    finally:
        stack.stop_all()



def test_the_proxy_s_credentials_go_to_the_proxy_only() -> None:
    """At http:// the request itself goes to the proxy; at https:// it goes through a tunnel to the
    provider, so the credentials go in the tunnel's CONNECT, never in the request."""
    proxy = Proxy("http://proxy.corp:3128", "Basic b3BzOnMzY3JldA==", "HTTPS_PROXY")
    plain, tunnelled, direct = Via(proxy, https=False), Via(proxy, https=True), Via(None, https=True)
    asked = {"Authorization": "Bearer k"}
    assert plain.headers(asked) == {**asked, "Proxy-Authorization": "Basic b3BzOnMzY3JldA=="}
    assert plain.tunnel_headers() is None and plain.url == "http://proxy.corp:3128"
    assert tunnelled.headers(asked) == asked
    first, second = tunnelled.tunnel_headers(), tunnelled.tunnel_headers()
    assert first == {"Proxy-Authorization": "Basic b3BzOnMzY3JldA=="} and first is not second
    assert direct.headers(asked) is asked and direct.tunnel_headers() is None and direct.url is None
    assert plain.secrets == ["b3BzOnMzY3JldA==", "s3cret"] and direct.secrets == []  # (redacted from errors)
    assert asked == {"Authorization": "Bearer k"}


def test_a_provider_at_https_with_a_private_ca_is_reached_with_ssl_cert_file(
        tmp_path: Path, own_redis: RedisServer) -> None:
    """A GPU box serving https with a certificate of the company's own CA: the worker trusts it
    with SSL_CERT_FILE (as every OpenSSL client does); without it the provider is unavailable,
    and the catalog says its certificate did not verify, and why."""
    make_certificates(tmp_path)
    stack = FaultStack(tmp_path, own_redis)
    try:
        proc = stack.start("sim-tls", "simulator", "--port", "0", "--models", "tls-served",
                           "--tls-cert", str(tmp_path / "server.crt"), "--tls-key", str(tmp_path / "server.key"))
        stack.sims["tls"] = proc.wait_for_line(r"listening on (https://\S+)").group(1)
        stack.configure({"tls": ("n1", 1)})
        stack.scheduler()
        untrusted = stack.worker("n1")
        stack.wait_health("tls", "unavailable")
        with stack.client() as r:
            reason = (r.hget("iop:provider:tls", "reason") or b"").decode()
        assert reason == "GET /health: its TLS certificate did not verify (unable to get local issuer certificate)"
        assert untrusted.stop(30) == 0
        trusting = {**stack.env(), "SSL_CERT_FILE": str(tmp_path / "ca.crt")}
        worker = Proc("worker-n1", ["worker", "--node", "n1"], trusting)
        stack.procs.append(worker)
        worker.wait_for_line(r"worker for queue \S+ started")
        gateway = stack.gateway()
        stack.wait_health("tls", "available")
        status, body, _ = post_json(gateway + "/v1/chat/completions", chat())
        assert status == 200 and body["choices"][0]["message"]["content"], body
    finally:
        stack.stop_all()


@pytest.fixture
async def proxy_407() -> AsyncIterator[str]:
    """A proxy that wants credentials it is not given: 407 to every request, a CONNECT too."""
    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b'HTTP/1.1 407 Proxy Authentication Required\r\nProxy-Authenticate: Basic realm="corp"\r\n'
                     b"Content-Length: 0\r\nConnection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(refuse, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    server.close()
    await server.wait_closed()


def _adapter(base_url: str, proxy: str, session: aiohttp.ClientSession) -> OpenAICompatAdapter:
    provider = ProviderConfig.model_validate({"id": "far", "type": "openai_api", "base_url": base_url, "capacity": 1,
                                              "models": ["m"], "connect_timeout_ms": 2000, "probe_timeout_ms": 2000})
    return OpenAICompatAdapter(provider, session, proxy=Proxy(proxy, None, "HTTPS_PROXY"))


CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
WANTS = " (a proxy on the way wants credentials: user:password@ in the worker's https_proxy or http_proxy)"


async def test_a_fault_of_the_proxy_is_said_to_be_the_proxy_s(proxy_407: str, session: aiohttp.ClientSession) -> None:
    """Found by a review: a proxy that wanted credentials, was down or did not resolve was taken for
    the provider ('the answer was not valid HTTP', 'connection refused', 'its host name did not
    resolve'), and a 407 said to check the provider's api_key_env."""
    closed = f"http://127.0.0.1:{free_port()}"
    for base_url, proxy, says in [
        ("https://api.example.com/v1", proxy_407, f"the proxy {proxy_407} answered 407 to the tunnel's CONNECT{WANTS}"),
        ("https://api.example.com/v1", closed, f"could not reach the proxy {closed} (connection refused)"),
        ("http://gpu.example:8000/v1", "http://proxy.invalid:3128",
         "could not reach the proxy http://proxy.invalid:3128 (its host name did not resolve)"),
    ]:
        adapter = _adapter(base_url, proxy, session)
        with pytest.raises(ProviderError) as err:
            await adapter.complete(RunKind.CHAT, CHAT, "run_1")
        assert err.value.message == f"provider far: {says}", err.value.message
        probe = await adapter.probe()
        assert probe.health is Health.UNAVAILABLE and probe.reason == f"GET /v1/models: {says}", probe.reason
    plain = _adapter("http://gpu.example:8000/v1", proxy_407, session)  # (at http:// the 407 is the answer itself)
    with pytest.raises(ProviderError) as err:
        await plain.complete(RunKind.CHAT, CHAT, "run_2")
    assert err.value.message.startswith("provider far answered 407") and err.value.message.endswith(WANTS)
    assert (await plain.probe()).reason == f"GET /v1/models answered 407{WANTS}"



async def test_a_proxy_that_echoes_its_credentials_in_an_error_has_them_redacted(
        session: aiohttp.ClientSession) -> None:
    """A proxy's error page may show the request it refused, `Proxy-Authorization` and all."""
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        said = head.replace("\r\n", " ").replace('"', "'") + " user ops password s3cret"
        body = ('{"error": {"message": "bad gateway: ' + said + '"}}').encode()
        writer.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    try:
        proxy = proxy_for("http://gpu.example:8000/v1", {
            "HTTP_PROXY": f"http://ops:s3cret@127.0.0.1:{server.sockets[0].getsockname()[1]}"})
        assert proxy is not None
        provider = ProviderConfig.model_validate({"id": "far", "type": "vllm", "base_url": "http://gpu.example:8000",
                                                  "capacity": 1, "models": ["m"]})
        adapter = OpenAICompatAdapter(provider, session, proxy=proxy)
        with pytest.raises(ProviderError) as err:
            await adapter.complete(RunKind.CHAT, CHAT, "run_1")
        assert "answered 502" in err.value.message and "Proxy-Authorization" in err.value.message, err.value.message
        assert "s3cret" not in err.value.message and "b3BzOnMzY3JldA==" not in err.value.message, err.value.message
    finally:
        server.close()
        await server.wait_closed()
