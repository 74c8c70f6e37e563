"""What the group consumer's statistics say about reaching Kafka (a worker's /readyz)."""

from __future__ import annotations

import json

from stepstream.consumers.kafka.group_stats import UNREACHABLE_SAMPLES, GroupStatistics


def stats(*states: str) -> str:
    brokers = {f"127.0.0.1:{9092 + i}/{i}": {"state": s} for i, s in enumerate(states)}
    return json.dumps({"brokers": brokers, "cgrp": {"state": "up", "join_state": "init"}})


def test_a_start_passing_through_handshakes_is_not_called_unreachable() -> None:
    heard = GroupStatistics({}, None)
    for state in ("CONNECT", "SSL_HANDSHAKE", "AUTH_REQ", "APIVERSION_QUERY"):
        heard.heard(stats(state))
    heard.heard(stats("UP"))
    assert heard.unreachable_since is None


def test_no_broker_up_for_a_while_is_unreachable_until_one_is() -> None:
    heard = GroupStatistics({}, None)
    for _ in range(UNREACHABLE_SAMPLES - 1):
        heard.heard(stats("DOWN", "CONNECT"))
    assert heard.unreachable_since is None  # not yet: a start can look like this
    heard.heard(stats("DOWN", "TRY_CONNECT"))
    assert heard.unreachable_since is not None
    heard.heard(stats("DOWN", "UPDATE"))  # an UP broker refreshing its metadata
    assert heard.unreachable_since is None
