"""The logger a worker's librdkafka clients write to: their lines go through Python's
logging (as ``stepstream.kafka.librdkafka``, in the worker's log format, JSON with the
rest) instead of straight to stderr, without the lines that repeat on every reconnect.
"""

from __future__ import annotations

import logging

LOGGER = "stepstream.kafka.librdkafka"


class _DropRefusals(logging.Filter):
    """librdkafka logs a refused login on every reconnect; ``LoginWatch`` reports it."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not ("SASL authentication error" in text or "SSL handshake failed" in text)


def quiet_librdkafka() -> logging.Logger:
    """The ``logger`` for a worker's librdkafka clients: their lines go through Python's
    logging (as ``stepstream.kafka.librdkafka``, in the worker's log format) instead of
    straight to stderr, without the line per refused reconnect."""
    logger = logging.getLogger(LOGGER)
    if not any(isinstance(f, _DropRefusals) for f in logger.filters):
        logger.addFilter(_DropRefusals())
    return logger
