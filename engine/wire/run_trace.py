"""A run's place in a trace: the ids of its run span and the W3C ``traceparent`` that
names it, derived from the instance alone.

Spans are made from durable records by whichever worker commits them, possibly after a
restart or on another worker. So that each of them (and a child the run starts, whose
StartWorkflow carries this context) names the same run span as its parent, the run
span's id is a hash of the instance id and its start time, and a run started without
trace context gets a trace id derived the same way. The engine computes them when it
starts a child, so they live here, below every span sink.
"""

from __future__ import annotations

import hashlib

SAMPLED = 0x01  # W3C trace flags


def run_span_id(instance_id: str, start_ms: int) -> int:
    """The run span's id: the same wherever it is computed, never 0."""
    digest = hashlib.blake2b(f"{instance_id}\0{start_ms}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") or 1


def trace_id_of_run(instance_id: str, start_ms: int) -> int:
    """For a run started without trace context: one trace per instance all the same."""
    digest = hashlib.blake2b(f"trace\0{instance_id}\0{start_ms}".encode(), digest_size=16)
    return int.from_bytes(digest.digest(), "big") or 1


def _client_trace(traceparent: str | None) -> tuple[int, int] | None:
    """(trace id, flags) of a well-formed W3C ``traceparent``, else None."""
    if not traceparent:
        return None
    parts = traceparent.strip().split("-")
    if len(parts) < 4 or len(parts[1]) != 32 or len(parts[3]) != 2 or parts[0] == "ff":
        return None
    try:
        trace_id, flags = int(parts[1], 16), int(parts[3], 16)
    except ValueError:
        return None
    return (trace_id, flags) if trace_id else None


def run_traceparent(instance_id: str, start_ms: int, traceparent: str | None) -> str:
    """The W3C ``traceparent`` of the run span of ``instance_id`` (started at
    ``start_ms``, its start carrying ``traceparent``): what a child's start carries, so
    the child's run is a span of its parent's run, in its parent's trace."""
    client = _client_trace(traceparent)
    trace_id, flags = (
        client
        if client is not None
        else (
            trace_id_of_run(instance_id, start_ms),
            SAMPLED,
        )
    )
    return f"00-{trace_id:032x}-{run_span_id(instance_id, start_ms):016x}-{flags & 0xFF:02x}"
