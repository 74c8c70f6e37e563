"""The Kafka backend: partition processors in a consumer group (confluent-kafka), one
RocksDB per owned partition, restore from the history topic, and topic administration.
See ``docs/kafka-notes.md`` for the broker behaviour this code is written against."""

from stepstream.consumers.kafka.admin import (
    TopicsMismatch,
    TopicsMissing,
    TopicState,
    create_topics,
    existing_partitions,
    topic_partitions,
)
from stepstream.consumers.kafka.db import PartitionDB
from stepstream.consumers.kafka.group import GroupConsumer
from stepstream.consumers.kafka.partition import KafkaPartition
from stepstream.consumers.kafka.producer import LogProducer, OutRecord, ProduceFailed
from stepstream.consumers.kafka.restore import HistoryReader, Restored, restore_partition
from stepstream.consumers.kafka.runner import KafkaRunner
from stepstream.consumers.kafka.source import KafkaSource
from stepstream.consumers.kafka.state_dir import StateDir, StateDirInUse

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
