"""Golden history exports, replayed against today's code (``replay_workflows.py``).

``replay/ok-*.json`` must replay (one is a loop whose pruned iterations left a gap in
the history); ``replay/diverged-*.json`` must not: each was recorded
by code that has since changed in a way that breaks instances in flight (a renamed step,
a step become a sleep, a wait inserted before a recorded step, a removed step, a step
added after the end of a completed instance), and replay must say where (key), what the
history has there (recorded) and what the code did instead (reached). They are checked
with ``stepstream.testing.replay`` and with ``stepstream replay --file``.

The files are exports (docs/history-export.md) of instances run on a
``WorkflowEnvironment`` with a virtual clock. Regenerate only on purpose:
``python -m tests.golden.test_replay_goldens [DIR]`` rewrites them (into DIR, if given),
the same bytes each time for the same code: ids and random values are seeded, and
tracebacks, which name the recording machine's files, are left out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import subprocess
import sys
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from stepstream import Context, workflow
from stepstream.engine.api.workflow import Registry
from stepstream.engine.errors import HistoryDiverged
from stepstream.ops.tools.history_export import (
    dumps,
    read_export,
    records_from_entries,
    to_document,
)
from stepstream.testing import ReplayDiverged, WorkflowEnvironment, replay
from tests.golden import replay_workflows as today

HERE = Path(__file__).parent / "replay"
REPO = Path(__file__).resolve().parents[2]
WORKFLOWS = "tests.golden.replay_workflows"

# name -> None (replays) or (key, recorded, reached).
EXPECTED: dict[str, tuple[str, str, str] | None] = {
    "ok-order": None,
    "ok-order-waiting": None,
    "ok-values": None,
    "ok-retrying": None,
    "ok-extended-running": None,
    "ok-loop-pruned": None,
    "diverged-extended-completed": ("b", "completed", "step:b"),
    "diverged-renamed": ("charge-card", "step", "step:charge"),
    "diverged-step-to-sleep": ("notify", "step", "sleep:notify"),
    "diverged-inserted-wait": ("b", "step", "wait:approval"),
    "diverged-removed-step": ("audit", "step", "end:returned"),
}
GOLDEN = sorted(HERE.glob("*.json"))


def test_every_golden_has_an_expectation() -> None:
    assert sorted(p.stem for p in GOLDEN) == sorted(EXPECTED)


@pytest.mark.parametrize("path", GOLDEN, ids=[p.stem for p in GOLDEN])
def test_a_golden_replays_or_diverges_where_expected(path: Path) -> None:
    expected = EXPECTED[path.stem]
    if expected is None:
        result = replay(path, today)
        assert result.outcome == "ok"
        return
    with pytest.raises(HistoryDiverged) as caught:
        replay(path, today)
    diverged = caught.value
    assert isinstance(diverged, ReplayDiverged)
    assert (diverged.key, diverged.recorded, diverged.reached) == expected, str(diverged)


def test_the_cli_replays_every_golden_with_one_line_each() -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "stepstream.ops.cli",
            "replay",
            "--workflows",
            WORKFLOWS,
            *[arg for path in GOLDEN for arg in ("--file", str(path))],
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1, run.stderr
    lines = dict(line.split(" ", 1) for line in run.stdout.splitlines())
    for name, expected in EXPECTED.items():
        if expected is None:
            assert lines[name] == "ok", run.stdout
        else:
            key, recorded, reached = expected
            assert lines[name] == f"diverged key={key} recorded={recorded} reached={reached}"
    assert f"{len(EXPECTED)} histories" in run.stderr

    passing = [str(p) for p in GOLDEN if EXPECTED[p.stem] is None]
    run = subprocess.run(
        [sys.executable, "-m", "stepstream.ops.cli", "replay", "--workflows", WORKFLOWS]
        + [arg for path in passing for arg in ("--file", path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("path", GOLDEN, ids=[p.stem for p in GOLDEN])
def test_a_golden_file_reads_back_to_the_same_document(path: Path) -> None:
    exported = read_export(path)
    assert exported.instance_id == path.stem
    assert dumps(to_document(exported.instance_id, exported.records)) == path.read_text()


# ---- how the goldens were recorded: the code as it was ------------------------------------


@workflow("extended")
async def extended_before(ctx: Context, _: Any) -> str:
    await ctx.step("a", today.note, "a")
    await ctx.wait_for_event("go")
    return "done"


@workflow("renamed")
async def renamed_before(ctx: Context, amount: int) -> Any:
    return await ctx.step("charge-card", today.charge, amount)


@workflow("step-to-sleep")
async def step_to_sleep_before(ctx: Context, _: Any) -> str:
    await ctx.step("notify", today.note, "sent")
    return "done"


@workflow("inserted-wait")
async def inserted_wait_before(ctx: Context, _: Any) -> str:
    await ctx.step("a", today.note, "a")
    await ctx.step("b", today.note, "b")
    return "done"


@workflow("removed-step")
async def removed_step_before(ctx: Context, _: Any) -> str:
    await ctx.step("a", today.note, "a")
    await ctx.step("audit", today.note, "audited")
    await ctx.step("b", today.note, "b")
    return "done"


BEFORE = Registry(
    [
        today.order,
        today.values,
        today.retrying,
        today.loop,
        extended_before,
        renamed_before,
        step_to_sleep_before,
        inserted_wait_before,
        removed_step_before,
    ]
)


def _seeded_ids(seed: int) -> Callable[[], uuid.UUID]:
    """``uuid.uuid4`` from a seeded generator: command ids and ``ctx.uuid`` values come
    out the same at every regeneration, so a diff shows only what changed on purpose."""
    rng = random.Random(seed)
    return lambda: uuid.UUID(int=rng.getrandbits(128), version=4)


def _without_tracebacks(records: list[Any]) -> list[Any]:
    """A traceback names the files of the machine that recorded it: kept out of the repo."""
    return [
        dataclasses.replace(r, traceback=None) if getattr(r, "traceback", None) else r
        for r in records
    ]


async def _record(out: Path) -> None:
    start = datetime(2024, 1, 1, tzinfo=UTC)
    random.seed(2024)  # ctx.random
    uuid.uuid4 = _seeded_ids(2024)  # type: ignore[assignment]  # a one-off script
    async with WorkflowEnvironment(BEFORE, clock="virtual", start=start) as env:
        client = env.client
        await client.start("order", {"amount": 25, "id": "o-1"}, instance_id="ok-order")
        await client.start("order", {"amount": 5, "id": "o-2"}, instance_id="ok-order-waiting")
        await client.start("values", None, instance_id="ok-values")
        await client.start("retrying", "r", instance_id="ok-retrying")
        await client.start("loop", 6, instance_id="ok-loop-pruned")
        for name in ("ok-extended-running", "diverged-extended-completed"):
            await client.start("extended", None, instance_id=name)
        await client.start("renamed", 7, instance_id="diverged-renamed")
        for name in ("step-to-sleep", "inserted-wait", "removed-step"):
            await client.start(name, None, instance_id=f"diverged-{name}")
        await env.settle()
        await client.send_event("ok-order", "approval", {"by": "ada"})
        await client.send_event("diverged-extended-completed", "go")
        await env.advance(120)
        assert (await client.status("ok-loop-pruned")).status == "completed"
        for name in EXPECTED:
            history = await client.history(name)
            records = _without_tracebacks(records_from_entries(name, history))
            (out / f"{name}.json").write_text(dumps(to_document(name, records)))
            print(f"wrote {out / name}.json ({len(records)} records)")


if __name__ == "__main__":
    asyncio.run(_record(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE))
