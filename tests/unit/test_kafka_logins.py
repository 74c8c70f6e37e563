"""What a worker logs while Kafka refuses its login: one ERROR line, then one a minute,
never one per reconnect; and a line when it is accepted again (consumers/kafka/logins.py,
exercised end to end on Apache Kafka by tests/integration/test_kafka_credentials.py)."""

from __future__ import annotations

import logging

import pytest
from confluent_kafka import KafkaError

from stepstream.consumers.kafka.logins import REMIND_EVERY_S, LoginWatch

REFUSAL = KafkaError(KafkaError._AUTHENTICATION, "SASL authentication error: invalid credentials")
UP = {"brokers": {"sasl_ssl://k:9093/0": {"state": "UP", "nodeid": 0}}}


def test_one_line_a_minute_while_refused_then_one_when_accepted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    watch = LoginWatch("k:9093", clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="stepstream.kafka.logins")
    for _ in range(int(REMIND_EVERY_S * 3) + 1):  # three reconnects a second for a minute
        assert watch.refused("group", REFUSAL)
        assert watch.refused("producer", REFUSAL)
        now[0] += 1 / 3
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2, [r.getMessage() for r in errors]  # the first, one reminder
    assert "refused this worker's SASL login" in errors[0].getMessage()
    assert "STEPSTREAM_KAFKA_SASL_PASSWORD" in errors[0].getMessage()
    assert watch.failing and watch.refusals_total == 2 * (int(REMIND_EVERY_S * 3) + 1)
    reason = watch.reason()
    assert reason is not None and "not ready" in reason

    assert not watch.refused("group", KafkaError(KafkaError._TRANSPORT, "disconnected"))
    now[0] += 5
    watch.statistics("group", UP)
    assert watch.failing  # the producer has not shown a connection up yet
    watch.statistics("producer", {"brokers": {"b/0": {"state": "AUTH_REQ", "nodeid": 0}}})
    assert watch.failing
    watch.statistics("producer", UP)
    assert not watch.failing and watch.reason() is None and watch.refused_for() == 0
    accepted = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(accepted) == 1 and "accepts this worker's login again" in accepted[0]


def test_a_connection_up_right_after_a_refusal_is_not_yet_a_recovery() -> None:
    now = [0.0]
    watch = LoginWatch("k:9093", clock=lambda: now[0])
    watch.refused("group", REFUSAL)
    now[0] += 0.5  # another broker's connection, not re-authenticated yet
    watch.statistics("group", UP)
    assert watch.failing
