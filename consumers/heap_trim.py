"""Giving freed memory back to the system once retention has forgotten many instances.

Forgetting an instance frees what it held (its state as read, its cached runtime, the
RocksDB work of deleting its keys), but glibc's allocator keeps freed memory in its
arenas, for the process to reuse, unless it lies at the very top of the heap: measured
over 10,000 to 100,000 short instances forgotten by retention, 5-27 MB of an embedded
engine's resident memory was free memory glibc had not returned, and ``malloc_trim(0)``
gave it back. So after sweeps that forgot ``STEPSTREAM_MALLOC_TRIM_AFTER`` instances
(1,000 by default; 0 never trims) the process trims its heap, at most once every
``MIN_INTERVAL_S``, on a thread (the call releases the GIL). Only on glibc: other C
libraries have no ``malloc_trim`` and return memory their own way.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from stepstream.engine.config.environ import env_int

log = logging.getLogger("stepstream.memory")

ENV = "STEPSTREAM_MALLOC_TRIM_AFTER"
DEFAULT_AFTER = 1000
# Trimming walks every arena, holding its lock (a few ms on a heap of 100 MB): a
# steady stream of forgotten instances trims now and then, not at every sweep.
MIN_INTERVAL_S = 10.0


def _glibc_malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(None)
    except (OSError, TypeError):  # no C library of the process to load (Windows)
        return None
    found: Any = getattr(libc, "malloc_trim", None)
    if found is None:  # musl, macOS: no malloc_trim
        return None
    found.argtypes = [ctypes.c_size_t]
    found.restype = ctypes.c_int
    trim: Callable[[int], int] = found
    return trim


_MALLOC_TRIM = _glibc_malloc_trim()


def available() -> bool:
    """Whether this process's C library can give freed memory back (glibc)."""
    return _MALLOC_TRIM is not None


def resident_bytes() -> int:
    """The process's resident memory (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def trim() -> bool:
    """Give the memory the allocator holds free back to the system, now; False where the
    C library cannot (not glibc)."""
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True


class HeapTrim:
    """Counts the instances the process's sweeps forgot, and trims the heap once they
    reach ``after`` (``forgotten``), at most once every ``interval_s``."""

    def __init__(self, after: int = DEFAULT_AFTER, *, interval_s: float = MIN_INTERVAL_S) -> None:
        self.after = after if available() else 0
        self._interval_s = interval_s
        self._pending = 0  # forgotten since the last trim
        self._last = -interval_s  # loop time of the last trim
        self._scheduled: asyncio.TimerHandle | None = None
        self._running: asyncio.Task[None] | None = None
        self.trims = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> HeapTrim:
        return cls(env_int(env, ENV, DEFAULT_AFTER, minimum=0))

    def forgotten(self, count: int) -> None:
        """A sweep forgot ``count`` instances (called on the event loop)."""
        if self.after <= 0 or count <= 0:
            return
        self._pending += count
        if self._pending < self.after or self._scheduled is not None or self._running is not None:
            return
        loop = asyncio.get_running_loop()
        delay = max(0.0, self._last + self._interval_s - loop.time())
        self._scheduled = loop.call_later(delay, self._start)

    def _start(self) -> None:
        self._scheduled = None
        self._running = asyncio.get_running_loop().create_task(
            self._trim(), name="stepstream-heap-trim"
        )

    async def _trim(self) -> None:
        forgotten, self._pending = self._pending, 0
        before = resident_bytes()
        began = time.perf_counter()
        try:
            await asyncio.to_thread(trim)
        finally:
            self._last = asyncio.get_running_loop().time()
            self._running = None
        self.trims += 1
        after = resident_bytes()
        log.info(
            "returned %.1f MB of freed memory to the system (malloc_trim, %.1f ms) after "
            "retention forgot %d instances; resident now %.1f MB",
            max(0, before - after) / 2**20,
            (time.perf_counter() - began) * 1000,
            forgotten,
            after / 2**20,
        )
        if self._pending >= self.after and self._scheduled is None:
            # Enough were forgotten while it ran: the next one after the interval.
            self._scheduled = asyncio.get_running_loop().call_later(self._interval_s, self._start)

    @property
    def due(self) -> bool:
        """Whether a trim is scheduled or running."""
        return self._scheduled is not None or self._running is not None

    def close(self) -> None:
        """Stop: nothing more is trimmed (a trim already running finishes on its
        thread)."""
        if self._scheduled is not None:
            self._scheduled.cancel()
            self._scheduled = None
        if self._running is not None:
            self._running.cancel()
            self._running = None
