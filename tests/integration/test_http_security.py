"""Who may use the HTTP API, and what hostile input gets, against real `stepstream dev`
processes, through raw HTTP, `Client.connect` and the CLI as a user would.

- a bearer token: none or a wrong one is 401 with a message saying what to do; the right
  one works through the Client (requests and the websocket session) and the CLI;
- cross-site requests (a foreign Origin, a text/plain POST, a Host that is not the
  server's) are refused and start or cancel nothing;
- a server bound beyond loopback refuses to start without a token unless --insecure;
- TLS with a self-signed certificate made here (openssl);
- deeply nested JSON and lone surrogates are 400 InvalidPayload and change nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import ssl
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from stepstream import AccessDenied, Client, ConnectionFailed, InvalidPayload
from tests.dev_server import DevServer, clean_env, run_cli, self_signed_certificate, start_dev

TOKEN = "s3cret-token-for-tests"
MODULE = "ss_security_flows"
WORKFLOWS = """
from stepstream import Context, workflow


@workflow("echo")
async def echo(ctx: Context, args):
    return args


@workflow("gate")
async def gate(ctx: Context, args):
    return await ctx.wait_for_event("go")
"""
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON = {"Content-Type": "application/json"}


@pytest.fixture(autouse=True)
def _no_ambient_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("STEPSTREAM_API_TOKEN", "STEPSTREAM_TLS_CA", "STEPSTREAM_CONNECT"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevServer]:
    """A server with a token (given by the environment, as operators should)."""
    root = tmp_path_factory.mktemp("http-security")
    server = start_dev(root, MODULE, WORKFLOWS, env=clean_env(root, STEPSTREAM_API_TOKEN=TOKEN))
    yield server
    server.stop()


@pytest.fixture
async def http(dev: DevServer) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(dev.url) as session:
        yield session


async def instance_ids(dev: DevServer) -> set[str]:
    async with Client.connect(dev.url, token=TOKEN) as client:
        return {i.instance_id for i in await client.list()}


async def answer(response: aiohttp.ClientResponse) -> tuple[int, dict[str, Any]]:
    return response.status, await response.json()


# ---- the token --------------------------------------------------------------------------


async def test_no_token_or_a_wrong_one_is_401_with_a_clear_message(
    dev: DevServer, http: aiohttp.ClientSession
) -> None:
    start = json.dumps({"workflow": "echo", "input": 1, "instance_id": "no-token-1"})
    async with http.post("/v1/instances", data=start, headers=JSON) as r:
        status, body = await answer(r)
    assert status == 401, body
    assert r.headers["WWW-Authenticate"] == "Bearer"
    assert body["error"]["type"] == "AccessDenied"
    assert "needs a bearer token" in body["error"]["message"]
    assert "STEPSTREAM_API_TOKEN" in body["error"]["message"]

    wrong = {"Authorization": "Bearer not-the-token", **JSON}
    async with http.post("/v1/instances", data=start, headers=wrong) as r:
        status, body = await answer(r)
    assert status == 401 and "not this server's" in body["error"]["message"], body
    async with http.get("/v1/instances", headers={"Authorization": "Basic eDp5"}) as r:
        assert r.status == 401
    with pytest.raises(aiohttp.WSServerHandshakeError) as upgrade:
        await http.ws_connect("/v1/session")
    assert upgrade.value.status == 401
    # A scrape without the token: the refusal speaks to whoever configures Prometheus.
    async with http.get("/metrics") as r:
        status, body = await answer(r)
    assert status == 401 and "give it to Prometheus" in body["error"]["message"], body

    # probes need no token
    async with http.get("/healthz") as r:
        assert r.status == 200

    async with Client.connect(dev.url) as client:
        with pytest.raises(AccessDenied, match="needs a bearer token"):
            await client.start("echo", 1, instance_id="no-token-2")  # a call on the session
        with pytest.raises(AccessDenied, match="needs a bearer token"):
            await client.result("no-token-2", timeout=1)  # over the websocket session
    async with Client.connect(dev.url, token="wrong") as client:
        with pytest.raises(AccessDenied, match="not this server's"):
            await client.status("no-token-2")

    done = dev.cli("start", "echo", "--input", "1", "--id", "no-token-3")
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.startswith("error: ") and "Traceback" not in done.stderr
    assert "needs a bearer token" in done.stderr and "--token" in done.stderr

    assert not {"no-token-1", "no-token-2", "no-token-3"} & await instance_ids(dev)


async def test_the_right_token_works_through_client_and_cli(dev: DevServer) -> None:
    async with Client.connect(dev.url, token=TOKEN) as client:
        await client.start("gate", None, instance_id="tok-1")
        waiting = asyncio.ensure_future(client.result("tok-1", timeout=20))
        await client.send_event("tok-1", "go", {"by": "ada"})
        assert await waiting == {"by": "ada"}
        assert (await client.status("tok-1")).status == "completed"

    done = dev.cli("start", "echo", "--input", '{"n": 1}', "--id", "tok-2", "--wait", "--json")
    assert done.returncode == 1 and "bearer token" in done.stderr  # no token: refused
    by_flag = dev.cli(
        "start",
        "echo",
        "--input",
        '{"n": 1}',
        "--id",
        "tok-2",
        "--wait",
        "--json",
        "--token",
        TOKEN,
    )
    assert by_flag.returncode == 0, by_flag.stderr
    assert json.loads(by_flag.stdout)["result"] == {"n": 1}
    by_env = dev.cli("status", "tok-2", "--json", STEPSTREAM_API_TOKEN=TOKEN)
    assert by_env.returncode == 0, by_env.stderr
    assert json.loads(by_env.stdout)["status"] == "completed"


# ---- cross-site requests ----------------------------------------------------------------


async def test_a_foreign_origin_is_refused_and_nothing_starts_or_is_cancelled(
    dev: DevServer, http: aiohttp.ClientSession
) -> None:
    async with Client.connect(dev.url, token=TOKEN) as client:
        await client.start("gate", None, instance_id="csrf-target")
    foreign = {"Origin": "http://evil.example"}
    start = json.dumps({"workflow": "echo", "input": 1, "instance_id": "csrf-1"})

    # what a web page can send without asking first: a text/plain POST
    async with http.post(
        "/v1/instances", data=start, headers={**foreign, "Content-Type": "text/plain"}
    ) as r:
        status, body = await answer(r)
    assert status == 403 and "cross-site request refused" in body["error"]["message"], body
    # refused even with the token and a JSON body, for every method
    for method, path, data in (
        ("POST", "/v1/instances", start),
        ("POST", "/v1/instances/csrf-target/cancel", "{}"),
        ("GET", "/v1/instances", None),
    ):
        async with http.request(method, path, data=data, headers={**foreign, **AUTH, **JSON}) as r:
            status, body = await answer(r)
        assert status == 403, (method, path, body)
        assert body["error"]["type"] == "AccessDenied"
    with pytest.raises(aiohttp.WSServerHandshakeError) as upgrade:
        await http.ws_connect("/v1/session", headers={**foreign, **AUTH})
    assert upgrade.value.status == 403
    async with http.get("/v1/instances", headers={"Origin": "null", **AUTH}) as r:
        assert r.status == 403

    # the server's own origin is fine
    own = {"Origin": dev.url, **AUTH}
    async with http.get("/v1/instances/csrf-target", headers=own) as r:
        status, body = await answer(r)
    assert status == 200 and body["status"] == "running", body

    assert "csrf-1" not in await instance_ids(dev)
    async with Client.connect(dev.url, token=TOKEN) as client:
        assert (await client.status("csrf-target")).status == "running"
        await client.cancel("csrf-target")


async def test_a_plain_http_server_takes_only_http_origins(
    dev: DevServer, http: aiohttp.ClientSession
) -> None:
    """The server's own host and port over https is another origin: a page served over
    https (by whatever listens there) cannot call a plain-http API."""
    assert dev.url.startswith("http://")
    secure = dev.url.replace("http://", "https://", 1)
    start = json.dumps({"workflow": "echo", "input": 1, "instance_id": "scheme-1"})
    headers = {"Origin": secure, **AUTH, **JSON}
    async with http.post("/v1/instances", data=start, headers=headers) as r:
        status, body = await answer(r)
    assert status == 403, body
    message = body["error"]["message"]
    assert f"Origin {secure!r} is not this server ({dev.url})" in message, message
    with pytest.raises(aiohttp.WSServerHandshakeError) as upgrade:
        await http.ws_connect("/v1/session", headers={"Origin": secure, **AUTH})
    assert upgrade.value.status == 403
    assert "scheme-1" not in await instance_ids(dev)
    async with http.get("/v1/instances", headers={"Origin": dev.url, **AUTH}) as r:
        assert r.status == 200


async def test_post_bodies_must_be_json(dev: DevServer, http: aiohttp.ClientSession) -> None:
    start = json.dumps({"workflow": "echo", "input": 1, "instance_id": "plain-1"})
    # The engine processes' forwarded records are taken on their internal routes only.
    records = "application/vnd.stepstream.records"
    for content_type in ("text/plain", "application/x-www-form-urlencoded", records, None):
        headers = {**AUTH, "Content-Type": content_type} if content_type else AUTH
        async with http.post("/v1/instances", data=start.encode(), headers=headers) as r:
            status, body = await answer(r)
        assert status == 415, (content_type, body)
        assert "Content-Type: application/json" in body["error"]["message"]
    async with http.post(
        "/v1/instances",
        data=start,
        headers={**AUTH, "Content-Type": "application/json; charset=utf-8"},
    ) as r:
        assert r.status == 201, await r.text()
    assert "plain-1" in await instance_ids(dev)
    # A POST without a body is no exception (a cross-site one is a simple request), and
    # the refusal says how to send it.
    async with http.post("/v1/instances/plain-1/pause", headers=AUTH) as r:
        status, body = await answer(r)
    assert status == 415, body
    assert "curl -H 'Content-Type: application/json'" in body["error"]["message"]
    async with http.post("/v1/instances/plain-1/pause", headers={**AUTH, **JSON}) as r:
        assert r.status == 409, await r.text()  # taken: plain-1 has finished already


async def test_a_host_header_that_is_not_the_servers_is_refused(
    dev: DevServer, http: aiohttp.ClientSession
) -> None:
    port = dev.url.rsplit(":", 1)[1]
    async with http.get("/v1/instances", headers={"Host": f"rebound.example:{port}", **AUTH}) as r:
        status, body = await answer(r)
    assert status == 403 and "DNS rebinding" in body["error"]["message"], body
    assert "--allowed-host" in body["error"]["message"]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "localhost"):
        async with http.get("/v1/instances", headers={"Host": host, **AUTH}) as r:
            assert r.status == 200, (host, await r.text())


# ---- binding beyond loopback ------------------------------------------------------------


def test_binding_beyond_loopback_needs_a_token_or_insecure(tmp_path: Path) -> None:
    (tmp_path / f"{MODULE}.py").write_text(WORKFLOWS)
    dev = ["dev", "--workflows", MODULE, "--data", str(tmp_path / "data"), "--port", "0"]
    done = run_cli(tmp_path, *dev, "--host", "0.0.0.0", timeout=30)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    message = done.stderr
    assert message.startswith("error: refusing to serve the API on 0.0.0.0 without a token")
    for advice in ("STEPSTREAM_API_TOKEN", "--api-token", "--insecure", "127.0.0.1"):
        assert advice in message, message
    assert not (tmp_path / "data").exists()  # refused before anything was opened

    worker = ["worker", "--workflows", MODULE, "--bootstrap", "127.0.0.1:1", "--host", "::"]
    done = run_cli(tmp_path, *worker, "--state-dir", str(tmp_path / "state"), timeout=30)
    assert done.returncode == 2 and "refusing to serve the API on ::" in done.stderr, done.stderr

    # with a token, or with --insecure, it starts; allowed hosts are answered
    (tmp_path / "a").mkdir()
    start_dev(tmp_path / "a", MODULE, WORKFLOWS, "--host", "0.0.0.0", "--api-token", TOKEN).stop()
    (tmp_path / "b").mkdir()
    insecure = start_dev(
        tmp_path / "b",
        MODULE,
        WORKFLOWS,
        *("--host", "0.0.0.0", "--insecure", "--allowed-host", "api.example"),
        env=clean_env(tmp_path / "b", STEPSTREAM_ALLOWED_HOSTS="other.example, *.shop.example"),
    )
    try:
        asyncio.run(_an_open_server(insecure))
    finally:
        insecure.stop()


async def _an_open_server(dev: DevServer) -> None:
    port = dev.url.rsplit(":", 1)[1]
    url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession(url) as http:
        answers = {
            "api.example": 200,
            "other.example": 200,
            "flows.shop.example": 200,  # below *.shop.example, as an Ingress host allows
            "a.b.shop.example": 200,
            "shop.example": 403,  # the wildcard is for the names below it
            "evilshop.example": 403,
            "evil.example": 403,
        }
        for host, expected in answers.items():
            async with http.get("/v1/instances", headers={"Host": f"{host}:{port}"}) as r:
                assert r.status == expected, (host, await r.text())
    async with Client.connect(url) as client:  # no token needed: --insecure
        await client.start("echo", 2, instance_id="open-1")
        assert await client.result("open-1", timeout=20) == 2


# ---- TLS --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return self_signed_certificate(tmp_path_factory.mktemp("tls"))


def _sockets_to(port: int) -> int:
    """How many of this process's open TCP sockets are connected to ``port``."""
    mine = set()
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                mine.add(target[len("socket:[") : -1])
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[2].rsplit(":", 1)[1], 16) == port and fields[9] in mine:
                count += 1
    return count


async def test_tls_with_a_self_signed_certificate(
    tmp_path: Path, certificate: tuple[Path, Path]
) -> None:
    cert, key = certificate
    dev = start_dev(
        tmp_path,
        MODULE,
        WORKFLOWS,
        "--tls-cert",
        str(cert),
        "--tls-key",
        str(key),
        env=clean_env(tmp_path, STEPSTREAM_API_TOKEN=TOKEN),
    )
    try:
        assert dev.url.startswith("https://127.0.0.1:")
        async with Client.connect(dev.url, token=TOKEN, tls_ca=str(cert)) as client:
            await client.start("gate", None, instance_id="tls-1")
            waiting = asyncio.ensure_future(client.result("tls-1", timeout=20))
            await client.send_event("tls-1", "go", "over tls")
            assert await waiting == "over tls"
        # Closed means closed: no socket to the server is left in TLS's closing
        # handshake, which an event loop ended right after would leave open.
        assert _sockets_to(int(dev.url.rsplit(":", 1)[1])) == 0
        async with Client.connect(dev.url, token=TOKEN) as client:
            with pytest.raises(ConnectionFailed, match=r"not trusted.*tls_ca="):
                await client.status("tls-1")
        plain = "http://" + dev.url.removeprefix("https://")
        async with Client.connect(plain, token=TOKEN, timeout=5) as client:
            with pytest.raises(ConnectionFailed):
                await client.status("tls-1")

        # Origins with their scheme: only https:// ones of this server.
        context = ssl.create_default_context(cafile=str(cert))
        connector = aiohttp.TCPConnector(ssl=context)
        async with aiohttp.ClientSession(dev.url, connector=connector, headers=AUTH) as http:
            async with http.get("/v1/instances/tls-1", headers={"Origin": plain}) as r:
                status, body = await answer(r)
            assert status == 403, body
            assert f"Origin {plain!r} is not this server ({dev.url})" in body["error"]["message"]
            with pytest.raises(aiohttp.WSServerHandshakeError) as upgrade:
                await http.ws_connect("/v1/session", headers={"Origin": plain})
            assert upgrade.value.status == 403
            async with http.get("/v1/instances/tls-1", headers={"Origin": dev.url}) as r:
                status, body = await answer(r)
            assert status == 200 and body["status"] == "completed", body

        done = dev.cli("status", "tls-1", "--json", "--token", TOKEN, "--tls-ca", str(cert))
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["status"] == "completed"
        done = dev.cli("status", "tls-1", STEPSTREAM_API_TOKEN=TOKEN, STEPSTREAM_TLS_CA=str(cert))
        assert done.returncode == 0, done.stderr
        done = dev.cli("status", "tls-1", "--token", TOKEN)
        assert done.returncode == 1 and "not trusted" in done.stderr, done.stderr
    finally:
        dev.stop()


def test_tls_needs_both_files(tmp_path: Path, certificate: tuple[Path, Path]) -> None:
    (tmp_path / f"{MODULE}.py").write_text(WORKFLOWS)
    done = run_cli(tmp_path, "dev", "--workflows", MODULE, "--tls-cert", str(certificate[0]))
    assert done.returncode == 1 and "needs both --tls-cert and --tls-key" in done.stderr


# ---- hostile input ----------------------------------------------------------------------


async def test_deeply_nested_json_is_400_and_changes_nothing(
    dev: DevServer, http: aiohttp.ClientSession
) -> None:
    headers = {**AUTH, **JSON}
    before = await instance_ids(dev)
    for depth, closed in ((100_000, False), (100_000, True), (600, True)):
        nested = "[" * depth + ("]" * depth if closed else "")
        body = f'{{"workflow": "echo", "instance_id": "deep-{depth}", "input": {nested}}}'
        async with http.post("/v1/instances", data=body, headers=headers) as r:
            status, answer_body = await answer(r)
        assert status == 400, answer_body
        assert answer_body["error"]["type"] == "InvalidPayload"
        assert "nests deeper than 512 levels" in answer_body["error"]["message"]
    async with Client.connect(dev.url, token=TOKEN) as client:
        await client.start("gate", None, instance_id="deep-gate")
        nested = "[" * 100_000
        async with http.post(
            "/v1/instances/deep-gate/events",
            data=f'{{"name": "go", "payload": {nested}',
            headers=headers,
        ) as r:
            assert r.status == 400 and "nests deeper" in (await r.json())["error"]["message"]
        deep: Any = 0
        for _ in range(600):
            deep = [deep]
        with pytest.raises(InvalidPayload, match="nests deeper"):
            await client.send_event("deep-gate", "go", deep)
        with pytest.raises(InvalidPayload, match="nests deeper"):
            await client.start("echo", deep, instance_id="deep-client")
        fine: Any = 0
        for _ in range(500):
            fine = [fine]
        await client.start("echo", fine, instance_id="deep-ok")
        assert await client.result("deep-ok", timeout=20) == fine
        status = await client.status("deep-gate")
        assert status.status == "running" and [w.event for w in status.waits] == ["go"]
        await client.cancel("deep-gate")
    assert await instance_ids(dev) - before == {"deep-gate", "deep-ok"}
    done = dev.cli("start", "echo", "--input", "[" * 100_000, "--token", TOKEN)
    assert done.returncode == 2 and "nests deeper" in done.stderr, done.stderr[-500:]


async def test_lone_surrogates_are_400_and_change_nothing(
    dev: DevServer, http: aiohttp.ClientSession
) -> None:
    headers = {**AUTH, **JSON}
    before = await instance_ids(dev)
    for text in (r'"\ud800"', r'{"x": "a\udc00b"}', r'{"\udbff": 1}'):
        body = f'{{"workflow": "echo", "instance_id": "sur-1", "input": {text}}}'
        async with http.post("/v1/instances", data=body, headers=headers) as r:
            status, answer_body = await answer(r)
        assert status == 400, (text, answer_body)
        assert answer_body["error"]["type"] == "InvalidPayload"
        assert "lone surrogate" in answer_body["error"]["message"]
    body = r'{"workflow": "echo", "instance_id": "sur-\ud800", "input": 1}'
    async with http.post("/v1/instances", data=body, headers=headers) as r:
        assert r.status == 400 and "lone surrogate" in (await r.json())["error"]["message"]

    async with Client.connect(dev.url, token=TOKEN) as client:
        await client.start("gate", None, instance_id="sur-gate")
        async with http.post(
            "/v1/instances/sur-gate/events",
            data=r'{"name": "go", "payload": "\ud800"}',
            headers=headers,
        ) as r:
            assert r.status == 400 and "lone surrogate" in (await r.json())["error"]["message"]
        with pytest.raises(InvalidPayload, match="lone surrogate"):
            await client.send_event("sur-gate", "go", "\udfff")
        # an escaped pair is one character, and fine
        body = r'{"workflow": "echo", "instance_id": "sur-pair", "input": "\ud83d\ude00"}'
        async with http.post("/v1/instances", data=body, headers=headers) as r:
            assert r.status == 201, await r.text()
        assert await client.result("sur-pair", timeout=20) == "\U0001f600"
        status = await client.status("sur-gate")
        assert status.status == "running" and [w.event for w in status.waits] == ["go"]
        await client.cancel("sur-gate")
    assert await instance_ids(dev) - before == {"sur-gate", "sur-pair"}
    done = dev.cli("start", "echo", "--input", r'"\ud800"', "--token", TOKEN)
    assert done.returncode == 2 and "lone surrogate" in done.stderr, done.stderr
