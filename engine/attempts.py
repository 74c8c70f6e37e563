"""The running step attempt's "given up" flag, and ``attempt_cancelled()`` that reads it.

A step attempt is given up when its timeout passes or the engine cancels it (a lost
race, a cancelled instance). An async body is cancelled outright; a sync body runs in a
thread nobody can stop, so it is flagged instead and may poll ``attempt_cancelled()``
to stop early. The step executor sets the flag's context variable around each body.
"""

from __future__ import annotations

from contextvars import ContextVar


class AttemptFlag:
    """Set once when an attempt is given up. A plain attribute, not a threading.Event:
    only the loop sets it and a body only reads it, and one is made per attempt."""

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


# The flag of the attempt whose body runs in this context; None outside step bodies.
current_flag: ContextVar[AttemptFlag | None] = ContextVar("stepstream_attempt_flag", default=None)


def attempt_cancelled() -> bool:
    """True once the step attempt running this code was given up: its ``timeout``
    passed, or the engine cancelled it (a race it lost, a cancelled instance).

    A sync step body keeps its thread until it returns, so a long-running one should
    check this now and then and return (or raise) when it is True; whatever it returns
    after that is discarded. False outside a step body.
    """
    flag = current_flag.get()
    return flag is not None and flag.is_set()
