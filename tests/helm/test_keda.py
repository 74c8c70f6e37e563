"""KEDA autoscaling as the chart renders it: the kafka trigger on the workers' consumer
group and the commands topic, with the workers' own Kafka credentials handed to KEDA
through a TriggerAuthentication (SASL, TLS, mutual TLS, none), and the Prometheus query
as the other choice. Every manifest is checked against KEDA's CRDs."""

from __future__ import annotations

from typing import Any

from tests.helm.chart import (
    Rendered,
    container,
    env_of,
    load_values,
    promql_metrics,
    render,
    render_file,
    validate,
)

HEADLESS = "shop-stepstream-workers"
AUTH = "shop-stepstream-keda-kafka"


def _merge(base: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in more.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _with_keda(values: dict[str, Any] | None = None) -> Rendered:
    rendered = render(_merge(values or {}, {"keda": {"enabled": True}}))
    for manifest in rendered.manifests:
        validate(manifest)
    return rendered


def _trigger(rendered: Rendered) -> dict[str, Any]:
    (trigger,) = rendered.one("ScaledObject")["spec"]["triggers"]
    result: dict[str, Any] = trigger
    return result


def _refs(auth: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {r["parameter"]: (r["name"], r["key"]) for r in auth["spec"].get("secretTargetRef", [])}


def test_keda_scales_the_statefulset_on_the_groups_lag_read_from_kafka() -> None:
    rendered = render_file("values-sasl.yaml")
    scaled = rendered.one("ScaledObject")
    statefulset = rendered.one("StatefulSet")
    target = scaled["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("StatefulSet", statefulset["metadata"]["name"])
    # The HPA owns the count: a replicas field would reset it on every upgrade.
    assert "replicas" not in statefulset["spec"]
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (2, 12)
    trigger = _trigger(rendered)
    assert trigger["type"] == "kafka"
    worker = container(statefulset, "worker")
    prefix = worker["args"][worker["args"].index("--prefix") + 1]
    assert trigger["metadata"] == {
        "bootstrapServers": env_of(worker)["STEPSTREAM_KAFKA_BOOTSTRAP_SERVERS"]["value"],
        # The group and topic the workers use (consumers/kafka/keys.py, topic names).
        "consumerGroup": f"{prefix}.workers",
        "topic": f"{prefix}.commands",
        "lagThreshold": "5000",
        "offsetResetPolicy": "earliest",
        "sasl": "scram_sha512",
        "tls": "enable",
    }
    assert trigger["authenticationRef"] == {"name": AUTH}


def test_sasl_credentials_and_ca_reach_keda_from_the_workers_secrets() -> None:
    rendered = render_file("values-sasl.yaml")
    auth = rendered.named("TriggerAuthentication", AUTH)
    assert _refs(auth) == {
        "username": ("shop-kafka-user", "username"),
        "password": ("shop-kafka-user", "password"),
        "ca": ("shop-kafka-ca", "ca.crt"),
    }
    assert "env" not in auth["spec"]
    worker = env_of(container(rendered.one("StatefulSet"), "worker"))
    assert worker["STEPSTREAM_KAFKA_SASL_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "shop-kafka-user",
        "key": "password",
    }


def test_a_user_name_and_password_given_in_values_reach_keda_without_a_copy() -> None:
    kafka = {
        "securityProtocol": "SASL_PLAINTEXT",
        "sasl": {"mechanism": "SCRAM-SHA-256", "username": "app", "password": "s3cret-pw"},
    }
    rendered = _with_keda({"kafka": kafka})
    trigger = _trigger(rendered)
    assert trigger["metadata"]["sasl"] == "scram_sha256"
    assert "tls" not in trigger["metadata"]
    auth = rendered.named("TriggerAuthentication", trigger["authenticationRef"]["name"])
    (password_secret, password_key) = _refs(auth)["password"]
    secret = rendered.named("Secret", password_secret)
    assert password_key in secret["data"]
    # The user name is read where the worker has it: its container's environment.
    assert auth["spec"]["env"] == [
        {
            "parameter": "username",
            "name": "STEPSTREAM_KAFKA_SASL_USERNAME",
            "containerName": "worker",
        }
    ]
    worker = env_of(container(rendered.one("StatefulSet"), "worker"))
    assert worker["STEPSTREAM_KAFKA_SASL_USERNAME"]["value"] == "app"


def test_mutual_tls_hands_keda_the_client_certificate() -> None:
    rendered = _with_keda(load_values("values-tls.yaml"))
    trigger = _trigger(rendered)
    assert trigger["metadata"]["tls"] == "enable" and "sasl" not in trigger["metadata"]
    auth = rendered.named("TriggerAuthentication", trigger["authenticationRef"]["name"])
    assert _refs(auth) == {
        "ca": ("shop-kafka-client", "ca.crt"),
        "cert": ("shop-kafka-client", "user.crt"),
        "key": ("shop-kafka-client", "user.key"),
    }


def test_a_plaintext_cluster_needs_no_trigger_authentication() -> None:
    rendered = _with_keda()
    assert "authenticationRef" not in _trigger(rendered)
    assert not rendered.all("TriggerAuthentication")
    assert _trigger(rendered)["metadata"]["bootstrapServers"] == "kafka:9092"


def test_the_operators_own_trigger_authentication_replaces_the_charts() -> None:
    values = load_values("values-sasl.yaml")
    values["keda"]["kafka"] = {"authenticationRef": "shop-kafka-oauth"}
    rendered = render(values)
    assert _trigger(rendered)["authenticationRef"] == {"name": "shop-kafka-oauth"}
    assert not rendered.all("TriggerAuthentication")


def test_the_prometheus_trigger_is_still_there_to_choose() -> None:
    keda = {
        "trigger": "prometheus",
        "prometheus": {
            "serverAddress": "http://prometheus-operated.monitoring:9090",
            "authenticationRef": "prometheus-auth",
        },
    }
    rendered = _with_keda(_merge(load_values("values-sasl.yaml"), {"keda": keda}))
    trigger = _trigger(rendered)
    assert trigger["type"] == "prometheus"
    assert trigger["metadata"]["serverAddress"] == "http://prometheus-operated.monitoring:9090"
    assert promql_metrics(trigger["metadata"]["query"]) == {"stepstream_consumer_lag_records"}
    assert f'job="{HEADLESS}"' in trigger["metadata"]["query"]
    assert trigger["authenticationRef"] == {"name": "prometheus-auth"}
    assert not rendered.all("TriggerAuthentication")
