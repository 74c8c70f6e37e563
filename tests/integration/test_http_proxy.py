"""`stepstream dev` behind a proxy that terminates TLS, as an Ingress does: browsers open
``https://PROXY`` and send that origin to a server that speaks plain http.

- without ``--public-url`` such pages are refused (their origin is another scheme), and
  the refusal says to set it;
- with ``--public-url https://PROXY`` (or ``STEPSTREAM_PUBLIC_URL``) they may start
  instances and open the session websocket, through the proxy;
- the plain case is unchanged: the server's own http origin works, foreign ones and the
  public host over the other scheme stay refused; a malformed URL is refused at start.

The proxy here is a real TLS server (a self-signed certificate made with openssl) that
passes the bytes on to the server, Host header untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from tests.dev_server import DevServer, clean_env, run_cli, self_signed_certificate, start_dev

TOKEN = "proxy-token-for-tests"
MODULE = "ss_proxy_flows"
WORKFLOWS = """
from stepstream import Context, workflow


@workflow("echo")
async def echo(ctx: Context, args):
    return args
"""
AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


@pytest.fixture(autouse=True)
def _no_ambient_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("STEPSTREAM_API_TOKEN", "STEPSTREAM_PUBLIC_URL", "STEPSTREAM_CONNECT"):
        monkeypatch.delenv(name, raising=False)


class TlsProxy:
    """Terminates TLS on 127.0.0.1 and forwards the plain bytes to ``target`` (a port
    set once the server behind it listens)."""

    def __init__(self, cert: Path, key: Path) -> None:
        self._context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._context.load_cert_chain(cert, key)
        self.target = 0
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._link, "127.0.0.1", 0, ssl=self._context)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        both = [
            asyncio.ensure_future(_pipe(reader, up_writer)),
            asyncio.ensure_future(_pipe(up_reader, writer)),
        ]
        self._tasks.update(both)
        try:
            await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in both:
                task.cancel()
            await asyncio.gather(*both, return_exceptions=True)
            self._tasks.difference_update(both)
            for stream in (up_writer, writer):
                stream.close()
                with contextlib.suppress(OSError, ssl.SSLError):
                    await stream.wait_closed()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while chunk := await reader.read(65536):
        writer.write(chunk)
        await writer.drain()


@pytest.fixture
async def proxy(tmp_path: Path) -> AsyncIterator[tuple[TlsProxy, ssl.SSLContext]]:
    cert, key = self_signed_certificate(tmp_path)
    server = TlsProxy(cert, key)
    await server.start()
    try:
        yield server, ssl.create_default_context(cafile=str(cert))
    finally:
        await server.stop()


def _serve_behind(proxy: TlsProxy, root: Path, *args: str, **env: str) -> DevServer:
    root.mkdir()
    dev = start_dev(
        root, MODULE, WORKFLOWS, *args, env=clean_env(root, STEPSTREAM_API_TOKEN=TOKEN, **env)
    )
    proxy.target = int(dev.url.rsplit(":", 1)[1])
    return dev


async def _start(http: aiohttp.ClientSession, origin: str, instance_id: str) -> tuple[int, str]:
    body = json.dumps({"workflow": "echo", "input": instance_id, "instance_id": instance_id})
    async with http.post("/v1/instances", data=body, headers={"Origin": origin, **AUTH}) as r:
        return r.status, await r.text()


async def test_pages_behind_a_tls_proxy_need_the_public_url(
    tmp_path: Path, proxy: tuple[TlsProxy, ssl.SSLContext]
) -> None:
    server, trust = proxy
    public = f"https://localhost:{server.port}"

    # Without the setting: the page's https origin is not this plain-http server's.
    dev = _serve_behind(server, tmp_path / "without")
    try:
        connector = aiohttp.TCPConnector(ssl=trust)
        async with aiohttp.ClientSession(public, connector=connector) as http:
            status, text = await _start(http, public, "refused-1")
            assert status == 403, text
            message = json.loads(text)["error"]["message"]
            assert "--public-url" in message and "STEPSTREAM_PUBLIC_URL" in message, message
            with pytest.raises(aiohttp.WSServerHandshakeError) as upgrade:
                await http.ws_connect("/v1/session", headers={"Origin": public, **AUTH})
            assert upgrade.value.status == 403
    finally:
        dev.stop()

    # With it (the flag, or the variable as the chart sets it): the page works.
    for name, args, env in (
        ("flag", ("--public-url", public), {}),
        ("variable", (), {"STEPSTREAM_PUBLIC_URL": f"https://other.example, {public}/ui"}),
    ):
        dev = _serve_behind(server, tmp_path / name, *args, **env)
        try:
            connector = aiohttp.TCPConnector(ssl=trust)
            async with aiohttp.ClientSession(public, connector=connector) as http:
                status, text = await _start(http, public, f"behind-{name}")
                assert status == 201, text
                async with http.get(
                    f"/v1/instances/behind-{name}/result?timeout=20",
                    headers={"Origin": public, **AUTH},
                ) as r:
                    assert r.status == 200, await r.text()
                    assert (await r.json())["result"] == f"behind-{name}"
                async with http.ws_connect("/v1/session", headers={"Origin": public, **AUTH}) as ws:
                    assert not ws.closed
                # Still refused: other sites, and the public host over plain http.
                plain_public = public.replace("https://", "http://", 1)
                for foreign in ("https://evil.example", plain_public, "null"):
                    status, text = await _start(http, foreign, f"foreign-{name}")
                    assert status == 403, (foreign, text)
                    # The refusal names the public URLs it has, not advice to set one.
                    message = json.loads(text)["error"]["message"]
                    assert f"or its public URLs {public}" in message, message
                    assert "Open the UI at its public URL" in message, message
            # The plain case is unchanged: the server's own origin, straight to it.
            async with aiohttp.ClientSession(dev.url) as direct:
                status, text = await _start(direct, dev.url, f"direct-{name}")
                assert status == 201, text
                status, text = await _start(direct, public, f"proxied-origin-direct-{name}")
                assert status == 201, text  # the public origin is the server's own
                status, text = await _start(direct, "http://evil.example", f"evil-{name}")
                assert status == 403, text
        finally:
            dev.stop()


def test_a_public_url_that_is_not_one_is_refused_saying_what_to_give(tmp_path: Path) -> None:
    (tmp_path / f"{MODULE}.py").write_text(WORKFLOWS)
    dev = ["dev", "--workflows", MODULE, "--data", str(tmp_path / "data"), "--port", "0"]
    done = run_cli(tmp_path, *dev, "--public-url", "flows.example.com", timeout=30)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert "'flows.example.com' is not an http(s) URL" in done.stderr, done.stderr
    assert "https://flows.example.com" in done.stderr
    assert not (tmp_path / "data").exists()  # refused before anything was opened
    helped = run_cli(tmp_path, "worker", "--help")
    assert "--public-url" in helped.stdout and "STEPSTREAM_PUBLIC_URL" in helped.stdout
