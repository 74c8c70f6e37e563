"""Which failure tracebacks the log leaves out: only those whose every frame is
stepstream's own, and never one that may hold frames the check cannot see."""

from __future__ import annotations

from pathlib import Path

import stepstream
from stepstream.consumers.failure_log import _worth_showing

OURS = str(Path(stepstream.__file__).parent / "engine" / "api" / "outbox.py")
USER = "/srv/shop/flows.py"


def frame(path: str, line: int = 1) -> str:
    return f'  File "{path}", line {line}, in f\n    pass\n'


def traceback(*paths: str) -> str:
    frames = "".join(frame(p) for p in paths)
    return f"Traceback (most recent call last):\n{frames}OutboxNotConfigured: no outbox\n"


def test_a_traceback_of_stepstreams_frames_alone_is_left_out() -> None:
    assert _worth_showing(traceback(OURS, OURS)) == ""


def test_one_frame_of_the_users_keeps_it() -> None:
    kept = traceback(USER, OURS)
    assert _worth_showing(kept) == kept


def test_a_clipped_or_grouped_traceback_is_kept_whole() -> None:
    clipped = "[1200 characters cut]...\n" + traceback(OURS)
    assert _worth_showing(clipped) == clipped
    grouped = traceback(OURS) + '\n  + Exception Group Traceback:\n  |   File "x.py"'
    assert _worth_showing(grouped) == grouped
