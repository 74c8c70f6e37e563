"""How long the garbage collector stops this process, per generation.

A collection stops the engine's event loop, so a long one (a full collection walking
every cached instance) shows up as timer lateness and step latency. ``recording()``
hooks ``gc.callbacks`` once per process; the engine's own servers serve the figures as
``stepstream_gc_pause_seconds`` (a histogram) and ``stepstream_gc_pause_max_seconds``,
and ``stepstream bench`` reports them per process.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from stepstream.consumers.telemetry import Histogram

# From a young collection (well under 1 ms) to a full one over a large heap (seconds).
GC_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
GENERATIONS = 3


class GcPauses:
    """The pauses of one process's collector, per generation (0, 1, 2)."""

    def __init__(self) -> None:
        self.seconds = [Histogram(GC_BUCKETS_S) for _ in range(GENERATIONS)]
        self.longest = [0.0] * GENERATIONS
        self._began = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        generation = info["generation"]
        took = time.perf_counter() - self._began
        self.seconds[generation].observe(took)
        if took > self.longest[generation]:
            self.longest[generation] = took

    def figures(self) -> dict[str, Any]:
        """Per generation: collections, their total and the longest (ms)."""
        return {
            f"gen{g}": {
                "collections": self.seconds[g].count,
                "total_ms": round(self.seconds[g].sum * 1000, 1),
                "longest_ms": round(self.longest[g] * 1000, 1),
            }
            for g in range(GENERATIONS)
        }


_recording: GcPauses | None = None


def recording() -> GcPauses:
    """This process's pauses, recorded from the first call on."""
    global _recording
    if _recording is None:
        _recording = GcPauses()
        gc.callbacks.append(_recording)
    return _recording
