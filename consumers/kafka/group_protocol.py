"""Which consumer group protocol a member of stepstream's groups speaks, and the
settings that go with it.

``group.protocol=classic`` (the default) is the JoinGroup/SyncGroup protocol: the
members assign partitions among themselves (stepstream's workers with the
cooperative-sticky assignor) and the client sets its session timeout and heartbeat.
``group.protocol=consumer`` is KIP-848's protocol (GA in Kafka 4.0, librdkafka 2.10):
the group coordinator on the broker assigns partitions (``group.remote.assignor``,
``uniform`` or ``range``; both sticky), every rebalance is incremental, and the session
timeout and heartbeat interval are the broker's (``group.consumer.session.timeout.ms``,
``group.consumer.heartbeat.interval.ms``, or per group ``consumer.session.timeout.ms``
set with ``kafka-configs --entity-type groups``). librdkafka refuses a consumer that sets
the classic protocol's own properties with the new one, so stepstream's defaults for
them are dropped, and a user's are refused here with what to do instead.

Chosen like any client property: ``--kafka-opt group.protocol=consumer`` or
``STEPSTREAM_KAFKA_GROUP_PROTOCOL=consumer``.
"""

from __future__ import annotations

from collections.abc import Mapping

from stepstream.engine.config.kafka import KafkaSettings, KafkaSettingsError

PROTOCOL = "group.protocol"
CLASSIC = "classic"
CONSUMER = "consumer"
PROTOCOLS = (CLASSIC, CONSUMER)

# Properties of the classic protocol that the consumer protocol keeps on the broker, and
# what to use instead.
CLASSIC_ONLY: dict[str, str] = {
    "partition.assignment.strategy": "the broker assigns partitions: choose its assignor "
    "with group.remote.assignor=uniform|range (both keep what a member has)",
    "session.timeout.ms": "the broker sets it: group.consumer.session.timeout.ms on the "
    "brokers, or consumer.session.timeout.ms on the group (kafka-configs --alter "
    "--entity-type groups)",
    "heartbeat.interval.ms": "the broker sets it: group.consumer.heartbeat.interval.ms on "
    "the brokers, or consumer.heartbeat.interval.ms on the group",
}


def group_protocol(settings: KafkaSettings) -> str:
    """``classic`` or ``consumer``, as the user's properties choose (classic if none)."""
    chosen = settings.client_config("consumer").get(PROTOCOL, CLASSIC)
    value = str(chosen).strip().lower()
    if value not in PROTOCOLS:
        raise KafkaSettingsError(
            f"group.protocol={chosen!r} is not a consumer group protocol: use classic "
            "(the default) or consumer (KIP-848, needs Kafka 4.0+ brokers)"
        )
    return value


def check_member_settings(settings: KafkaSettings) -> None:
    """Refuse (``KafkaSettingsError``) a protocol, or a property of it, that
    ``member_config`` would refuse: a worker checks this before it touches anything (the
    brokers, its state directory, the definitions topic)."""
    member_config(settings, {}, {})


def member_config(
    settings: KafkaSettings,
    defaults: Mapping[str, object],
    required: Mapping[str, object],
) -> dict[str, object]:
    """The configuration of a group member (``KafkaSettings.client_config``) for the
    chosen protocol: with ``consumer``, stepstream's classic-only settings are dropped
    and a user's are refused (``KafkaSettingsError`` naming the broker-side setting)."""
    protocol = group_protocol(settings)
    if protocol == CONSUMER:
        given = settings.client_config("consumer")
        refused = [key for key in CLASSIC_ONLY if key in given]
        if refused:
            raise KafkaSettingsError(
                "with group.protocol=consumer (KIP-848) these client properties do not "
                "exist; remove them: "
                + "; ".join(f"{key} ({CLASSIC_ONLY[key]})" for key in refused)
            )
        defaults = {k: v for k, v in defaults.items() if k not in CLASSIC_ONLY}
        required = {k: v for k, v in required.items() if k not in CLASSIC_ONLY}
    return settings.client_config("consumer", defaults, {**required, PROTOCOL: protocol})
