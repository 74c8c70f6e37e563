"""The running step attempt as its body sees it: its number, its "given up" flag
(``attempt_cancelled()`` reads it) and the host's outbox (``ctx.publish``).

A step attempt is given up when its timeout passes or the engine cancels it (a lost
race, a cancelled instance). An async body is cancelled outright; a sync body runs in a
thread nobody can stop, so it is flagged instead and may poll ``attempt_cancelled()``
to stop early. The step executor sets one context variable, ``current_flag``, around
each body (one set per step: this is the engine's hot path).
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import TYPE_CHECKING

from stepstream.engine.errors import InvalidWorkflowCall

if TYPE_CHECKING:
    from stepstream.engine.api.outbox import Outbox


class AttemptFlag:
    """One attempt of a step, for its body: ``attempt`` (1-based), the outbox of the host
    running it, and a flag set once when the attempt is given up. A plain attribute, not
    a threading.Event: only the loop sets it and a body only reads it, and one is made
    per attempt."""

    __slots__ = ("_set", "attempt", "outbox")

    def __init__(self, attempt: int = 0, outbox: Outbox | None = None) -> None:
        self._set = False
        self.attempt = attempt
        self.outbox = outbox

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


# The flag of the attempt whose body runs in this context; None outside step bodies.
current_flag: ContextVar[AttemptFlag | None] = ContextVar("stepstream_attempt_flag", default=None)


def attempt_number() -> int:
    """The attempt number (1-based) of the step body running this code; 0 outside."""
    flag = current_flag.get()
    return 0 if flag is None else flag.attempt


def refuse_in_step_body(what: str) -> None:
    """Raise ``InvalidWorkflowCall`` when ``what`` (a ``ctx`` call) runs in a step body:
    what it records would land between the step's own records, where no replay of the
    workflow code reaches it."""
    if attempt_number():
        raise InvalidWorkflowCall(
            f"{what} was called inside a step body; step bodies do the work of one step "
            "and must not call ctx methods (call them from the workflow function instead)"
        )


def attempt_cancelled() -> bool:
    """True once the step attempt running this code was given up: its ``timeout``
    passed, or the engine cancelled it (a race it lost, a cancelled instance).

    A sync step body keeps its thread until it returns, so a long-running one should
    check this now and then and return (or raise) when it is True; whatever it returns
    after that is discarded. False outside a step body.
    """
    flag = current_flag.get()
    return flag is not None and flag.is_set()
