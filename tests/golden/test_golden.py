"""Golden histories: records written by an earlier build, replayed by the current code.

Each ``*.json`` file here is the complete history of one instance of a workflow in
``tests.workflows``, with fixed values. Replaying every record but the last through
``InstanceRuntime`` with today's code must reach the recorded end without
``HistoryDiverged``: a change to replay keys (step/sleep/wait names, value counters) or to
what a key means would break instances already in flight, and fails here first.

Regenerate only on purpose (a deliberate, versioned change of the record vocabulary):
``python -m tests.golden.test_golden`` rewrites the files.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import inspect
import json
from pathlib import Path
from typing import Any

import pytest

from stepstream.engine.api.workflow import Registry
from stepstream.engine.replay.runtime import InstanceRuntime, Output, StepOutcome
from stepstream.engine.replay.state import InstanceState, Status
from stepstream.engine.wire.codec import JSON, JsonCodec
from stepstream.engine.wire.records import (
    HISTORY_TYPES,
    HistoryRecord,
    Payload,
    StartWorkflow,
    TimerCancelled,
    TimerFired,
    TimerScheduled,
)
from stepstream.engine.wire.records import SendEvent as SendEventCommand
from stepstream.engine.wire.serde import default_serde
from tests.fakes import FakeClock

HERE = Path(__file__).parent
CODEC = JsonCodec()
_CLASSES: dict[str, type[HistoryRecord]] = {cls.type_name: cls for cls in HISTORY_TYPES}
_ENVELOPE = ("seq", "time_ms", "command_id", "epoch")


def _registry() -> Registry:
    registry = Registry()
    registry.add_module("tests.workflows")
    registry.add_module("tests.lifecycle_workflows")
    return registry


# ---- the file format: one JSON object per record --------------------------------------


def _to_json(record: HistoryRecord) -> dict[str, Any]:
    out: dict[str, Any] = {"type": record.type}
    out.update({name: getattr(record, name) for name in _ENVELOPE})
    attributes = {}
    for f in dataclasses.fields(record):
        if f.name in _ENVELOPE or f.name in ("instance_id", "traceparent", "tracestate"):
            continue
        value = getattr(record, f.name)
        if isinstance(value, Payload):
            value = (
                {"content_type": value.content_type, "json": value.data.decode()}
                if value.content_type == JSON
                else {
                    "content_type": value.content_type,
                    "base64": base64.b64encode(value.data).decode(),
                }
            )
        attributes[f.name] = value
    out["attributes"] = attributes
    return out


def _from_json(instance_id: str, raw: dict[str, Any]) -> HistoryRecord:
    cls = _CLASSES[raw["type"]]
    attributes = {}
    for name, value in raw["attributes"].items():
        if isinstance(value, dict) and "content_type" in value:
            data = value["json"].encode() if "json" in value else base64.b64decode(value["base64"])
            value = Payload(value["content_type"], data)
        attributes[name] = value
    envelope = {name: raw[name] for name in _ENVELOPE}
    return cls(instance_id=instance_id, **envelope, **attributes)


def load(path: Path) -> tuple[dict[str, Any], list[HistoryRecord]]:
    golden = json.loads(path.read_text())
    records = [_from_json(golden["instance_id"], raw) for raw in golden["records"]]
    return golden, records


# ---- the histories, as they were produced ---------------------------------------------

# name -> (workflow, input, inputs after start). An input is "run" (run the oldest
# launched step body), ("fail", message) (its attempt fails), "fire" (the earliest timer
# fires), ("send", event, payload) or ("start", if_exists, input) (a start of the same id).
SCENARIOS: dict[str, tuple[str, Any, list[Any]]] = {
    "arith": ("arith", 4, ["run", "run"]),
    "values": ("values", None, ["fire"]),
    "gated": ("gated", "g", [("send", "go", {"by": "ada"}), "run", "run"]),
    "retrying": (
        "retrying",
        {"key": "k", "fail": 1, "max": 3},
        [("fail", "transient failure 1"), "fire", ("result", "ok after 2")],
    ),
    "parallel": ("parallel", 3, ["run", "run", "run"]),
    "two-events": ("two-events", None, [("send", "item", 1), ("send", "item", 2)]),
    # A run under a time limit (WorkflowTimeoutSet, its entry no code visits), and a
    # second run after a failed one: replay runs the second run alone.
    "deadline": ("deadline", {"sleep": 1.0}, ["fire"]),
    "restarted": (
        "flaky-once",
        {"fail": True},
        [("start", "restart_if_failed", {"wait": True, "n": 2}), ("send", "go", None)],
    ),
    "tagged": ("tagged", {"customer": "42", "amount": 25.0}, [("send", "more", {"vip": True})]),
}


def _produce(name: str) -> dict[str, Any]:
    workflow, value, inputs = SCENARIOS[name]
    instance_id = f"golden-{name}"
    clock = FakeClock()
    state = InstanceState(instance_id)
    runtime = InstanceRuntime(
        state, _registry().resolve(workflow), codec=CODEC, clock=clock, epoch=1
    )
    launches: list[Any] = []
    timers: dict[str, int] = {}
    records: list[HistoryRecord] = []

    def feed(msg: Any) -> None:
        out = Output()
        runtime.handle(msg, out)
        records.extend(out.history)
        launches.extend(out.launches)
        for timer in out.timers:
            if isinstance(timer, TimerScheduled):
                timers[timer.timer_id] = timer.fire_at_ms
            elif isinstance(timer, TimerCancelled):
                timers.pop(timer.timer_id, None)
        clock.ms += 10

    feed(
        StartWorkflow(
            instance_id=instance_id,
            command_id="start-1",
            workflow=workflow,
            input=CODEC.encode(value),
        )
    )
    for n, step in enumerate(inputs):
        if step == "fire":
            timer = min(timers, key=lambda t: timers[t])
            clock.ms = max(clock.ms, timers.pop(timer))
            feed(
                TimerFired(
                    instance_id=instance_id,
                    command_id=f"fire:{timer}",
                    timer_id=timer,
                    fire_at_ms=clock.ms,
                )
            )
        elif step[0] == "start":
            feed(
                StartWorkflow(
                    instance_id=instance_id,
                    command_id=f"start-{n + 2}",
                    workflow=workflow,
                    input=CODEC.encode(step[2]),
                    if_exists=step[1],
                )
            )
        elif step[0] == "send":
            feed(
                SendEventCommand(
                    instance_id=instance_id,
                    command_id=f"event-{n}",
                    name=step[1],
                    payload=CODEC.encode(step[2]),
                )
            )
        else:
            launch = launches.pop(0)
            if step == "run":
                result = launch.fn(*launch.args, **launch.kwargs)
                if inspect.isawaitable(result):
                    result = asyncio.run(result)  # type: ignore[arg-type]
                step = ("result", result)
            if step[0] == "result":
                outcome = StepOutcome(
                    instance_id, launch.key, launch.attempt, CODEC.encode(step[1])
                )
            else:
                outcome = StepOutcome(
                    instance_id,
                    launch.key,
                    launch.attempt,
                    error_type="RuntimeError",
                    error_message=step[1],
                )
            feed(outcome)
    runtime.close()
    assert state.status is Status.COMPLETED, records
    return {
        "workflow": workflow,
        "instance_id": instance_id,
        "records": [_to_json(r) for r in records],
    }


# ---- the tests ------------------------------------------------------------------------

GOLDEN = sorted(HERE.glob("*.json"))


def test_every_scenario_has_a_golden_file() -> None:
    assert sorted(p.stem for p in GOLDEN) == sorted(SCENARIOS)


def _describe(records: list[HistoryRecord]) -> str:
    return "\n".join(f"  {r.seq:3d} {r!r}" for r in records)


@pytest.mark.parametrize("path", GOLDEN, ids=[p.stem for p in GOLDEN])
def test_golden_history_replays_to_its_recorded_end(path: Path) -> None:
    golden, records = load(path)
    assert [r.seq for r in records] == list(range(1, len(records) + 1))
    *before, last = records

    state = InstanceState(golden["instance_id"])
    for record in before:
        state.apply(record)
    clock = FakeClock()
    clock.ms = records[-1].time_ms + 3_600_000  # replay happens later; nothing may read it
    runtime = InstanceRuntime(
        state,
        _registry().resolve(state.workflow, state.version),
        codec=CODEC,
        clock=clock,
        epoch=2,
    )
    out = Output()
    runtime.recover(out)
    runtime.close()

    assert out.launches == [], f"replay re-ran steps: {out.launches}\n{_describe(records)}"
    decided = [(r.type, _to_json(r)["attributes"]) for r in out.history]
    assert decided == [(last.type, _to_json(last)["attributes"])], (
        f"{path.name}: replay decided\n{_describe(out.history)}\n"
        f"where the golden history ends with\n{_describe([last])}"
    )
    assert state.status is Status.COMPLETED


@pytest.mark.parametrize("path", GOLDEN, ids=[p.stem for p in GOLDEN])
def test_golden_records_still_encode_and_decode(path: Path) -> None:
    serde = default_serde()
    _, records = load(path)
    for record in records:
        assert serde.decode(serde.encode(record)) == record


def test_format_round_trip() -> None:
    golden = _produce("arith")
    records = [_from_json(golden["instance_id"], raw) for raw in golden["records"]]
    assert [_to_json(r) for r in records] == golden["records"]


if __name__ == "__main__":
    for name in SCENARIOS:
        (HERE / f"{name}.json").write_text(json.dumps(_produce(name), indent=1) + "\n")
        print(f"wrote {HERE / name}.json")
