"""The partition processor and its parts (see ``processor`` for how a batch goes)."""

from stepstream.consumers.partition.processor import PartitionProcessor
from stepstream.consumers.partition.settings import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_RETENTION_S,
    SWEEP_INTERVAL_S,
    Committed,
    ProcessorConfig,
)

__all__ = [
    "DEFAULT_DRAIN_TIMEOUT_S",
    "DEFAULT_RETENTION_S",
    "SWEEP_INTERVAL_S",
    "Committed",
    "PartitionProcessor",
    "ProcessorConfig",
]
