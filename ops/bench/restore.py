"""What a Kafka worker without local state spends restoring every partition, from the
newest snapshots and from the whole history, timed on the topics a workload left."""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from typing import Any


async def kafka_restore(bootstrap: str, prefix: str, partitions: int) -> dict[str, Any]:
    """What a worker without local state spends restoring every partition, from the
    newest snapshots and from the whole history, on the topics a workload left."""
    from stepstream.consumers.kafka import (
        HistoryReader,
        LogProducer,
        OutRecord,
        PartitionDB,
        restore_partition,
    )
    from stepstream.consumers.kafka.snapshots import SnapshotReader
    from stepstream.engine.config.kafka import KafkaSettings
    from stepstream.engine.seams import SystemClock
    from stepstream.engine.wire.records import PartitionFenced
    from stepstream.engine.wire.serde import default_serde
    from stepstream.engine.wire.topics import SNAPSHOTS, TopicNames

    settings = KafkaSettings(bootstrap=bootstrap, prefix=prefix)
    serde = default_serde()
    producer = await asyncio.to_thread(LogProducer, settings, client_id="stepstream-bench")
    reader = await asyncio.to_thread(HistoryReader, settings)
    snapshots = SnapshotReader(await asyncio.to_thread(HistoryReader, settings, SNAPSHOTS), serde)
    out: dict[str, Any] = {}
    try:
        # The producer's first send waits for its producer id (about 0.5 s): not part of
        # either way of restoring, so it is paid before the clock starts.
        # (A fence of epoch 0 changes nothing for any reader.)
        warm = PartitionFenced(instance_id="", command_id="bench-warm-up", epoch=0, partition=0)
        await producer.send([OutRecord(TopicNames(prefix).history, 0, b"", serde.encode(warm))])
        for label, source in (("snapshot", snapshots), ("full", None)):
            seconds = 0.0
            records = from_snapshot = 0
            with tempfile.TemporaryDirectory(prefix="stepstream-restore-") as tmp:
                for partition in range(partitions):
                    db = PartitionDB.open(os.path.join(tmp, str(partition)), partition, partitions)
                    began = time.perf_counter()
                    db, restored = await restore_partition(
                        db,
                        partition,
                        reader=reader,
                        producer=producer,
                        serde=serde,
                        clock=SystemClock(),
                        topics=TopicNames(prefix),
                        group_offsets={},
                        snapshots=source,
                    )
                    seconds += time.perf_counter() - began
                    records += restored.records
                    from_snapshot += restored.snapshot is not None
                    db.close()
            out[label] = {
                "restore_s": round(seconds, 3),
                "history_records_folded": records,
                "partitions_from_snapshot": from_snapshot,
            }
    finally:
        await asyncio.to_thread(reader.close)
        await asyncio.to_thread(snapshots.close)
        await asyncio.to_thread(producer.close)
    return out
