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
from stepstream.engine.wire.topics import COMMANDS, HISTORY, TIMERS


def persist(batch: Batch, serde: RecordSerde, partition: int) -> None:
    """Put what the batch decided into its commit: history (appended and stored), timer
    records, commands to other instances, and the state of every instance touched."""
    encode = serde.encode
    out = batch.out
    commit = batch.commit
    appends = commit.appends
    for record in out.history:
        value = encode(record)
        instance = record.instance_id.encode()
        appends.append(Append(HISTORY, instance, value, partition))
        commit.put(keys.history(record.instance_id, record.seq), value)
    for timer in out.timers:
        appends.append(Append(TIMERS, timer.instance_id.encode(), encode(timer), partition))
    for _, command in out.commands:  # to other instances, wherever they live
        appends.append(Append(COMMANDS, command.instance_id.encode(), encode(command)))
    for runtime in batch.touched.values():
        state = runtime.state
        if state.new_replies:
            out.replies.update(state.new_replies)
        write_state(state, commit)


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
