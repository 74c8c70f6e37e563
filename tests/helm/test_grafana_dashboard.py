"""The Grafana dashboard shipped with the chart: every query parses as PromQL and selects
only metrics the workers serve, and it shows what an operator watches (throughput,
latency, timer lateness, lag, dead letters, parked instances, rebalances)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from tests.helm.chart import CHART, promql_metrics
from tests.helm.metric_names import series_names

DASHBOARD = CHART / "dashboards" / "stepstream.json"


def _dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def _queries() -> Iterator[tuple[str, str]]:
    """(panel title, PromQL) for every panel target."""
    for panel in _panels(_dashboard()["panels"]):
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]


def test_every_query_parses_and_uses_only_served_metrics() -> None:
    known = series_names()
    queries = list(_queries())
    assert len(queries) >= 20
    for title, expr in queries:
        used = promql_metrics(expr)
        assert used, f"panel {title!r} selects no metric: {expr}"
        assert used <= known, f"panel {title!r} uses {used - known}, not served by workers"


def test_variables_query_served_metrics() -> None:
    known = series_names()
    for variable in _dashboard()["templating"]["list"]:
        if variable["type"] != "query":
            continue
        match = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["query"]["query"])
        assert match, variable["query"]
        assert promql_metrics(match.group(1)) <= known


def test_the_panels_cover_what_an_operator_watches() -> None:
    used_by_title: dict[str, set[str]] = {}
    for title, expr in _queries():
        used_by_title.setdefault(title, set()).update(promql_metrics(expr))
    everything = set().union(*used_by_title.values())
    for metric in [
        "stepstream_steps_total",  # steps/s
        "stepstream_workflows_total",  # workflows/s
        "stepstream_step_attempt_duration_seconds_bucket",
        "stepstream_workflow_duration_seconds_bucket",
        "stepstream_timer_lateness_seconds_bucket",
        "stepstream_consumer_lag_records",
        "stepstream_dead_letters_total",
        "stepstream_parked_instances",
        "stepstream_rebalances_total",
        "stepstream_step_schedule_to_start_seconds_bucket",
        "stepstream_workflow_schedule_to_start_seconds_bucket",
        "stepstream_partition_owned",
        "stepstream_http_requests_total",
        "stepstream_http_request_duration_seconds_bucket",
        "process_resident_memory_bytes",
        "process_cpu_seconds_total",
    ]:
        assert metric in everything, f"no panel shows {metric}"
    assert used_by_title["Steps / s by outcome"] == {"stepstream_steps_total"}
    assert used_by_title["Workflows / s by outcome"] == {"stepstream_workflows_total"}


def test_every_panel_reads_the_chosen_data_source_and_scope() -> None:
    dashboard = _dashboard()
    names = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "namespace", "job"} <= names
    ids = []
    for panel in _panels(dashboard["panels"]):
        ids.append(panel["id"])
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert 'namespace=~"$namespace"' in target["expr"], (panel["title"], target["expr"])
    assert len(ids) == len(set(ids)), "panel ids must be unique"


def test_panels_do_not_overlap() -> None:
    taken: set[tuple[int, int]] = set()
    for panel in _panels(_dashboard()["panels"]):
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        cells = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & taken, f"panel {panel['title']!r} overlaps another"
        taken |= cells
