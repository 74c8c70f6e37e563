"""The ids and keys the engine makes from names: command ids of messages and child starts,
the events and replay keys of answers, loop iteration prefixes, timer ids, and which
command ids are the engine's own rather than a client's.

Instance ids and keys may hold "/": a command id that holds an instance id prefixes it
with its length, and a timer id is split by one who knows its instance id.
"""

from __future__ import annotations


def reply_key(message_id: str) -> str:
    """The replay key of the answer to a message (``msg.complete``)."""
    return f"~reply/{message_id}"


def message_command(sender_id: str, key: str) -> str:
    """The command id of a message one instance sends another: applied once however
    often it is published."""
    return f"msg:{len(sender_id)}:{sender_id}/{key}"


CHILD_COMMAND = "child:"


def child_command(parent_id: str, key: str, run: int = 1) -> str:
    """The command id of a child's start: names its parent and its key there, and the
    parent's run after a restart (``child<run>:``), so that a restarted parent's start
    of a child with a fixed id is a new command there, answered with its outcome,
    rather than a repeat of the first run's, dropped."""
    prefix = CHILD_COMMAND if run == 1 else f"child{run}:"
    return f"{prefix}{len(parent_id)}:{parent_id}/{key}"


def child_command_run(command_id: str) -> int:
    """The parent's run a child's start command id names (1 for a first run's)."""
    head = command_id.partition(":")[0]
    return int(head[5:]) if head.startswith("child") and head[5:].isdigit() else 1


def child_done(child_id: str, run: int = 1) -> str:
    """The command id of a child's notice of its end to its parent's run ``run``: once
    per run, since a restarted parent asks again and must hear again."""
    return f"childdone:{child_id}" if run == 1 else f"childdone{run}:{child_id}"


def parse_child_command(command_id: str) -> tuple[str, str] | None:
    """(parent id, key) from a child's start command id, or None for other commands."""
    if not command_id.startswith("child"):
        return None
    head, colon, tail = command_id.partition(":")
    if not colon or not (head == "child" or head[5:].isdigit()):
        return None
    size, sep, rest = tail.partition(":")
    if not sep or not size.isdigit() or rest[int(size) : int(size) + 1] != "/":
        return None
    return rest[: int(size)], rest[int(size) + 1 :]


CHILD_EVENT_PREFIX = "~child/"


def child_event(key: str) -> str:
    """The event a child sends its parent when it finishes (``~`` is not for clients)."""
    return f"{CHILD_EVENT_PREFIX}{key}"


def is_child_notice(name: str, command_id: str) -> bool:
    """Whether an event is the engine's notice to a parent of how its child ended (the
    only ``~`` event it sends): named ``~child/KEY`` under the command id the engine
    gives such a notice (``child_done``, or ``childexists:`` for a refused start)."""
    head = command_id.partition(":")[0]
    return name.startswith(CHILD_EVENT_PREFIX) and (
        head == "childexists"
        or head == "childdone"
        or (head[:9] == "childdone" and head[9:].isdigit())
    )


def loop_prefixes(key: str, iteration: int) -> tuple[str, str]:
    """The key prefixes of one loop iteration: its scope, and the tasks it ran in (the
    keys of values read there start with the task's name)."""
    return f"{key}/{iteration}/", f"{key}/{iteration}."


# The entry that holds a run's time limit (``@workflow(timeout=)``): its timer is a sleep's,
# but no code visits it (``~`` is not for user names).
RUN_TIMEOUT_KEY = "~run/timeout"


def timer_id(instance_id: str, purpose: str, key: str, n: int) -> str:
    return f"{instance_id}/{purpose}/{n}/{key}"


def split_timer_id(instance_id: str, fired: str) -> tuple[str, str] | None:
    """(purpose, entry key) of one of the instance's timer ids; None for any other id.
    Instance ids and keys may hold "/": the instance id is known, the key is the rest."""
    prefix = f"{instance_id}/"
    if not fired.startswith(prefix):
        return None
    parts = fired[len(prefix) :].split("/", 2)
    return (parts[0], parts[2]) if len(parts) == 3 else None


# Ids of commands the engine makes itself. Each is applied at most once by construction
# (a step outcome names its attempt, a timer fire its timer); every other command id is
# a client's, kept for good so that a re-delivered command is never applied twice.
TIMER_FIRE_PREFIX = "fire:"  # then the timer's id
INTERNAL_COMMAND_PREFIXES = (
    "step:",
    "recover:",
    TIMER_FIRE_PREFIX,
    "fence:",
    "forget:",
    "snapshot:",
)


def is_client_command(command_id: str) -> bool:
    return bool(command_id) and not command_id.startswith(INTERNAL_COMMAND_PREFIXES)
