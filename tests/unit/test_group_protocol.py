"""The consumer group protocol a worker's group members speak: classic by default,
KIP-848's ``consumer`` when the user's properties say so, with the settings librdkafka
accepts for each (a client is made from them, offline), and a worker that refuses them
before it does anything else."""

from __future__ import annotations

from pathlib import Path

import pytest
from confluent_kafka import Consumer

from stepstream.consumers.kafka.group import CONSUMER_DEFAULTS, CONSUMER_REQUIRED
from stepstream.consumers.kafka.group_protocol import member_config
from stepstream.engine.config.kafka import KafkaSettings, KafkaSettingsError
from tests.dev_server import run_cli


def config(*options: str, environ: dict[str, str] | None = None) -> dict[str, object]:
    settings = KafkaSettings.load("127.0.0.1:1", "shop", options=options, environ=environ or {})
    return member_config(
        settings, CONSUMER_DEFAULTS, {**CONSUMER_REQUIRED, "group.id": "shop.workers"}
    )


def made(built: dict[str, object]) -> None:
    Consumer({**built, "log_level": 0}).close()  # librdkafka accepts it


def test_classic_by_default_with_the_cooperative_assignor() -> None:
    built = config()
    assert built["group.protocol"] == "classic"
    assert built["partition.assignment.strategy"] == "cooperative-sticky"
    assert built["session.timeout.ms"] == CONSUMER_DEFAULTS["session.timeout.ms"]
    made(built)


@pytest.mark.parametrize(
    ("options", "environ"),
    [(("group.protocol=consumer",), {}), ((), {"STEPSTREAM_KAFKA_GROUP_PROTOCOL": "consumer"})],
)
def test_the_consumer_protocol_drops_the_classic_settings(
    options: tuple[str, ...], environ: dict[str, str]
) -> None:
    built = config(*options, environ=environ)
    assert built["group.protocol"] == "consumer"
    for key in ("partition.assignment.strategy", "session.timeout.ms", "heartbeat.interval.ms"):
        assert key not in built
    made(built)
    made(config("group.protocol=consumer", "consumer.group.remote.assignor=range"))


def test_a_classic_setting_given_with_the_consumer_protocol_names_the_broker_setting() -> None:
    with pytest.raises(KafkaSettingsError) as raised:
        config("group.protocol=consumer", "session.timeout.ms=2000")
    assert "group.consumer.session.timeout.ms" in str(raised.value)
    with pytest.raises(KafkaSettingsError) as raised:
        config("group.protocol=consumer", "partition.assignment.strategy=range")
    assert "group.remote.assignor" in str(raised.value)


def test_an_unknown_protocol_is_refused() -> None:
    with pytest.raises(KafkaSettingsError, match=r"classic .* or consumer"):
        config("group.protocol=eager")


def test_a_worker_refuses_a_classic_setting_before_it_touches_anything(tmp_path: Path) -> None:
    """The refusal comes first: no broker is asked (there is none at the address), no
    state directory is made, nothing is registered on the definitions topic."""
    (tmp_path / "flows.py").write_text(
        "from stepstream import workflow\n\n@workflow('w')\nasync def w(ctx, x):\n    return x\n"
    )
    state = tmp_path / "state"
    done = run_cli(
        tmp_path,
        *("worker", "--workflows", "flows", "--bootstrap", "127.0.0.1:9", "--port", "0"),
        *("--state-dir", str(state), "--kafka-opt", "group.protocol=consumer"),
        *("--kafka-opt", "session.timeout.ms=5000"),
    )
    assert done.returncode == 1, done.stderr
    assert "session.timeout.ms (the broker sets it" in done.stderr, done.stderr
    assert not state.exists()
