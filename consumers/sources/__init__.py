"""Event sources on the Kafka backend: user topics declared with ``stepstream.Source``,
read by a consumer group of the workers and turned into commands (see ``consumer``)."""

from stepstream.consumers.sources.consumer import SourceConsumer, SourcesConfig, kafka_sink
from stepstream.consumers.sources.lag import METRIC_NAME, SourceLag
from stepstream.consumers.sources.translate import RecordTranslator, SourceRecord, Unreadable

__all__ = [
    "METRIC_NAME",
    "RecordTranslator",
    "SourceConsumer",
    "SourceLag",
    "SourceRecord",
    "SourcesConfig",
    "Unreadable",
    "kafka_sink",
]
