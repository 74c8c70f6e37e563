"""Instance ids and names are checked at every entry point, and the state of one
instance can never be reached through another's id.

An id with a NUL byte once read, and after retention destroyed, another instance's
state (keys were NUL-joined). Clients now refuse such ids with ``InvalidPayload``; a
command that gets past a client is dead-lettered by the processor; and the key layout
keeps instances apart even when neither check runs.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from stepstream import InvalidPayload, PayloadTooLarge, UnknownInstance
from stepstream.engine.seams import Append
from stepstream.engine.wire.codec import JsonCodec
from stepstream.engine.wire.records import SendEvent, StartWorkflow
from stepstream.engine.wire.serde import default_serde
from stepstream.engine.wire.topics import COMMANDS, partition_for
from stepstream.ops.embedded import EmbeddedConfig, open_embedded
from stepstream.producers.client import Client
from tests.conftest import test_registry as workflows_of_tests
from tests.faults.test_dead_letters import dead_letters

CODEC = JsonCodec()
SERDE = default_serde()

BAD_IDS = {
    "nul": "victim\x00x",
    "newline": "a\nb",
    "escape": "a\x1b[31mred",
    "lone surrogate": "a\ud800b",
    "10 KB": "x" * 10_000,
    "257 bytes of UTF-8": "é" * 129,
    "empty": "",
    "spaces": "   ",
}


@pytest.mark.parametrize("name", list(BAD_IDS))
async def test_bad_instance_ids_are_refused_and_nothing_is_created(
    client: Client, name: str
) -> None:
    bad = BAD_IDS[name]
    before = {s.instance_id for s in await client.list()}
    with pytest.raises(InvalidPayload, match="instance id") as caught:
        await client.start("arith", 1, instance_id=bad)
    assert len(str(caught.value)) < 400  # a 10 KB id is not quoted back whole
    for call in (client.status, client.pause, client.resume, client.history):
        with pytest.raises(InvalidPayload, match="instance id"):
            await call(bad)
    with pytest.raises(InvalidPayload, match="instance id"):
        await client.send_event(bad, "go", 1)
    with pytest.raises(InvalidPayload, match="instance id"):
        await client.cancel(bad, reason="no")
    assert {s.instance_id for s in await client.list()} == before


async def test_the_engines_own_ids_are_refused_to_starts_and_forks(client: Client) -> None:
    await client.start("arith", 1, instance_id="source")
    await client.result("source", timeout=20)
    for reserved in ("~schedule/nightly", "~queue/api", "~queue/api/tenant-1"):
        with pytest.raises(InvalidPayload, match="which is reserved for"):
            await client.start("arith", 1, instance_id=reserved)
        with pytest.raises(InvalidPayload, match="which is reserved for"):
            await client.fork("source", to="add", instance_id=reserved)
    assert [s.instance_id for s in await client.list()] == ["source"]


async def test_a_priority_beyond_64_bits_is_refused(client: Client) -> None:
    with pytest.raises(InvalidPayload, match="priority of instance p-1 must fit in 64 bits"):
        await client.start("arith", 1, instance_id="p-1", priority=2**63)
    await client.start("arith", 1, instance_id="p-1", priority=-(2**63))
    assert await client.result("p-1", timeout=20) == {"total": 2, "doubled": 4}


async def test_good_ids_of_any_script_work(client: Client) -> None:
    for instance in ("order/2024#1", "заказ-1", "注文 1", "x" * 256, "é" * 128):
        await client.start("arith", 2, instance_id=instance)
        assert await client.result(instance, timeout=20) == {"total": 3, "doubled": 6}
        assert (await client.status(instance)).instance_id == instance


async def test_event_names_and_cancel_reasons_are_checked(client: Client) -> None:
    instance = await client.start("waiter", None, instance_id="names-waiter")
    for bad in ("a\x00b", "e" * 300, "", "x\ud800"):
        with pytest.raises(InvalidPayload, match="event"):
            await client.send_event(instance, bad, 1)
    with pytest.raises(InvalidPayload, match="cancel reason"):
        await client.cancel(instance, reason="why\udfff")
    with pytest.raises(PayloadTooLarge, match="cancel reason"):
        await client.cancel(instance, reason="r" * 9000)
    assert (await client.status(instance)).status == "running"
    await client.send_event(instance, "approval", "fine")
    assert await client.result(instance, timeout=20) == "fine"


async def test_ids_refused_over_http_get_a_400(tmp_path: Path) -> None:
    """Through the HTTP API: the JSON body's id is checked before anything is written."""
    from stepstream.ops.api.routes import make_app

    engine = await open_embedded(
        workflows_of_tests(), EmbeddedConfig(data_dir=str(tmp_path / "data"), partitions=1)
    )
    app = make_app(engine.make_transport())
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    url = f"http://127.0.0.1:{port}/v1/instances"
    try:
        async with aiohttp.ClientSession() as http:
            for bad in ("v\x00x", "x" * 10_000, "a\x7f"):
                body = json.dumps({"workflow": "arith", "input": 1, "instance_id": bad})
                headers = {"Content-Type": "application/json"}
                async with http.post(url, data=body, headers=headers) as response:
                    answer = await response.json()
                    assert response.status == 400, answer
                    assert answer["error"]["type"] == "InvalidPayload"
                    assert "instance id" in answer["error"]["message"]
            # The engine's own ids, which only a client's check refused before.
            for reserved in ("~schedule/nightly", "~queue/api"):
                body = json.dumps({"workflow": "arith", "input": 1, "instance_id": reserved})
                async with http.post(url, data=body, headers=headers) as response:
                    answer = await response.json()
                    assert response.status == 400, answer
                    assert "which is reserved for" in answer["error"]["message"]
            # A priority no record could hold: a 400 naming it, not a 500.
            body = json.dumps({"workflow": "arith", "input": 1, "priority": 2**64})
            async with http.post(url, data=body, headers=headers) as response:
                answer = await response.json()
                assert response.status == 400, answer
                assert "'priority' must fit in 64 bits" in answer["error"]["message"]
            async with http.get(url) as response:
                assert (await response.json())["instances"] == []
    finally:
        await runner.cleanup()
        await engine.close()


async def test_a_foreign_command_with_a_nul_in_its_id_is_dead_lettered(tmp_path: Path) -> None:
    engine = await open_embedded(
        workflows_of_tests(), EmbeddedConfig(data_dir=str(tmp_path / "data"), partitions=1)
    )
    try:
        client = Client(engine.make_transport())
        await client.start("waiter", None, instance_id="victim")
        bad = [
            StartWorkflow(
                instance_id="victim\x00x",
                command_id="c-start",
                workflow="arith",
                version="1",
                input=CODEC.encode(1),
            ),
            SendEvent(
                instance_id="victim", command_id="c-ev", name="a\x00", payload=CODEC.encode(1)
            ),
        ]
        await engine.db.log.append([Append(COMMANDS, b"victim", SERDE.encode(c), 0) for c in bad])
        for _ in range(300):
            letters = dead_letters(engine, 0)
            if len(letters) == 2:
                break
            await asyncio.sleep(0.01)
        assert len(letters) == 2, letters
        assert "instance id" in letters[0].reason and "control character" in letters[0].reason
        assert "event name" in letters[1].reason
        assert [s.instance_id for s in await client.list()] == ["victim"]
        await client.send_event("victim", "approval", "ok")
        assert await client.result("victim", timeout=10) == "ok"
    finally:
        await engine.close()


async def test_a_foreign_start_under_a_reserved_id_is_dead_lettered(tmp_path: Path) -> None:
    """A producer other than the client (a Kafka source keyed by the upstream's ids, a
    Kafka tool) writes a start under a schedule's id: the engine refuses it, and the
    schedule of that name can still be made."""
    engine = await open_embedded(
        workflows_of_tests(), EmbeddedConfig(data_dir=str(tmp_path / "data"), partitions=1)
    )
    try:
        client = Client(engine.make_transport())
        start = StartWorkflow(
            instance_id="~schedule/weekly",
            command_id="c-squat",
            workflow="arith",
            version="1",
            input=CODEC.encode(1),
        )
        await engine.db.log.append([Append(COMMANDS, b"~schedule/weekly", SERDE.encode(start), 0)])
        for _ in range(300):
            letters = dead_letters(engine, 0)
            if letters:
                break
            await asyncio.sleep(0.01)
        assert len(letters) == 1, letters
        assert "'~schedule/weekly' starts with '~schedule/', which is reserved for schedules" in (
            letters[0].reason
        )
        assert await client.list() == []
        await client.create_schedule("weekly", "arith", input=1, every=3600)
        assert [s.name for s in await client.list_schedules()] == ["weekly"]
    finally:
        await engine.close()


async def test_an_id_that_extends_another_with_a_nul_cannot_touch_its_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key layout alone keeps instances apart: with the name checks switched off, an
    instance "victim\\0x" that runs steps and is forgotten by retention leaves the
    instance "victim" whole: it replays after a restart and completes."""
    monkeypatch.setattr("stepstream.consumers.partition.intake.name_problem", lambda value: None)
    config = EmbeddedConfig(
        data_dir=str(tmp_path / "data"), partitions=1, retention_s=0.5, sweep_interval_s=0.05
    )
    attacker = "victim\x00x"
    assert partition_for(attacker, 1) == partition_for("victim", 1) == 0
    engine = await open_embedded(workflows_of_tests(), config)
    try:
        client = Client(engine.make_transport())
        await client.start("waiter", None, instance_id="victim")
        start = StartWorkflow(
            instance_id=attacker,
            command_id="c-attack",
            workflow="chain",
            version="1",
            input=CODEC.encode(5),
        )
        await engine.db.log.append([Append(COMMANDS, b"x", SERDE.encode(start), 0)])
        processor = engine.host._processor("victim")
        for _ in range(300):
            state = processor.reads.read_state(attacker, entries=False)
            if state is not None and state.status.finished:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the second instance never finished")
        victim_history = [h.type for h in await client.history("victim")]
        assert victim_history.count("WorkflowStarted") == 1
        assert "StepSucceeded" not in victim_history  # none of the other's records
        for _ in range(300):  # retention forgets the finished one
            if processor.reads.read_state(attacker) is None:
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the second instance was never forgotten")
        assert (await client.status("victim")).status == "running"
    finally:
        await engine.close()
    engine = await open_embedded(workflows_of_tests(), config)  # replays "victim" from its keys
    try:
        client = Client(engine.make_transport())
        status = await client.status("victim")
        assert status.status == "running" and status.error is None, status
        await client.send_event("victim", "approval", "still mine")
        assert await client.result("victim", timeout=10) == "still mine"
        with pytest.raises(UnknownInstance):
            await client.status("victim-unknown")
    finally:
        await engine.close()
