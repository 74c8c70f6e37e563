"""Where histories come from: an embedded data directory (opened read-only), a client
(``Client.list`` + ``Client.history``), a Kafka history topic (folded by the reader rules
of ``schemas/README.md``) or export files (``ops.tools.history_export``)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from stepstream.engine.errors import StepstreamError, UndecodableRecord
from stepstream.engine.wire.codec import PayloadCodec
from stepstream.engine.wire.records import (
    HistoryRecord,
    InstanceForgotten,
    PartitionFenced,
    WorkflowStarted,
)
from stepstream.engine.wire.serde import RecordSerde, default_serde


@dataclass(frozen=True, slots=True)
class History:
    """One instance's recorded story, in sequence order."""

    instance_id: str
    records: list[HistoryRecord]

    @property
    def started(self) -> WorkflowStarted | None:
        first = self.records[0] if self.records else None
        return first if isinstance(first, WorkflowStarted) else None


def group_records(records: Iterable[HistoryRecord]) -> list[History]:
    """Records of any instances, each instance's in sequence order."""
    stories: dict[str, list[HistoryRecord]] = {}
    for record in records:
        stories.setdefault(record.instance_id, []).append(record)
    return [
        History(instance_id, sorted(story, key=lambda r: r.seq))
        for instance_id, story in stories.items()
    ]


def fold_history_log(
    entries: Iterable[tuple[int, bytes]], serde: RecordSerde | None = None
) -> tuple[list[History], int]:
    """Fold raw history-topic records ((partition, value) in offset order per partition)
    by the reader rules of ``schemas/README.md``: records of an epoch below the newest
    fence are skipped, so are re-deliveries (seq not above the last one of the instance);
    an ``InstanceForgotten`` drops the instance. Returns the stories and how many records
    were skipped as unreadable."""
    serde = serde or default_serde()
    fences: dict[int, int] = {}
    stories: dict[str, list[HistoryRecord]] = {}
    unreadable = 0
    for partition, value in entries:
        try:
            record = serde.decode(value)
        except UndecodableRecord:
            unreadable += 1
            continue
        if isinstance(record, PartitionFenced):
            fences[partition] = max(fences.get(partition, 0), record.epoch)
            continue
        if not isinstance(record, HistoryRecord) or record.epoch < fences.get(partition, 0):
            continue
        story = stories.setdefault(record.instance_id, [])
        if story and record.seq <= story[-1].seq:
            continue
        if isinstance(record, InstanceForgotten):
            del stories[record.instance_id]
            continue
        story.append(record)
    return [History(i, story) for i, story in stories.items() if story], unreadable


def read_data_dir(path: str, *, instance_id: str | None = None) -> Iterator[History]:
    """Histories in an embedded data directory, read from a read-only RocksDB: the
    writer's lock is not taken (a running engine may hold it) and nothing is written."""
    from stepstream.consumers.embedded.readonly import ReadOnlyData

    serde = default_serde()
    with ReadOnlyData(path) as data:
        for instance, values in data.histories(instance_id):
            records = []
            for value in values:
                record = serde.decode(value)
                if isinstance(record, HistoryRecord):
                    records.append(record)
            yield History(instance, records)


def read_kafka(settings: Any, *, from_offset: int = 0) -> tuple[list[History], int]:
    """Every partition of ``<prefix>.history`` from ``from_offset`` (or its first offset)
    to its end, folded by the reader rules. Returns the histories and how many records
    could not be read."""
    from stepstream.consumers.kafka.admin import existing_partitions
    from stepstream.consumers.kafka.restore import HistoryReader
    from stepstream.engine.wire.topics import HISTORY, TopicNames

    topic = TopicNames(settings.prefix).name(HISTORY)
    partitions = existing_partitions(settings).get(topic)
    if partitions is None:
        raise StepstreamError(
            f"topic {topic} does not exist on {settings.bootstrap}; check --bootstrap and --prefix"
        )
    raw: list[tuple[int, bytes]] = []
    reader = HistoryReader(settings)
    try:
        for partition in range(partitions):
            low, end = reader.end(partition)
            start = max(low, from_offset)
            if start >= end:
                continue
            reader.read(partition, start, None, _collect(raw, partition))
    finally:
        reader.close()
    return fold_history_log(raw)


def _collect(into: list[tuple[int, bytes]], partition: int) -> Callable[[int, bytes, Any], None]:
    def on_record(_offset: int, value: bytes, _headers: Any) -> None:
        into.append((partition, value))

    return on_record


async def read_client(
    client: Any,
    *,
    instance_id: str | None = None,
    workflow: str | None = None,
    codec: PayloadCodec | None = None,
    concurrency: int = 16,
) -> list[History]:
    """Histories through a client: ``Client.list`` and ``Client.history``, rebuilt into
    records (``ops.tools.history_export.records_from_entries``) whose payloads ``codec``
    encodes again (JSON by default), so the replay decodes them with the same codec."""
    from stepstream.ops.tools.history_export import records_from_entries

    if instance_id is not None:
        ids = [instance_id]
    else:
        ids = [
            s.instance_id for s in await client.list() if workflow is None or s.workflow == workflow
        ]
    limit = asyncio.Semaphore(concurrency)

    async def one(instance: str) -> History:
        async with limit:
            entries = await client.history(instance)
        return History(instance, records_from_entries(instance, entries, codec))

    return list(await asyncio.gather(*(one(i) for i in ids)))


def read_files(paths: Sequence[str | os.PathLike[str]]) -> list[History]:
    from stepstream.ops.tools.history_export import read_export

    out = []
    for path in paths:
        exported = read_export(path)
        out.append(History(exported.instance_id, exported.records))
    return out
