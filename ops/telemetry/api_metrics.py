"""Metrics of what the HTTP API holds and refuses: its pending calls and waits against
the ``--max-pending`` bound, the calls it refused and why, and its session websockets'
calls and frames.

The API counts in plain ints on the event loop (``ops.api.limits.Pending``,
``ops.api.session.Session``); this collector reads them when Prometheus scrapes (on the
same loop). Labels take a fixed set of values: a refusal's reason, a session call's op
(an unknown op is ``other``), a frame's direction.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from stepstream.ops.api.limits import Pending


class SessionCounts(Protocol):
    """What ``ops.api.session.Session`` counts."""

    @property
    def sessions(self) -> int: ...

    @property
    def calls_by_op(self) -> Mapping[str, int]: ...

    @property
    def frames(self) -> Mapping[str, int]: ...


class ApiCollector(Collector):
    """The API's families, over one app's ``Pending`` and ``Session``."""

    def __init__(self, pending: Pending, sessions: SessionCounts) -> None:
        self._pending = pending
        self._sessions = sessions

    def collect(self) -> Iterator[Metric]:
        pending, sessions = self._pending, self._sessions
        yield _gauge(
            "stepstream_api_pending_calls",
            "Calls and waits the API holds now over all its clients (session calls from "
            "when they are read until they end, HTTP result and command waits while they "
            "wait), against stepstream_api_max_pending_calls.",
            pending.count,
        )
        yield _gauge(
            "stepstream_api_pending_waits",
            "Of those, the waits (result, reply, settled, and reads after a start): they "
            "may fill at most 90% of the bound.",
            pending.waits,
        )
        yield _gauge(
            "stepstream_api_max_pending_calls",
            "The bound on pending calls and waits (--max-pending, STEPSTREAM_MAX_PENDING).",
            pending.limit,
        )
        refused = CounterMetricFamily(
            "stepstream_api_refused_calls",
            "Calls refused at once with ServerBusy, by reason: max_pending (the bound was "
            "full), waits_share (waits filled their share of it), session_calls (the "
            "session already ran as many calls as one session may).",
            labels=["reason"],
        )
        for reason, n in pending.refused.items():
            refused.add_metric([reason], n)
        yield refused
        yield _gauge(
            "stepstream_api_sessions",
            "Session websockets open (the http:// and kafka:// clients hold one each).",
            sessions.sessions,
        )
        calls = CounterMetricFamily(
            "stepstream_api_session_calls",
            "Calls received over session websockets, by op (start, send_event, "
            "cancel_workflow, pause, resume, status, history, result, reply, finished, "
            "settled, cancel; any other: other).",
            labels=["op"],
        )
        for op, n in sessions.calls_by_op.items():
            calls.add_metric([op], n)
        yield calls
        frames = CounterMetricFamily(
            "stepstream_api_session_frames",
            "Text frames of session websockets, by direction: received (each a batch of "
            "calls) and sent (each a batch of replies).",
            labels=["direction"],
        )
        for direction, n in sessions.frames.items():
            frames.add_metric([direction], n)
        yield frames


def _gauge(name: str, doc: str, value: float) -> Metric:
    family = GaugeMetricFamily(name, doc)
    family.add_metric([], value)
    return family
