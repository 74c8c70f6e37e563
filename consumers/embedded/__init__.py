"""The embedded backend: one process, one RocksDB holding the log and every partition's
state, so a commit is one atomic, fsynced WriteBatch."""

from stepstream.consumers.embedded.datadir import DEFAULT_PARTITIONS, Durability
from stepstream.consumers.embedded.db import EmbeddedDB
from stepstream.consumers.embedded.errors import (
    DataDirCorrupted,
    DataDirInUse,
    DiskFull,
    PartitionCountMismatch,
    StorageFailed,
)
from stepstream.consumers.embedded.log import EmbeddedLog
from stepstream.consumers.embedded.partition import EmbeddedPartition, EmbeddedSource, EmbeddedStore

__all__ = [
    "DEFAULT_PARTITIONS",
    "DataDirCorrupted",
    "DataDirInUse",
    "DiskFull",
    "Durability",
    "EmbeddedDB",
    "EmbeddedLog",
    "EmbeddedPartition",
    "EmbeddedSource",
    "EmbeddedStore",
    "PartitionCountMismatch",
    "StorageFailed",
]
