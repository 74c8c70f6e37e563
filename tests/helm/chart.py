"""Renders helm/stepstream and validates what it renders, offline.

Rendering uses Helm's own engine (helm-python-sdk bundles Helm's Go SDK as a library, so no
helm binary is needed), values.schema.json included. Built-in kinds are checked against
Kubernetes' JSON schemas in their strict form (kubernetes-validate bundles them), the
Prometheus Operator's and KEDA's kinds against their CRDs' schemas (tests/helm/crds), with
unknown fields refused as the API server would prune them.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import promql_parser
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "stepstream"
HERE = Path(__file__).resolve().parent
RELEASE = "shop"
NAMESPACE = "prod"
# The oldest Kubernetes the chart's fields need (PVC retention policy on by default since
# 1.27) and a recent one.
KUBERNETES_VERSIONS = ("1.27.0", "1.33.0")

Manifest = dict[str, Any]


@dataclass(frozen=True)
class Rendered:
    manifests: list[Manifest]
    notes: str

    def all(self, kind: str) -> list[Manifest]:
        return [m for m in self.manifests if m["kind"] == kind]

    def one(self, kind: str) -> Manifest:
        found = self.all(kind)
        assert len(found) == 1, f"expected one {kind}, rendered {len(found)}"
        return found[0]

    def named(self, kind: str, name: str) -> Manifest:
        found = [m for m in self.all(kind) if m["metadata"]["name"] == name]
        assert found, f"no {kind} named {name}: {[m['metadata']['name'] for m in self.all(kind)]}"
        return found[0]


def render(values: dict[str, Any] | None = None) -> Rendered:
    """The chart as `helm install shop -n prod [-f ...]` would create it."""
    with helm_python.Chart.load(CHART) as chart:
        files = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    manifests: list[Manifest] = []
    notes = ""
    for path, text in sorted(files.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        manifests.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return Rendered(manifests, notes)


@functools.cache
def render_file(name: str | None) -> Rendered:
    """The chart rendered with tests/helm/<name> (None: the defaults)."""
    return render(None if name is None else load_values(name))


def load_values(name: str) -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load((HERE / name).read_text())
    return values


def container(manifest: Manifest, name: str) -> Manifest:
    pod = manifest["spec"]["template"]["spec"]
    found: Manifest = next(c for c in pod["containers"] if c["name"] == name)
    return found


def env_of(container_spec: Manifest) -> dict[str, Manifest]:
    """Each variable by name (the last wins, as in Kubernetes)."""
    return {var["name"]: var for var in container_spec.get("env", [])}


def validate(manifest: Manifest) -> None:
    """Raises with the path of the first field a cluster would refuse."""
    group = manifest["apiVersion"].split("/")[0]
    if group in _CRD_FILES:
        _crd_validator(manifest["apiVersion"], manifest["kind"]).validate(manifest)
        return
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(manifest, version, strict=True)


_CRD_FILES = {
    "monitoring.coreos.com": (
        "monitoring.coreos.com_servicemonitors.yaml",
        "monitoring.coreos.com_prometheusrules.yaml",
    ),
    "keda.sh": ("keda.sh_scaledobjects.yaml", "keda.sh_triggerauthentications.yaml"),
}


@functools.cache
def _crd_validator(api_version: str, kind: str) -> jsonschema.protocols.Validator:
    group, version = api_version.split("/")
    for file in _CRD_FILES[group]:
        crd = yaml.safe_load((HERE / "crds" / file).read_text())
        if crd["spec"]["names"]["kind"] != kind:
            continue
        for served in crd["spec"]["versions"]:
            if served["name"] == version and served.get("served", False):
                schema = _pruning(served["schema"]["openAPIV3Schema"])
                schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
                schema["properties"]["metadata"] = _OBJECT_META
                return jsonschema.Draft7Validator(schema)
    raise AssertionError(f"no CRD serves {kind} {api_version}: add it to tests/helm/crds")


# What the chart sets in metadata; the CRDs leave metadata to the API server.
_OBJECT_META = {
    "type": "object",
    "required": ["name", "namespace"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"},
        "namespace": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}


def _pruning(schema: Any) -> Any:
    """The schema with unknown fields refused where the API server would drop them."""
    if isinstance(schema, list):
        return [_pruning(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    pruned = {key: _pruning(value) for key, value in schema.items()}
    if (
        "properties" in pruned
        and "additionalProperties" not in pruned
        and not pruned.get("x-kubernetes-preserve-unknown-fields", False)
    ):
        pruned["additionalProperties"] = False
    return pruned


def promql_metrics(expr: str) -> set[str]:
    """The metric names an expression selects; a syntax error raises ValueError."""
    # Grafana's variables are not PromQL: give the range ones a duration.
    expr = expr.replace("$__rate_interval", "5m").replace("$__interval", "1m")
    names: set[str] = set()

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def leaves(values: dict[str, Any], prefix: str = "") -> Iterator[str]:
    """Dotted keys of values.yaml down to scalars, lists and empty maps."""
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and not _is_free_map(path):
            yield from leaves(value, f"{path}.")
        else:
            yield path


def _is_free_map(path: str) -> bool:
    # Maps documented as one parameter: their keys are the user's (Kubernetes objects).
    return path.rsplit(".", 1)[-1] in {
        "resources",
        "podSecurityContext",
        "containerSecurityContext",
        "updateStrategy",
        "labels",
        "persistentVolumeClaimRetentionPolicy",
    }
