"""Garbage-collector settings for the engine's own server processes (``stepstream dev``,
``stepstream worker``, ``stepstream bench``).

The engine allocates many short-lived containers per transition (records, tasks,
coroutines) while it keeps a large long-lived heap (cached instance runtimes, loaded
modules). With CPython's default thresholds (700, 10, 10) the collector runs a full
collection every few seconds of load, each one walking that whole heap: profiled on
W1, full collections took a fifth of the engine's time. Raising the young threshold
and freezing the start-up heap (``gc.freeze``) takes that away; cyclic garbage is still
collected, only in larger batches. ``STEPSTREAM_GC=default`` keeps Python's settings;
``STEPSTREAM_GC=T0,T1,T2`` sets the three thresholds. Processes that embed the engine
in their own code are left alone: the setting belongs to whoever owns the process.

A Kafka worker goes further (``WORKER_THRESHOLDS``). Its batches stay alive across a
produce round trip to the broker, so at 20,000 its young collections kept finding a
thousand in-flight instances alive and freed nothing, and every tenth a generation-1
collection walked them all again (75-85 ms of CPU each, 200-500 ms of wall time on a
busy machine, while a worker took a million timers). The young count falls again as a
batch is freed, so at 100,000 a steady stream of fires rarely reaches a collection: over
the 500 s a worker fired a million timers at 2,000/s, five collections took over 40 ms.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Mapping

from stepstream.engine.config.environ import ConfigError

log = logging.getLogger("stepstream.gc")

SERVING_THRESHOLDS = (20_000, 10, 10)
WORKER_THRESHOLDS = (100_000, 10, 10)
VARIABLE = "STEPSTREAM_GC"


def thresholds_from_env(
    env: Mapping[str, str], default: tuple[int, int, int] = SERVING_THRESHOLDS
) -> tuple[int, int, int] | None:
    """The thresholds to use (``default`` unless the variable says), or None to keep
    Python's."""
    raw = env.get(VARIABLE, "").strip()
    if not raw:
        return default
    if raw == "default":
        return None
    parts = raw.split(",")
    try:
        values = tuple(int(part) for part in parts)
    except ValueError:
        values = ()
    if len(values) != 3 or any(value < 1 for value in values):
        raise ConfigError(
            f"{VARIABLE}={raw!r} is not usable: set three positive whole numbers such as "
            f"{','.join(map(str, SERVING_THRESHOLDS))} (gc thresholds), or 'default' for "
            "Python's own"
        )
    return values[0], values[1], values[2]


def tune_for_serving(
    env: Mapping[str, str] | None = None,
    default: tuple[int, int, int] = SERVING_THRESHOLDS,
) -> None:
    """Apply the serving thresholds (``default``, or what ``STEPSTREAM_GC`` says) and
    freeze what start-up allocated (modules, registered workflows) so collections no
    longer walk it. Call once the workflow modules are imported, before serving."""
    thresholds = thresholds_from_env(os.environ if env is None else env, default)
    if thresholds is None:
        return
    gc.collect()
    gc.freeze()
    gc.set_threshold(*thresholds)
    log.debug("gc thresholds=%s frozen=%d", thresholds, gc.get_freeze_count())
