"""A worker's API with a token and TLS, reached by the kafka:// client.

The kafka:// client reads and waits through the workers' HTTP APIs (a websocket session
per worker, lists over HTTP), so it must send the token and trust the workers'
certificate; without the token its reads are refused at once with a message saying
what to pass (publishing commands is Kafka's to authorise: its ACLs, not this token).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from stepstream import AccessDenied, Client
from stepstream.ops.api.security import ApiSecurity, InsecureBind
from stepstream.ops.kafka_worker import KafkaWorker
from stepstream.ops.kafka_worker_config import KafkaWorkerConfig
from tests.conftest import (
    KAFKA_TEST_PARTITIONS,
    ThreadedWorker,
    kafka_settings,
    kafka_url,
)
from tests.conftest import test_registry as registry
from tests.dev_server import self_signed_certificate
from tests.kafka_broker import Broker

TOKEN = "kafka-worker-token"


@pytest.fixture
def secured_worker(kafka_broker: Broker, tmp_path: Path) -> Iterator[tuple[ThreadedWorker, Path]]:
    from stepstream.consumers.kafka import create_topics

    cert, key = self_signed_certificate(tmp_path)
    settings = kafka_settings(kafka_broker)
    create_topics(settings, KAFKA_TEST_PARTITIONS)
    api = ApiSecurity(token=TOKEN, tls_cert=str(cert), tls_key=str(key))
    worker = ThreadedWorker(settings, tmp_path / "worker", registry(), api=api)
    try:
        worker.start()
        yield worker, cert
    finally:
        worker.stop()


async def test_kafka_client_with_token_and_tls(
    secured_worker: tuple[ThreadedWorker, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    worker, cert = secured_worker
    monkeypatch.delenv("STEPSTREAM_API_TOKEN", raising=False)
    assert worker.worker.url.startswith("https://127.0.0.1:")
    url = kafka_url(worker.settings)
    async with Client.connect(url, token=TOKEN, tls_ca=str(cert)) as client:
        await client.start("waiter", None, instance_id="k-1")
        waiting = asyncio.ensure_future(client.result("k-1", timeout=30))
        await client.send_event("k-1", "approval", {"by": "ada"})
        assert await waiting == {"by": "ada"}
        assert (await client.status("k-1")).status == "completed"
        assert "k-1" in [i.instance_id for i in await client.list()]

    async with Client.connect(url, tls_ca=str(cert), timeout=10) as client:
        with pytest.raises(AccessDenied, match="bearer token"):
            await client.status("k-1")
        with pytest.raises(AccessDenied, match="bearer token"):
            await client.list()
    monkeypatch.setenv("STEPSTREAM_API_TOKEN", TOKEN)
    monkeypatch.setenv("STEPSTREAM_TLS_CA", str(cert))
    async with Client.connect(url) as client:  # both from the environment
        assert (await client.status("k-1")).status == "completed"


async def test_a_worker_beyond_loopback_needs_a_token(kafka_broker: Broker, tmp_path: Path) -> None:
    settings = kafka_settings(kafka_broker)
    config = KafkaWorkerConfig(settings, state_dir=str(tmp_path / "w"), host="0.0.0.0", port=0)
    with pytest.raises(InsecureBind, match="--insecure"):
        await KafkaWorker(registry(), config).start()
    assert not (tmp_path / "w").exists()  # refused before anything was claimed


async def test_a_worker_answers_to_its_advertised_host(
    kafka_broker: Broker, tmp_path: Path
) -> None:
    from stepstream.consumers.kafka import create_topics

    settings = kafka_settings(kafka_broker)
    create_topics(settings, KAFKA_TEST_PARTITIONS)
    advertised = "http://worker-0.stepstream:8233"  # as in a StatefulSet; bound elsewhere
    worker = ThreadedWorker(settings, tmp_path / "w", registry(), advertise=advertised)
    try:
        worker.call_sync(worker.worker.start())
        host, port = worker.worker._http.addresses[0][:2]
        async with aiohttp.ClientSession(f"http://{host}:{port}") as http:
            for name, expected in (
                ("worker-0.stepstream:8233", 200),
                ("WORKER-0.stepstream.", 200),
                ("worker-1.stepstream:8233", 403),
            ):
                async with http.get("/v1/workflows", headers={"Host": name}) as r:
                    assert r.status == expected, (name, await r.text())
    finally:
        worker.stop()
