"""A partition commit that fails once: the processor must not stop for good.

engine/replay/runtime.py promises: "If that commit fails, the processor drops the runtime and
replays it later." A Kafka produce can fail transiently (ProduceFailed), and an ack can
be lost after the write landed. Here the embedded partition is wrapped so that exactly
one commit fails, either before anything was written or after the write was durable;
the instance must still complete, with every guarantee intact.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from stepstream.consumers.embedded import EmbeddedPartition
from stepstream.engine.api.workflow import Registry
from stepstream.engine.errors import ResultTimeout
from stepstream.engine.seams import CommitBatch
from stepstream.ops.embedded import EmbeddedConfig, EmbeddedEngine, open_embedded
from stepstream.producers.client import Client
from tests.fakes import CommitFaults


class CommitFailed(Exception):
    """What a transport error looks like to the processor."""


class FlakyPartition(CommitFaults):
    """An embedded partition whose ``fail_at``-th commit raises, once."""

    def __init__(self, inner: EmbeddedPartition, fail_at: int, *, after_write: bool) -> None:
        super().__init__(inner)
        self._fail_at = fail_at
        self._after_write = after_write
        self.failed = False

    async def commit(self, batch: CommitBatch) -> None:
        self.commits += 1
        if self.commits != self._fail_at:
            await self.inner.commit(batch)
            return
        self.failed = True
        if self._after_write:
            await self.inner.commit(batch)
            raise CommitFailed("the write landed but its acknowledgement was lost")
        raise CommitFailed("the write failed; nothing was written")


async def engine_with_flaky_partition(
    data: Path, fail_at: int, after_write: bool
) -> tuple[EmbeddedEngine, FlakyPartition]:
    registry = Registry()
    registry.add_module("tests.workflows")
    engine = await open_embedded(registry, EmbeddedConfig(data_dir=str(data), partitions=1))
    await engine.host.revoke(0)
    flaky = FlakyPartition(EmbeddedPartition(engine.db, 0), fail_at, after_write=after_write)
    await engine.host.assign(flaky)
    return engine, flaky


@pytest.mark.parametrize("after_write", [False, True], ids=["before-write", "ack-lost"])
async def test_processor_survives_one_failed_commit(tmp_path: Path, after_write: bool) -> None:
    # Commit 1 fences the partition, 2 applies the start, 3+ apply step outcomes.
    engine, flaky = await engine_with_flaky_partition(tmp_path / "data", 4, after_write)
    instance = "flaky-commit"
    try:
        client = Client(engine.make_transport())
        await client.start("chain", 10, instance_id=instance)
        try:
            result = await client.result(instance, timeout=3)
        except ResultTimeout:
            so_far = [(h.seq, h.type, h.attributes) for h in await client.history(instance)]
            pytest.fail(
                f"{instance} never finished after commit {flaky.commits} of the partition "
                f"failed (failed={flaky.failed}); the processor stopped. History:\n"
                + "\n".join(map(str, so_far))
            )
        assert flaky.failed
        assert result == 10
        history = await client.history(instance)
        assert [h.seq for h in history] == list(range(1, len(history) + 1)), history
        succeeded = Counter(h.attributes["key"] for h in history if h.type == "StepSucceeded")
        assert succeeded == Counter(f"s{i}" for i in range(10)), history
    finally:
        await engine.close()
