"""Retry policy of a step: how many attempts, and how long to back off between them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from stepstream.engine.api.durations import duration_problem


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Exponential backoff: attempt n waits ``initial_interval * backoff**(n-1)`` seconds,
    capped at ``max_interval``, before attempt n+1. ``max_attempts`` counts the first one;
    None retries for ever (recorded as 0)."""

    max_attempts: int | None = 3
    initial_interval: float = 0.1
    backoff: float = 2.0
    max_interval: float = 30.0

    def __post_init__(self) -> None:
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError("RetryPolicy.max_attempts must be at least 1, or None (no limit)")
        for what in ("initial_interval", "max_interval"):
            problem = duration_problem(getattr(self, what))
            if problem is not None:
                raise ValueError(f"RetryPolicy.{what} {problem}")
        if self.backoff < 1:
            raise ValueError("RetryPolicy.backoff must be at least 1.0")

    def delay_ms(self, failed_attempt: int) -> int:
        """Milliseconds to wait after attempt ``failed_attempt`` (1-based) failed."""
        seconds = self.initial_interval * self.backoff ** (failed_attempt - 1)
        # Rounded first so float noise (0.2 * 3 = 0.6000000000000001) adds no millisecond.
        return math.ceil(round(min(seconds, self.max_interval) * 1000, 6))


DEFAULT_RETRY = RetryPolicy()
