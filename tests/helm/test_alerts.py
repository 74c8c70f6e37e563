"""The alerts an operator is paged by: each links its runbook, a heading of
docs/operations.md that exists and says what to do, and the new ones watch failing
workflows and steps, dropped spans and partitions no worker owns, on the series and
label values the workers really serve."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.helm.chart import ROOT, promql_metrics, render, render_file

OPERATIONS = ROOT / "docs" / "operations.md"
HEADLESS = "shop-stepstream-workers"
# The label values the engine gives these counters (consumers/telemetry.py).
WORKFLOW_OUTCOMES = {"started", "completed", "failed", "cancelled"}
STEP_OUTCOMES = {"succeeded", "retried", "failed", "timed_out", "cancelled"}


def _rules(values: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    rendered = render(values) if values is not None else render_file("values-sasl.yaml")
    (group,) = rendered.one("PrometheusRule")["spec"]["groups"]
    return {rule["alert"]: rule for rule in group["rules"]}


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return slug.replace(" ", "-")


def _sections() -> dict[str, str]:
    """Each heading's anchor -> the text under it, up to the next heading."""
    text = re.sub(r"^```.*?^```", "", OPERATIONS.read_text(), flags=re.MULTILINE | re.DOTALL)
    parts = re.split(r"^#+ (.+)$", text, flags=re.MULTILINE)
    return {_anchor(parts[i]): parts[i + 1] for i in range(1, len(parts), 2)}


def test_every_alert_links_a_runbook_in_the_operations_guide_that_says_what_to_do() -> None:
    sections = _sections()
    for name, rule in _rules().items():
        url = urlsplit(rule["annotations"]["runbook_url"])
        assert url.scheme == "https" and url.path.endswith("/docs/operations.md"), name
        assert url.fragment in sections, f"{name}: docs/operations.md has no #{url.fragment}"
        runbook = sections[url.fragment]
        assert len(runbook.split()) >= 15, f"{name}: its runbook says too little"
        for link in re.findall(r"\]\(#([^)]+)\)", runbook):
            assert link in sections, f"{name}: its runbook links #{link}, which is not there"


def test_runbook_links_follow_the_base_url_given() -> None:
    base = "https://wiki.shop.example/stepstream/docs/operations.md"
    values = {"metrics": {"prometheusRule": {"enabled": True, "runbookBaseUrl": base}}}
    for rule in _rules(values).values():
        assert rule["annotations"]["runbook_url"].startswith(base + "#stepstream")


def _matchers(expr: str, metric: str) -> list[dict[str, str]]:
    """The `label=value` and `label=~regex` matchers of each selector of `metric`."""
    found = []
    for selector in re.findall(metric + r"\{([^}]*)\}", expr):
        found.append(dict(re.findall(r'(\w+)=~?"([^"]*)"', selector)))
    return found


@pytest.mark.parametrize(
    ("alert", "metric", "group_by", "outcomes"),
    [
        ("StepstreamWorkflowsFailing", "stepstream_workflows_total", "workflow", WORKFLOW_OUTCOMES),
        ("StepstreamStepsFailing", "stepstream_steps_total", "workflow, step", STEP_OUTCOMES),
    ],
)
def test_failing_workflows_and_steps_alert_on_the_share_that_failed(
    alert: str, metric: str, group_by: str, outcomes: set[str]
) -> None:
    expr = _rules()[alert]["expr"]
    assert promql_metrics(expr) == {metric}
    failed, ended = _matchers(expr, metric)
    assert failed["outcome"] == "failed"
    assert set(ended["outcome"].split("|")) <= outcomes and "failed" in ended["outcome"]
    assert "started" not in ended["outcome"] and "retried" not in ended["outcome"]
    assert expr.count(f"sum by (namespace, job, {group_by})") == 2
    assert expr.endswith("> 0.05")
    tuned = {"failingSteps": {"ratio": 0.2, "window": "1h"}}
    values = {"metrics": {"prometheusRule": {"enabled": True, "alerts": tuned}}}
    tuned_expr = _rules(values)["StepstreamStepsFailing"]["expr"]
    assert tuned_expr.endswith("> 0.2") and tuned_expr.count("[1h]") == 2


def test_dropped_spans_and_unowned_partitions_have_alerts() -> None:
    rules = _rules()
    spans = rules["StepstreamSpansDropped"]
    assert promql_metrics(spans["expr"]) == {"stepstream_spans_dropped_total"}
    assert "by (namespace, job, reason)" in spans["expr"]
    unowned = rules["StepstreamPartitionsUnowned"]
    assert promql_metrics(unowned["expr"]) == {"stepstream_partitions_owned"}
    # values-sasl.yaml has 24 partitions; with no worker scraped at all it still fires.
    assert unowned["expr"].endswith("< 24") and "or on() vector(0)" in unowned["expr"]
    assert unowned["labels"]["severity"] == "critical"
    for rule in (spans, unowned):
        assert f'job="{HEADLESS}"' in rule["expr"]


def test_each_new_alert_can_be_turned_off() -> None:
    names = {
        "failingWorkflows": "StepstreamWorkflowsFailing",
        "failingSteps": "StepstreamStepsFailing",
        "spansDropped": "StepstreamSpansDropped",
        "unownedPartitions": "StepstreamPartitionsUnowned",
    }
    off = {key: {"enabled": False} for key in names}
    values = {"metrics": {"prometheusRule": {"enabled": True, "alerts": off}}}
    assert not set(names.values()) & set(_rules(values))


def test_http_errors_and_late_starts_have_alerts_that_can_be_tuned_and_turned_off() -> None:
    rules = _rules()
    http = rules["StepstreamHttpErrors"]["expr"]
    assert promql_metrics(http) == {"stepstream_http_requests_total"}
    errors, answered = _matchers(http, "stepstream_http_requests_total")
    assert errors["code"] == "5.." and "code" not in answered
    assert http.endswith("> 0.05")
    for alert, metric, threshold in (
        ("StepstreamStepsStartLate", "stepstream_step_schedule_to_start_seconds_bucket", "10"),
        ("StepstreamStartsLate", "stepstream_workflow_schedule_to_start_seconds_bucket", "30"),
    ):
        expr = rules[alert]["expr"]
        assert promql_metrics(expr) == {metric}
        assert expr.startswith("histogram_quantile(0.99,") and expr.endswith(f"> {threshold}")
        assert f'job="{HEADLESS}"' in expr
    tuned = {
        "httpErrors": {"ratio": 0.2},
        "stepScheduleToStart": {"thresholdSeconds": 2},
        "startScheduleToStart": {"enabled": False},
    }
    values = {"metrics": {"prometheusRule": {"enabled": True, "alerts": tuned}}}
    tuned_rules = _rules(values)
    assert tuned_rules["StepstreamHttpErrors"]["expr"].endswith("> 0.2")
    assert tuned_rules["StepstreamStepsStartLate"]["expr"].endswith("> 2")
    assert "StepstreamStartsLate" not in tuned_rules


def test_an_api_that_keeps_refusing_calls_at_its_bound_alerts_and_can_be_tuned() -> None:
    rule = _rules()["StepstreamApiBusy"]
    expr = rule["expr"]
    assert promql_metrics(expr) == {"stepstream_api_refused_calls_total"}
    (matchers,) = _matchers(expr, "stepstream_api_refused_calls_total")
    # a session over its own cap is one client's business, not the worker's bound
    assert matchers["reason"] == "max_pending|waits_share"
    assert "by (namespace, job, pod)" in expr and expr.endswith("> 0")
    assert rule["for"] == "10m" and rule["labels"]["severity"] == "warning"
    tuned = {"apiBusy": {"window": "15m", "for": "30m", "severity": "critical"}}
    values = {"metrics": {"prometheusRule": {"enabled": True, "alerts": tuned}}}
    busy = _rules(values)["StepstreamApiBusy"]
    assert "[15m]" in busy["expr"] and busy["for"] == "30m"
    off = {
        "metrics": {"prometheusRule": {"enabled": True, "alerts": {"apiBusy": {"enabled": False}}}}
    }
    assert "StepstreamApiBusy" not in _rules(off)
