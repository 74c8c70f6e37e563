"""Durations a workflow gives the engine (sleeps, timeouts, retry intervals, queue
windows): a number of seconds or a ``timedelta``, not negative, finite and at most
``MAX_DURATION_S``.

Each becomes a time in milliseconds in a record (an Avro long). An unchecked
``timeout=1e300`` passed every check before and then could not be encoded: the batch
that held it failed to commit again and again, and the whole partition stopped. A
hundred years is longer than anything an engine can be asked to wait for.
"""

from __future__ import annotations

import math
from datetime import timedelta

from stepstream.engine.errors import InvalidPayload

MAX_DURATION_S = 100 * 365 * 86400


def duration_problem(duration: object) -> str | None:
    """Why ``duration`` is not a duration the engine can record, or None."""
    if isinstance(duration, timedelta):
        seconds = duration.total_seconds()
    elif isinstance(duration, int | float) and not isinstance(duration, bool):
        seconds = float(duration)
    else:
        return f"is a {type(duration).__name__}; give a number of seconds or a timedelta"
    if math.isnan(seconds):
        return "is not a number (nan); give a number of seconds or a timedelta"
    if seconds < 0:
        return f"must not be negative, got {duration!r}"
    if seconds > MAX_DURATION_S:
        return (
            f"is longer than the 100 years a duration may be ({duration!r}); leave a "
            "timeout out to wait without one"
        )
    return None


def seconds_of(duration: float | timedelta, what: str) -> float:
    """``duration`` in seconds, or ``ValueError`` naming ``what`` and the problem."""
    problem = duration_problem(duration)
    if problem is not None:
        raise ValueError(f"{what} {problem}")
    if isinstance(duration, timedelta):
        return duration.total_seconds()
    return float(duration)


def wait_timeout(timeout: object) -> float | None:
    """How long a client waits (``Client.result``, ``request``): None, or an infinite
    number, waits without a timeout; else a number of seconds, 0 or more. Anything else
    is ``InvalidPayload``, raised before the client sends anything."""
    if timeout is None:
        return None
    if isinstance(timeout, int | float) and not isinstance(timeout, bool):
        if timeout == math.inf:
            return None
        if timeout >= 0:  # False for nan
            return float(timeout)
    raise InvalidPayload(
        f"timeout={timeout!r}: give a number of seconds, 0 or more, or None to wait without one"
    )
