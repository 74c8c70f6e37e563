"""The logger a worker's librdkafka clients write to: their lines go through Python's
logging (as ``stepstream.kafka.librdkafka``, in the worker's log format, JSON with the
rest) instead of straight to stderr, without the lines that repeat on every reconnect.

confluent-kafka logs each librdkafka line as ``logger.log(level, "%s [%s] %s", facility,
client, text)``, where ``text`` starts with the broker thread (``[thrd:host:port/id]: ...``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

LOGGER = "stepstream.kafka.librdkafka"

# A client's connection failures to one broker are logged once per this many seconds.
FAILURES_EVERY_S = 60.0
_KEYS_KEPT = 1024  # (client, broker) pairs remembered; restore readers come and go


class _DropRefusals(logging.Filter):
    """librdkafka logs a refused login on every reconnect; ``LoginWatch`` reports it."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not ("SASL authentication error" in text or "SSL handshake failed" in text)


class BrokerFailures(logging.Filter):
    """While a broker is down or unreachable, librdkafka logs a ``FAIL`` line (connection
    refused, timed out, closed by the peer) at every reconnect, two a second per client
    and broker. The first goes through; the next for the same client and broker only
    once ``every_s`` has passed, saying how many were not logged meanwhile. The worker's
    own warning (``Kafka producer error: 1/1 brokers are down``) says it all along."""

    def __init__(
        self, every_s: float = FAILURES_EVERY_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self._every = every_s
        self._clock = clock
        self._lock = threading.Lock()  # each client logs from the thread that polls it
        self._seen: dict[tuple[str, str], tuple[float, int]] = {}  # -> (logged at, skipped)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not (isinstance(args, tuple) and len(args) == 3 and args[0] == "FAIL"):
            return True
        facility, client, text = args
        key = (str(client), str(text).split("]", 1)[0])  # the client, "[thrd:host:port/id"
        now = self._clock()
        with self._lock:
            logged_at, skipped = self._seen.get(key, (now - self._every, 0))
            if now - logged_at < self._every:
                self._seen[key] = (logged_at, skipped + 1)
                return False
            if len(self._seen) >= _KEYS_KEPT:
                self._seen = {k: v for k, v in self._seen.items() if now - v[0] < self._every}
            self._seen[key] = (now, 0)
        if skipped:
            record.args = (
                facility,
                client,
                f"{text} ({skipped} more like it from this client to this broker not "
                f"logged since the last one logged, {now - logged_at:.0f} s ago)",
            )
        return True


class SameLineLimit:
    """librdkafka queues its error callbacks until the client is next polled, so an
    outage can hand a client's callback the same error many times in one poll (nine
    ``1/1 brokers are down`` in a millisecond). ``fresh(text)`` is True for a text not
    seen in the last ``every_s`` seconds; the client logs only those."""

    def __init__(self, every_s: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self._every = every_s
        self._clock = clock
        self._last: tuple[str, float] | None = None
        self._lock = threading.Lock()  # callbacks come on whichever thread polls

    def fresh(self, text: str) -> bool:
        now = self._clock()
        with self._lock:
            if self._last is not None and self._last[0] == text:
                if now - self._last[1] < self._every:
                    return False
            self._last = (text, now)
            return True


def quiet_librdkafka() -> logging.Logger:
    """The ``logger`` for a worker's librdkafka clients: their lines go through Python's
    logging (as ``stepstream.kafka.librdkafka``, in the worker's log format) instead of
    straight to stderr, without the line per refused reconnect, and with a client's
    failures to reach a broker at most once a minute (``BrokerFailures``)."""
    logger = logging.getLogger(LOGGER)
    if not any(isinstance(f, _DropRefusals) for f in logger.filters):
        logger.addFilter(_DropRefusals())
    if not any(isinstance(f, BrokerFailures) for f in logger.filters):
        logger.addFilter(BrokerFailures())
    return logger
