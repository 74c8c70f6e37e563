"""The chart's optional pieces around the workers, as an operator turns them on: the
startup probe, a NetworkPolicy and an Ingress. Each rendered manifest must be valid for
Kubernetes, and each must agree with the rest of the chart (ports, Service, selectors,
the host names the workers accept)."""

from __future__ import annotations

from typing import Any

from tests.helm.chart import Rendered, container, render, validate

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
