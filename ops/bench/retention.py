"""The retention workload: many short instances run to completion and are forgotten by
retention, for the memory the engine keeps once they are gone.

N one-step instances are started and awaited (a bounded number in flight), on an engine
whose retention forgets a finished instance after ``RETENTION_S`` and sweeps every
``SWEEP_INTERVAL_S``. Once none is left (a listing by their id prefix is empty), the
engine has given what it freed back to the system (a heap trim, at most 10 s later) and
the garbage collector has run, the engine's resident memory is what finished-and-forgotten
work leaves behind: it should not grow with N, and what of it is bounded caches is
reported beside it (RocksDB's share of its budget, the settled commands kept).
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Awaitable, Callable
from typing import Any

from stepstream.consumers import rocks_memory
from stepstream.ops.bench.sessions import Session, rss_mb
from stepstream.ops.bench.workloads import RESULT_TIMEOUT_S, Progress, gather_limited

# The engine settings of this workload (the in-process engine's EmbeddedConfig).
RETENTION_S = 1.0
SWEEP_INTERVAL_S = 0.5
_IN_FLIGHT = 200
_PREFIX = "retained-"
# After the last result, how long forgetting every instance may take.
_FORGET_TIMEOUT_S = 600.0


async def retention(session: Session, n: int) -> dict[str, Any]:
    client = session.client
    gc.collect()
    before = rss_mb(session.engine_pids)
    peak = before
    progress = Progress("instances run", n)

    def runner(i: int) -> Callable[[], Awaitable[None]]:
        async def one() -> None:
            nonlocal peak
            instance_id = f"{_PREFIX}{i}"
            await client.start("bench-steps", {"steps": 1}, instance_id=instance_id)
            await client.result(instance_id, timeout=RESULT_TIMEOUT_S)
            progress.tick()
            if i % 1000 == 0:
                peak = max(peak, rss_mb(session.engine_pids))

        return one

    began = time.perf_counter()
    await gather_limited([runner(i) for i in range(n)], _IN_FLIGHT)
    ran_s = time.perf_counter() - began
    at_end = rss_mb(session.engine_pids)
    deadline = time.monotonic() + _FORGET_TIMEOUT_S
    while (await client.list_page(prefix=_PREFIX, limit=1)).instances:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"retention: instances still there {_FORGET_TIMEOUT_S:.0f} s after the last "
                "one finished"
            )
        peak = max(peak, rss_mb(session.engine_pids))
        await asyncio.sleep(0.5)
    forgotten_s = time.perf_counter() - began
    # The engine gives what it freed back to the system at most every 10 s after
    # retention forgot many (consumers/heap_trim.py): what it keeps is measured after that.
    while session.host is not None and session.host.heap_trim.due:
        await asyncio.sleep(0.5)
    gc.collect()
    after = rss_mb(session.engine_pids)
    return {
        "n": n,
        "instances_per_s": round(n / ran_s, 1),
        "ran_s": round(ran_s, 3),  # 20 instances run in a few ms on a quiet machine
        "all_forgotten_s": round(forgotten_s, 3),
        "retention_s": RETENTION_S,
        "rss_mb_before": before,
        "rss_mb_after_run": at_end,
        "rss_mb_peak": max(peak, at_end),
        "rss_mb_after_retention": after,
        "rss_of": "bench process (engine and client)",
        # What of it is bounded, and by what (docs/performance.md): RocksDB's blocks and
        # memtables within its budget (STEPSTREAM_ROCKSDB_MEMORY_MB), and the commands
        # the host still remembers as settled (consumers/host.py RECENT_SETTLED).
        "rocksdb_mb_after_retention": round(rocks_memory.usage_bytes() / 2**20, 1),
        "rocksdb_budget_mb": round(rocks_memory.limit_bytes() / 2**20, 1),
        "settled_commands_kept": session.host.recent_settled if session.host else None,
        # How often the engine gave freed memory back to the system (consumers/heap_trim).
        "heap_trims": session.host.heap_trim.trims if session.host else None,
    }
