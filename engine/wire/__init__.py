"""The wire format: the record vocabulary, its Avro encoding, payload codecs, names and
limits, topic names and partitioning. What any Kafka tool reads and writes."""
