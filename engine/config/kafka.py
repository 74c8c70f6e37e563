"""Kafka connection settings: where the cluster is, the topic prefix, and the client
properties (security, timeouts, tuning) that every producer, consumer and admin client
stepstream makes must carry.

Properties use librdkafka names (``security.protocol``, ``sasl.mechanism``,
``ssl.ca.location``...). They come from, lowest precedence first: a config file of
``key=value`` lines, ``STEPSTREAM_KAFKA_<NAME>`` environment variables (``NAME`` upper
case with ``_`` for ``.``: ``STEPSTREAM_KAFKA_SECURITY_PROTOCOL=SASL_SSL``), and
``key=value`` options (the CLI's repeated ``--kafka-opt``). A plain key reaches every
client; ``producer.``, ``consumer.`` or ``admin.`` in front of a key sends it to that kind
of client only (``consumer.fetch.wait.max.ms=20``); a plain key that only consumers (or
only producers) read goes to those alone.

Pure data: nothing here imports a Kafka client library.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from stepstream.engine.errors import StepstreamError
from stepstream.engine.wire.topics import DEFAULT_PREFIX

ENV_PREFIX = "STEPSTREAM_KAFKA_"
# Not a client property: the path of a config file.
ENV_CONFIG_FILE = "STEPSTREAM_KAFKA_CONFIG"
ENV_TOPIC_PREFIX = "STEPSTREAM_PREFIX"
BOOTSTRAP = "bootstrap.servers"

ClientKind = Literal["producer", "consumer", "admin"]
CLIENT_KINDS: tuple[ClientKind, ...] = ("producer", "consumer", "admin")

# librdkafka properties that only one kind of client reads (its CONFIGURATION.md scope
# C or P). A plain key of these reaches only that kind: librdkafka warns about the rest.
CONSUMER_ONLY = frozenset(
    {
        "group.id",
        "group.instance.id",
        "group.protocol",
        "group.protocol.type",
        "group.remote.assignor",
        "partition.assignment.strategy",
        "session.timeout.ms",
        "heartbeat.interval.ms",
        "coordinator.query.interval.ms",
        "max.poll.interval.ms",
        "enable.auto.commit",
        "auto.commit.interval.ms",
        "enable.auto.offset.store",
        "queued.min.messages",
        "queued.max.messages.kbytes",
        "fetch.wait.max.ms",
        "fetch.queue.backoff.ms",
        "fetch.message.max.bytes",
        "max.partition.fetch.bytes",
        "fetch.max.bytes",
        "fetch.min.bytes",
        "fetch.error.backoff.ms",
        "isolation.level",
        "enable.partition.eof",
        "check.crcs",
        "auto.offset.reset",
    }
)
PRODUCER_ONLY = frozenset(
    {
        "transactional.id",
        "transaction.timeout.ms",
        "enable.idempotence",
        "enable.gapless.guarantee",
        "queue.buffering.max.messages",
        "queue.buffering.max.kbytes",
        "queue.buffering.max.ms",
        "linger.ms",
        "message.send.max.retries",
        "retries",
        "queue.buffering.backpressure.threshold",
        "compression.codec",
        "compression.type",
        "compression.level",
        "batch.num.messages",
        "batch.size",
        "delivery.report.only.error",
        "sticky.partitioning.linger.ms",
        "request.required.acks",
        "acks",
        "request.timeout.ms",
        "message.timeout.ms",
        "delivery.timeout.ms",
        "partitioner",
    }
)
_ONLY_FOR: dict[str, frozenset[str]] = {
    "producer": CONSUMER_ONLY,
    "consumer": PRODUCER_ONLY,
    "admin": CONSUMER_ONLY | PRODUCER_ONLY,
}


class KafkaSettingsError(StepstreamError):
    """A Kafka setting is malformed or missing."""


class KafkaAuthenticationFailed(KafkaSettingsError):
    """The cluster refused the client: its SASL login failed (a wrong user, password or
    mechanism), or the TLS handshake did (a CA that did not sign the brokers'
    certificates, a listener that speaks another protocol). Trying again changes nothing:
    the message names the settings to check."""


# Where a client's properties come from, for messages that name a setting to fix.
_SOURCES = (
    f"{ENV_PREFIX}* variables, --kafka-opt, the --kafka-config file, or "
    "Client.connect(..., kafka={...})"
)


def authentication_failed(bootstrap: str, reason: str, *, tls: bool) -> KafkaAuthenticationFailed:
    """The error for a refused SASL login (``tls`` False) or a failed TLS handshake, with
    the client library's ``reason`` (which never holds the password)."""
    if tls:
        return KafkaAuthenticationFailed(
            f"TLS with Kafka at {bootstrap} failed: {reason}. Check ssl.ca.location "
            f"({ENV_PREFIX}SSL_CA_LOCATION): the CA certificate (PEM) that signed the "
            "brokers' certificates; and security.protocol (SSL or SASL_SSL, as the "
            f"listener expects). Set them with {_SOURCES}"
        )
    return KafkaAuthenticationFailed(
        f"Kafka at {bootstrap} refused the SASL login: {reason}. Check sasl.username and "
        f"sasl.password ({ENV_PREFIX}SASL_USERNAME, {ENV_PREFIX}SASL_PASSWORD) and "
        f"sasl.mechanism ({ENV_PREFIX}SASL_MECHANISM: the broker's, e.g. SCRAM-SHA-512). "
        f"Set them with {_SOURCES}"
    )


# What Kafka takes in a topic name, and how long a prefix leaves room for the longest of
# its topics' names (``<prefix>.dead-letters``) within Kafka's 249 characters.
_TOPIC_CHARS = re.compile(r"[A-Za-z0-9._-]+")
MAX_PREFIX_CHARS = 249 - len(".dead-letters")
# The listener protocols librdkafka takes in front of a bootstrap server.
_LISTENER_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")


def _server_problem(server: str) -> str | None:
    """Why ``server`` is not a bootstrap server ``[PROTOCOL://]HOST[:PORT]``, or None."""
    scheme, sep, rest = server.partition("://")
    if sep and scheme.upper() not in _LISTENER_PROTOCOLS:
        return (
            f"is a {scheme}:// URL (a client's address for Client.connect and --connect, "
            "with ?prefix=), not a broker's"
        )
    host, colon, port = (rest if sep else server).rpartition(":")
    if colon and not port.isdigit() and not host.endswith(":"):  # not an IPv6 address
        return f"has the port {port!r}, which is not a number"
    return None


@dataclass(frozen=True)
class KafkaSettings:
    """``properties`` holds user-given client properties by librdkafka name, scoped ones
    with their ``producer.``/``consumer.``/``admin.`` prefix kept."""

    bootstrap: str
    prefix: str = DEFAULT_PREFIX
    properties: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.bootstrap:
            raise KafkaSettingsError(
                "no Kafka bootstrap servers: pass --bootstrap HOST:PORT (or "
                f"{ENV_PREFIX}BOOTSTRAP_SERVERS, or bootstrap.servers in the config file)"
            )
        if not self.prefix or not _TOPIC_CHARS.fullmatch(self.prefix):
            raise KafkaSettingsError(
                f"topic prefix {self.prefix!r} must be non-empty, of letters, digits, '.', "
                "'_' and '-' only (what Kafka takes in a topic name)"
            )
        if len(self.prefix) > MAX_PREFIX_CHARS:
            raise KafkaSettingsError(
                f"topic prefix {self.prefix!r} is {len(self.prefix)} characters long; the "
                f"limit is {MAX_PREFIX_CHARS} (Kafka's 249 for a topic name, less "
                "'.dead-letters')"
            )
        for server in filter(None, self.bootstrap.split(",")):
            problem = _server_problem(server.strip())
            if problem is not None:
                raise KafkaSettingsError(
                    f"bootstrap server {server.strip()!r} {problem}: give HOST:PORT (several "
                    "separated by commas), for example --bootstrap 127.0.0.1:9092"
                )

    @classmethod
    def load(
        cls,
        bootstrap: str | None = None,
        prefix: str | None = None,
        *,
        config_file: str | os.PathLike[str] | None = None,
        options: Iterable[str] = (),
        environ: Mapping[str, str] | None = None,
    ) -> KafkaSettings:
        """Settings from every source; ``bootstrap``/``prefix`` arguments win over the
        properties, ``options`` (``key=value`` strings) over the environment, and the
        environment over the file (``config_file`` or ``$STEPSTREAM_KAFKA_CONFIG``)."""
        env = os.environ if environ is None else environ
        properties: dict[str, str] = {}
        path = config_file if config_file is not None else env.get(ENV_CONFIG_FILE)
        if path:
            properties.update(read_config_file(path))
        properties.update(properties_from_env(env))
        for option in options:
            key, value = parse_property(option, where="--kafka-opt")
            properties[key] = value
        servers = bootstrap or properties.pop(BOOTSTRAP, "")
        properties.pop(BOOTSTRAP, None)
        if prefix is None:  # given, even as "": checked as given (a script's unset $PREFIX)
            prefix = env.get(ENV_TOPIC_PREFIX) or DEFAULT_PREFIX  # an empty variable: unset
        return cls(servers, prefix, properties)

    def client_config(
        self,
        kind: ClientKind,
        defaults: Mapping[str, object] | None = None,
        required: Mapping[str, object] | None = None,
    ) -> dict[str, object]:
        """The configuration of one client: ``defaults`` (stepstream's tuning), then the
        user's properties for every client, then those scoped to ``kind``, then
        ``required`` (what stepstream's correctness depends on; the user cannot change it).
        """
        config: dict[str, object] = {BOOTSTRAP: self.bootstrap, **(defaults or {})}
        foreign = _ONLY_FOR[kind]
        config.update({k: v for k, v in self.shared_properties().items() if k not in foreign})
        scope = f"{kind}."
        config.update(
            {
                key[len(scope) :]: value
                for key, value in self.properties.items()
                if key.startswith(scope)
            }
        )
        config.update(required or {})
        return config

    def shared_properties(self) -> dict[str, str]:
        """The user's properties that apply to every client."""
        scoped = tuple(f"{kind}." for kind in CLIENT_KINDS)
        return {k: v for k, v in self.properties.items() if not k.startswith(scoped)}


def parse_property(text: str, *, where: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise KafkaSettingsError(
            f"{where}: expected key=value with a librdkafka property name, got {text!r} "
            "(e.g. security.protocol=SASL_SSL)"
        )
    return key, value.strip()


def read_config_file(path: str | os.PathLike[str]) -> dict[str, str]:
    """``key=value`` lines; blank lines and lines starting with ``#`` are skipped."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise KafkaSettingsError(
            f"cannot read Kafka config file {os.fspath(path)}: {exc.strerror or exc}"
        ) from None
    properties: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        key, value = parse_property(stripped, where=f"{os.fspath(path)} line {number}")
        properties[key] = value
    return properties


def properties_from_env(environ: Mapping[str, str]) -> dict[str, str]:
    """``STEPSTREAM_KAFKA_SASL_MECHANISM=PLAIN`` -> ``{"sasl.mechanism": "PLAIN"}``."""
    properties: dict[str, str] = {}
    for name, value in environ.items():
        if name.startswith(ENV_PREFIX) and name != ENV_CONFIG_FILE:
            key = name[len(ENV_PREFIX) :].lower().replace("_", ".")
            if key:
                properties[key] = value
    return properties
