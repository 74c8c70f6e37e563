"""The Kafka backend: partition processors in a consumer group (confluent-kafka), one
RocksDB per owned partition, restore from the history topic, and topic administration.
See ``docs/kafka-notes.md`` for the broker behaviour this code is written against."""

from consumers.kafka.admin import (
    TopicsMismatch,
    TopicsMissing,
    TopicState,
    create_topics,
    existing_partitions,
    topic_partitions,
)
from consumers.kafka.db import PartitionDB
from consumers.kafka.group import GroupConsumer
from consumers.kafka.partition import KafkaPartition
from consumers.kafka.producer import LogProducer, OutRecord, ProduceFailed
from consumers.kafka.restore import HistoryReader, Restored, restore_partition
from consumers.kafka.runner import KafkaRunner
from consumers.kafka.source import KafkaSource
from consumers.kafka.state_dir import StateDir, StateDirInUse

__all__ = [
    "GroupConsumer",
    "HistoryReader",
    "KafkaPartition",
    "KafkaRunner",
    "KafkaSource",
    "LogProducer",
    "OutRecord",
    "PartitionDB",
    "ProduceFailed",
    "Restored",
    "StateDir",
    "StateDirInUse",
    "TopicState",
    "TopicsMismatch",
    "TopicsMissing",
    "create_topics",
    "existing_partitions",
    "restore_partition",
    "topic_partitions",
]
