"""``Queue``: limits on how many instances (or step calls) run at once and how many are
admitted per time window, held across every worker of the group.

Each queue (each queue and key, with ``per_key=True``) is one engine-owned instance,
``~queue/<name>[/<key>]``, running the workflow ``engine.api.queue_service`` defines. Its
instance id puts it on one partition, so one owner decides every admission, as commands
applied in that partition's commits: durable, replay-safe, applied once, and surviving a
kill -9 or a change of owner like any instance.

What asks for a slot (this module, from the asking instance's workflow code):

1. sends ``queue.acquire`` to the queue instance (a recorded message, published with the
   commit; ``engine.replay.admission`` starts the queue instance with it);
2. waits for ``queue.admitted/<key>`` (a durable message wait; a workflow waiting here
   keeps status ``pending``). Its payload says when the queue admitted it;
3. sends ``queue.release`` when it is done. A cancelled instance withdraws what it
   asked for (``engine.replay.admission.withdraw``).

A step in a queue (``queued_step``) holds a slot per attempt, not for the whole step: it
releases the slot when an attempt fails, waits out the backoff durably (a sleep keyed
``<step>#backoff#<attempt>``), then asks again (``<step>#slot#<attempt>``) before the
next attempt starts, so a step backing off holds no slot.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from stepstream.engine.api.durations import MAX_DURATION_S, duration_problem
from stepstream.engine.errors import InvalidWorkflowCall
from stepstream.engine.wire.names import event_name_problem, name_problem, whole_in

if TYPE_CHECKING:
    from stepstream.engine.api.context import Context

T = TypeVar("T")

# The engine's instance of each queue, the messages an instance sends it, and the one it
# answers with (the name ends with the asker's replay key).
QUEUE_INSTANCE_PREFIX = "~queue/"
QUEUE_WORKFLOW = "stepstream.queue"
QUEUE_ACQUIRE = "queue.acquire"
QUEUE_RELEASE = "queue.release"
QUEUE_ADMITTED = "queue.admitted/"
# The name of an admission's replay key (``queue``, ``queue#2``, ``scope/queue``).
WORKFLOW_SLOT = "queue"
# What ends the key of a slot asked for again (``queue#ask2``): "#" is not in step names.
_ASK = "#ask"


def ask_key(slot_key: str, given_back: int) -> str:
    """The replay key a slot is asked for under once a reset or fork gave back its
    ``given_back`` first asks (``engine.replay.slots``): the slot's own key at first."""
    return slot_key if given_back == 0 else f"{slot_key}{_ASK}{given_back + 1}"


def asked_slot(key: str) -> tuple[str, int]:
    """The slot key an ask's replay key is for, and which ask it is (1: the first)."""
    head, sep, tail = key.rpartition(_ASK)
    if sep and tail.isdigit():
        return head, int(tail)
    return key, 1


@dataclass(frozen=True, slots=True)
class Queue:
    """A limit shared by every worker: at most ``concurrency`` holders at once, at most
    ``rate[0]`` admissions per ``rate[1]`` seconds. ``per_key=True`` keeps the limits
    for each key (``queue_key=``, a tenant) apart. Waiters are admitted by priority
    (lower number first), then in arrival order."""

    name: str
    concurrency: int | None = None
    rate: tuple[int, float] | None = None
    per_key: bool = False

    def __post_init__(self) -> None:
        problem = name_problem(self.name)
        if problem is None and "/" in self.name:
            problem = "must not contain '/'"
        if problem is not None:
            raise ValueError(f"queue name {self.name!r} {problem}")
        if self.concurrency is None and self.rate is None:
            raise ValueError(
                f"queue {self.name!r} has no limit: give concurrency=N, rate=(N, seconds) or both"
            )
        if self.concurrency is not None and not whole_in(self.concurrency, 1):
            raise ValueError(
                f"queue {self.name!r}: concurrency must be a whole number of at least 1, "
                f"not {self.concurrency!r}"
            )
        if self.rate is not None:
            count, window = self.rate if _pair(self.rate) else (0, 0)
            if not whole_in(count, 1) or duration_problem(window) is not None or not window > 0:
                raise ValueError(
                    f"queue {self.name!r}: rate must be (admissions, seconds) with at least "
                    f"1 admission and a window above 0 s and at most {MAX_DURATION_S} s, "
                    f"not {self.rate!r}"
                )

    def instance_id(self, key: str | None = None) -> str:
        """The id of the engine's instance that holds this queue (for ``key``)."""
        if self.per_key and key:
            return f"{QUEUE_INSTANCE_PREFIX}{self.name}/{key}"
        return f"{QUEUE_INSTANCE_PREFIX}{self.name}"

    def limits(self) -> dict[str, Any]:
        """The limits as the queue instance reads them (each request carries them, so
        the newest deployment's limits hold)."""
        return {
            "concurrency": self.concurrency,
            "rate": None if self.rate is None else [self.rate[0], float(self.rate[1])],
        }


def _pair(value: object) -> bool:
    return isinstance(value, tuple | list) and len(value) == 2


@dataclass(frozen=True, slots=True)
class AttemptBackoff:
    """What a queued step's attempt future gives when the attempt failed and the step
    will retry: the attempt's number and when its backoff ends (None on replay, where the
    backoff's sleep is already recorded)."""

    attempt: int
    retry_at_ms: int | None


@dataclass(frozen=True, slots=True)
class Slot:
    """A slot a queue admitted: release it when done."""

    queue: str
    target: str
    key: str  # the replay key of the wait
    token: str  # what the queue knows the request by (the key, and the run after a restart)
    admitted_ms: int


def slot_token(slot_key: str, run: int) -> str:
    """What a request for ``slot_key`` is known by at its queue: a restarted run asks
    afresh, so an admission meant for an earlier run is not its own."""
    return slot_key if run == 1 else f"run{run}/{slot_key}"


async def acquire(
    ctx: Context,
    queue: Queue,
    slot_key: str,
    *,
    priority: int = 0,
    key: str | None = None,
    what: str = "",
) -> Slot:
    """Ask ``queue`` for a slot and wait until it is admitted (durably: a crash or a
    move of the instance meanwhile changes nothing). ``slot_key`` is the replay key of
    the wait, made in the calling task."""
    rt = ctx._rt
    # Asked again (under a key of its own) where a reset or fork gave its slot back.
    slot_key = ask_key(slot_key, rt.given_back(slot_key))
    target = queue.instance_id(key)
    token = slot_token(slot_key, rt.run)
    answer = f"{QUEUE_ADMITTED}{token}"
    problem = name_problem(target) or event_name_problem(answer)
    if problem is not None:
        # Asked anyway, the queue's own instance could not answer, and would fail.
        raise InvalidWorkflowCall(
            f"{what or slot_key}: queue {queue.name!r} cannot admit it, the name it answers "
            f"with {problem}; give the step (with its scope) or the queue key a shorter name"
        )
    rt.send_message(
        f"{slot_key}#acquire",
        target,
        QUEUE_ACQUIRE,
        {
            "instance": rt.instance_id,
            "key": token,
            "priority": int(priority),
            "what": what,
            "queue": queue.name,
            "queue_key": key if queue.per_key else None,
            "limits": queue.limits(),
        },
    )
    [(_, _, payload, _)] = await rt.message_future(slot_key, [answer], 1, None)
    admitted = rt.decode_recorded(payload, f"the admission of {slot_key!r}")
    return Slot(queue.name, target, slot_key, token, int(admitted.get("admitted_ms", 0)))


def release(ctx: Context, slot: Slot) -> None:
    """Give ``slot`` back (recorded; the queue admits the next waiter)."""
    rt = ctx._rt
    rt.send_message(
        f"{slot.key}#release",
        slot.target,
        QUEUE_RELEASE,
        {"instance": rt.instance_id, "key": slot.token},
    )


async def holding(
    ctx: Context,
    queue: Queue,
    run: Callable[[], Awaitable[T]],
    slot_key: str,
    *,
    priority: int = 0,
    key: str | None = None,
    what: str = "",
) -> T:
    """``run()`` inside a slot of ``queue``: admitted first, released when it returns or
    raises. Not on an eviction or a task's cancellation (BaseException: the code did not
    end, or ends without running on); a slot still held when the instance finishes is
    given back then (``engine.replay.admission.withdraw``)."""
    slot = await acquire(ctx, queue, slot_key, priority=priority, key=key, what=what)
    try:
        result = await run()
    except Exception:
        release(ctx, slot)
        raise
    release(ctx, slot)
    return result


async def queued_run(
    ctx: Context,
    queue: Queue,
    fn: Callable[[Context, Any], Awaitable[Any]],
    arg: Any,
    priority: int,
    key: str | None,
) -> Any:
    """A workflow of ``@workflow(queue=...)``: its code runs once the queue admits it
    (till then the instance is ``pending``), and its slot is released when it ends."""
    return await holding(
        ctx,
        queue,
        lambda: fn(ctx, arg),
        ctx._rt.key_for(WORKFLOW_SLOT),
        priority=priority,
        key=key,
        what=f"workflow {ctx.workflow}",
    )


def step_slot_key(key: str, attempt: int) -> str:
    """The replay key of the slot a queued step's ``attempt`` waits for (the first keeps
    the key a slot for the whole step had, so older histories replay)."""
    return f"{key}#slot" if attempt <= 1 else f"{key}#slot#{attempt}"


def step_backoff_key(key: str, attempt: int) -> str:
    """The replay key of the sleep that waits out the backoff after ``attempt`` failed."""
    return f"{key}#backoff#{attempt}"


async def queued_step(
    ctx: Context,
    queue: Queue,
    key: str,
    attempt_after: Callable[[int], Awaitable[Any]],
    *,
    priority: int = 0,
    queue_key: str | None = None,
) -> Any:
    """A step whose attempts each run in a slot of ``queue``. ``attempt_after(n)`` starts
    the attempt after attempt ``n`` (0: the first) and gives the step's value, raises its
    failure, or gives ``AttemptBackoff`` when that attempt failed and the step retries:
    the slot goes back, the backoff is waited out holding nothing, and the next attempt
    asks for a slot again. Every record it makes is keyed by attempt, so replay finds each
    one and a request or release is sent once per attempt."""
    rt = ctx._rt
    after = 0
    while True:
        slot = await acquire(
            ctx,
            queue,
            step_slot_key(key, after + 1),
            priority=priority,
            key=queue_key,
            what=f"step {key}",
        )
        try:
            ended = await attempt_after(after)
        except Exception:
            release(ctx, slot)
            raise
        release(ctx, slot)
        if not isinstance(ended, AttemptBackoff):
            return ended
        wake = ended.retry_at_ms if ended.retry_at_ms is not None else rt.now_ms()
        await rt.sleep_future(step_backoff_key(key, ended.attempt), wake_at_ms=wake)
        after = ended.attempt
