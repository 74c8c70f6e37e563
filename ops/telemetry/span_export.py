"""Spans built and exported by a process of their own, so tracing costs the engine's
event loop almost nothing.

The engine's loop only appends each commit's activations and finished step attempts
(a list of flat tuples, ``consumers/spans.py``) to a batch; a ``multiprocessing`` queue
carries the batches to a child process, which exports them as configured by the
``OTEL_*`` variables it inherits. To OTLP over HTTP (the usual case) it writes each
batch's request bytes itself (``ops/telemetry/otlp_wire.py``, about 5 µs a span against
the SDK's 60: the child shares the second core with the WAL's fsyncs and the clients);
to anything else it makes finished SDK spans (``ops/telemetry/span_direct.py``) for the
SDK's exporter. It exits when told to (flushing what it holds) or when its parent is
gone. If it falls behind (an OTLP endpoint that does not answer), the engine drops whole
batches beyond ``MAX_BACKLOG`` rather than hold them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import marshal
import multiprocessing
import os
import queue
import time
from typing import Any

from stepstream.consumers.spans import (
    FLAT_ACTIVATION,
    FLAT_STEP,
    ActivationSpan,
    StepSpan,
    flat_activation,
    flat_step,
    named,
)
from stepstream.ops.telemetry import logs
from stepstream.producers.trace_context import ProducerSpan

log = logging.getLogger("stepstream.tracing")

BATCH = 2048  # spans per message to the exporter process (and per OTLP request)
MAX_BACKLOG = 32  # batches handed over and not yet exported (65,536 spans): beyond, dropped
WARN_EVERY_S = 10.0
_PRODUCER = max(FLAT_STEP, FLAT_ACTIVATION) + 1  # a producer span's kind, in a batch
FLUSH_AFTER_S = 0.2  # the longest a span waits in a batch
STOP_TIMEOUT_S = 10.0
DROP_REASONS = ("backlog", "export_failed")  # why spans were not exported
NICENESS = 10  # added to the exporter process's nice value


class SpanExportProcess:
    """A ``SpanSink`` whose spans another process makes and exports."""

    def __init__(self, service: str) -> None:
        context = multiprocessing.get_context("spawn")
        self._queue: Any = context.Queue()
        self._done: Any = context.Value("q", 0, lock=False)  # batches the child took
        self._failed: Any = context.Value("q", 0, lock=False)  # spans it failed to export
        self._ready: Any = context.Event()  # set once the child has its exporter
        self._sent = 0
        self.dropped = 0  # spans dropped because the exporter fell behind
        self._warned = -WARN_EVERY_S
        self._process = context.Process(
            target=_export,
            args=(
                self._queue,
                self._done,
                self._failed,
                self._ready,
                service,
                os.getpid(),
                logs.configured(),
            ),
            name="stepstream-span-export",
            daemon=True,
        )
        self._process.start()
        self._batch: list[Any] = []
        self._count = 0  # spans in the batch
        self._timer: asyncio.TimerHandle | None = None

    # A commit's spans wait in the batch as the list the engine made of them, each a flat
    # tuple: nothing is copied or made per span here, and the batch is marshalled in one
    # call when it leaves (the span tuples live until then; flattening them into one list
    # cost the engine more than the collector's walks of them).
    def step(self, span: StepSpan) -> None:
        self._batch.append([flat_step(span)])
        self._added(1)

    def activation(self, span: ActivationSpan) -> None:
        self._batch.append([flat_activation(span)])
        self._added(1)

    def spans_flat(self, spans: list[tuple[object, ...]]) -> None:
        """A commit's spans, flat (``FlatSpanSink``); the list is kept, not copied."""
        self._batch.append(spans)
        self._added(len(spans))

    def producer(self, span: ProducerSpan) -> None:
        self._batch.append([(_PRODUCER, *span)])
        self._added(1)

    def _added(self, count: int) -> None:
        self._count += count
        if self._count >= BATCH:
            self.flush()
        elif self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return  # not on an event loop (a thread): the next flush takes it
            self._timer = loop.call_later(FLUSH_AFTER_S, self.flush)

    def wait_ready(self, timeout: float) -> bool:
        """Block until the exporter process has imported and configured its exporter
        (about 0.3 s of CPU), or ``timeout``; whether it is. Spans handed over before
        then wait in the queue: this only keeps a start-up off a measurement."""
        return bool(self._ready.wait(timeout))

    def spans_dropped(self) -> dict[str, int]:
        """Spans lost so far, by why (``DROP_REASONS``): the exporter fell behind
        (``backlog``), or the endpoint failed or refused them (``export_failed``)."""
        return dict(zip(DROP_REASONS, (self.dropped, int(self._failed.value)), strict=True))

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._batch:
            batch, count, self._batch, self._count = self._batch, self._count, [], 0
            if self._sent - self._done.value >= MAX_BACKLOG:
                self.dropped += count
                now = time.monotonic()
                if now - self._warned >= WARN_EVERY_S:
                    self._warned = now
                    log.warning(
                        "the span exporter is %d batches behind (is the OTLP endpoint up?); "
                        "%d spans dropped so far",
                        self._sent - self._done.value,
                        self.dropped,
                    )
                return
            data = marshal.dumps(batch)  # bytes: the queue's feeder thread only copies
            self._sent += 1
            self._queue.put(data)

    def close(self) -> None:
        """Export what is left and stop the exporter process."""
        self.flush()
        self._queue.put(None)
        self._process.join(STOP_TIMEOUT_S)
        if self._process.is_alive():
            log.warning("span exporter did not stop within %.0f s; stopping it", STOP_TIMEOUT_S)
            self._process.terminate()
        # Nobody reads the pipe any more: the process must not wait at exit for the
        # queue's thread to write what is left (a child that ended early left it full).
        self._queue.cancel_join_thread()
        self._queue.close()


def _export(
    spans: Any,
    done: Any,
    failed: Any,
    ready: Any,
    service: str,
    parent: int,
    logging_as: tuple[str, str, int | None] | None = None,
) -> None:
    """The exporter process: spans in, OTLP out, until told to stop or orphaned.
    ``failed`` counts the spans it could not export (the endpoint refused or failed).
    ``logging_as``: the parent's log settings (its lines, the OTLP exporter's and the
    HTTP library's included, come out as the parent's do: JSON ones for a log pipeline).

    It runs at a lower CPU priority than the engine: spans can wait a moment, a
    transition cannot. When the cores are busy the engine's threads get them first, and
    an exporter left too far behind has its batches dropped (and counted) rather than
    the engine slowed."""
    if logging_as is not None:
        level, log_format, process = logging_as
        logs.configure(level, log_format, process=process)
    with contextlib.suppress(OSError):
        os.nice(NICENESS)
    from stepstream.ops.telemetry.otlp_wire import wire_from_env
    from stepstream.ops.telemetry.span_direct import direct_from_env

    try:
        sink = wire_from_env(os.environ, service=service) or direct_from_env(
            os.environ, service=service
        )
    finally:
        ready.set()  # configured, or failed and said why on stderr: nobody waits longer
    if sink is None:
        return
    raised = 0
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
            spans_in = _spans(marshal.loads(batch))
            try:
                sink.batch(spans_in)
            except Exception:
                log.exception("exporting %d spans failed; they are dropped", len(spans_in))
                raised += len(spans_in)
            failed.value = raised + getattr(sink, "dropped", 0)
            done.value += 1
    finally:
        sink.shutdown()


def _spans(commits: list[list[tuple[Any, ...]]]) -> list[StepSpan | ActivationSpan | ProducerSpan]:
    """The spans of a batch: lists of flat spans (``FlatSpanSink``), each a tuple that
    begins with its kind; a producer span's fields follow its kind as they are."""
    spans: list[StepSpan | ActivationSpan | ProducerSpan] = []
    for commit in commits:
        for flat in commit:
            if flat[0] == _PRODUCER:
                spans.append(ProducerSpan._make(flat[1:]))
            else:
                spans.append(named(flat))
    return spans
