"""Errors of the embedded backend: each one names the data directory and what to do."""

from __future__ import annotations

from stepstream.engine.errors import StepstreamError
from stepstream.engine.seams import PartitionLost


class DataDirInUse(StepstreamError):
    """Another stepstream process (or another open in this one) owns the data directory."""


class PartitionCountMismatch(StepstreamError):
    """The data directory was created with a different number of partitions."""


class StorageFailed(StepstreamError, PartitionLost):
    """A durable write failed; nothing after it is accepted until the directory is reopened.

    After a failed fsync the OS may have dropped the dirty pages, so retrying the write in
    the same process could acknowledge data that never reached the disk. So it is also a
    ``PartitionLost`` to the partitions' processors: they stop, where they would reload
    and retry after another failure, and the next start goes on from what is durable."""


class DiskFull(StorageFailed):
    """The disk holding the data directory has no space left; free some, then start
    again (what was acknowledged is on the disk)."""


class DataDirCorrupted(StorageFailed):
    """RocksDB found the data directory damaged: restore it from a backup, or move it
    away to start empty."""
