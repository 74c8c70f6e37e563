"""A worker's librdkafka lines: a broker that is down does not flood the log."""

from __future__ import annotations

import logging
import uuid

import pytest

from stepstream.consumers.kafka.librdkafka_log import (
    BrokerFailures,
    SameLineLimit,
    quiet_librdkafka,
)

REFUSED = (
    "[thrd:127.0.0.1:9092/bootstrap]: 127.0.0.1:9092/bootstrap: Connect to "
    "ipv4#127.0.0.1:9092 failed: Connection refused (after 0ms in state CONNECT)"
)
OTHER_BROKER = REFUSED.replace("9092", "9093")


def librdkafka_line(logger: logging.Logger, facility: str, client: str, text: str) -> None:
    # What confluent-kafka does with each line of a client given ``"logger": logger``.
    logger.log(logging.ERROR, "%s [%s] %s", facility, client, text)


def test_a_down_broker_is_logged_once_per_client_not_per_reconnect(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = quiet_librdkafka()
    w = f"w-{uuid.uuid4().hex[:8]}"  # the filter is the process's: clients of its own
    with caplog.at_level(logging.INFO, logger=logger.name):
        for _ in range(20):  # ten seconds of reconnects, two clients, two brokers
            librdkafka_line(logger, "FAIL", f"{w}#producer-1", REFUSED)
            librdkafka_line(logger, "FAIL", f"{w}#consumer-2", REFUSED)
            librdkafka_line(logger, "FAIL", f"{w}#producer-1", OTHER_BROKER)
        librdkafka_line(logger, "METADATAUPDATE", f"{w}#producer-1", "leader not found")
        librdkafka_line(logger, "METADATAUPDATE", f"{w}#producer-1", "leader not found")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        f"FAIL [{w}#producer-1] {REFUSED}",
        f"FAIL [{w}#consumer-2] {REFUSED}",
        f"FAIL [{w}#producer-1] {OTHER_BROKER}",
        f"METADATAUPDATE [{w}#producer-1] leader not found",
        f"METADATAUPDATE [{w}#producer-1] leader not found",
    ]
    # Installed once, however many clients ask for the logger.
    assert quiet_librdkafka() is logger
    assert sum(isinstance(f, BrokerFailures) for f in logger.filters) == 1


def test_after_a_minute_the_next_failure_says_how_many_were_not_logged() -> None:
    now = [1000.0]
    throttle = BrokerFailures(every_s=60.0, clock=lambda: now[0])

    def failure() -> logging.LogRecord:
        return logging.LogRecord(
            "stepstream.kafka.librdkafka",
            logging.ERROR,
            __file__,
            1,
            "%s [%s] %s",
            ("FAIL", "w-1#producer-1", REFUSED),
            None,
        )

    assert throttle.filter(failure())
    passed = []
    for _ in range(120):  # two a second for the next minute
        now[0] += 0.5
        record = failure()
        if throttle.filter(record):
            passed.append((now[0], record.getMessage()))
    assert passed == [
        (
            1060.0,
            f"FAIL [w-1#producer-1] {REFUSED} (119 more like it from this client to this "
            "broker not logged since the last one logged, 60 s ago)",
        )
    ]
    # Back after a quiet spell: its first failure is logged as it is.
    now[0] += 3600
    record = failure()
    assert throttle.filter(record)
    assert record.getMessage() == f"FAIL [w-1#producer-1] {REFUSED}"


def test_an_error_queued_many_times_in_one_poll_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """librdkafka hands a client's error callback what queued up while it was not
    polled: nine "all brokers down" at once are one warning; another error, or the same
    one a second later, is logged again."""
    from confluent_kafka import KafkaError

    from stepstream.consumers.kafka.producer import _Errors

    now = [100.0]
    errors = _Errors(None)
    errors._repeats = SameLineLimit(clock=lambda: now[0])
    down = KafkaError(KafkaError._ALL_BROKERS_DOWN, "1/1 brokers are down")
    with caplog.at_level(logging.WARNING, logger="stepstream.kafka.producer"):
        for _ in range(9):
            errors(down)
        errors(KafkaError(KafkaError._TIMED_OUT, "metadata request timed out"))
        errors(down)  # after another error: news again
        now[0] += 1.5
        errors(down)
        errors(down)
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "Kafka producer error: 1/1 brokers are down",
        "Kafka producer error: metadata request timed out",
        "Kafka producer error: 1/1 brokers are down",
        "Kafka producer error: 1/1 brokers are down",
    ], said
