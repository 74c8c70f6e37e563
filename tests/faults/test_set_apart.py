"""An instance whose decisions cannot be stored is set apart, and its partition goes on.

Every value a workflow gives is checked where it is given, but a value that got past the
checks and that no record can hold used to fail its partition's commit, again after
every reload: the whole partition stopped for good. This test makes one instance's
records unencodable (as such a value would) and checks what the worker does instead:
the instance's commands are dead-lettered with the reason, the client that sent one is
told, the metric counts it, and the other instances of the partition run on."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from stepstream import StepstreamError
from stepstream.engine.wire.records import WorkflowCompleted
from stepstream.engine.wire.serde import RecordSerde
from stepstream.ops.embedded import EmbeddedConfig, open_embedded
from stepstream.producers.client import Client
from tests.conftest import test_registry as workflows_of_tests
from tests.faults.test_dead_letters import dead_letters

POISON = "set-apart"


async def test_an_unstorable_instance_is_set_apart_and_its_partition_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    encode = RecordSerde.encode

    def unstorable_end(self: RecordSerde, record: Any) -> bytes:
        if isinstance(record, WorkflowCompleted) and record.instance_id == POISON:
            raise ValueError("attribute result=10**300 does not fit in an Avro long")
        return encode(self, record)

    monkeypatch.setattr(RecordSerde, "encode", unstorable_end)
    engine = await open_embedded(
        workflows_of_tests(), EmbeddedConfig(data_dir=str(tmp_path / "data"), partitions=1)
    )
    try:
        client = Client(engine.make_transport())
        await client.start("waiter", None, instance_id=POISON)
        await client.start("waiter", None, instance_id="beside")
        # The event ends the instance, and its end cannot be stored.
        with caplog.at_level(logging.ERROR, logger="stepstream.partition"):
            with pytest.raises(StepstreamError, match="is set apart: what it decided cannot be"):
                await client.send_event(POISON, "approval", "yes")
        assert "does not fit in an Avro long" in caplog.text
        # As it was last committed; the others of the partition run on.
        assert (await client.status(POISON)).status == "running"
        await client.send_event("beside", "approval", "fine")
        assert await client.result("beside", timeout=20) == "fine"
        await client.start("arith", 2, instance_id="after")
        assert await client.result("after", timeout=20) == {"total": 3, "doubled": 6}
        with pytest.raises(StepstreamError, match="is set apart"):
            await client.send_event(POISON, "approval", "again")
        letters = [letter for letter in dead_letters(engine, 0) if "set apart" in letter.reason]
        assert len(letters) == 2, [letter.reason for letter in dead_letters(engine, 0)]
        assert "reset, cancel or terminate" in letters[0].reason
        metrics = engine.host.telemetry
        assert metrics.set_apart == 1
        assert metrics.dead_letters["set_apart"] == 2
    finally:
        await engine.close()
