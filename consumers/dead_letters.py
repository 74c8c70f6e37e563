"""Dead letters: records a processor cannot use, kept with the reason and the original
bytes, so the partition keeps moving and nothing is lost."""

from __future__ import annotations

import logging

from stepstream.engine.seams import Append, Clock, LogEntry, PartitionBackend
from stepstream.engine.wire.records import DeadLetter
from stepstream.engine.wire.serde import RecordSerde
from stepstream.engine.wire.topics import DEAD_LETTERS

log = logging.getLogger("stepstream.dead_letters")


def dead_letter(
    entry: LogEntry,
    reason: str,
    *,
    serde: RecordSerde,
    backend: PartitionBackend,
    clock: Clock,
    command_id: str = "",
) -> Append:
    """``command_id``: the refused command's id, when its record could be read (a reader
    of the dead letters correlates by it without decoding the value)."""
    log.warning(
        "%s record sent to dead-letters: %s",
        entry.topic,
        reason,
        extra={
            "instance_id": entry.key.decode(errors="replace"),
            "partition": entry.partition,
            "offset": entry.offset,
        },
    )
    letter = DeadLetter(
        instance_id=entry.key.decode(errors="replace"),
        time_ms=clock.now_ms(),
        command_id=command_id,
        epoch=backend.epoch,
        source_topic=entry.topic,
        partition=entry.partition,
        offset=entry.offset,
        key=entry.key,
        value=entry.value,
        reason=reason,
    )
    return Append(DEAD_LETTERS, entry.key, serde.encode(letter), backend.partition)
