"""``kafka://HOST:PORT[,HOST:PORT...]?prefix=P``: a client that needs nothing but the
bootstrap servers.

Commands are checked here (``CommandPublisher``: known workflow, encodable and small
enough payloads, instance not finished), then published to ``<prefix>.commands`` with
aiokafka (acks=all; not idempotent: its InitProducerId fails against some brokers), on
the instance's partition. Everything else goes to the worker that owns the instance's
partition, found on ``<prefix>.members``, over one websocket session per worker (many
calls in flight, batched both ways; ``list`` over plain HTTP; the ``token`` and
``tls_ca`` options as for http://): reads, and the wait until
a published command is settled (the worker is woken by its commit). When the owner moves
(rebalance, crash) a waiting call is abandoned and asked again of the new owner; nothing
polls in a loop.

Client properties (security, timeouts) come from ``engine.kafka_settings`` and are mapped
from librdkafka names to aiokafka's arguments; a security property that cannot be mapped
is refused rather than silently dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar
from urllib.parse import parse_qs, urlsplit

import aiohttp
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from aiokafka.helpers import create_ssl_context

from engine.codec import DEFAULT_MAX_PAYLOAD_BYTES, JsonCodec, PayloadCodec
from engine.environ import env_int
from engine.errors import ConnectionFailed, ResultTimeout, StepstreamError
from engine.kafka_settings import KafkaSettings, KafkaSettingsError
from engine.listing import InstancePage, ListQuery, Overview, merge_overviews, merge_pages
from engine.records import Command
from engine.serde import RecordSerde, default_serde
from engine.topics import MEMBERS, TopicNames, partition_for
from engine.views import HistoryEntry, InstanceStatus
from producers.client import Transport, register_transport
from producers.http import (
    DEFAULT_REQUEST_TIMEOUT_S,
    HttpTransport,
    client_headers,
    client_security,
    client_ssl,
)
from producers.kafka_members import MembersView, RemoteWorkflow
from producers.publisher import CommandPublisher

log = logging.getLogger("stepstream.kafka.client")

T = TypeVar("T")
DEFAULT_COMMAND_TIMEOUT_S = 30.0
_RETRY_S = 1.0  # longest wait for the members view to move on before asking again
_CONNECT_TIMEOUT_S = 15.0

# librdkafka property -> (aiokafka argument, converter, clients it applies to)
_BOTH: frozenset[str] = frozenset({"producer", "consumer"})
_MAPPED: dict[str, tuple[str, Callable[[str], Any], frozenset[str]]] = {
    "security.protocol": ("security_protocol", str.upper, _BOTH),
    "sasl.mechanism": ("sasl_mechanism", str.upper, _BOTH),
    "sasl.mechanisms": ("sasl_mechanism", str.upper, _BOTH),
    "sasl.username": ("sasl_plain_username", str, _BOTH),
    "sasl.password": ("sasl_plain_password", str, _BOTH),
    "sasl.kerberos.service.name": ("sasl_kerberos_service_name", str, _BOTH),
    "client.id": ("client_id", str, _BOTH),
    "request.timeout.ms": ("request_timeout_ms", int, _BOTH),
    "socket.timeout.ms": ("request_timeout_ms", int, _BOTH),
    "metadata.max.age.ms": ("metadata_max_age_ms", int, _BOTH),
    "connections.max.idle.ms": ("connections_max_idle_ms", int, _BOTH),
    "retry.backoff.ms": ("retry_backoff_ms", int, _BOTH),
    "linger.ms": ("linger_ms", int, frozenset({"producer"})),
    "queue.buffering.max.ms": ("linger_ms", int, frozenset({"producer"})),
    "compression.type": (
        "compression_type",
        lambda v: None if v == "none" else v,
        frozenset({"producer"}),
    ),
    "compression.codec": (
        "compression_type",
        lambda v: None if v == "none" else v,
        frozenset({"producer"}),
    ),
    "message.max.bytes": ("max_request_size", int, frozenset({"producer"})),
}
_SSL_PROPERTIES = frozenset(
    {
        "ssl.ca.location",
        "ssl.certificate.location",
        "ssl.key.location",
        "ssl.key.password",
        "enable.ssl.certificate.verification",
        "ssl.endpoint.identification.algorithm",
    }
)
# Properties that must not be dropped silently: connecting without them is insecure or
# fails in confusing ways.
_MUST_MAP = ("security.", "sasl.", "ssl.")


def aiokafka_options(
    settings: KafkaSettings, kind: Literal["producer", "consumer"]
) -> dict[str, Any]:
    """aiokafka keyword arguments for ``settings`` (librdkafka property names)."""
    properties = settings.client_config(kind)
    options: dict[str, Any] = {"bootstrap_servers": settings.bootstrap.split(",")}
    ssl_properties: dict[str, str] = {}
    for key, raw in properties.items():
        value = str(raw)
        if key == "bootstrap.servers":
            continue
        if key in _SSL_PROPERTIES:
            ssl_properties[key] = value
            continue
        mapped = _MAPPED.get(key)
        if mapped is not None:
            name, convert, kinds = mapped
            if kind in kinds:
                try:
                    options[name] = convert(value)
                except ValueError:
                    raise KafkaSettingsError(
                        f"Kafka property {key}={value!r} is not valid"
                    ) from None
            continue
        if key.startswith(_MUST_MAP):
            supported = sorted(k for k in (*_MAPPED, *_SSL_PROPERTIES) if k.startswith(_MUST_MAP))
            raise KafkaSettingsError(
                f"Kafka property {key} is not supported by the Python client's publisher "
                f"(aiokafka); supported security properties: {', '.join(supported)}"
            )
        log.debug("Kafka property %s has no aiokafka equivalent; ignored by the client", key)
    if options.get("sasl_mechanism") == "OAUTHBEARER":
        raise KafkaSettingsError(
            "sasl.mechanism=OAUTHBEARER needs a token provider object, which the kafka:// "
            "client cannot build from properties; use PLAIN, SCRAM-SHA-256/512 or GSSAPI"
        )
    protocol = options.get("security_protocol", "PLAINTEXT")
    if protocol in ("SSL", "SASL_SSL"):
        options["ssl_context"] = _ssl_context(ssl_properties)
    elif ssl_properties:
        raise KafkaSettingsError(
            f"ssl.* properties are set but security.protocol is {protocol}; set "
            "security.protocol=SSL or SASL_SSL"
        )
    return options


def _ssl_context(properties: Mapping[str, str]) -> ssl.SSLContext:
    context: ssl.SSLContext = create_ssl_context(
        cafile=properties.get("ssl.ca.location"),
        certfile=properties.get("ssl.certificate.location"),
        keyfile=properties.get("ssl.key.location"),
        password=properties.get("ssl.key.password"),
    )
    if properties.get("ssl.endpoint.identification.algorithm", "https").lower() == "none":
        context.check_hostname = False
    if properties.get("enable.ssl.certificate.verification", "true").lower() == "false":
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


class _WorkerApi(HttpTransport):
    """One worker: reads and waits over its session websocket, listing over HTTP."""

    async def settled(self, command_id: str, instance_id: str, timeout: float) -> str | None:
        reason = await self._calls.call(
            "settled", command_id=command_id, instance_id=instance_id, timeout=timeout
        )
        return None if reason is None else str(reason)

    async def finished_status(self, instance_id: str) -> str | None:
        """The status of a finished instance, or None (raises ``UnknownInstance``)."""
        status = await self._calls.call("finished", instance_id=instance_id)
        return None if status is None else str(status)

    async def status(self, instance_id: str) -> InstanceStatus:
        return InstanceStatus.from_json(await self._calls.call("status", instance_id=instance_id))

    async def history(self, instance_id: str) -> list[HistoryEntry]:
        raw = await self._calls.call("history", instance_id=instance_id)
        return [HistoryEntry.from_json(entry) for entry in raw]

    async def result(self, instance_id: str, timeout: float | None) -> Any:
        return await self._calls.call("result", instance_id=instance_id, timeout=timeout)

    async def reply(self, instance_id: str, message_id: str, timeout: float | None) -> Any:
        return await self._calls.call(
            "reply", instance_id=instance_id, message_id=message_id, timeout=timeout
        )

    async def close(self) -> None:
        # The HTTP session is the transport's, shared by every worker's API.
        await self._calls.close()


class _Settlements:
    """``Publishing`` for ``CommandPublisher``: workflows from the members view, and the
    futures that the publish step resolves once the owner says a command is settled."""

    def __init__(self, members: MembersView) -> None:
        self._members = members
        self._waiting: dict[str, asyncio.Future[str | None]] = {}

    def resolve(self, workflow: str, version: str | None = None) -> RemoteWorkflow:
        return self._members.resolve(workflow, version)

    def settled(self, command_id: str) -> asyncio.Future[str | None]:
        fut = self._waiting.get(command_id)
        if fut is None:
            fut = self._waiting[command_id] = asyncio.get_running_loop().create_future()
        return fut

    def forget(self, command_id: str) -> None:
        self._waiting.pop(command_id, None)

    def settle(self, command_id: str, reason: str | None) -> None:
        fut = self._waiting.get(command_id)
        if fut is not None and not fut.done():
            fut.set_result(reason)


class KafkaTransport(CommandPublisher):
    def __init__(
        self,
        *,
        producer: Any,
        members: MembersView,
        session: aiohttp.ClientSession,
        topics: TopicNames,
        partitions: int,
        codec: PayloadCodec,
        serde: RecordSerde,
        max_payload_bytes: int,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S,
        command_timeout: float = DEFAULT_COMMAND_TIMEOUT_S,
    ) -> None:
        self._settlements = _Settlements(members)
        super().__init__(
            self._produce, self._settlements, codec=codec, max_payload_bytes=max_payload_bytes
        )
        self._producer = producer
        self._members = members
        self._session = session
        self._topics = topics
        self._partitions = partitions
        self._serde = serde
        self._request_timeout = request_timeout
        self._command_timeout = command_timeout
        self._apis: dict[str, _WorkerApi] = {}
        self._watched: dict[asyncio.Future[Any], tuple[int, str, str]] = {}
        members.on_change(self._owners_changed)

    # ---- commands -----------------------------------------------------------------------

    async def start(
        self, workflow: str, input: Any, instance_id: str, version: str | None = None
    ) -> str:
        if not self._members.knows(workflow, version):
            await self._members.synced(self._request_timeout)  # a worker may have just joined
        return await super().start(workflow, input, instance_id, version)

    async def _produce(self, command: Command) -> None:
        partition = self._partition(command.instance_id)
        try:
            await self._producer.send_and_wait(
                self._topics.commands,
                self._serde.encode(command),
                key=command.instance_id.encode(),
                partition=partition,
            )
        except KafkaError as exc:
            raise ConnectionFailed(
                f"cannot publish {command.type} for instance {command.instance_id} to "
                f"{self._topics.commands}: {exc}; check the brokers, then retry"
            ) from None

        async def ask(api: _WorkerApi, remaining: float | None) -> str | None:
            assert remaining is not None
            return await api.settled(command.command_id, command.instance_id, remaining)

        try:
            reason = await self._routed(
                partition, ask, self._command_timeout, f"{command.type} for {command.instance_id}"
            )
        except (ConnectionFailed, ResultTimeout) as exc:
            raise ConnectionFailed(
                f"{command.type} for instance {command.instance_id} was published but no "
                f"worker confirmed it within {self._command_timeout} s ({exc}); it will be "
                "applied once a worker owns its partition: check `stepstream status`"
            ) from None
        self._settlements.settle(command.command_id, reason)

    async def _check_exists(self, instance_id: str) -> None:
        """No round trip before publishing: the owner settles a command for an unknown
        instance as a dead letter (UnknownInstance) and one for a finished instance as
        recorded and ignored (InstanceFinished), and ``_submit`` raises either."""

    # ---- reads ----------------------------------------------------------------------------

    async def status(self, instance_id: str) -> InstanceStatus:
        async def ask(api: _WorkerApi, _: float | None) -> InstanceStatus:
            return await api.status(instance_id)

        return await self._routed(
            self._partition(instance_id), ask, self._request_timeout, f"status of {instance_id}"
        )

    async def result(self, instance_id: str, timeout: float | None) -> Any:
        async def ask(api: _WorkerApi, remaining: float | None) -> Any:
            return await api.result(instance_id, remaining)

        def expired() -> ResultTimeout:
            return ResultTimeout(
                f"instance {instance_id} did not finish within {timeout} s; it is still "
                "running: check `stepstream status` and wait again"
            )

        return await self._routed(
            self._partition(instance_id), ask, timeout, f"result of {instance_id}", expired
        )

    async def reply(self, instance_id: str, message_id: str, timeout: float | None) -> Any:
        async def ask(api: _WorkerApi, remaining: float | None) -> Any:
            return await api.reply(instance_id, message_id, remaining)

        def expired() -> ResultTimeout:
            return ResultTimeout(
                f"instance {instance_id} did not answer message {message_id} within {timeout} "
                "s; the message is queued there: wait again, or check `stepstream status`"
            )

        return await self._routed(
            self._partition(instance_id), ask, timeout, f"reply of {instance_id}", expired
        )

    async def history(self, instance_id: str) -> list[HistoryEntry]:
        async def ask(api: _WorkerApi, _: float | None) -> list[HistoryEntry]:
            return await api.history(instance_id)

        return await self._routed(
            self._partition(instance_id), ask, self._request_timeout, f"history of {instance_id}"
        )

    async def list(self, status: str | None) -> list[InstanceStatus]:
        """Every owner's instances (each worker lists the partitions it owns)."""

        async def ask(api: _WorkerApi) -> list[InstanceStatus]:
            return await api.list(status)

        answers = await self._every_worker(ask, "list instances")
        merged = {view.instance_id: view for answer in answers for view in answer}
        return sorted(merged.values(), key=lambda v: (v.created_at, v.instance_id))

    async def list_page(self, query: ListQuery) -> InstancePage:
        """One page merged from every worker's page of the partitions it owns."""

        async def ask(api: _WorkerApi) -> InstancePage:
            return await api.list_page(query)

        return merge_pages(await self._every_worker(ask, "list instances"), query.limit)

    async def overview(self) -> Overview:
        async def ask(api: _WorkerApi) -> Overview:
            return await api.overview()

        return merge_overviews(await self._every_worker(ask, "read the overview"))

    async def _every_worker(
        self, call: Callable[[_WorkerApi], Awaitable[T]], what: str
    ) -> Sequence[T]:
        """``call`` every live worker once every partition has one; again while some
        cannot be reached, until the request timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._request_timeout
        problem = ""
        while loop.time() < deadline:
            orphans = [p for p in range(self._partitions) if self._members.owner(p) is None]
            members = self._members.live()
            if orphans:
                problem = f"partitions {orphans} have no worker"
            else:
                answers = await asyncio.gather(
                    *(call(self._api(m.url)) for m in members), return_exceptions=True
                )
                failed = [a for a in answers if isinstance(a, BaseException)]
                if not failed:
                    return [a for a in answers if not isinstance(a, BaseException)]
                if not all(isinstance(a, ConnectionFailed) for a in failed):
                    raise failed[0]
                problem = str(failed[0])
            await self._members.changed(min(_RETRY_S, max(deadline - loop.time(), 0)))
        raise ConnectionFailed(
            f"cannot {what}: {problem}; is every worker of prefix {self._topics.prefix!r} running?"
        )

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self._producer.stop()
        await self._members.close()
        for api in self._apis.values():
            await api.close()
        await self._session.close()

    # ---- routing --------------------------------------------------------------------------

    def _partition(self, instance_id: str) -> int:
        return partition_for(instance_id, self._partitions)

    def _api(self, url: str) -> _WorkerApi:
        api = self._apis.get(url)
        if api is None:
            api = self._apis[url] = _WorkerApi(
                url, self._session, request_timeout=self._request_timeout
            )
        return api

    async def _routed(
        self,
        partition: int,
        call: Callable[[_WorkerApi, float | None], Awaitable[T]],
        timeout: float | None,
        what: str,
        expired: Callable[[], StepstreamError] | None = None,
    ) -> T:
        """``call`` the owner of ``partition``; ask again, of the new owner, when the owner
        moves or cannot be reached, until ``timeout`` seconds have passed (then raise
        ``expired()``, or ``ConnectionFailed``)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        problem = "no worker owns it"
        while True:
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                if expired is not None:
                    raise expired()
                raise ConnectionFailed(
                    f"{what}: the owner of partition {partition} did not answer within "
                    f"{timeout} s ({problem}); is a worker of prefix {self._topics.prefix!r} "
                    "running?"
                )
            owner = self._members.owner(partition)
            if owner is None:
                await self._members.changed(
                    _RETRY_S if remaining is None else min(remaining, _RETRY_S)
                )
                continue
            request = asyncio.ensure_future(call(self._api(owner.url), remaining))
            # Cancelled by _owners_changed if the partition gets another owner meanwhile.
            self._watched[request] = (partition, owner.worker_id, owner.url)
            try:
                await asyncio.wait((request,), timeout=remaining)
            finally:
                self._watched.pop(request, None)
                if not request.done():
                    request.cancel()
                    with contextlib.suppress(BaseException):
                        await request
            if request.cancelled():
                continue  # the owner moved (or the deadline passed): the loop decides
            try:
                return request.result()
            except ConnectionFailed as exc:
                # Gone, or no longer the owner: let the view catch up, then ask again.
                problem = str(exc)
                wait = _RETRY_S if remaining is None else min(remaining, _RETRY_S)
                await self._members.changed(wait)

    def _owners_changed(self) -> None:
        for request, (partition, worker_id, url) in list(self._watched.items()):
            owner = self._members.owner(partition)
            if owner is None or (owner.worker_id, owner.url) != (worker_id, url):
                request.cancel()


def settings_from_url(url: str, options: dict[str, Any]) -> KafkaSettings:
    """Settings for ``kafka://HOSTS?prefix=P``; takes ``prefix``, ``kafka`` (a dict of
    client properties) and ``kafka_config`` (a config file) out of ``options``."""
    parts = urlsplit(url)
    if parts.scheme != "kafka":
        raise StepstreamError(f"{url!r} is not a kafka://HOST:PORT?prefix=P address")
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    unknown = sorted(set(query) - {"prefix"})
    if unknown:
        raise StepstreamError(
            f"cannot connect to {url!r}: unknown parameters {', '.join(unknown)} (known: prefix)"
        )
    extra = options.pop("kafka", None) or {}
    return KafkaSettings.load(
        parts.netloc or None,
        options.pop("prefix", None) or query.get("prefix"),
        config_file=options.pop("kafka_config", None),
        options=[f"{key}={value}" for key, value in dict(extra).items()],
    )


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
    """``token`` and ``tls_ca``: for the workers' HTTP APIs (see ``producers.http``)."""
    topics = TopicNames(settings.prefix)
    headers = client_headers(token)
    worker_tls = client_ssl(tls_ca)
    producer_options = aiokafka_options(settings, "producer")
    producer_options.setdefault("max_request_size", max(2 * max_payload_bytes, 1 << 21))
    producer = AIOKafkaProducer(**producer_options, acks="all", enable_idempotence=False)
    try:
        async with asyncio.timeout(_CONNECT_TIMEOUT_S):
            await producer.start()
            # A metadata request naming a topic creates it on brokers that auto-create:
            # ask for all topics, and name ours only once they are known to exist.
            cluster = await producer.client.fetch_all_metadata()
    except (KafkaError, TimeoutError, OSError) as exc:
        with contextlib.suppress(Exception):
            await producer.stop()
        raise ConnectionFailed(
            f"cannot reach Kafka at {settings.bootstrap}: {exc or type(exc).__name__}; check "
            "the address and the security settings"
        ) from None
    members: MembersView | None = None
    try:
        found = cluster.partitions_for_topic(topics.commands)
        missing = [
            name
            for name in (topics.commands, topics.name(MEMBERS))
            if cluster.partitions_for_topic(name) is None
        ]
        if missing or not found:
            raise StepstreamError(
                f"topics {', '.join(missing)} do not exist on {settings.bootstrap}; create "
                f"them with `stepstream topics create --bootstrap {settings.bootstrap} "
                f"--prefix {settings.prefix} --partitions N` and start a worker"
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
        raise
    # Waits are calls on one websocket per worker; requests (lists) are few.
    session = aiohttp.ClientSession(
        headers=headers, connector=aiohttp.TCPConnector(limit=0, ssl=worker_tls)
    )
    return KafkaTransport(
        producer=producer,
        members=members,
        session=session,
        topics=topics,
        partitions=len(found),
        codec=codec or JsonCodec(),
        serde=default_serde(),
        max_payload_bytes=max_payload_bytes,
        request_timeout=request_timeout,
        command_timeout=command_timeout,
    )


register_transport("kafka", _connect)
