"""Configuration shared by every component: ``STEPSTREAM_*`` variables, Kafka settings."""
