"""docs/operations.md says what the chart and the workers do: the commands and values
files it shows install, the metrics table is the served metrics, the alerts table is the
rules the chart installs."""

from __future__ import annotations

import itertools
import re
import shlex

import helm_python
import yaml

from tests.helm.chart import ROOT, container, env_of, render, render_file, validate
from tests.helm.metric_names import METRICS, PROCESSES_METRICS

OPERATIONS = ROOT / "docs" / "operations.md"


def _table_rows(text: str, first_header: str) -> list[list[str]]:
    """The rows of the markdown table whose first column is headed `first_header`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_the_metrics_table_lists_every_served_metric_with_its_type() -> None:
    rows = _table_rows(OPERATIONS.read_text(), "metric")
    documented = {row[0].strip("`"): row[1] for row in rows}
    assert documented == METRICS | PROCESSES_METRICS
    for row in rows:
        assert row[2] and row[4], f"{row[0]} needs a unit and a meaning"


def test_the_alerts_table_names_the_rules_the_chart_installs() -> None:
    rows = _table_rows(OPERATIONS.read_text(), "alert")
    documented = {row[0].strip("`") for row in rows}
    (group,) = render_file("values-sasl.yaml").one("PrometheusRule")["spec"]["groups"]
    assert documented == {rule["alert"] for rule in group["rules"]}


def test_the_values_file_in_the_guide_installs() -> None:
    text = OPERATIONS.read_text()
    block = re.search(r"```yaml\n# shop-values.yaml\n(.*?)```", text, flags=re.DOTALL)
    assert block, "docs/operations.md lost its shop-values.yaml example"
    rendered = render(yaml.safe_load(block.group(1)))
    for manifest in rendered.manifests:
        validate(manifest)
    worker = container(rendered.one("StatefulSet"), "worker")
    env = {var["name"]: var for var in worker["env"]}
    assert env["STEPSTREAM_KAFKA_SASL_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == (
        "shop-kafka-user"
    )
    assert env["STEPSTREAM_KAFKA_SSL_CA_LOCATION"]["value"].endswith("/ca.crt")


def test_the_ingress_and_network_policy_example_installs_over_the_values_file() -> None:
    text = OPERATIONS.read_text()
    shop = re.search(r"```yaml\n# shop-values.yaml\n(.*?)```", text, flags=re.DOTALL)
    edge = re.search(r"```yaml\n# edge-values.yaml.*?\n(.*?)```", text, flags=re.DOTALL)
    assert shop and edge, "docs/operations.md lost its shop-values.yaml or edge-values.yaml"
    values = _merge(yaml.safe_load(shop.group(1)), yaml.safe_load(edge.group(1)))
    rendered = render(values)
    for manifest in rendered.manifests:
        validate(manifest)
    assert rendered.one("Ingress")["spec"]["rules"][0]["host"] == "workflows.shop.example"
    egress = rendered.one("NetworkPolicy")["spec"]["egress"]
    assert {"port": 9093, "protocol": "TCP"} in [port for rule in egress for port in rule["ports"]]


def test_the_autoscaling_example_scales_on_kafka_lag_with_the_clusters_credentials() -> None:
    text = OPERATIONS.read_text()
    shop = re.search(r"```yaml\n# shop-values.yaml\n(.*?)```", text, flags=re.DOTALL)
    keda = re.search(r"```yaml\n *# keda-values.yaml.*?\n(.*?)```", text, flags=re.DOTALL)
    assert shop and keda, "docs/operations.md lost its shop-values.yaml or keda-values.yaml"
    rendered = render(_merge(yaml.safe_load(shop.group(1)), yaml.safe_load(keda.group(1))))
    for manifest in rendered.manifests:
        validate(manifest)
    (trigger,) = rendered.one("ScaledObject")["spec"]["triggers"]
    assert trigger["type"] == "kafka" and trigger["metadata"]["consumerGroup"] == "shop.workers"
    auth = rendered.named("TriggerAuthentication", trigger["authenticationRef"]["name"])
    assert {ref["name"] for ref in auth["spec"]["secretTargetRef"]} == {
        "shop-kafka-user",
        "shop-kafka-ca",
    }


def test_the_memory_example_sets_the_workers_rocksdb_budget() -> None:
    text = OPERATIONS.read_text()
    shop = re.search(r"```yaml\n# shop-values.yaml\n(.*?)```", text, flags=re.DOTALL)
    memory = re.search(r"```yaml\n# memory-values.yaml.*?\n(.*?)```", text, flags=re.DOTALL)
    assert shop and memory, "docs/operations.md lost its shop-values.yaml or memory-values.yaml"
    rendered = render(_merge(yaml.safe_load(shop.group(1)), yaml.safe_load(memory.group(1))))
    for manifest in rendered.manifests:
        validate(manifest)
    worker = container(rendered.one("StatefulSet"), "worker")
    assert env_of(worker)["STEPSTREAM_ROCKSDB_MEMORY_MB"]["value"] == "256"
    assert worker["resources"]["limits"]["memory"] == "1Gi"


def test_the_helm_template_example_renders_every_optional_piece() -> None:
    text = OPERATIONS.read_text()
    command = re.search(r"```bash\n(helm template .*?)```", text, flags=re.DOTALL)
    assert command, "docs/operations.md lost its helm template example"
    words = shlex.split(command.group(1).replace("\\\n", " "))
    assert words[:3] == ["helm", "template", "shop"] and words[3] == "./helm/stepstream"
    values: dict[str, object] = {}
    for flag, argument in itertools.pairwise(words):
        if flag == "-f":
            block = re.search(rf"```yaml\n# {re.escape(argument)}.*?\n(.*?)```", text, re.DOTALL)
            assert block, f"the example reads {argument}, which the guide does not show"
            values = _merge(values, yaml.safe_load(block.group(1)))
        elif flag == "--set":
            values = _merge(values, helm_python.parse_set_string(argument))
    rendered = render(values)
    for manifest in rendered.manifests:
        validate(manifest)
    kinds = {manifest["kind"] for manifest in rendered.manifests}
    assert {"Ingress", "NetworkPolicy", "ScaledObject", "TriggerAuthentication"} <= kinds
    assert {"PrometheusRule", "StatefulSet", "Job"} <= kinds


def test_the_shortest_helm_install_command_installs() -> None:
    text = OPERATIONS.read_text()
    block = re.search(r"```bash\n(helm install .*?--set .*?)```", text, flags=re.DOTALL)
    assert block, "docs/operations.md lost its helm install example with --set"
    words = shlex.split(block.group(1).replace("\\\n", " "))
    assert words[:4] == ["helm", "install", "shop", "./helm/stepstream"]
    values: dict[str, object] = {}
    for flag, setting in itertools.pairwise(words):
        if flag == "--set":
            values = _merge(values, helm_python.parse_set_string(setting))
    rendered = render(values)
    for manifest in rendered.manifests:
        validate(manifest)
    worker = container(rendered.one("StatefulSet"), "worker")
    assert worker["image"] == "registry.example/shop/workflows:0.1.0"
    assert worker["args"][worker["args"].index("--workflows") + 1] == "shop.workflows"


def _merge(into: dict[str, object], more: dict[str, object]) -> dict[str, object]:
    merged = dict(into)
    for key, value in more.items():
        current = merged.get(key)
        if isinstance(current, dict) and isinstance(value, dict):
            merged[key] = _merge(current, value)
        else:
            merged[key] = value
    return merged
