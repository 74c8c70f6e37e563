"""The event loop of the engine's own processes (``stepstream dev``, ``worker``, ``run``,
``bench`` and the CLI's commands): uvloop, libuv's implementation of asyncio's loop.

The engine's time goes largely to the event loop's own work: scheduling callbacks,
running tasks a step at a time, socket reads and writes. uvloop does that work in C.
``STEPSTREAM_EVENT_LOOP=asyncio`` keeps the standard library's loop (to compare, or
where uvloop cannot be installed: without it the standard loop is used and the log
says so). Processes that embed the engine in their own code are left alone: the loop
belongs to whoever owns the process.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

from stepstream.engine.config.environ import ConfigError

log = logging.getLogger("stepstream.loop")

VARIABLE = "STEPSTREAM_EVENT_LOOP"
CHOICES = ("uvloop", "asyncio")
T = TypeVar("T")


def loop_factory(
    env: Mapping[str, str] | None = None,
) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """What makes the event loop ``STEPSTREAM_EVENT_LOOP`` asks for (default uvloop);
    None for the standard library's."""
    raw = (os.environ if env is None else env).get(VARIABLE, "").strip().lower() or "uvloop"
    if raw not in CHOICES:
        raise ConfigError(
            f"{VARIABLE}={raw!r} is not one of {', '.join(CHOICES)}: set uvloop (the "
            "default) or asyncio (the standard library's loop)"
        )
    if raw == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        log.warning(
            "uvloop is not installed: running on asyncio's own event loop, which is "
            "slower; pip install uvloop, or set %s=asyncio to say so",
            VARIABLE,
        )
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on the loop ``loop_factory`` makes."""
    try:
        factory = loop_factory()
    except ConfigError:
        main.close()  # never awaited: no warning about it on top of the error
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


def running_loop_name() -> str:
    """``uvloop`` or ``asyncio``: the loop this code runs on (for reports)."""
    return (
        "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"
    )
