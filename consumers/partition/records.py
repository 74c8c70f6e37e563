"""How a batch's decisions become the records and state of one commit, and which
instances may leave memory once it is durable."""

from __future__ import annotations

from stepstream.consumers import state_keys as keys
from stepstream.consumers.instance_store import write_state
from stepstream.consumers.partition.batch import Batch
from stepstream.engine.replay.state import EntryState, Status
from stepstream.engine.seams import Append
from stepstream.engine.wire.records import SleepStarted
from stepstream.engine.wire.serde import RecordSerde
from stepstream.engine.wire.settle import settled_key
from stepstream.engine.wire.topics import COMMANDS, HISTORY, TIMERS


class Unstorable(Exception):
    """What a batch decided for one instance cannot be stored: a value no record (an Avro
    long, say) or state can hold got past every check. Retrying the batch would fail the
    same way for ever, so the processor sets the instance apart instead
    (``Applier.quarantine``) and the rest of the partition goes on."""

    def __init__(self, instance_id: str, reason: str) -> None:
        super().__init__(f"instance {instance_id}: what it decided cannot be stored: {reason}")
        self.instance_id = instance_id
        self.reason = reason


# What encoding a record (fastavro, our Avro writer) or a state (orjson) raises on a value
# it cannot hold.
_UNSTORABLE = (ValueError, TypeError, OverflowError)


def persist(batch: Batch, serde: RecordSerde, partition: int) -> None:
    """Put what the batch decided into its commit: history (appended and stored), timer
    records, commands to other instances, and the state of every instance touched.
    ``Unstorable`` names the instance whose records or state could not be encoded."""
    encode = serde.encode
    out = batch.out
    commit = batch.commit
    appends = commit.appends
    owner = ""
    try:
        for record in out.history:
            owner = record.instance_id
            value = encode(record)
            appends.append(Append(HISTORY, owner.encode(), value, partition))
            commit.put(keys.history(owner, record.seq), value)
        for timer in out.timers:
            owner = timer.instance_id
            appends.append(Append(TIMERS, owner.encode(), encode(timer), partition))
        for owner, command in out.commands:  # noqa: B007 (named if it fails) to any instance
            appends.append(Append(COMMANDS, command.instance_id.encode(), encode(command)))
        for runtime in batch.touched.values():
            state = runtime.state
            owner = state.instance_id
            if state.new_replies:
                for message_id, answer in state.new_replies.items():
                    out.replies[settled_key(owner, message_id)] = answer
            write_state(state, commit)
    except _UNSTORABLE as exc:
        if not owner:
            raise
        raise Unstorable(owner, f"{type(exc).__name__}: {exc}") from exc


def long_sleepers(batch: Batch, horizon_ms: float) -> list[str]:
    """Instances that just started a sleep due after ``horizon_ms`` and now wait for
    nothing else: they leave the cache once the batch is durable."""
    found = []
    for record in batch.out.history:
        if type(record) is not SleepStarted or record.wake_at_ms <= horizon_ms:
            continue
        runtime = batch.touched.get(record.instance_id)
        if runtime is None or runtime.busy or runtime.state.status is not Status.RUNNING:
            continue
        if all(
            e.state.final or (e.state is EntryState.SLEEPING and (e.fire_at_ms or 0) > horizon_ms)
            for e in runtime.state.entries.values()
        ):
            found.append(record.instance_id)
    return found
