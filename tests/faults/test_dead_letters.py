"""Bad records that reach a partition processor anyway: dead-lettered, partition moving.

The client rejects bad input before it is published; these tests write straight into the
commands log of a stopped engine, the way a foreign producer or a corrupted disk would,
then open the engine and check that every bad record went to ``dead-letters`` with a
reason and its original bytes, and that good commands behind them still run.
"""

from __future__ import annotations

import asyncio
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from examples.aes_gcm_codec import AesGcmCodec
from stepstream.consumers.embedded import EmbeddedDB
from stepstream.engine.api.workflow import Registry
from stepstream.engine.errors import UndecodableRecord
from stepstream.engine.seams import Append
from stepstream.engine.wire.codec import JsonCodec
from stepstream.engine.wire.records import (
    DeadLetter,
    Payload,
    SendEvent,
    StartWorkflow,
    TimerScheduled,
    WorkflowStarted,
)
from stepstream.engine.wire.serde import default_serde
from stepstream.engine.wire.topics import COMMANDS, DEAD_LETTERS, TIMERS, partition_for
from stepstream.ops.embedded import EmbeddedConfig, EmbeddedEngine, open_embedded
from stepstream.producers.client import Client

PARTITIONS = 2
KEY = b"some-id"
GOOD = "dl-good"  # the instance started after the bad records, on the same partition
PARTITION = partition_for(GOOD, PARTITIONS)
CODEC = JsonCodec()
SERDE = default_serde()


class _CreatesFileWhenUnpickled:
    """``pickle.loads`` of this calls ``open(path, "w")``: proof that something was
    executed from a record if the file ever exists."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


@dataclass(frozen=True)
class Bad:
    name: str
    value: bytes
    reason: str  # a fragment the dead letter's reason must contain


def _start(instance_id: str, workflow: str = "arith", value: Any = 1) -> StartWorkflow:
    return StartWorkflow(
        instance_id=instance_id,
        command_id=f"start-{instance_id}",
        workflow=workflow,
        input=CODEC.encode(value),
    )


def _event(instance_id: str, command_id: str, name: str, value: Any) -> SendEvent:
    return SendEvent(
        instance_id=instance_id, command_id=command_id, name=name, payload=CODEC.encode(value)
    )


def bad_records(marker: Path) -> list[Bad]:
    truncated = SERDE.encode(_start("dl-truncated"))
    history = WorkflowStarted(
        instance_id="dl-history",
        seq=1,
        command_id="start-dl-history",
        workflow="arith",
        version="1",
        input=CODEC.encode(1),
    )
    unknown_fingerprint = b"\xc3\x01" + b"\x00" * 8 + b"\x02ab"
    return [
        Bad("garbage", b"garbage", "shorter than the 10-byte Avro single-object header"),
        Bad("json", b'{"type": "StartWorkflow", "workflow": "arith"}', "not the Avro"),
        Bad("fingerprint", unknown_fingerprint, "unknown schema fingerprint"),
        Bad("truncated", truncated[:-3], "truncated"),
        Bad("trailing", truncated + b"\x00", "left over"),
        Bad("history-record", SERDE.encode(history), "WorkflowStarted is not a command"),
        Bad("timer-record", _timer_record(), "TimerScheduled is not a command"),
        Bad("pickle", pickle.dumps(_CreatesFileWhenUnpickled(marker)), "not the Avro"),
        Bad(
            "unknown-workflow",
            SERDE.encode(_start(id_on(PARTITION, "dl-unknown-wf"), workflow="no-such-workflow")),
            "unknown workflow 'no-such-workflow'",
        ),
        Bad(
            "unknown-instance",
            SERDE.encode(_event(id_on(PARTITION, "dl-ghost"), "ev-ghost", "go", 1)),
            f"unknown instance {id_on(PARTITION, 'dl-ghost')!r}",
        ),
        Bad(
            "misrouted",
            SERDE.encode(_start(id_on(1 - PARTITION, "dl-misrouted"))),
            f"lives on partition {1 - PARTITION}",
        ),
        Bad(  # a child's notice to its parent is the engine's to send, not a producer's
            "engine-event",
            SERDE.encode(
                _event(
                    id_on(PARTITION, "dl-forged"),
                    "ev-forged",
                    "~child/pay",
                    {"status": "completed", "result": 1},
                )
            ),
            "InvalidPayload: event name starts with '~', which is reserved",
        ),
    ]


def _timer_record() -> bytes:
    return SERDE.encode(
        TimerScheduled(
            instance_id="dl-timer", timer_id="dl-timer/sleep/1/x", fire_at_ms=0, purpose="sleep"
        )
    )


def id_on(partition: int, prefix: str) -> str:
    return next(
        f"{prefix}-{n}"
        for n in range(1000)
        if partition_for(f"{prefix}-{n}", PARTITIONS) == partition
    )


async def append_while_stopped(data: Path, appends: list[Append]) -> list[tuple[int, int]]:
    db = await EmbeddedDB.open(str(data), PARTITIONS)
    try:
        return await db.log.append(appends)
    finally:
        await db.close()


async def open_engine(data: Path) -> EmbeddedEngine:
    registry = Registry()
    registry.add_module("tests.workflows")
    return await open_embedded(registry, EmbeddedConfig(data_dir=str(data), partitions=PARTITIONS))


def dead_letters(engine: EmbeddedEngine, partition: int = PARTITION) -> list[DeadLetter]:
    letters = []
    for entry in engine.db.log.read(DEAD_LETTERS, partition, 0, 100):
        letter = SERDE.decode(entry.value)
        assert isinstance(letter, DeadLetter)
        letters.append(letter)
    return letters


async def run_good_instance(engine: EmbeddedEngine) -> None:
    """A normal workflow on the partition the bad records are on still completes."""
    client = Client(engine.make_transport())
    await client.start("arith", 4, instance_id=GOOD)
    try:
        assert await client.result(GOOD, timeout=10) == {"total": 5, "doubled": 10}
    except Exception:
        for h in await client.history(GOOD):
            print(h)
        raise


async def test_bad_commands_are_dead_lettered_and_the_partition_keeps_moving(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    marker = tmp_path / "pwned"
    bad = bad_records(marker)
    placed = await append_while_stopped(
        data, [Append(COMMANDS, KEY, b.value, PARTITION) for b in bad]
    )

    engine = await open_engine(data)
    try:
        await run_good_instance(engine)
        letters = dead_letters(engine)
        assert [letter.offset for letter in letters] == [offset for _, offset in placed], [
            (letter.offset, letter.reason) for letter in letters
        ]
        for b, letter in zip(bad, letters, strict=True):
            assert b.reason in letter.reason, f"{b.name}: {letter.reason}"
            assert letter.value == b.value, b.name  # the original bytes, untouched
            assert letter.key == KEY
            assert letter.source_topic == COMMANDS
            assert letter.partition == PARTITION
            assert letter.time_ms > 0
            # A record that could be read is named by its command id (readers correlate
            # by it without decoding the value); an unreadable one has none.
            try:
                expected = SERDE.decode(b.value).command_id
            except UndecodableRecord:
                expected = ""
            assert letter.command_id == expected, b.name
            if b.name in ("unknown-workflow", "unknown-instance", "misrouted"):
                assert expected, b.name
        # Nothing else was dead-lettered, anywhere.
        others = [p for p in range(PARTITIONS) if p != PARTITION]
        assert all(dead_letters(engine, p) == [] for p in others)
        # No bad record created an instance.
        names = {s.instance_id for s in engine.host.list_instances()}
        assert names == {GOOD}
    finally:
        await engine.close()
    assert not marker.exists(), "a pickle in the commands log was unpickled"


async def test_dead_lettering_is_durable_and_not_repeated_after_restart(tmp_path: Path) -> None:
    data = tmp_path / "data"
    await append_while_stopped(data, [Append(COMMANDS, KEY, b"garbage", PARTITION)])
    engine = await open_engine(data)
    try:
        await run_good_instance(engine)
        assert len(dead_letters(engine)) == 1
    finally:
        await engine.close()
    engine = await open_engine(data)
    try:
        client = Client(engine.make_transport())
        instance = id_on(PARTITION, "dl-after-restart")
        await client.start("arith", 1, instance_id=instance)
        await client.result(instance, timeout=10)
        assert len(dead_letters(engine)) == 1  # the consumed offset was committed with it
    finally:
        await engine.close()


def test_the_pickle_used_here_would_create_its_file(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    pickle.loads(pickle.dumps(_CreatesFileWhenUnpickled(marker))).close()
    assert marker.exists()  # so "the file does not exist" below means "never unpickled"


async def test_pickled_payload_inside_a_valid_command_is_never_unpickled(tmp_path: Path) -> None:
    data = tmp_path / "data"
    marker = tmp_path / "pwned"
    instance = "dl-pickled-input"
    command = StartWorkflow(
        instance_id=instance,
        command_id="start-pickled",
        workflow="arith",
        input=Payload("application/python-pickle", pickle.dumps(_CreatesFileWhenUnpickled(marker))),
    )
    await append_while_stopped(data, [Append(COMMANDS, instance.encode(), SERDE.encode(command))])
    engine = await open_engine(data)
    try:
        await run_good_instance(engine)
        partition = partition_for(instance, PARTITIONS)
        letters = dead_letters(engine, partition)
        states = {s.instance_id: s for s in engine.host.list_instances()}
        # Either outcome is safe as long as nothing ran: dead-lettered, or an instance
        # that failed with InvalidPayload before any step.
        if letters:
            assert instance not in states
            assert "application/python-pickle" in letters[0].reason
        else:
            state = states[instance]
            assert state.status.value == "failed"
            assert state.error_type == "InvalidPayload"
            assert state.entries == {}
    finally:
        await engine.close()
    assert not marker.exists(), "a pickled payload was unpickled"


# ---- what the design asks beyond undecodable records ----------------------------------


async def test_oversized_payload_reaching_the_processor_is_dead_lettered(tmp_path: Path) -> None:
    """design.md: an oversized payload is rejected at the client; "if one reaches a
    processor anyway it goes to dead-letters with the reason"."""
    data = tmp_path / "data"
    instance = "dl-huge"
    limit = EmbeddedConfig().max_payload_bytes
    command = _start(instance, value="x" * (limit + 1))
    await append_while_stopped(data, [Append(COMMANDS, instance.encode(), SERDE.encode(command))])
    engine = await open_engine(data)
    try:
        await run_good_instance(engine)
        letters = dead_letters(engine, partition_for(instance, PARTITIONS))
        states = {s.instance_id for s in engine.host.list_instances()}
        assert [letter.offset for letter in letters] == [0], (
            f"not dead-lettered; instances: {sorted(states)}"
        )
        assert "limit" in letters[0].reason
        assert instance not in states
    finally:
        await engine.close()


async def approval_behind_the_client(
    engine: EmbeddedEngine, instance: str, payload: Payload
) -> Client:
    """A waiter started, and an approval with ``payload`` written to the commands log
    as any producer may (no client checks it); the client of the engine."""
    client = Client(engine.make_transport())
    await client.start("waiter", None, instance_id=instance)
    event = SendEvent(
        instance_id=instance, command_id=f"ev-{instance}", name="approval", payload=payload
    )
    await engine.db.log.append([Append(COMMANDS, instance.encode(), SERDE.encode(event))])
    return client


async def test_malformed_event_payload_reaching_the_processor_is_dead_lettered(
    tmp_path: Path,
) -> None:
    """design.md: a malformed payload that reaches a processor goes to dead-letters with
    the reason, and loses nothing: the waiting instance is not failed by it."""
    data = tmp_path / "data"
    instance = "dl-waiter"
    engine = await open_engine(data)
    try:
        bad = Payload("application/json", b"{not json")
        client = await approval_behind_the_client(engine, instance, bad)
        await client.send_event(instance, "approval", {"by": "ada"})
        result = await client.result(instance, timeout=10)
        letters = dead_letters(engine, partition_for(instance, PARTITIONS))
        assert result == {"by": "ada"}, f"dead letters: {[d.reason for d in letters]}"
        assert len(letters) == 1 and "JSON" in letters[0].reason
    finally:
        await engine.close()


async def test_an_event_sealed_by_a_codec_this_engine_lacks_is_kept(tmp_path: Path) -> None:
    """docs/encryption.md: an engine started without the codec loses nothing. An event a
    codec sealed (from a client that has it) is not malformed: it is kept, the instance
    parks when it reads it, and an engine with the codec goes on with it."""
    data = tmp_path / "data"
    instance = "dl-sealed"
    sealing = AesGcmCodec([("k1", bytes(range(32)))])
    engine = await open_engine(data)
    try:
        client = await approval_behind_the_client(engine, instance, sealing.encode({"by": "ada"}))
        for _ in range(200):
            status = await client.status(instance)
            if status.error:
                break
            await asyncio.sleep(0.05)
        assert status.status == "running" and status.error.startswith("InvalidPayload: "), status
        assert dead_letters(engine, partition_for(instance, PARTITIONS)) == []
    finally:
        await engine.close()
    registry = Registry()
    registry.add_module("tests.workflows")
    config = EmbeddedConfig(data_dir=str(data), partitions=PARTITIONS)
    engine = await open_embedded(registry, config, codec=sealing)
    try:
        client = Client(engine.make_transport())
        assert await client.result(instance, timeout=10) == {"by": "ada"}
    finally:
        await engine.close()


async def test_a_sealed_event_too_large_or_for_a_queue_is_still_refused(tmp_path: Path) -> None:
    """What is kept unread is bounded, and only a workflow's instance keeps it: a
    schedule or a queue reads every message it gets and could never go on."""
    data = tmp_path / "data"
    limit = EmbeddedConfig().max_payload_bytes
    huge = SendEvent(
        instance_id="dl-sealed-huge",
        command_id="ev-huge",
        name="approval",
        payload=Payload("application/octet-stream", b"x" * (limit + 1)),
    )
    queue = "~queue/desk"
    acquire = SendEvent(
        instance_id=queue,
        command_id="ev-queue",
        name="queue.acquire",
        payload=Payload("text/plain", b"hello"),
    )
    engine = await open_engine(data)
    try:
        for event in (huge, acquire):
            target = event.instance_id.encode()
            await engine.db.log.append([Append(COMMANDS, target, SERDE.encode(event))])
        await run_good_instance(engine)
        for _ in range(200):  # each partition gets to its record in its own time
            reasons = {
                letter.instance_id: letter.reason
                for p in range(PARTITIONS)
                for letter in dead_letters(engine, p)
            }
            if len(reasons) == 2:
                break
            await asyncio.sleep(0.02)
        assert reasons["dl-sealed-huge"].startswith("PayloadTooLarge"), reasons
        assert "content type 'text/plain'" in reasons[queue], reasons
    finally:
        await engine.close()


async def test_undecodable_timer_record_does_not_stop_timers(tmp_path: Path) -> None:
    data = tmp_path / "data"
    instance = "dl-sleeper"
    partition = partition_for(instance, PARTITIONS)
    await append_while_stopped(data, [Append(TIMERS, instance.encode(), b"garbage", partition)])
    engine = await open_engine(data)
    try:
        client = Client(engine.make_transport())
        await client.start("sleeper", 0.05, instance_id=instance)
        assert (await client.result(instance, timeout=10))["slept"] >= 0.05
    finally:
        await engine.close()


async def test_undecodable_timer_record_is_dead_lettered(tmp_path: Path) -> None:
    """design.md: an undecodable record that reaches a processor goes to dead-letters
    with the reason. The timer service reads the timers topic; today it logs and skips."""
    data = tmp_path / "data"
    await append_while_stopped(data, [Append(TIMERS, KEY, b"garbage", PARTITION)])
    engine = await open_engine(data)
    try:
        await run_good_instance(engine)
        letters = dead_letters(engine)
        assert [(d.source_topic, d.value) for d in letters] == [(TIMERS, b"garbage")]
    finally:
        await engine.close()


async def test_command_for_a_finished_instance_is_recorded_not_dead_lettered(
    tmp_path: Path,
) -> None:
    """design.md: commands for a finished instance are recorded and ignored; dead letters
    are for bad input, and such a command is not bad input."""
    data = tmp_path / "data"
    engine = await open_engine(data)
    try:
        await run_good_instance(engine)
        late = SendEvent(instance_id=GOOD, command_id="ev-late", name="go", payload=CODEC.encode(1))
        await engine.db.log.append([Append(COMMANDS, GOOD.encode(), SERDE.encode(late))])
        client = Client(engine.make_transport())
        for _ in range(200):
            history = await client.history(GOOD)
            if history[-1].type == "CommandIgnored":
                break
            await asyncio.sleep(0.01)
        assert history[-1].type == "CommandIgnored", [h.type for h in history]
        assert history[-1].attributes["command_type"] == "SendEvent"
        assert history[-1].command_id == "ev-late"
        assert dead_letters(engine) == []
    finally:
        await engine.close()


async def test_an_internal_error_undoes_the_instance_s_whole_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug while applying a command (not user code) must not leave records of the same
    instance from earlier in the batch without the state that goes with them: all its
    inputs in the batch are undone and dead-lettered, other instances are unaffected."""
    events_named_boom_hit_a_bug(monkeypatch)
    data = tmp_path / "data"
    engine = await open_engine(data)
    try:
        client = Client(engine.make_transport())
        hit = id_on(PARTITION, "dl-hit")
        other = id_on(PARTITION, "dl-other")
        for instance in (hit, other):
            await client.start("two-events", None, instance_id=instance)
            await wait_waiting(client, instance)
        events = [
            SendEvent(instance_id=hit, command_id="e1", name="item", payload=CODEC.encode(1)),
            SendEvent(instance_id=other, command_id="o1", name="item", payload=CODEC.encode(9)),
            SendEvent(instance_id=hit, command_id="e2", name="boom", payload=CODEC.encode(2)),
            SendEvent(instance_id=hit, command_id="e3", name="item", payload=CODEC.encode(3)),
        ]
        await engine.db.log.append(
            [Append(COMMANDS, e.instance_id.encode(), SERDE.encode(e), PARTITION) for e in events]
        )
        for _ in range(200):
            if len(dead_letters(engine)) >= 2:
                break
            await asyncio.sleep(0.01)
        letters = sorted(dead_letters(engine), key=lambda d: d.offset)
        assert [SERDE.decode(d.value).command_id for d in letters] == ["e1", "e2"], [
            d.reason for d in letters
        ]
        assert "not applied" in letters[0].reason and "internal error" in letters[1].reason
        # What came before the failure is undone, what came after it applied (once);
        # the other instance moved on.
        history = await client.history(hit)
        assert [h.seq for h in history] == list(range(1, len(history) + 1))
        claimed = [h.attributes["event_command_id"] for h in history if h.type == "WaitSatisfied"]
        assert claimed == ["e3"], [(h.type, h.command_id) for h in history]
        assert [h.type for h in await client.history(other)].count("WaitSatisfied") == 1
        await client.send_event(hit, "item", 4)
        assert await client.result(hit, timeout=10) == [3, 4]
    finally:
        await engine.close()


def events_named_boom_hit_a_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine bug, injected: applying an event named "boom" raises."""
    from stepstream.engine.replay.inputs import HANDLERS
    from stepstream.engine.replay.runtime import InstanceRuntime

    real = HANDLERS[SendEvent]

    def buggy(rt: InstanceRuntime, msg: SendEvent) -> None:
        if msg.name == "boom":
            raise RuntimeError("a bug in the engine")
        real(rt, msg)

    monkeypatch.setitem(HANDLERS, SendEvent, buggy)


async def wait_waiting(client: Client, instance: str) -> None:
    for _ in range(500):
        if (await client.status(instance)).waits:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{instance} never waited")


async def test_two_internal_errors_of_one_instance_in_a_batch_undo_what_each_follows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events_named_boom_hit_a_bug(monkeypatch)
    engine = await open_engine(tmp_path / "data")
    try:
        client = Client(engine.make_transport())
        hit = id_on(PARTITION, "dl-twice")
        await client.start("two-events", None, instance_id=hit)
        await wait_waiting(client, hit)
        names = [("e1", "item"), ("e2", "boom"), ("e3", "item"), ("e4", "boom")]
        events = [
            SendEvent(instance_id=hit, command_id=c, name=n, payload=CODEC.encode(c))
            for c, n in names
        ]
        await engine.db.log.append(
            [Append(COMMANDS, hit.encode(), SERDE.encode(e), PARTITION) for e in events]
        )
        for _ in range(200):
            if len(dead_letters(engine)) >= 4:
                break
            await asyncio.sleep(0.01)
        letters = sorted(dead_letters(engine), key=lambda d: d.offset)
        assert [SERDE.decode(d.value).command_id for d in letters] == ["e1", "e2", "e3", "e4"]
        assert ["not applied" in d.reason for d in letters] == [True, False, True, False]
        history = await client.history(hit)
        assert [h.seq for h in history] == list(range(1, len(history) + 1))
        assert "WaitSatisfied" not in [h.type for h in history]
        await client.send_event(hit, "item", 1)
        await client.send_event(hit, "item", 2)
        assert await client.result(hit, timeout=10) == [1, 2]
    finally:
        await engine.close()
