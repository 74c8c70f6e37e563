"""Queue metrics, from the durable records of the queues' own instances
(``engine.api.queue_service``): each iteration's ``LoopAdvanced`` carries the queue's
waiting list and holders, and each admission (a ``MessageSent`` named
``queue.admitted/...``) how long it waited. Labelled by queue name: a ``per_key`` queue's
keys are summed, so a tenant id never becomes a label."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stepstream.engine.api.queues import QUEUE_ADMITTED, QUEUE_INSTANCE_PREFIX
from stepstream.engine.errors import StepstreamError
from stepstream.engine.wire.codec import decode_safely
from stepstream.engine.wire.records import HistoryRecord, LoopAdvanced, MessageSent

if TYPE_CHECKING:
    from stepstream.consumers.telemetry import Histogram
    from stepstream.engine.replay.runtime import InstanceRuntime


def queue_name(instance_id: str) -> str:
    """``pool`` of ``~queue/pool`` and of ``~queue/pool/<key>``."""
    return instance_id[len(QUEUE_INSTANCE_PREFIX) :].split("/", 1)[0]


class QueueTelemetry:
    def __init__(self, new_histogram: Any) -> None:
        self._new_histogram = new_histogram
        # partition -> queue instance -> (waiting, running), as last committed.
        self._sizes: dict[int, dict[str, tuple[int, int]]] = {}
        self.admission_wait_seconds: dict[str, Histogram] = {}

    def recorded(
        self, partition: int, record: HistoryRecord, runtime: InstanceRuntime | None
    ) -> None:
        """Count one durable record of a queue instance (the caller checked the id)."""
        if runtime is None:
            return
        if isinstance(record, LoopAdvanced):
            state = _decoded(runtime, record.state)
            if isinstance(state, dict):
                sizes = (len(state.get("waiting", ())), len(state.get("running", ())))
                self._sizes.setdefault(partition, {})[record.instance_id] = sizes
        elif isinstance(record, MessageSent) and record.name.startswith(QUEUE_ADMITTED):
            admission = _decoded(runtime, record.payload)
            if isinstance(admission, dict):
                name = queue_name(record.instance_id)
                histogram = self.admission_wait_seconds.get(name)
                if histogram is None:
                    histogram = self.admission_wait_seconds[name] = self._new_histogram()
                histogram.observe(max(0, int(admission.get("waited_ms", 0))) / 1000)

    def sizes(self) -> dict[str, tuple[int, int]]:
        """Queue name -> (waiting, running) over the queue instances owned here."""
        out: dict[str, tuple[int, int]] = {}
        for instances in self._sizes.values():
            for instance_id, (waiting, running) in instances.items():
                w, r = out.get(queue_name(instance_id), (0, 0))
                out[queue_name(instance_id)] = (w + waiting, r + running)
        return out

    def partition_released(self, partition: int) -> None:
        """Its queues are counted by their new owner now."""
        self._sizes.pop(partition, None)


def _decoded(runtime: InstanceRuntime, payload: Any) -> Any:
    try:
        return decode_safely(runtime.codec, payload)
    except StepstreamError:
        return None
