"""The chart's optional pieces around the workers, as an operator turns them on: the
startup probe, a NetworkPolicy and an Ingress. Each rendered manifest must be valid for
Kubernetes, and each must agree with the rest of the chart (ports, Service, selectors,
the host names the workers accept)."""

from __future__ import annotations

from typing import Any

import helm_python
import pytest

from tests.helm.chart import Rendered, container, env_of, render, validate

FULLNAME = "shop-stepstream"


def _worker(rendered: Rendered) -> dict[str, Any]:
    return container(rendered.one("StatefulSet"), "worker")


def _valid(rendered: Rendered) -> Rendered:
    for manifest in rendered.manifests:
        validate(manifest)
    return rendered


def test_the_startup_probe_gives_a_slow_start_five_minutes_then_liveness_takes_over() -> None:
    worker = _worker(render())
    startup = worker["startupProbe"]
    assert startup["httpGet"] == worker["livenessProbe"]["httpGet"]
    assert startup["periodSeconds"] * startup["failureThreshold"] == 300
    # Once started, a hung worker is still restarted within a minute.
    liveness = worker["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] <= 60


def test_the_startup_probe_follows_values_and_can_be_turned_off() -> None:
    probe = {"periodSeconds": 10, "failureThreshold": 90, "timeoutSeconds": 3}
    worker = _worker(_valid(render({"workers": {"startupProbe": probe}})))
    assert probe.items() <= worker["startupProbe"].items()
    off = _worker(render({"workers": {"startupProbe": {"enabled": False}}}))
    assert "startupProbe" not in off and "livenessProbe" in off


def test_the_startup_probe_speaks_https_when_the_api_does() -> None:
    values = {"api": {"tls": {"existingSecret": "shop-api-tls"}}}
    assert _worker(render(values))["startupProbe"]["httpGet"]["scheme"] == "HTTPS"


PROMETHEUS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
APPS = {"podSelector": {"matchLabels": {"app": "shop-web"}}}


def test_no_network_policy_or_ingress_unless_asked() -> None:
    kinds = {m["kind"] for m in render().manifests}
    assert not kinds & {"NetworkPolicy", "Ingress"}


def test_the_network_policy_lets_in_only_the_listed_peers_to_the_api_port() -> None:
    values = {"networkPolicy": {"enabled": True, "apiFrom": [APPS], "metricsFrom": [PROMETHEUS]}}
    rendered = _valid(render(values))
    policy = rendered.one("NetworkPolicy")
    pod_labels = rendered.one("StatefulSet")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    (rule,) = policy["spec"]["ingress"]
    # The named port is the worker's API port, where /metrics is served too.
    assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert _worker(rendered)["ports"][0]["name"] == "http"
    workers = {"podSelector": {"matchLabels": policy["spec"]["podSelector"]["matchLabels"]}}
    assert rule["from"] == [workers, APPS, PROMETHEUS]


def _egress_ports(policy: dict[str, Any]) -> set[tuple[object, str]]:
    return {(p["port"], p["protocol"]) for rule in policy["spec"]["egress"] for p in rule["ports"]}


def test_the_network_policy_lets_out_dns_kafka_the_other_workers_and_tracing() -> None:
    values = {
        "kafka": {"bootstrapServers": "kafka-0.kafka:9093,kafka-1.kafka:9093,kafka-2:9094"},
        "workers": {"otlpEndpoint": "http://collector.observability:4318"},
        "networkPolicy": {"enabled": True},
    }
    policy = _valid(render(values)).one("NetworkPolicy")
    assert _egress_ports(policy) == {
        (53, "UDP"),
        (53, "TCP"),
        (9093, "TCP"),
        (9094, "TCP"),
        ("http", "TCP"),
        (4318, "TCP"),
    }
    # Without kafkaTo or dnsTo, those ports are open to any address; with them, only there.
    assert all(
        "to" not in rule for rule in policy["spec"]["egress"] if rule["ports"][0]["port"] != "http"
    )
    kube_dns = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}}
    }
    brokers = {"ipBlock": {"cidr": "10.20.0.0/16"}}
    values["networkPolicy"] = {
        "enabled": True,
        "kafkaPorts": [9092],
        "kafkaTo": [brokers],
        "dnsTo": [kube_dns],
        "extraEgress": [{"ports": [{"port": 5432, "protocol": "TCP"}]}],
    }
    policy = _valid(render(values)).one("NetworkPolicy")
    by_port = {rule["ports"][0]["port"]: rule for rule in policy["spec"]["egress"]}
    assert by_port[53]["to"] == [kube_dns]
    assert by_port[9092] == {"ports": [{"port": 9092, "protocol": "TCP"}], "to": [brokers]}
    assert 5432 in by_port and 9093 not in by_port


def test_an_https_otlp_endpoint_without_a_port_is_let_out_on_443() -> None:
    values = {
        "workers": {"otlpEndpoint": "https://otlp.vendor.example"},
        "networkPolicy": {"enabled": True},
    }
    assert (443, "TCP") in _egress_ports(render(values).one("NetworkPolicy"))


def test_the_ingress_serves_the_api_service_and_the_workers_accept_its_hosts() -> None:
    values = {
        "ingress": {
            "enabled": True,
            "className": "nginx",
            "annotations": {"cert-manager.io/cluster-issuer": "letsencrypt"},
            "hosts": [
                {"host": "workflows.shop.example"},
                {"host": "ops.shop.example", "paths": [{"path": "/ui", "pathType": "Prefix"}]},
            ],
            "tls": [{"secretName": "workflows-tls", "hosts": ["workflows.shop.example"]}],
        }
    }
    rendered = _valid(render(values))
    ingress = rendered.one("Ingress")["spec"]
    assert ingress["ingressClassName"] == "nginx"
    assert ingress["tls"] == values["ingress"]["tls"]
    service = rendered.named("Service", FULLNAME)
    routes = {
        (rule["host"], path["path"]): path["backend"]["service"]
        for rule in ingress["rules"]
        for path in rule["http"]["paths"]
    }
    assert set(routes) == {("workflows.shop.example", "/"), ("ops.shop.example", "/ui")}
    port_names = {p["name"] for p in service["spec"]["ports"]}
    for backend in routes.values():
        assert backend["name"] == FULLNAME and backend["port"]["name"] in port_names
    allowed = env_of(_worker(rendered))["STEPSTREAM_ALLOWED_HOSTS"]["value"].split(",")
    assert {"workflows.shop.example", "ops.shop.example"} <= set(allowed)
    # Browsers behind the Ingress send its origin to plain-http workers: https where its
    # TLS covers the host.
    public = env_of(_worker(rendered))["STEPSTREAM_PUBLIC_URL"]["value"].split(",")
    assert public == ["https://workflows.shop.example", "http://ops.shop.example"]


def test_public_urls_reach_the_workers_and_none_without_an_ingress() -> None:
    assert "STEPSTREAM_PUBLIC_URL" not in env_of(_worker(render({})))
    values = {
        "api": {"publicUrls": ["https://flows.shop.example"]},
        "ingress": {"enabled": True, "hosts": [{"host": "*.shop.example"}]},
    }
    public = env_of(_worker(_valid(render(values))))["STEPSTREAM_PUBLIC_URL"]["value"]
    assert public == "https://flows.shop.example"  # a wildcard host is no page's origin
    with pytest.raises(helm_python.HelmValuesError) as refused:
        render({"api": {"publicUrls": ["flows.shop.example"]}})
    assert "/api/publicUrls/0" in str(refused.value)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"ingress": {"enabled": True}}, "ingress.enabled needs ingress.hosts"),
        (
            {"ingress": {"enabled": True, "hosts": [{"host": "Workflows.Shop:443"}]}},
            "/ingress/hosts/0/host",
        ),
        (
            {"networkPolicy": {"enabled": True, "apiFrom": [{"podSelectr": {}}]}},
            "'podSelectr' not allowed",
        ),
        ({"networkPolicy": {"kafkaPorts": ["9092"]}}, "/networkPolicy/kafkaPorts/0"),
    ],
    ids=["ingress-no-hosts", "ingress-bad-host", "peer-typo", "port-string"],
)
def test_mistakes_in_these_values_are_refused_naming_them(
    values: dict[str, Any], message: str
) -> None:
    with pytest.raises((helm_python.HelmValuesError, helm_python.HelmRenderError)) as refused:
        render(values)
    assert message in str(refused.value)


def test_kafka_properties_reach_the_client_as_written_large_numbers_too() -> None:
    """Helm reads numbers as floats: 10000000 must not reach librdkafka as 1e+07, which
    it would read as 1."""
    config = {
        "message.max.bytes": 10000000,
        "queue.buffering.max.kbytes": 1048576,
        "linger.ms": 5,
        "enable.idempotence": True,
        "client.rack": "eu-west-1a",
    }
    env = env_of(_worker(render({"kafka": {"config": config}})))
    got = {name: env[f"STEPSTREAM_KAFKA_{name.upper().replace('.', '_')}"] for name in config}
    assert {name: value["value"] for name, value in got.items()} == {
        "message.max.bytes": "10000000",
        "queue.buffering.max.kbytes": "1048576",
        "linger.ms": "5",
        "enable.idempotence": "true",
        "client.rack": "eu-west-1a",
    }
