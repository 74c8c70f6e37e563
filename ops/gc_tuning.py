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
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Mapping

from stepstream.engine.config.environ import ConfigError

log = logging.getLogger("stepstream.gc")

SERVING_THRESHOLDS = (20_000, 10, 10)
VARIABLE = "STEPSTREAM_GC"


def thresholds_from_env(env: Mapping[str, str]) -> tuple[int, int, int] | None:
    """The thresholds to use, or None to keep Python's."""
    raw = env.get(VARIABLE, "").strip()
    if not raw:
        return SERVING_THRESHOLDS
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


def tune_for_serving(env: Mapping[str, str] | None = None) -> None:
    """Apply the serving thresholds and freeze what start-up allocated (modules,
    registered workflows) so collections no longer walk it. Call once the workflow
    modules are imported, before serving."""
    thresholds = thresholds_from_env(os.environ if env is None else env)
    if thresholds is None:
        return
    gc.collect()
    gc.freeze()
    gc.set_threshold(*thresholds)
    log.debug("gc thresholds=%s frozen=%d", thresholds, gc.get_freeze_count())
