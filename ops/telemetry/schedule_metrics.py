"""The schedules' counters at /metrics, read from the schedules this process owns when
Prometheus scrapes (each schedule's counts are durable in its instance's state, so they
survive restarts and move with the partition, as a counter should).

- ``stepstream_schedule_slots_skipped_total{schedule, reason}``: slots not started,
  ``reason`` ``catchup`` (older than the catch-up window when the schedule woke) or
  ``overlap`` (held back by the overlap policy)
- ``stepstream_schedule_instances_started_total{schedule}``: instances started, by slot
  or trigger
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from stepstream.consumers.host import PartitionHost
from stepstream.engine.api.schedule_spec import SCHEDULE_ID_PREFIX, SCHEDULE_WORKFLOW
from stepstream.engine.api.schedules import LOOP
from stepstream.engine.errors import StepstreamError
from stepstream.engine.reads.listing import MAX_PAGE_SIZE, ListQuery
from stepstream.engine.wire.codec import decode_safely

# Instances each partition looks at per page: schedules are few, and sit under one prefix.
_BUDGET = 10_000


class ScheduleCollector(Collector):
    def __init__(self, host: PartitionHost) -> None:
        self._host = host

    def collect(self) -> Iterator[Metric]:
        skipped = CounterMetricFamily(
            "stepstream_schedule_slots_skipped",
            "Schedule slots not started, by schedule and reason (catchup: older than the "
            "catch-up window when the schedule woke; overlap: held back by its policy).",
            labels=["schedule", "reason"],
        )
        started = CounterMetricFamily(
            "stepstream_schedule_instances_started",
            "Instances schedules started (slots and triggers), by schedule.",
            labels=["schedule"],
        )
        for name, state in self._schedules():
            skipped.add_metric([name, "catchup"], int(state["skipped_catchup"]))
            skipped.add_metric([name, "overlap"], int(state["skipped_overlap"]))
            started.add_metric([name], int(state["started"]))
        yield skipped
        yield started

    def _schedules(self) -> Iterator[tuple[str, dict[str, Any]]]:
        after: str | None = None
        while True:
            query = ListQuery(None, SCHEDULE_WORKFLOW, SCHEDULE_ID_PREFIX, after, MAX_PAGE_SIZE)
            page = self._host.list_page(query, _BUDGET)
            for view in page.instances:
                try:
                    state = self._host.read_state(view.instance_id)
                    entry = state.entries.get(LOOP)
                    if entry is None or entry.result is None:
                        continue
                    loop_state = decode_safely(self._host.codec, entry.result)
                except StepstreamError:
                    continue  # moved or forgotten since the page was read
                yield view.instance_id[len(SCHEDULE_ID_PREFIX) :], loop_state
            if page.next is None:
                return
            after = page.next
