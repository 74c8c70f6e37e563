"""Kafka client settings: a property from each source (config file, STEPSTREAM_KAFKA_*
variable, --kafka-opt) reaches every client the worker and the kafka:// client make."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stepstream.consumers.kafka import admin, group, producer, restore
from stepstream.engine.config.kafka import KafkaSettings, KafkaSettingsError
from stepstream.producers import kafka as kafka_client

REPO = Path(__file__).resolve().parents[2]

SECURE = {
    "security.protocol": "SASL_SSL",  # from the environment
    "sasl.mechanism": "SCRAM-SHA-256",  # from the file
    "sasl.username": "ada",  # from an option
    "sasl.password": "s3cret",  # from an option
    "ssl.ca.location": "/etc/ssl/our-ca.pem",  # from the file
}


@pytest.fixture
def secure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> KafkaSettings:
    config = tmp_path / "client.properties"
    config.write_text(
        "# cluster credentials\n"
        "sasl.mechanism=SCRAM-SHA-256\n"
        "ssl.ca.location = /etc/ssl/our-ca.pem\n"
        "\n"
        "sasl.username=overridden-below\n"
        "consumer.fetch.wait.max.ms=20\n"
    )
    monkeypatch.setenv("STEPSTREAM_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("STEPSTREAM_KAFKA_PRODUCER_LINGER_MS", "3")
    monkeypatch.setenv("STEPSTREAM_KAFKA_SESSION_TIMEOUT_MS", "7000")
    return KafkaSettings.load(
        "broker-1:9093,broker-2:9093",
        "orders",
        config_file=config,
        options=["sasl.username=ada", "sasl.password=s3cret"],
    )


def test_precedence_and_scopes(secure: KafkaSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    assert secure.bootstrap == "broker-1:9093,broker-2:9093"
    assert secure.prefix == "orders"
    for kind in ("producer", "consumer", "admin"):
        config = secure.client_config(kind)
        assert {k: config[k] for k in SECURE} == SECURE, kind
        assert config["bootstrap.servers"] == "broker-1:9093,broker-2:9093"
    consumer = secure.client_config("consumer")
    producer_config = secure.client_config("producer")
    assert consumer["fetch.wait.max.ms"] == "20" and "fetch.wait.max.ms" not in producer_config
    assert producer_config["linger.ms"] == "3" and "linger.ms" not in consumer
    # A consumer-only property given plainly goes to consumers only (librdkafka warns
    # about properties a client does not read).
    assert consumer["session.timeout.ms"] == "7000"
    assert "session.timeout.ms" not in producer_config
    assert "session.timeout.ms" not in secure.client_config("admin")
    # What stepstream needs for correctness wins over the user.
    pinned = secure.client_config("consumer", {"fetch.min.bytes": 1}, {"enable.auto.commit": False})
    assert pinned["enable.auto.commit"] is False

    monkeypatch.setenv("STEPSTREAM_KAFKA_BOOTSTRAP_SERVERS", "from-env:9092")
    monkeypatch.setenv("STEPSTREAM_PREFIX", "env-prefix")
    from_env = KafkaSettings.load()
    assert (from_env.bootstrap, from_env.prefix) == ("from-env:9092", "env-prefix")


def test_malformed_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(KafkaSettingsError, match="expected key=value"):
        KafkaSettings.load("b:9092", options=["security.protocol"], environ={})
    bad = tmp_path / "bad.properties"
    bad.write_text("ok=1\nnot a property\n")
    with pytest.raises(KafkaSettingsError, match="line 2"):
        KafkaSettings.load("b:9092", config_file=bad, environ={})
    with pytest.raises(KafkaSettingsError, match="no Kafka bootstrap servers"):
        KafkaSettings.load(environ={})
    with pytest.raises(KafkaSettingsError, match="cannot read Kafka config file"):
        KafkaSettings.load("b:9092", config_file=tmp_path / "missing", environ={})


class _Recorder:
    """Stands in for a client class: records the configuration it was made with."""

    def __init__(self) -> None:
        self.configs: list[dict[str, Any]] = []

    def __call__(self, config: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        self.configs.append(dict(config or kwargs))
        recorder = self

        class Client:
            def __getattr__(self, name: str) -> Any:
                def call(*args: Any, **kwargs: Any) -> Any:
                    if name in ("subscribe", "list_topics"):
                        raise RuntimeError(f"recorded {recorder}")
                    return None

                return call

        return Client()


def test_every_worker_client_gets_every_setting(
    secure: KafkaSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: dict[str, _Recorder] = {}
    for module, name in (
        (producer, "Producer"),
        (group, "Consumer"),
        (restore, "Consumer"),
        (admin, "AdminClient"),
    ):
        made[f"{module.__name__}.{name}"] = recorder = _Recorder()
        monkeypatch.setattr(module, name, recorder)

    log_producer = producer.LogProducer(secure)
    log_producer.close(timeout=0)
    restore.HistoryReader(secure)
    failures: list[BaseException] = []
    group.GroupConsumer(
        secure,
        on_assign=None,  # type: ignore[arg-type]
        on_revoke=None,  # type: ignore[arg-type]
        on_fatal=failures.append,
    )._run()  # the poll thread's body: makes the consumer, which fails to subscribe
    with pytest.raises(Exception, match="recorded"):
        admin.existing_partitions(secure)

    for client, recorder in made.items():
        [config] = recorder.configs
        assert {k: config[k] for k in SECURE} == SECURE, client
        assert config["bootstrap.servers"] == secure.bootstrap, client
    assert (
        made["stepstream.consumers.kafka.group.Consumer"].configs[0]["group.id"] == "orders.workers"
    )
    assert made["stepstream.consumers.kafka.group.Consumer"].configs[0]["fetch.wait.max.ms"] == "20"
    assert made["stepstream.consumers.kafka.producer.Producer"].configs[0]["linger.ms"] == "3"


async def _open_kafka_client(
    settings: KafkaSettings, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The keyword arguments of the aiokafka clients and SSL contexts a kafka:// client
    makes for ``settings`` (it stops at its first consumer)."""
    contexts: list[dict[str, Any]] = []

    def fake_context(**kwargs: Any) -> Any:
        contexts.append(kwargs)
        import ssl

        return ssl.create_default_context()

    made: list[dict[str, Any]] = []

    class FakeProducer:
        def __init__(self, **kwargs: Any) -> None:
            made.append({"client": "producer", **kwargs})
            self.client = self

        async def start(self) -> None:
            pass

        async def stop(self) -> None:
            pass

        async def fetch_all_metadata(self) -> Any:
            return self

        def partitions_for_topic(self, topic: str) -> set[int]:
            return {0, 1}

    class FakeConsumer:
        def __init__(self, **kwargs: Any) -> None:
            made.append({"client": "consumer", **kwargs})

        async def start(self) -> None:
            raise RuntimeError("recorded")

        async def stop(self) -> None:
            pass

    monkeypatch.setattr("stepstream.producers.kafka.settings.create_ssl_context", fake_context)
    monkeypatch.setattr("stepstream.producers.kafka.connect.AIOKafkaProducer", FakeProducer)
    monkeypatch.setattr("stepstream.producers.kafka.follower.AIOKafkaConsumer", FakeConsumer)
    with pytest.raises(RuntimeError, match="recorded"):
        await kafka_client.open_kafka_transport(settings)
    return made, contexts


async def test_the_kafka_client_maps_settings_to_aiokafka(
    secure: KafkaSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    made, contexts = await _open_kafka_client(secure, monkeypatch)

    assert [m["client"] for m in made] == ["producer", "consumer"]
    for kwargs in made:
        assert kwargs["bootstrap_servers"] == ["broker-1:9093", "broker-2:9093"]
        assert kwargs["security_protocol"] == "SASL_SSL"
        assert kwargs["sasl_mechanism"] == "SCRAM-SHA-256"
        assert kwargs["sasl_plain_username"] == "ada"
        assert kwargs["sasl_plain_password"] == "s3cret"
        assert kwargs["ssl_context"] is not None
    assert made[0]["linger_ms"] == 3 and made[0]["acks"] == "all"
    assert made[0]["enable_idempotence"] is False
    assert [c["cafile"] for c in contexts] == ["/etc/ssl/our-ca.pem"] * 2


@pytest.mark.parametrize(
    ("properties", "batch", "request_size"),
    [
        ({}, 1 << 20, 1 << 21),  # many starts at once share a batch per partition
        ({"producer.message.max.bytes": "300000"}, 300_000, 300_000),  # never above a request
        ({"producer.batch.size": "65536"}, 65_536, 1 << 21),  # the user's own
    ],
)
async def test_the_kafka_client_batches_many_commands_per_request(
    properties: dict[str, str], batch: int, request_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = KafkaSettings("localhost:9092", "orders", properties)
    made, _ = await _open_kafka_client(settings, monkeypatch)
    assert made[0]["max_batch_size"] == batch
    assert made[0]["max_request_size"] == request_size


def test_unmappable_security_settings_are_refused() -> None:
    settings = KafkaSettings.load(
        "b:9092", options=["security.protocol=SASL_SSL", "sasl.oauthbearer.method=oidc"], environ={}
    )
    with pytest.raises(KafkaSettingsError, match=r"sasl\.oauthbearer\.method is not supported"):
        kafka_client.aiokafka_options(settings, "producer")
    plaintext_ssl = KafkaSettings.load("b:9092", options=["ssl.ca.location=/x"], environ={})
    with pytest.raises(KafkaSettingsError, match=r"security\.protocol is PLAINTEXT"):
        kafka_client.aiokafka_options(plaintext_ssl, "producer")


@pytest.mark.parametrize(
    ("properties", "refused"),
    [
        ({"lingr.ms": "5"}, r'lingr\.ms is refused: No such configuration property: "lingr\.ms"'),
        # A scoped key is checked too, though only the consumer of the workers would read it.
        ({"consumer.fetch.wait.mx.ms": "5"}, r"consumer\.fetch\.wait\.mx\.ms is refused"),
        ({"sasl.password": "s3cret", "linger.ms": "soon"}, r"linger\.ms is refused: Invalid"),
    ],
)
async def test_the_kafka_client_refuses_what_librdkafka_refuses(
    properties: dict[str, str], refused: str
) -> None:
    """The workers' client (librdkafka) refuses a misspelt property or a bad value; the
    kafka:// client, which maps what aiokafka can use and leaves the rest to the workers,
    must not drop it without a word. Refused before any connection, naming the property,
    never quoting a value (it may be a secret)."""
    from stepstream import Client

    with pytest.raises(KafkaSettingsError, match=refused) as caught:
        await Client.connect("kafka://127.0.0.1:1?prefix=orders", kafka=properties, timeout=2)
    assert "s3cret" not in str(caught.value) and "soon" not in str(caught.value)


def test_the_kafka_client_passes_what_librdkafka_takes() -> None:
    """Consumer-only and unmapped properties included: the config is the workers' too."""
    from stepstream.producers.kafka.settings import check_properties

    check_properties(
        KafkaSettings(
            "b:9092",
            "orders",
            {"fetch.wait.max.ms": "5", "client.rack": "a", "producer.linger.ms": "2"},
        )
    )


def test_cli_flags_reach_the_settings(tmp_path: Path) -> None:
    """`stepstream topics create` with --kafka-config / --kafka-opt: a wrong protocol
    value from a flag is what librdkafka refuses, so the flag got through."""
    config = tmp_path / "c.properties"
    config.write_text("client.id=from-file\n")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "stepstream.ops.cli",
            "topics",
            "create",
            "--bootstrap",
            "127.0.0.1:1",
            "--partitions",
            "1",
            "--kafka-config",
            str(config),
            "--kafka-opt",
            "security.protocol=NOT_A_PROTOCOL",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode != 0
    assert "security.protocol" in done.stderr and "NOT_A_PROTOCOL" in done.stderr, done.stderr


def test_the_local_brokers_variables_are_not_read_as_client_properties() -> None:
    """Every STEPSTREAM_KAFKA_<NAME> variable is a client property, so the settings of
    `stepstream broker --apache` live under another prefix: with STEPSTREAM_KAFKA_JARS
    set, every client refused an unknown property "jars"."""
    from stepstream.engine.config.kafka import ENV_PREFIX
    from stepstream.ops.brokers import apache, jars

    names = [apache.ENV_JVM_OPTS, jars.ENV_JARS, jars.ENV_VERSION]
    assert not [n for n in names if n.startswith(ENV_PREFIX)], names
    environ = {name: "x" for name in names}
    settings = KafkaSettings.load("127.0.0.1:9092", "p", environ=environ)
    assert settings.client_config("producer", {}, {})["bootstrap.servers"] == "127.0.0.1:9092"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--prefix", ""], "topic prefix '' must be non-empty"),  # a script's unset $PREFIX
        (["--prefix", "shop:eu"], "of letters, digits, '.', '_' and '-' only"),
        (["--prefix", "q" * 237], "237 characters long; the limit is 236"),
        (["--bootstrap", "kafka://127.0.0.1:1"], "is a kafka:// URL (a client's address"),
        (["--bootstrap", "127.0.0.1:port"], "has the port 'port', which is not a number"),
        (["--partitions", "0"], "--partitions must be 1 or more, got 0"),
        (["--replication-factor", "0"], "--replication-factor must be 1 or more, got 0"),
        (["--min-insync", "0"], "--min-insync must be 1 or more, got 0"),
    ],
)
def test_topics_create_refuses_a_wrong_command_line_before_the_cluster(
    args: list[str], says: str
) -> None:
    command = ["topics", "create", "--bootstrap", "127.0.0.1:1", "--partitions", "1", *args]
    done = subprocess.run(
        [sys.executable, "-m", "stepstream.ops.cli", *command],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert says in done.stderr, done.stderr
    assert done.returncode == (2 if says.startswith("--") else 1), done.stderr


def test_an_empty_prefix_variable_means_the_default_and_an_empty_flag_is_refused() -> None:
    from stepstream.engine.config.kafka import KafkaSettings as Settings
    from stepstream.engine.config.kafka import KafkaSettingsError

    assert Settings.load("b:9092", environ={"STEPSTREAM_PREFIX": ""}).prefix == "stepstream"
    with pytest.raises(KafkaSettingsError, match="must be non-empty"):
        Settings.load("b:9092", "", environ={})


@pytest.mark.parametrize(
    ("partitions", "named"),
    [
        ([3], "partition 3"),
        ([0, 1, 2, 3], "partitions 0-3"),
        ([5, 0, 1, 2, 9, 10], "partitions 0-2, 5, 9-10"),
        ([4, 4, 7], "partitions 4, 7"),
    ],
)
def test_partitions_in_one_plight_are_named_as_ranges(partitions: list[int], named: str) -> None:
    from stepstream.producers.kafka.routing import _partitions_named

    assert _partitions_named(partitions) == named


async def test_a_kafka_url_with_a_path_says_the_prefix_is_a_parameter() -> None:
    """kafka://HOST:PORT/shop looks like a prefix; taken silently it would connect to the
    default prefix's topics. It is refused, with the address as it should be."""
    from stepstream import Client, StepstreamError

    with pytest.raises(StepstreamError, match=r"kafka://127\.0\.0\.1:1\?prefix=shop"):
        async with Client.connect("kafka://127.0.0.1:1/shop"):
            pass
