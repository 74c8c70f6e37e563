"""The engine's own processes run on uvloop unless told otherwise."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import uvloop

from stepstream.engine.config.environ import ConfigError
from stepstream.ops import event_loop
from tests.dev_server import clean_env


def test_uvloop_by_default_and_asyncio_when_asked() -> None:
    assert event_loop.loop_factory({}) is uvloop.new_event_loop
    assert event_loop.loop_factory({"STEPSTREAM_EVENT_LOOP": " UVLOOP "}) is uvloop.new_event_loop
    assert event_loop.loop_factory({"STEPSTREAM_EVENT_LOOP": "asyncio"}) is None


def test_an_unknown_loop_is_refused_saying_what_to_set() -> None:
    with pytest.raises(ConfigError, match="STEPSTREAM_EVENT_LOOP='tokio' is not one of uvloop"):
        event_loop.loop_factory({"STEPSTREAM_EVENT_LOOP": "tokio"})


@pytest.mark.parametrize(("setting", "expected"), [("", "uvloop"), ("asyncio", "asyncio")])
def test_run_runs_on_the_loop_asked_for(
    monkeypatch: pytest.MonkeyPatch, setting: str, expected: str
) -> None:
    monkeypatch.setenv("STEPSTREAM_EVENT_LOOP", setting)

    async def name() -> str:
        await asyncio.sleep(0)
        return event_loop.running_loop_name()

    assert event_loop.run(name()) == expected


def test_a_command_with_an_unknown_loop_says_what_to_set(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "stepstream.ops.cli",
            "run",
            "examples.order:order",
            "--input",
            "{}",
        ],
        cwd=tmp_path,
        env=clean_env(tmp_path, STEPSTREAM_EVENT_LOOP="tokio"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done.stderr
    assert "error: STEPSTREAM_EVENT_LOOP='tokio' is not one of uvloop, asyncio" in done.stderr
    assert "Traceback" not in done.stderr and "never awaited" not in done.stderr, done.stderr
