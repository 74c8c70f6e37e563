"""What a name may be: instance ids, workflow names and event names that clients send.

Names end up in storage keys, Kafka record keys, log lines and URLs, so they are short
printable text: 1 to ``MAX_NAME_BYTES`` bytes of UTF-8, no control characters, no lone
surrogates (which no encoding can store). Every entry point checks them before anything
is published, and a processor dead-letters a command that got past a client anyway.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable

from stepstream.engine.errors import InvalidPayload

MAX_NAME_BYTES = 256
_SHOWN = 60  # characters of a refused name quoted back


def check_name(
    value: object, what: str, problem_of: Callable[[object], str | None] | None = None
) -> str:
    """``value`` if it is a valid name, else ``InvalidPayload`` saying what is wrong;
    ``what`` names it for the message ("instance id", "event name")."""
    problem = (problem_of or name_problem)(value)
    if problem is None:
        assert isinstance(value, str)
        return value
    raise InvalidPayload(f"{what} {_shown(value)} {problem}")


IF_EXISTS_POLICIES = ("return", "fail", "restart_if_failed")


def check_if_exists(value: object) -> str:
    """``value`` if it is a start policy (``start(if_exists=)``), else ``InvalidPayload``."""
    if isinstance(value, str) and value in IF_EXISTS_POLICIES:
        return value
    raise InvalidPayload(
        f"if_exists={value!r} is not a start policy; use one of "
        + ", ".join(repr(p) for p in IF_EXISTS_POLICIES)
    )


def name_problem(value: object) -> str | None:
    """Why ``value`` is not a valid name, or None if it is."""
    if not isinstance(value, str):
        return f"must be a string, not {type(value).__name__}"
    if not value.strip():
        return "must not be empty or only spaces"
    if len(value) > MAX_NAME_BYTES:  # fast path: over the limit in characters already
        return f"is {len(value)} characters long; the limit is {MAX_NAME_BYTES} bytes"
    if value.isascii() and value.isprintable():
        return None  # the usual id: nothing more to look at
    for position, char in enumerate(value):
        category = unicodedata.category(char)
        if category == "Cc":
            return (
                f"contains the control character U+{ord(char):04X} at position {position}; "
                "use printable characters only"
            )
        if category == "Cs":
            return (
                f"contains a lone surrogate U+{ord(char):04X} at position {position}, "
                "which is not valid text"
            )
    size = len(value.encode())
    if size > MAX_NAME_BYTES:
        return f"is {size} bytes of UTF-8; the limit is {MAX_NAME_BYTES}"
    return None


def event_name_problem(value: object) -> str | None:
    """Why a client may not send an event of this name, or None: names starting with
    ``~`` are the engine's own (a child's notice to its parent)."""
    problem = name_problem(value)
    if problem is None and isinstance(value, str) and value.startswith("~"):
        return "starts with '~', which is reserved for the engine's own events"
    return problem


def event_id_problem(value: object) -> str | None:
    """Why ``value`` cannot be a client's event id, or None: a name without ``:`` (the
    engine's own command ids have one)."""
    problem = name_problem(value)
    if problem is None and isinstance(value, str) and ":" in value:
        return "contains ':', which is reserved for the engine's own command ids"
    return problem


def text_problem(value: str) -> str | None:
    """Why free text (a cancel reason) cannot be stored, or None: only lone
    surrogates; its length is limited where it is taken."""
    try:
        value.encode()
    except UnicodeEncodeError:
        pass
    else:
        return None
    for position, char in enumerate(value):
        if 0xD800 <= ord(char) <= 0xDFFF:
            return (
                f"contains a lone surrogate U+{ord(char):04X} at position {position}, "
                "which is not valid text"
            )
    return None


LONG_MIN, LONG_MAX = -(1 << 63), (1 << 63) - 1


def whole_in(value: object, low: int, high: int = LONG_MAX) -> bool:
    """Whether ``value`` is a whole number (an int, not a bool) from ``low`` to ``high``."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def whole_number_problem(value: object) -> str | None:
    """Why ``value`` is not a whole number a record can hold (an Avro long), or None."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"must be a whole number, not {_shown(value)}"
    if not LONG_MIN <= value <= LONG_MAX:
        return f"must fit in 64 bits (-2**63 to 2**63-1), not {_shown(value)}"
    return None


def _shown(value: object) -> str:
    text = repr(value)
    if len(text) > _SHOWN:
        text = text[:_SHOWN] + f"... ({len(str(value))} characters)"
    return text


# Step names found valid: workflow code names the same steps in every instance, so each
# is checked once, not at every call (bounded: cleared when full).
_VALID_STEP_NAMES: set[str] = set()
_VALID_STEP_NAMES_MAX = 65_536


def step_name_problem(name: object) -> str | None:
    """Why ``name`` cannot name a step, sleep, wait, scope or branch in workflow code, or
    None: a valid name without ``#`` and ``/`` (reserved for repeats and scopes)."""
    if type(name) is str and name in _VALID_STEP_NAMES:
        return None
    problem = name_problem(name)
    if problem is not None:
        return f"{name!r} {problem}" if isinstance(name, str) else problem
    assert isinstance(name, str)
    for reserved in "#/":
        if reserved in name:
            return f"{name!r} contains {reserved!r}, which is reserved (scopes and repeats)"
    if type(name) is str:  # not a subclass, whose hash or equality could be its own
        if len(_VALID_STEP_NAMES) >= _VALID_STEP_NAMES_MAX:
            _VALID_STEP_NAMES.clear()
        _VALID_STEP_NAMES.add(name)
    return None
