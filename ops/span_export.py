"""Spans built and exported by a process of their own, so tracing costs the engine's
event loop almost nothing.

Measured on W1: the OpenTelemetry SDK takes about 25 µs to make a span and its OTLP
encoder about 38 µs to encode one, all of it Python holding the GIL: in the engine's
process that halved the steps per second. Here the engine's loop only appends each
finished run and step attempt (named tuples) to a batch; a ``multiprocessing`` queue
carries the batches to a child process, which makes them into finished spans
(``ops/span_direct.py``: the ids, names and attributes of ``ops.tracing.OtelSpans``)
and exports them with the SDK's batch processor and OTLP exporter, configured by the
``OTEL_*`` variables it inherits. The
child runs on the other core; it exits when told to (flushing what it holds) or when
its parent is gone.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import queue
from typing import Any

from consumers.telemetry import RunSpan, StepSpan

log = logging.getLogger("stepstream.tracing")

BATCH = 512  # spans per message to the exporter process
FLUSH_AFTER_S = 0.2  # the longest a span waits in a batch
STOP_TIMEOUT_S = 10.0


class SpanExportProcess:
    """A ``SpanSink`` whose spans another process makes and exports."""

    def __init__(self, service: str) -> None:
        context = multiprocessing.get_context("spawn")
        self._queue: Any = context.Queue()
        self._process = context.Process(
            target=_export,
            args=(self._queue, service, os.getpid()),
            name="stepstream-span-export",
            daemon=True,
        )
        self._process.start()
        self._batch: list[StepSpan | RunSpan] = []
        self._timer: asyncio.TimerHandle | None = None

    def step(self, span: StepSpan) -> None:
        self._add(span)

    def run(self, span: RunSpan) -> None:
        self._add(span)

    def _add(self, span: StepSpan | RunSpan) -> None:
        batch = self._batch
        batch.append(span)
        if len(batch) >= BATCH:
            self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(FLUSH_AFTER_S, self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._batch:
            batch, self._batch = self._batch, []
            self._queue.put(batch)  # pickled by the queue's feeder thread

    def close(self) -> None:
        """Export what is left and stop the exporter process."""
        self.flush()
        self._queue.put(None)
        self._process.join(STOP_TIMEOUT_S)
        if self._process.is_alive():
            log.warning("span exporter did not stop within %.0f s; stopping it", STOP_TIMEOUT_S)
            self._process.terminate()
        self._queue.close()


def _export(spans: Any, service: str, parent: int) -> None:
    """The exporter process: spans in, OTLP out, until told to stop or orphaned."""
    from ops.span_direct import direct_from_env

    sink = direct_from_env(os.environ, service=service)
    if sink is None:
        return
    try:
        while True:
            try:
                batch = spans.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent:
                    return  # the engine's process is gone (killed): nothing more comes
                continue
            if batch is None:
                return
            for span in batch:
                if isinstance(span, StepSpan):
                    sink.step(span)
                else:
                    sink.run(span)
    finally:
        sink.shutdown()
