"""The ``kafka://`` client: publishes commands to Kafka itself and routes reads to the
worker that owns the instance's partition, configured with nothing but the bootstrap
servers. Importing this package registers ``kafka://`` with ``Client.connect``.

- ``settings``: ``kafka://`` URLs and librdkafka properties mapped to aiokafka's arguments
- ``follower``: a live copy of a one-partition compacted topic
- ``members``: who owns which partition, at which address (``<prefix>.members``)
- ``definitions``: which workflows workers registered (``<prefix>.definitions``)
- ``session``: one worker's API (reads and waits over its websocket)
- ``routing``: a call made of the partition's owner, again of the next one when it moves
- ``transport``: ``KafkaTransport`` (commands published, reads routed)
- ``connect``: opening one from a ``kafka://`` URL (registers the scheme)
"""

from stepstream.producers.kafka.connect import open_kafka_transport
from stepstream.producers.kafka.members import Member, MembersView
from stepstream.producers.kafka.settings import aiokafka_options, settings_from_url
from stepstream.producers.kafka.transport import KafkaTransport

__all__ = [
    "KafkaTransport",
    "Member",
    "MembersView",
    "aiokafka_options",
    "open_kafka_transport",
    "settings_from_url",
]
