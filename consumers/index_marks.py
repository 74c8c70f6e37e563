"""The marks of the indexes lists and retention read, and making those indexes whole.

Two indexes are kept by ``write_state`` with every transition: instances by created time
(newest-first lists read it) and finished instances by finish time (retention reads it).
A version older than either did not keep it, so state it wrote is missing from it: state
from before this version first ran, and state an older version wrote after this one (a
rollback and a new roll-out). Each index has a mark that holds the epoch of the owner
that last found the index whole. Every open of a partition's state counts the epoch up,
whichever version opens it, so when an owner resumes a partition:

- a mark left by the owner before it (``previous_epoch``), or by its own restore, says
  nobody else wrote in between: the index is whole;
- no mark, or an older one, means one pass over the metas, which puts every key the
  index misses (keys it has for instances gone or started again are checked where
  they are read, as they always are).

Either way the owner marks both indexes with its own epoch in its first commit.
"""

from __future__ import annotations

import logging

from stepstream.consumers import state_keys as keys
from stepstream.consumers.meta_filter import created_in
from stepstream.engine.replay.state_json import state_from_storage
from stepstream.engine.seams import CommitBatch, PartitionBackend

log = logging.getLogger("stepstream.partition")


def mark(epoch: int) -> bytes:
    """The value of an index's mark: found whole by the owner of ``epoch``."""
    return str(epoch).encode()


def make_whole(backend: PartitionBackend, commit: CommitBatch) -> int:
    """Put into ``commit`` what the indexes may miss, and the owner's marks; returns how
    many instances were looked at (0 when both marks were trusted)."""
    store = backend.store
    trusted = {mark(backend.previous_epoch), mark(backend.epoch)}
    started = store.get(keys.STARTED_INDEXED) not in trusted
    finished = store.get(keys.FINISHED_INDEXED) not in trusted
    looked = 0
    if started or finished:
        for key, meta in store.scan(keys.META):
            instance_id = keys.split_meta(key)
            looked += 1
            if started:
                commit.put(keys.started(created_in(meta), instance_id), b"")
            if finished:
                state = state_from_storage(instance_id, meta, [])
                if state.status.finished:
                    commit.put(keys.finished(state.finished_ms, instance_id), b"")
    if looked:  # a new partition has nothing to index, and nothing to say
        log.info(
            "indexed %d instances by %s: state here was written by a version that kept "
            "no such index (before this one ran, or since: a rollback)",
            looked,
            " and by ".join(
                name
                for name, missing in (("created time", started), ("finish time", finished))
                if missing
            ),
            extra={"partition": backend.partition},
        )
    own = mark(backend.epoch)
    commit.put(keys.STARTED_INDEXED, own)
    commit.put(keys.FINISHED_INDEXED, own)
    return looked
