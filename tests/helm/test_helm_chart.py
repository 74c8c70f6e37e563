"""helm/stepstream rendered with the defaults and with two operators' values files: every
manifest valid for Kubernetes (and the Prometheus Operator and KEDA CRDs), and the facts
an operator relies on: graceful stops outlast the drain, one volume per worker, workers
reachable at stable names, scrapes and alerts on the real metric names, secrets kept out
of the manifests, and mistakes in values refused with a message saying what to change.
"""

from __future__ import annotations

import json
import re
from typing import Any

import helm_python
import pytest
import yaml

from tests.helm.chart import (
    CHART,
    NAMESPACE,
    Rendered,
    container,
    env_of,
    leaves,
    load_values,
    promql_metrics,
    render,
    render_file,
    validate,
)
from tests.helm.metric_names import series_names

VALUES_FILES = [None, "values-sasl.yaml", "values-tls.yaml"]
FULLNAME = "shop-stepstream"
HEADLESS = "shop-stepstream-workers"


def _statefulset(rendered: Rendered) -> dict[str, Any]:
    return rendered.one("StatefulSet")


def _worker(rendered: Rendered) -> dict[str, Any]:
    return container(_statefulset(rendered), "worker")


def _arg(args: list[str], flag: str) -> str:
    assert flag in args, f"{flag} missing from {args}"
    return args[args.index(flag) + 1]


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=["defaults", "sasl", "tls"])
def test_every_manifest_is_valid_for_kubernetes(values_file: str | None) -> None:
    rendered = render_file(values_file)
    assert rendered.manifests
    for manifest in rendered.manifests:
        assert manifest["metadata"]["namespace"] == NAMESPACE, manifest["metadata"]
        validate(manifest)


def test_the_validators_refuse_what_a_cluster_refuses() -> None:
    """A guard on the check above: a misspelt field fails it, in each kind of schema."""
    import jsonschema
    import kubernetes_validate

    rendered = render_file("values-sasl.yaml")
    statefulset = json.loads(json.dumps(_statefulset(rendered)))
    container(statefulset, "worker")["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="livenesProbe"):
        validate(statefulset)
    for kind, misspelt in [
        ("ServiceMonitor", "endpoint"),
        ("PrometheusRule", "group"),
        ("ScaledObject", "maxReplicas"),
        ("TriggerAuthentication", "secretTargetRefs"),
    ]:
        manifest = json.loads(json.dumps(rendered.one(kind)))
        manifest["spec"][misspelt] = []
        with pytest.raises(jsonschema.ValidationError, match=misspelt):
            validate(manifest)


def test_the_default_install_renders_what_a_plain_cluster_needs() -> None:
    kinds = sorted(m["kind"] for m in render_file(None).manifests)
    # No CRD-backed kinds by default: they would fail on a cluster without the operators.
    assert kinds == [
        "Job",
        "PodDisruptionBudget",
        "Secret",
        "Service",
        "Service",
        "ServiceAccount",
        "StatefulSet",
    ]


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=["defaults", "sasl", "tls"])
def test_a_stopping_worker_gets_longer_than_its_drain(values_file: str | None) -> None:
    rendered = render_file(values_file)
    pod = _statefulset(rendered)["spec"]["template"]["spec"]
    drain = float(env_of(_worker(rendered))["STEPSTREAM_DRAIN_TIMEOUT_S"]["value"])
    assert pod["terminationGracePeriodSeconds"] >= drain + 10


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=["defaults", "sasl", "tls"])
def test_each_worker_keeps_its_state_on_its_own_volume(values_file: str | None) -> None:
    rendered = render_file(values_file)
    statefulset = _statefulset(rendered)
    worker = _worker(rendered)
    (claim,) = statefulset["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    mounts = {m["name"]: m["mountPath"] for m in worker["volumeMounts"]}
    assert _arg(worker["args"], "--state-dir") == mounts["data"] == "/data"
    # A pod volume named "data" would take the claim's place.
    assert "data" not in {v["name"] for v in statefulset["spec"]["template"]["spec"]["volumes"]}


def test_state_volume_size_and_class_come_from_values() -> None:
    (claim,) = _statefulset(render_file("values-tls.yaml"))["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "50Gi"
    assert claim["spec"]["storageClassName"] == "fast-ssd"


def test_without_persistence_the_state_is_an_empty_dir_and_notes_warn() -> None:
    rendered = render({"workers": {"persistence": {"enabled": False}}})
    statefulset = _statefulset(rendered)
    assert "volumeClaimTemplates" not in statefulset["spec"]
    volumes = {v["name"]: v for v in statefulset["spec"]["template"]["spec"]["volumes"]}
    assert volumes["data"] == {"name": "data", "emptyDir": {}}
    assert "persistence.enabled=false" in rendered.notes


@pytest.mark.parametrize(
    ("values_file", "scheme"), [(None, "http"), ("values-tls.yaml", "https")], ids=["http", "tls"]
)
def test_each_worker_advertises_its_stable_name(values_file: str | None, scheme: str) -> None:
    rendered = render_file(values_file)
    statefulset = _statefulset(rendered)
    headless = rendered.named("Service", statefulset["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    worker = _worker(rendered)
    assert env_of(worker)["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert _arg(worker["args"], "--advertise") == (
        f"{scheme}://$(POD_NAME).{HEADLESS}.{NAMESPACE}.svc.cluster.local:8233"
    )
    assert _arg(worker["args"], "--host") == "0.0.0.0"


@pytest.mark.parametrize(
    ("values_file", "scheme"), [(None, "HTTP"), ("values-tls.yaml", "HTTPS")], ids=["http", "tls"]
)
def test_probes_ask_healthz_and_readyz_on_the_api_port(
    values_file: str | None, scheme: str
) -> None:
    worker = _worker(render_file(values_file))
    (port,) = worker["ports"]
    assert (port["name"], port["containerPort"]) == ("http", 8233)
    assert _arg(worker["args"], "--port") == "8233"
    probes = [
        ("startupProbe", "/healthz"),
        ("livenessProbe", "/healthz"),
        ("readinessProbe", "/readyz"),
    ]
    for probe, path in probes:
        assert worker[probe]["httpGet"] == {"path": path, "port": "http", "scheme": scheme}


def test_the_api_service_reaches_the_workers_and_allows_its_own_names() -> None:
    rendered = render_file(None)
    service = rendered.named("Service", FULLNAME)
    pod_labels = _statefulset(rendered)["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    hosts = env_of(_worker(rendered))["STEPSTREAM_ALLOWED_HOSTS"]["value"].split(",")
    assert f"{FULLNAME}.{NAMESPACE}.svc.cluster.local" in hosts
    assert "workflows.shop.example" in env_of(_worker(render_file("values-sasl.yaml")))[
        "STEPSTREAM_ALLOWED_HOSTS"
    ]["value"].split(",")


@pytest.mark.parametrize(
    ("host", "status"),
    [
        (f"{FULLNAME}-0.{FULLNAME}-workers", 200),
        (f"{FULLNAME}-0.{FULLNAME}-workers.{NAMESPACE}", 200),
        (f"{FULLNAME}-0.{FULLNAME}-workers.{NAMESPACE}.svc", 200),
        (f"{FULLNAME}-2.{FULLNAME}-workers.{NAMESPACE}.svc.cluster.local:8233", 200),
        (f"{FULLNAME}.{NAMESPACE}", 200),
        ("rebound.attacker.example", 403),
    ],
)
async def test_a_worker_answers_to_its_headless_name_in_every_form_dns_resolves(
    host: str, status: int
) -> None:
    """The names the chart allows, enforced by the worker's own guard: a pod reached as
    <pod>.<release>-stepstream-workers[.<ns>[.svc[.<domain>]]] is served, as the
    Service is; any other name is refused (a defence against DNS rebinding)."""
    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from stepstream.ops.api.security import ApiSecurity

    allowed = env_of(_worker(render_file(None)))["STEPSTREAM_ALLOWED_HOSTS"]["value"]
    security = ApiSecurity.from_env({"STEPSTREAM_ALLOWED_HOSTS": allowed})
    guard = security.guard(served_hosts=("0.0.0.0",))

    async def ok(_: web.Request) -> web.StreamResponse:
        return web.Response(text="ok")

    answer = await guard(make_mocked_request("GET", "/healthz", headers={"Host": host}), ok)
    assert answer.status == status, (host, allowed)


def test_the_api_token_comes_from_a_secret() -> None:
    rendered = render_file(None)
    token = env_of(_worker(rendered))["STEPSTREAM_API_TOKEN"]["valueFrom"]["secretKeyRef"]
    secret = rendered.named("Secret", token["name"])
    assert len(secret["data"][token["key"]]) >= 40  # generated: base64 of 40 characters
    ref = env_of(_worker(render_file("values-sasl.yaml")))["STEPSTREAM_API_TOKEN"]
    assert ref["valueFrom"]["secretKeyRef"] == {"name": "shop-stepstream-token", "key": "api-token"}
    assert not render_file("values-sasl.yaml").all("Secret")


def test_insecure_api_takes_no_token_and_notes_warn() -> None:
    rendered = render({"api": {"insecure": True}})
    worker = _worker(rendered)
    assert "--insecure" in worker["args"]
    assert "STEPSTREAM_API_TOKEN" not in env_of(worker)
    assert not rendered.all("Secret")
    assert "api.insecure=true" in rendered.notes


def test_sasl_credentials_and_ca_come_from_the_operators_secrets() -> None:
    rendered = render_file("values-sasl.yaml")
    job = rendered.one("Job")
    for spec in (_worker(rendered), container(job, "topics")):
        env = env_of(spec)
        assert env["STEPSTREAM_KAFKA_SECURITY_PROTOCOL"]["value"] == "SASL_SSL"
        assert env["STEPSTREAM_KAFKA_SASL_MECHANISM"]["value"] == "SCRAM-SHA-512"
        assert env["STEPSTREAM_KAFKA_SASL_USERNAME"]["valueFrom"]["secretKeyRef"] == {
            "name": "shop-kafka-user",
            "key": "username",
        }
        assert env["STEPSTREAM_KAFKA_SASL_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
            "name": "shop-kafka-user",
            "key": "password",
        }
        ca = env["STEPSTREAM_KAFKA_SSL_CA_LOCATION"]["value"]
        mount = next(m for m in spec["volumeMounts"] if m["name"] == "kafka-tls")
        assert ca == f"{mount['mountPath']}/ca.crt"
        # Other properties reach the client as STEPSTREAM_KAFKA_<NAME> (. written _).
        assert env["STEPSTREAM_KAFKA_CLIENT_RACK"]["value"] == "eu-west-1a"
        assert env["STEPSTREAM_KAFKA_PRODUCER_COMPRESSION_TYPE"]["value"] == "lz4"
    volumes = _statefulset(rendered)["spec"]["template"]["spec"]["volumes"]
    assert {
        "name": "kafka-tls",
        "secret": {"secretName": "shop-kafka-ca", "defaultMode": 0o440},
    } in (volumes)


def test_a_sasl_password_given_in_values_stays_in_secrets() -> None:
    values = {
        "kafka": {
            "securityProtocol": "SASL_PLAINTEXT",
            "sasl": {"mechanism": "PLAIN", "username": "app", "password": "s3cret-pw"},
        }
    }
    rendered = render(values)
    for manifest in rendered.manifests:
        if manifest["kind"] != "Secret":
            assert "s3cret-pw" not in json.dumps(manifest), manifest["kind"]
    worker_ref = env_of(_worker(rendered))["STEPSTREAM_KAFKA_SASL_PASSWORD"]["valueFrom"]
    job_ref = env_of(container(rendered.one("Job"), "topics"))["STEPSTREAM_KAFKA_SASL_PASSWORD"]
    # The Job runs before the release's Secrets exist, so it reads a hook Secret of its own.
    worker_secret = rendered.named("Secret", worker_ref["secretKeyRef"]["name"])
    job_secret = rendered.named("Secret", job_ref["valueFrom"]["secretKeyRef"]["name"])
    assert "helm.sh/hook" not in worker_secret["metadata"].get("annotations", {})
    assert job_secret["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert int(job_secret["metadata"]["annotations"]["helm.sh/hook-weight"]) < int(
        rendered.one("Job")["metadata"]["annotations"]["helm.sh/hook-weight"]
    )
    assert worker_secret["data"] == job_secret["data"]


def test_workers_serving_https_trust_the_ca_they_are_given_for_each_other() -> None:
    """The web UI of a worker and the CLI run in its pod call the other workers at their
    announced https addresses: a certificate from a private CA must be trusted there."""
    rendered = render_file("values-tls.yaml")
    worker = _worker(rendered)
    ca = env_of(worker)["STEPSTREAM_TLS_CA"]["value"]
    mount = next(m for m in worker["volumeMounts"] if m["name"] == "api-tls")
    assert ca == f"{mount['mountPath']}/ca.crt"
    volumes = _statefulset(rendered)["spec"]["template"]["spec"]["volumes"]
    assert next(v for v in volumes if v["name"] == "api-tls")["secret"]["secretName"] == (
        "shop-api-tls"
    )
    # A certificate from a public CA: nothing to add (the system's CAs are trusted).
    public = render({"api": {"tls": {"existingSecret": "shop-api-tls"}}})
    assert "STEPSTREAM_TLS_CA" not in env_of(_worker(public))
    # NOTES says what to set if it is not.
    assert "set api.tls.caKey" in public.notes and "api.tls.caKey" not in rendered.notes


def test_mutual_tls_mounts_the_client_certificate() -> None:
    env = env_of(_worker(render_file("values-tls.yaml")))
    assert env["STEPSTREAM_KAFKA_SECURITY_PROTOCOL"]["value"] == "SSL"
    assert env["STEPSTREAM_KAFKA_SSL_CERTIFICATE_LOCATION"]["value"].endswith("/user.crt")
    assert env["STEPSTREAM_KAFKA_SSL_KEY_LOCATION"]["value"].endswith("/user.key")
    assert "STEPSTREAM_KAFKA_SASL_PASSWORD" not in env
    # Secret properties (the key's password) come in a properties file from a Secret.
    rendered = render_file("values-tls.yaml")
    for spec in (_worker(rendered), container(rendered.one("Job"), "topics")):
        path = env_of(spec)["STEPSTREAM_KAFKA_CONFIG"]["value"]
        mount = next(m for m in spec["volumeMounts"] if m["name"] == "kafka-config")
        assert path == f"{mount['mountPath']}/client.properties"
    volumes = _statefulset(rendered)["spec"]["template"]["spec"]["volumes"]
    config = next(v for v in volumes if v["name"] == "kafka-config")
    assert config["secret"]["secretName"] == "shop-kafka-properties"


def test_replicas_resources_and_disruption_budget_follow_values() -> None:
    rendered = render_file("values-tls.yaml")
    assert _statefulset(rendered)["spec"]["replicas"] == 5
    assert _worker(rendered)["resources"] == {
        "requests": {"cpu": "2", "memory": "2Gi"},
        "limits": {"cpu": "4", "memory": "4Gi"},
    }
    pdb = rendered.one("PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 2
    pod_labels = _statefulset(rendered)["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert env_of(_worker(rendered))["STEPSTREAM_RETENTION_S"]["value"] == "604800"


def test_the_topic_job_is_a_hook_that_creates_the_topics() -> None:
    rendered = render_file("values-sasl.yaml")
    job = rendered.one("Job")
    annotations = job["metadata"]["annotations"]
    assert annotations["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert "before-hook-creation" in annotations["helm.sh/hook-delete-policy"]
    # A failed try keeps its pod, so the log that says why outlives the last retry.
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    assert "hook-failed" not in annotations["helm.sh/hook-delete-policy"]
    topics = container(job, "topics")
    assert topics["command"] == ["stepstream"]
    assert topics["args"][:2] == ["topics", "create"]
    assert _arg(topics["args"], "--partitions") == "24"
    assert _arg(topics["args"], "--replication") == "3"
    assert _arg(topics["args"], "--prefix") == _arg(_worker(rendered)["args"], "--prefix") == "shop"
    assert not render({"topics": {"create": False}}).all("Job")


def test_without_the_topics_job_notes_give_the_command_with_the_security_it_needs() -> None:
    plain = render({"topics": {"create": False}}).notes
    assert "stepstream topics create --bootstrap" in plain
    assert "STEPSTREAM_KAFKA_SECURITY_PROTOCOL" not in plain
    values = load_values("values-sasl.yaml")
    values["topics"] = {**values.get("topics", {}), "create": False}
    secured = render(values).notes
    assert "STEPSTREAM_KAFKA_SECURITY_PROTOCOL=SASL_SSL" in secured, secured
    assert "STEPSTREAM_KAFKA_SASL_MECHANISM=SCRAM-SHA-512" in secured
    assert "STEPSTREAM_KAFKA_SSL_CA_LOCATION=" in secured
    assert "STEPSTREAM_KAFKA_SSL_CERTIFICATE_LOCATION" not in secured  # no client cert
    # mTLS: the client's certificate and key too, as the workers get them.
    values = load_values("values-tls.yaml")
    values["topics"] = {**values.get("topics", {}), "create": False}
    mutual = render(values).notes
    for name in ("SSL_CA_LOCATION", "SSL_CERTIFICATE_LOCATION", "SSL_KEY_LOCATION"):
        assert f"STEPSTREAM_KAFKA_{name}=" in mutual, mutual


def test_the_service_monitor_scrapes_metrics_of_every_worker_on_the_api_port() -> None:
    rendered = render_file("values-sasl.yaml")
    monitor = rendered.one("ServiceMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    scraped = [
        s for s in rendered.all("Service") if selector.items() <= s["metadata"]["labels"].items()
    ]
    # The headless Service only: through the API Service each scrape would hit a random worker.
    assert [s["metadata"]["name"] for s in scraped] == [HEADLESS]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    (port,) = [p for p in scraped[0]["spec"]["ports"] if p["name"] == endpoint["port"]]
    assert port["targetPort"] == _worker(rendered)["ports"][0]["name"]
    token = env_of(_worker(rendered))["STEPSTREAM_API_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert endpoint["authorization"]["credentials"] == token
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (https,) = render_file("values-tls.yaml").one("ServiceMonitor")["spec"]["endpoints"]
    assert https["scheme"] == "https" and https["tlsConfig"] == {"insecureSkipVerify": True}


def test_alerts_watch_lag_dead_letters_timers_parked_and_readiness() -> None:
    rule = render_file("values-sasl.yaml").one("PrometheusRule")
    (group,) = rule["spec"]["groups"]
    alerts = {r["alert"]: r for r in group["rules"]}
    assert set(alerts) == {
        "StepstreamConsumerLagHigh",
        "StepstreamDeadLetters",
        "StepstreamTimersLate",
        "StepstreamParkedInstances",
        "StepstreamWorkerNotReady",
        "StepstreamWorkerDown",
        "StepstreamWorkflowsFailing",
        "StepstreamStepsFailing",
        "StepstreamSpansDropped",
        "StepstreamPartitionsUnowned",
        "StepstreamHttpErrors",
        "StepstreamApiBusy",
        "StepstreamStepsStartLate",
        "StepstreamStartsLate",
    }
    known = series_names()
    for name, alert in alerts.items():
        used = promql_metrics(alert["expr"])
        assert used and used <= known, f"{name} uses {used - known}: not a stepstream metric"
        # Scoped to this release's workers, as the ServiceMonitor labels them.
        assert f'job="{HEADLESS}"' in alert["expr"] and f'namespace="{NAMESPACE}"' in alert["expr"]
        assert alert["labels"]["severity"] in {"critical", "warning", "info"}
        assert alert["annotations"]["summary"] and alert["annotations"]["description"]
    assert alerts["StepstreamConsumerLagHigh"]["expr"].endswith("> 50000")
    assert "stepstream_consumer_lag_records" in promql_metrics(
        alerts["StepstreamConsumerLagHigh"]["expr"]
    )
    assert "stepstream_parked_instances" in alerts["StepstreamParkedInstances"]["expr"]


def test_the_dashboard_config_map_ships_the_dashboard_file() -> None:
    config_map = render_file("values-sasl.yaml").one("ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads(config_map["data"]["stepstream.json"])
    assert shipped == json.loads((CHART / "dashboards" / "stepstream.json").read_text())


def test_notes_tell_how_to_reach_the_api() -> None:
    notes = render_file(None).notes
    assert f"kubectl -n {NAMESPACE} port-forward svc/{FULLNAME} 8233:8233" in notes
    assert f"get secret {FULLNAME}-api" in notes
    assert "rollout status statefulset/" + FULLNAME in notes
    assert f"kubectl -n {NAMESPACE} exec {FULLNAME}-0 -- stepstream list --diverged" in notes
    connect = env_of(_worker(render_file(None)))["STEPSTREAM_CONNECT"]["value"]
    assert connect == "kafka://kafka:9092?prefix=stepstream"
    idle = render({"workers": {"replicaCount": 14}}).notes
    assert "2 workers will own no partition" in idle


def test_values_schema_refuses_a_bad_values_file_and_says_where() -> None:
    with pytest.raises(helm_python.HelmValuesError) as refused:
        render(load_values("values-bad.yaml"))
    message = str(refused.value)
    assert "/kafka/securityProtocol" in message and "SASL_SSL" in message
    assert "/workers/replicaCount" in message and "want integer" in message


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"topics": {"partitons": 4}}, "'partitons' not allowed"),
        ({"kafka": {"bootstrapServers": "kafka"}}, "/kafka/bootstrapServers"),
        ({"workers": {"workflows": ""}}, "/workers/workflows"),
        ({"kafka": {"config": {"SASL_MECHANISM": "PLAIN"}}}, "'SASL_MECHANISM' not allowed"),
        ({"keda": {"minReplicaCount": 0}}, "/keda/minReplicaCount"),
        ({"metrics": {"serviceMonitor": {"interval": "30 seconds"}}}, "/interval"),
    ],
    ids=["typo", "no-port", "no-workflows", "env-style-key", "keda-zero", "duration"],
)
def test_values_schema_refuses_mistakes(values: dict[str, Any], where: str) -> None:
    with pytest.raises(helm_python.HelmValuesError, match=re.escape(where)):
        render(values)


@pytest.mark.parametrize(
    ("values", "advice"),
    [
        (
            {"workers": {"drainTimeoutSeconds": 60, "terminationGracePeriodSeconds": 60}},
            "workers.terminationGracePeriodSeconds (60) must exceed "
            "workers.drainTimeoutSeconds (60) by 10 s or more",
        ),
        (
            {"kafka": {"securityProtocol": "SASL_SSL", "sasl": {"username": "app"}}},
            "set kafka.sasl.existingSecret",
        ),
        (
            {"kafka": {"securityProtocol": "SASL_SSL", "sasl": {"password": "x"}}},
            "set kafka.sasl.username",
        ),
        (
            {"keda": {"enabled": True, "trigger": "prometheus"}},
            "keda.trigger prometheus needs keda.prometheus.serverAddress",
        ),
        (
            {"keda": {"enabled": True, "maxReplicaCount": 20}},
            "keda.maxReplicaCount (20) exceeds topics.partitions (12)",
        ),
        (
            {"kafka": {"tls": {"existingSecret": "ca", "certKey": "user.crt"}}},
            "needs its private key",
        ),
        ({"api": {"tls": {"caKey": "ca.crt"}}}, "api.tls.existingSecret, which is empty"),
    ],
    ids=[
        "grace-period",
        "sasl-no-password",
        "sasl-no-user",
        "keda-no-prometheus",
        "keda-max",
        "mtls",
        "api-ca-without-secret",
    ],
)
def test_combinations_that_cannot_work_are_refused(values: dict[str, Any], advice: str) -> None:
    with pytest.raises(helm_python.HelmRenderError, match=re.escape(advice)):
        render(values)


def test_every_value_is_documented_and_every_doc_names_a_value() -> None:
    text = (CHART / "values.yaml").read_text()
    documented = set(re.findall(r"^\s*## @param (\S+) \S", text, flags=re.MULTILINE))
    keys = set(leaves(yaml.safe_load(text)))
    assert keys - documented == set(), "values without a ## @param line"
    assert documented - keys == set(), "## @param lines naming no value"


def test_helm_lint_finds_nothing() -> None:
    findings = helm_python.lint(CHART)
    assert not findings["errors"], findings
    # Severity 1 is Helm's INFO (a chart icon is recommended); 2 and 3 are warnings and errors.
    assert [m for m in findings["messages"] if m["severity"] > 1] == [], findings


def test_workers_log_json_and_trace_to_the_otlp_endpoint_given() -> None:
    plain = _worker(render())
    assert _arg(plain["args"], "--log-format") == "json"
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in env_of(plain)
    traced = _worker(render({"workers": {"otlpEndpoint": "http://collector:4318"}}))
    env = env_of(traced)
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://collector:4318"
    assert env["OTEL_SERVICE_NAME"]["value"]
