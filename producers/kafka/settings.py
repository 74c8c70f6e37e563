"""Kafka client properties for the ``kafka://`` client: ``kafka://`` URLs to
``KafkaSettings``, and librdkafka property names (how every stepstream component is
configured) to aiokafka's keyword arguments. A security property that cannot be mapped is
refused rather than silently dropped."""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable, Mapping
from typing import Any, Literal
from urllib.parse import parse_qs, urlsplit

from aiokafka.helpers import create_ssl_context

from stepstream.engine.config.kafka import (
    BOOTSTRAP,
    CLIENT_KINDS,
    KafkaSettings,
    KafkaSettingsError,
)
from stepstream.engine.errors import StepstreamError

log = logging.getLogger("stepstream.kafka.client")

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
    "batch.size": ("max_batch_size", int, frozenset({"producer"})),
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


# Not a librdkafka property: set after the one checked, so that librdkafka refuses the
# configuration before it would make a client of it.
_SENTINEL = "stepstream.property.check"


def check_properties(settings: KafkaSettings) -> None:
    """Refuse what librdkafka (the workers' client) would refuse, in any client's scope:
    a name it does not know (aiokafka has no use for most properties, so a misspelling
    would otherwise be dropped without a word) or a value it cannot take."""
    scopes = tuple(f"{kind}." for kind in CLIENT_KINDS)
    for key, value in settings.properties.items():
        name = key.split(".", 1)[1] if key.startswith(scopes) else key
        if name != BOOTSTRAP:
            _check_property(key, name, str(value))


def _check_property(key: str, name: str, value: str) -> None:
    # The value is never quoted back: it may be a secret.
    from confluent_kafka import KafkaException, Producer

    try:
        Producer({name: value, _SENTINEL: ""})  # a client is made only if both are known
    except KafkaException as exc:
        reason = exc.args[0].str() if exc.args else str(exc)
        if _SENTINEL not in reason:
            raise KafkaSettingsError(
                f"Kafka property {key} is refused: {reason}. Properties take librdkafka's "
                "names and values (its CONFIGURATION.md), as the workers' do: check the "
                "client's kafka options, the config file and the STEPSTREAM_KAFKA_* variables"
            ) from None
    except (TypeError, ValueError):
        return  # a value only confluent-kafka's own code looks at (a callback): not ours


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


def settings_from_url(url: str, options: dict[str, Any]) -> KafkaSettings:
    """Settings for ``kafka://HOSTS?prefix=P``; takes ``prefix``, ``kafka`` (a dict of
    client properties) and ``kafka_config`` (a config file) out of ``options``."""
    parts = urlsplit(url)
    if parts.scheme != "kafka":
        raise StepstreamError(f"{url!r} is not a kafka://HOST:PORT?prefix=P address")
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    if parts.path.strip("/"):
        # kafka://HOST:PORT/shop reads as a prefix, but the prefix is a parameter: taken
        # silently, the path would leave the default prefix, and the wrong topics.
        raise StepstreamError(
            f"cannot connect to {url!r}: a kafka:// address has no path; give the topic "
            f"prefix as a parameter: kafka://{parts.netloc}?prefix={parts.path.strip('/')}"
        )
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
