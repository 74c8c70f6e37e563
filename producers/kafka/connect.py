"""Connecting a ``kafka://`` client: the URL and its options, the producer, a check that
the prefix's topics exist, the members and definitions views, and registering the
``kafka`` scheme with ``Client.connect``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
from collections.abc import Iterator
from typing import Any

import aiohttp
from aiokafka import AIOKafkaProducer
from aiokafka.conn import create_conn
from aiokafka.errors import KafkaError, SaslAuthenticationFailed, UnsupportedSaslMechanismError

from stepstream.engine.config.environ import env_int
from stepstream.engine.config.kafka import KafkaSettings, authentication_failed
from stepstream.engine.errors import ConnectionFailed, StepstreamError
from stepstream.engine.wire.codec import DEFAULT_MAX_PAYLOAD_BYTES, JsonCodec, PayloadCodec
from stepstream.engine.wire.serde import default_serde
from stepstream.engine.wire.topics import DEFINITIONS, MEMBERS, TopicNames
from stepstream.producers.client import Transport, register_transport
from stepstream.producers.http.security import client_headers, client_security, client_ssl
from stepstream.producers.http.transport import DEFAULT_REQUEST_TIMEOUT_S
from stepstream.producers.kafka.definitions import DefinitionsView
from stepstream.producers.kafka.members import MembersView
from stepstream.producers.kafka.settings import (
    aiokafka_options,
    check_properties,
    settings_from_url,
)
from stepstream.producers.kafka.transport import DEFAULT_COMMAND_TIMEOUT_S, KafkaTransport

log = logging.getLogger("stepstream.kafka.client")

_CONNECT_TIMEOUT_S = 15.0
_BATCH_BYTES = 1 << 20


async def _connect(url: str, options: dict[str, Any]) -> Transport:
    settings = settings_from_url(url, options)
    request_timeout = float(options.pop("timeout", DEFAULT_REQUEST_TIMEOUT_S))
    command_timeout = float(options.pop("command_timeout", DEFAULT_COMMAND_TIMEOUT_S))
    limit = int(
        options.pop("max_payload_bytes", None)
        or env_int(os.environ, "STEPSTREAM_MAX_PAYLOAD_BYTES", DEFAULT_MAX_PAYLOAD_BYTES)
    )
    codec: PayloadCodec = options.pop("codec", None) or JsonCodec()
    token, tls_ca = client_security(options)
    if options:
        raise StepstreamError(
            f"unknown options for {url}: {', '.join(sorted(options))} (known: prefix, kafka, "
            "kafka_config, timeout, command_timeout, max_payload_bytes, codec, token, tls_ca)"
        )
    return await open_kafka_transport(
        settings,
        codec=codec,
        max_payload_bytes=limit,
        request_timeout=request_timeout,
        command_timeout=command_timeout,
        token=token,
        tls_ca=tls_ca,
    )


class _Unreachable(logging.Filter):
    """While the client first connects, aiokafka logs each of its bootstrap servers it
    cannot reach (``Unable connect to "host:port": [Errno 111] Connection refused``) at
    ERROR before the start fails. Held back here, the reason goes into the one error the
    caller gets; if the start goes on through another server, they are logged then, as
    warnings (a wrong entry in the list is still reported). Other clients' lines pass."""

    def __init__(self, bootstrap: str) -> None:
        super().__init__()
        self._servers = tuple(f'"{s.strip()}"' for s in bootstrap.split(",") if s.strip())
        self.reasons: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if not text.startswith("Unable connect to") or not any(
            server in text for server in self._servers
        ):
            return True
        self.reasons.append(text.removeprefix("Unable connect to "))
        return False

    def report(self) -> None:
        for reason in dict.fromkeys(self.reasons):  # each server once, in order
            log.warning("could not reach Kafka at %s; connected through another server", reason)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        logger = logging.getLogger("aiokafka")
        logger.addFilter(self)
        try:
            yield
        finally:
            logger.removeFilter(self)


async def open_kafka_transport(
    settings: KafkaSettings,
    *,
    codec: PayloadCodec | None = None,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S,
    command_timeout: float = DEFAULT_COMMAND_TIMEOUT_S,
    token: str | None = None,
    tls_ca: str | None = None,
) -> KafkaTransport:
    """``token`` and ``tls_ca``: for the workers' HTTP APIs (see ``producers.http.security``)."""
    check_properties(settings)
    topics = TopicNames(settings.prefix)
    headers = client_headers(token)
    worker_tls = client_ssl(tls_ca)
    producer_options = aiokafka_options(settings, "producer")
    producer_options.setdefault("max_request_size", max(2 * max_payload_bytes, 1 << 21))
    # Many starts at once: with aiokafka's 16 KB batches every sender past a full batch
    # waits for it to drain, wakes, and most wait again (a timer and a wake-up each).
    producer_options.setdefault(
        "max_batch_size", min(_BATCH_BYTES, producer_options["max_request_size"])
    )
    producer = AIOKafkaProducer(**producer_options, acks="all", enable_idempotence=False)
    unreachable = _Unreachable(settings.bootstrap)
    # The views' consumers bootstrap too: the servers that do not answer are held
    # back until the client is open (then warned of) or has failed (then said).
    with unreachable.held():
        try:
            async with asyncio.timeout(_CONNECT_TIMEOUT_S):
                await producer.start()
                # A metadata request naming a topic creates it on brokers that auto-create:
                # ask for all topics, and name ours only once they are known to exist.
                cluster = await producer.client.fetch_all_metadata()
        except BaseException as exc:
            # Whatever stopped the start (a refusal, a timeout, a cancel), the connections it
            # opened are closed here, not left to the garbage collector.
            with contextlib.suppress(Exception):
                await producer.stop()
            if not isinstance(exc, (KafkaError, TimeoutError, OSError)):
                raise
            if not isinstance(exc, TimeoutError):  # a refusal comes at once, never as a timeout
                await _raise_if_refused(settings, producer_options)
            why = unreachable.reasons[-1] if unreachable.reasons else str(exc) or type(exc).__name__
            raise ConnectionFailed(
                f"cannot reach Kafka at {settings.bootstrap}: {why}; check the address and the "
                "security settings"
            ) from None
        members: MembersView | None = None
        definitions: DefinitionsView | None = None
        try:
            found = cluster.partitions_for_topic(topics.commands)
            missing = [
                name
                for name in (topics.commands, topics.name(MEMBERS), topics.name(DEFINITIONS))
                if cluster.partitions_for_topic(name) is None
            ]
            if missing or not found:
                raise StepstreamError(
                    f"topics {', '.join(missing)} do not exist on {settings.bootstrap}; create "
                    f"them with `stepstream topics create --bootstrap {settings.bootstrap} "
                    f"--prefix {settings.prefix} --partitions N` and start a worker"
                )
            definitions = await DefinitionsView.open(
                topics.name(DEFINITIONS),
                prefix=settings.prefix,
                timeout=request_timeout,
                **aiokafka_options(settings, "consumer"),
            )
            members = await MembersView.open(
                topics.name(MEMBERS),
                timeout=request_timeout,
                **aiokafka_options(settings, "consumer"),
            )
            announced = members.partition_count
            if announced and announced != len(found):
                raise StepstreamError(
                    f"{topics.commands} has {len(found)} partitions but the workers run with "
                    f"{announced}; the topics were recreated: restart the workers"
                )
        except BaseException:
            with contextlib.suppress(Exception):
                await producer.stop()
            if members is not None:
                await members.close()
            if definitions is not None:
                await definitions.close()
            raise
    unreachable.report()
    # Waits are calls on one websocket per worker; requests (lists) are few.
    session = aiohttp.ClientSession(
        headers=headers, connector=aiohttp.TCPConnector(limit=0, ssl=worker_tls)
    )
    return KafkaTransport(
        producer=producer,
        members=members,
        definitions=definitions,
        session=session,
        topics=topics,
        partitions=len(found),
        codec=codec or JsonCodec(),
        serde=default_serde(),
        max_payload_bytes=max_payload_bytes,
        request_timeout=request_timeout,
        command_timeout=command_timeout,
    )


# aiokafka's own arguments that a single connection takes too.
_CONNECTION_OPTIONS = (
    "client_id",
    "ssl_context",
    "security_protocol",
    "sasl_mechanism",
    "sasl_plain_username",
    "sasl_plain_password",
    "sasl_kerberos_service_name",
)
_PROBE_TIMEOUT_S = 5.0


async def _raise_if_refused(settings: KafkaSettings, options: dict[str, Any]) -> None:
    """After a failed start: connect once to each bootstrap server, as the producer did,
    and raise ``KafkaAuthenticationFailed`` if one refuses the SASL login or the TLS
    handshake fails. aiokafka only logs why a bootstrap failed ("Unable to bootstrap")."""
    arguments = {k: v for k, v in options.items() if k in _CONNECTION_OPTIONS}
    with contextlib.suppress(TimeoutError):  # all of them within one bound
        async with asyncio.timeout(_PROBE_TIMEOUT_S):
            for server in settings.bootstrap.split(","):
                host, _, port = server.strip().rpartition(":")
                try:
                    connection = await create_conn(
                        host.strip("[]"),
                        int(port),
                        request_timeout_ms=int(_PROBE_TIMEOUT_S * 1000),
                        **arguments,
                    )
                except (SaslAuthenticationFailed, UnsupportedSaslMechanismError) as exc:
                    raise authentication_failed(settings.bootstrap, str(exc), tls=False) from None
                except ssl.SSLError as exc:
                    raise authentication_failed(settings.bootstrap, str(exc), tls=True) from None
                except (KafkaError, OSError, ValueError):
                    continue  # down or unreachable: the caller's error says so
                connection.close()


register_transport("kafka", _connect)
