"""The fires a partition's timer service appended come back to its processor without a
second decode; the memo holding them is bounded and hands each record out once."""

from __future__ import annotations

from stepstream.consumers.timers import OwnFires
from stepstream.engine.wire.records import TimerFired
from stepstream.engine.wire.serde import RecordSerde


def fire(n: int) -> TimerFired:
    return TimerFired(
        instance_id=f"i-{n}",
        time_ms=1_000 + n,
        command_id=f"fire:i-{n}/sleep/1/nap",
        epoch=3,
        timer_id=f"i-{n}/sleep/1/nap",
        fire_at_ms=900 + n,
    )


def test_a_fire_read_back_is_the_record_its_bytes_decode_to_and_is_taken_once() -> None:
    serde = RecordSerde()
    own = OwnFires()
    record = fire(1)
    value = serde.encode(record)
    own.add(value, record)
    taken = own.take(bytes(value))  # the log hands back equal bytes, not the same object
    assert taken == serde.decode(value) == record
    assert own.take(value) is None  # read again (a rewind): decoded like any record
    assert len(own) == 0


def test_only_the_most_recent_fires_are_kept() -> None:
    serde = RecordSerde()
    own = OwnFires(limit=3)
    values = []
    for n in range(5):
        record = fire(n)
        values.append(serde.encode(record))
        own.add(values[-1], record)
    assert len(own) == 3
    assert own.take(values[0]) is None and own.take(values[1]) is None
    assert [own.take(v) for v in values[2:]] == [fire(2), fire(3), fire(4)]
