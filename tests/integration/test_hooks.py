"""Workflow hooks (``on_error``, ``on_status_change``) through the public path.

The workflows of ``tests.hook_workflows`` note every hook call in a file; the same cases
run on the embedded and the Kafka backend: the events of a run and their fields, status
changes through pause, resume, cancel and failure, a hook that raises, and no event from
replay (a resume or a restart replays the workflow: nothing is reported twice).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from stepstream import Context, StatusChangeEvent, workflow
from stepstream.engine.api.workflow import Registry
from stepstream.producers.client import Client
from stepstream.testing import WorkflowEnvironment
from tests.dev_server import run_cli
from tests.hook_workflows import read_notes
from tests.restartable import restartable_backend

Notes = list[dict[str, Any]]


def _registry() -> Registry:
    registry = Registry()
    registry.add_module("tests.hook_workflows")
    return registry


@pytest.fixture
def notes_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "hooks"
    root.mkdir()
    monkeypatch.setenv("STEPSTREAM_TEST_HOOKS", str(root))
    monkeypatch.setenv("STEPSTREAM_HOOK_BACKOFF_S", "0.01")  # raising hooks give up fast
    return root


@pytest.fixture(params=["embedded", "kafka"])
async def backend(
    request: pytest.FixtureRequest, tmp_path: Path, notes_dir: Path
) -> AsyncIterator[Any]:
    async with restartable_backend(request, tmp_path, _registry) as made:
        yield made


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _of(notes: Notes, instance_id: str, *hooks: str) -> Notes:
    return [n for n in notes if n["instance_id"] == instance_id and n["hook"] in hooks]


def _changes(notes: Notes, instance_id: str, hook: str = "status") -> list[tuple[Any, Any]]:
    return [(n["old_status"], n["new_status"]) for n in _of(notes, instance_id, hook)]


async def _until_notes(
    root: Path, check: Callable[[Notes], bool], what: str, timeout: float = 20
) -> Notes:
    deadline = time.monotonic() + timeout
    while True:
        notes = read_notes(root)
        if check(notes):
            return notes
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}; hook calls so far:\n{notes}")
        await asyncio.sleep(0.02)


async def _waiting_for_go(client: Client, instance_id: str) -> None:
    for _ in range(1000):
        status = await client.status(instance_id)
        if [w.key for w in status.waits] == ["go"]:
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"{instance_id} never waited for 'go': {await client.history(instance_id)}")


async def test_step_errors_and_status_changes_of_a_run(backend: Any, notes_dir: Path) -> None:
    client: Client = backend.client
    began = datetime.now(UTC) - timedelta(seconds=1)
    instance = await client.start("hooked", None, instance_id=_id("run"))
    assert await client.result(instance, timeout=20) == {"flaky": 3}
    notes = await _until_notes(
        notes_dir, lambda n: ("running", "completed") in _changes(n, instance), "completion"
    )
    history = await client.history(instance)
    why = f"instance {instance}: {notes}\n{history}"

    assert _changes(notes, instance) == [
        (None, "pending"),
        ("pending", "running"),
        ("running", "completed"),
    ], why
    errors = _of(notes, instance, "error")
    assert [(e["step"], e["attempt"], e["will_retry"]) for e in errors] == [
        ("flaky", 1, True),
        ("flaky", 2, True),
        ("doomed", 1, True),
        ("doomed", 2, False),
    ], why
    for e in errors:
        assert (e["workflow"], e["version"]) == ("hooked", "1")
    assert [e["error_type"] for e in errors] == ["RuntimeError"] * 2 + ["ValueError"] * 2
    assert [e["message"] for e in errors] == [
        "attempt 1 fails",
        "attempt 2 fails",
        "no luck on attempt 1",
        "no luck on attempt 2",
    ]
    # retry_at: when the retry is due (the StepFailed record's next attempt), UTC.
    failed = [h for h in history if h.type == "StepFailed"]
    for e, record in zip(errors, failed, strict=True):
        due = record.attributes["next_attempt_at_ms"]
        if due is None:
            assert e["retry_at"] is None
        else:
            retry_at = datetime.fromisoformat(e["retry_at"])
            assert retry_at.tzinfo is not None and retry_at.utcoffset() == timedelta(0)
            assert retry_at == datetime.fromtimestamp(due / 1000, tz=UTC)
            assert began < retry_at < datetime.now(UTC) + timedelta(seconds=5)
    # at: when the change was recorded.
    for n, kind in zip(
        _of(notes, instance, "status"), ["WorkflowStarted", None, "WorkflowCompleted"], strict=True
    ):
        at = datetime.fromisoformat(n["at"])
        assert began < at < datetime.now(UTC) + timedelta(seconds=1)
        assert n["error"] is None
        if kind is not None:
            [record] = [h for h in history if h.type == kind]
            assert at == datetime.fromisoformat(record.time)


async def test_status_changes_through_pause_resume_cancel_and_failure(
    backend: Any, notes_dir: Path
) -> None:
    client: Client = backend.client
    done = await client.start("hooked-waiter", None, instance_id=_id("done"))
    cancelled = await client.start("hooked-waiter", None, instance_id=_id("cancelled"))
    failing = await client.start("hooked-failing", None, instance_id=_id("failing"))
    await _waiting_for_go(client, done)
    await _waiting_for_go(client, cancelled)

    await client.pause(done)
    await _until_notes(notes_dir, lambda n: ("running", "paused") in _changes(n, done), "pause")
    # The resume replays the workflow (its failed and retried step included).
    await client.resume(done)
    await _waiting_for_go(client, done)
    await client.send_event(done, "go", "now")
    assert await client.result(done, timeout=20) == "now"
    await client.cancel(cancelled, reason="customer left")

    def settled(notes: Notes) -> bool:
        return (
            ("running", "completed") in _changes(notes, done)
            and ("running", "cancelled") in _changes(notes, cancelled)
            and ("running", "failed") in _changes(notes, failing)
        )

    notes = await _until_notes(notes_dir, settled, "the three instances to settle")
    assert _changes(notes, done) == [
        (None, "pending"),
        ("pending", "running"),
        ("running", "paused"),
        ("paused", "running"),
        ("running", "completed"),
    ], notes
    # One failed attempt of "warm", reported once: replay reported nothing again.
    assert [(e["step"], e["attempt"]) for e in _of(notes, done, "error")] == [("warm", 1)]
    assert _changes(notes, cancelled)[-1] == ("running", "cancelled")
    assert _of(notes, cancelled, "status")[-1]["error"] == "cancelled: customer left"
    assert _changes(notes, failing) == [
        (None, "pending"),
        ("pending", "running"),
        ("running", "failed"),
    ]
    assert _of(notes, failing, "status")[-1]["error"] == "RuntimeError: boom"

    # A restart replays the unfinished and reports nothing again; the outbox is empty.
    waiting = await client.start("hooked-waiter", None, instance_id=_id("waiting"))
    await _waiting_for_go(client, waiting)
    await _until_notes(notes_dir, lambda n: _of(n, waiting, "error") != [], "warm's failure")
    before = read_notes(notes_dir)
    client = await backend.restart()
    await client.send_event(waiting, "go", "later")
    assert await client.result(waiting, timeout=20) == "later"
    notes = await _until_notes(
        notes_dir, lambda n: ("running", "completed") in _changes(n, waiting), "completion"
    )
    await asyncio.sleep(0.3)  # nothing else is on its way
    after = read_notes(notes_dir)
    assert after[: len(before)] == before
    assert [(n["hook"], n["instance_id"], n.get("new_status")) for n in after[len(before) :]] == [
        ("status", waiting, "completed")
    ]


async def test_a_resume_before_admission_reports_pending_again(
    backend: Any, notes_dir: Path
) -> None:
    """Paused while its queue has not admitted it, an instance resumed is pending, and
    the hook says so, across a restart between the pause and the resume too."""
    client: Client = backend.client
    holds = await client.start("hooked-queued", None, instance_id=_id("holds"))
    await _waiting_for_go(client, holds)
    behind = await client.start("hooked-queued", None, instance_id=_id("behind"))
    await asyncio.sleep(0.3)  # its request has reached the queue
    await client.pause(behind)
    await _until_notes(
        notes_dir, lambda n: ("pending", "paused") in _changes(n, behind), "the pause"
    )
    client = await backend.restart()
    await client.resume(behind)
    await client.send_event(holds, "go", 1)
    await _waiting_for_go(client, behind)
    await client.send_event(behind, "go", 2)
    assert await client.result(behind, timeout=20) == 2
    notes = await _until_notes(
        notes_dir, lambda n: ("running", "completed") in _changes(n, behind), "completion"
    )
    assert _changes(notes, behind) == [
        (None, "pending"),
        ("pending", "paused"),
        ("paused", "pending"),
        ("pending", "running"),
        ("running", "completed"),
    ], notes


async def test_a_hook_that_raises_never_affects_the_workflow(backend: Any, notes_dir: Path) -> None:
    client: Client = backend.client
    instance = await client.start("hooked-raising", 10, instance_id=_id("raising"))
    assert await client.result(instance, timeout=20) == 12
    # Each event is tried 5 times (the default), then dropped.
    expected = [
        ("raising-status", "pending"),
        ("raising-status", "running"),
        ("raising-error", None),
        ("raising-status", "completed"),
    ]

    def all_given_up(notes: Notes) -> bool:
        return len(_of(notes, instance, "raising-status", "raising-error")) >= 5 * len(expected)

    notes = await _until_notes(notes_dir, all_given_up, "every call to be tried 5 times")
    calls = [
        (n["hook"], n.get("new_status"))
        for n in _of(notes, instance, "raising-status", "raising-error")
    ]
    assert calls == [call for call in expected for _ in range(5)], notes
    # Other instances' hooks were not held up by it, and the partition goes on.
    other = await client.start("hooked", None, instance_id=_id("after"))
    assert await client.result(other, timeout=20) == {"flaky": 3}
    await _until_notes(
        notes_dir, lambda n: ("running", "completed") in _changes(n, other), "other's hooks"
    )
    assert (await client.status(instance)).status == "completed"


def test_the_example_reports_failed_attempts_and_status_changes(tmp_path: Path) -> None:
    done = run_cli(
        tmp_path, "run", "examples.hooks:payout", "--input", '{"account": "a-1", "amount": 25}'
    )
    assert done.returncode == 0, done.stderr
    assert "tx-a-1-25" in done.stdout
    for said in ("attempt 1 failed", "attempt 2 failed", "None -> pending", "-> completed"):
        assert said in done.stderr, done.stderr


async def test_status_changes_of_a_terminate_and_a_restart(backend: Any, notes_dir: Path) -> None:
    """A terminate is recorded like any end: on_status_change gets it (nothing waits for
    the hook); a restart begins again at pending."""
    client: Client = backend.client
    ended = await client.start("hooked-waiter", None, instance_id=_id("terminated"))
    await _waiting_for_go(client, ended)
    await client.terminate(ended, reason="stop now")
    notes = await _until_notes(
        notes_dir, lambda n: ("running", "terminated") in _changes(n, ended), "the terminate"
    )
    assert _of(notes, ended, "status")[-1]["error"] == "terminated: stop now"

    await client.start("hooked-waiter", None, instance_id=ended, if_exists="restart_if_failed")
    await _waiting_for_go(client, ended)
    notes = await _until_notes(
        notes_dir, lambda n: _changes(n, ended)[-1] == ("pending", "running"), "the second run"
    )
    assert _changes(notes, ended)[-3:] == [
        ("running", "terminated"),
        ("terminated", "pending"),
        ("pending", "running"),
    ], notes


async def test_a_hook_that_raises_systemexit_or_cancelled_is_a_failed_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hook's library may call sys.exit() or be cancelled under it: the call failed
    and is retried; the engine goes on and the calls owed after it are made in order."""
    monkeypatch.setenv("STEPSTREAM_HOOK_BACKOFF_S", "0.01")
    calls: list[tuple[str | None, str]] = []

    async def audit(event: StatusChangeEvent) -> None:
        calls.append((event.old_status, event.new_status))
        if len(calls) == 1:
            raise asyncio.CancelledError()
        if len(calls) == 2:
            raise SystemExit("the pager library gave up")

    @workflow("hooked-exits", on_status_change=audit)
    async def hooked(ctx: Context, value: int) -> int:
        await ctx.sleep("nap", 5)
        return value

    registry = Registry()
    registry.add(hooked)
    async with WorkflowEnvironment(registry, clock="virtual") as env:
        await env.client.start("hooked-exits", 1, instance_id="h-1")
        await env.advance(10)
        assert await env.client.result("h-1") == 1
        for _ in range(200):
            if calls[-1:] == [("running", "completed")]:
                break
            await asyncio.sleep(0.02)
    assert calls == [
        (None, "pending"),
        (None, "pending"),
        (None, "pending"),
        ("pending", "running"),
        ("running", "completed"),
    ]


async def test_a_sync_hook_stuck_for_good_holds_up_no_other_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sync hook blocked for good (what it waits for has no timeout) fails its call
    once past the hook timeout; its thread cannot be stopped and is left to finish, and
    the calls of other instances go on, even with one hook thread."""
    monkeypatch.setenv("STEPSTREAM_HOOK_THREADS", "1")
    monkeypatch.setenv("STEPSTREAM_HOOK_TIMEOUT_S", "0.2")
    monkeypatch.setenv("STEPSTREAM_HOOK_ATTEMPTS", "2")
    monkeypatch.setenv("STEPSTREAM_HOOK_BACKOFF_S", "0.01")
    release = threading.Event()
    calls: list[tuple[str, str]] = []

    def audit(event: StatusChangeEvent) -> None:
        calls.append((event.instance_id, event.new_status))
        if event.instance_id == "stuck":
            release.wait()

    @workflow("hooked-hangs", on_status_change=audit)
    async def hooked(ctx: Context, value: int) -> int:
        return value

    registry = Registry()
    registry.add(hooked)
    try:
        async with WorkflowEnvironment(registry, partitions=1) as env:
            await env.client.start("hooked-hangs", 0, instance_id="stuck")
            for n in range(3):
                await env.client.start("hooked-hangs", n, instance_id=f"ok-{n}")
                assert await env.client.result(f"ok-{n}") == n
            for _ in range(500):
                if ("ok-2", "completed") in calls and calls.count(("stuck", "pending")) == 2:
                    break
                await asyncio.sleep(0.02)
            made = [c for c in calls if c[0] != "stuck"]
            for n in range(3):  # each instance's calls made, in the order of its records
                mine = [c for c in made if c[0] == f"ok-{n}"]
                assert mine == [(f"ok-{n}", "pending"), (f"ok-{n}", "completed")], calls
            # The stuck call was made again (its second attempt), its thread left behind.
            assert calls.count(("stuck", "pending")) == 2, calls
    finally:
        release.set()
