"""Whether Kafka still accepts a running worker's login, from what its clients report.

A SASL credential that changes under a live worker (the password rotated on the broker,
the user deleted) shows once the broker makes connections log in again: with
``connections.max.reauth.ms`` set (KIP-368) within that time, otherwise when a connection
drops. librdkafka then reports ``_AUTHENTICATION`` through each client's ``error_cb``,
not fatal, on every reconnect (about three a second for a consumer, one for a producer),
and tries again for ever: records wait in the producer's queue (its messages never time
out), fetches stop, and everything goes on once the login is accepted again. A failed TLS
handshake (``_SSL``: a certificate that expired or was replaced) behaves the same way.

``LoginWatch`` turns that into what an operator needs: one ERROR line naming the cause and
what to do, then a reminder once a minute while it lasts (librdkafka's own line per
reconnect is dropped, see ``librdkafka_log``); the worker reported not ready with the
reason; counts for ``/metrics``; and an INFO line when the clients are logged in again,
seen in their statistics (a broker connection up, no refusal for ``RECOVERED_AFTER_S``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError

from stepstream.engine.config.kafka import ENV_PREFIX

log = logging.getLogger("stepstream.kafka.logins")

# librdkafka errors a login or handshake refused, and whether each is TLS's.
REFUSED: dict[int, bool] = {KafkaError._AUTHENTICATION: False, KafkaError._SSL: True}
# While refused, the ERROR line is repeated this often (with the count), not per reconnect.
REMIND_EVERY_S = 60.0
# A client is logged in again when its statistics show a broker connection up and it
# has reported no refusal for this long (a consumer is refused about every 0.35 s).
RECOVERED_AFTER_S = 2.0
# librdkafka's broker states; "UP": connected and logged in.
_UP = "UP"


@dataclass
class _Refused:
    first: float  # monotonic
    last: float
    reason: str
    tls: bool


class LoginWatch:
    """Shared by a worker's Kafka clients (each names itself: ``producer``, ``group``);
    called from their librdkafka threads, read from the event loop."""

    def __init__(self, bootstrap: str, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._bootstrap = bootstrap
        self._clock = clock
        self._lock = threading.Lock()
        self._refused: dict[str, _Refused] = {}
        self._since: float | None = None  # monotonic: the first refusal of this outage
        self._since_wall: float | None = None
        self._reminded = 0.0
        self._count = 0  # refusals in this outage
        self.refusals_total = 0

    # ---- from the clients' threads ------------------------------------------------------

    def refused(self, client: str, err: KafkaError) -> bool:
        """``err`` from ``client``'s ``error_cb``: True if it was a refused login or TLS
        handshake (recorded and logged here), False for any other error."""
        tls = REFUSED.get(err.code())
        if tls is None:
            return False
        now = self._clock()
        with self._lock:
            self.refusals_total += 1
            self._count += 1
            was = self._refused.get(client)
            self._refused[client] = _Refused(was.first if was else now, now, err.str(), tls)
            first = self._since is None
            if first:
                self._since, self._since_wall, self._reminded = now, time.time(), now
            remind = not first and now - self._reminded >= REMIND_EVERY_S
            if remind:
                self._reminded = now
            message = self._message_locked(now) if first or remind else None
        if message is not None:
            log.error(message, extra={"kafka_client": client})
        return True

    def statistics(self, client: str, stats: Mapping[str, Any]) -> None:
        """``client``'s parsed statistics (``stats_cb``): a refused client whose brokers
        show a connection up, with no refusal for ``RECOVERED_AFTER_S``, is logged in."""
        if client not in self._refused:
            return
        brokers = stats.get("brokers", {})
        up = any(
            isinstance(b, dict) and b.get("state") == _UP and b.get("nodeid", -1) >= 0
            for b in brokers.values()
        )
        if up:
            self._accepted(client)

    def _accepted(self, client: str) -> None:
        now = self._clock()
        with self._lock:
            refused = self._refused.get(client)
            if refused is None or now - refused.last < RECOVERED_AFTER_S:
                return
            del self._refused[client]
            if self._refused or self._since is None:
                return
            lasted, count = now - self._since, self._count
            self._since = self._since_wall = None
            self._count = 0
        log.info(
            "Kafka at %s accepts this worker's login again, after %.1f s and %d refused "
            "attempts; it goes on with what waited",
            self._bootstrap,
            lasted,
            count,
        )

    # ---- from the event loop ----------------------------------------------------------

    @property
    def failing(self) -> bool:
        """Whether a client's login or TLS handshake is being refused now."""
        return bool(self._refused)

    def refused_for(self) -> float:
        """Seconds since the first refusal of the outage going on (0: none)."""
        since = self._since
        return 0.0 if since is None or not self._refused else self._clock() - since

    def giving_up(self, after_s: float, setting: str) -> str:
        """Why a worker that exits after ``after_s`` seconds of refusals (``setting``) does."""
        with self._lock:
            last = max(self._refused.values(), key=lambda r: r.last, default=None)
        reason = last.reason if last is not None else "refused"
        if last is not None and last.tls:
            fix = f"ssl.ca.location ({ENV_PREFIX}SSL_CA_LOCATION) naming the CA that signs them"
        else:
            fix = (
                f"valid sasl.username and sasl.password ({ENV_PREFIX}SASL_USERNAME, "
                f"{ENV_PREFIX}SASL_PASSWORD)"
            )
        return (
            f"Kafka at {self._bootstrap} refused this worker for {after_s:g} s ({setting}): "
            f"{reason}. Exiting: start it again with {fix}; nothing is lost, the next owner "
            "of its partitions restores them from the topics"
        )

    def reason(self) -> str | None:
        """What ``/readyz`` says while refused (None otherwise)."""
        with self._lock:
            if not self._refused:
                return None
            return self._message_locked(self._clock())

    def _message_locked(self, now: float) -> str:
        refused = max(self._refused.values(), key=lambda r: r.last)
        lasted = now - (self._since if self._since is not None else now)
        since = time.strftime("%H:%M:%S UTC", time.gmtime(self._since_wall or time.time()))
        when = f"since {since} ({lasted:.0f} s, {self._count} attempts)"
        if refused.tls:
            what = f"the TLS handshake with Kafka at {self._bootstrap} fails while it runs"
            fix = (
                "make the brokers' certificates valid again, or restart the worker with "
                f"ssl.ca.location ({ENV_PREFIX}SSL_CA_LOCATION) naming the CA that signs "
                "them now"
            )
        else:
            what = f"Kafka at {self._bootstrap} refused this worker's SASL login"
            fix = (
                "restore the user's credential on the brokers, or, if it was rotated on "
                f"purpose, restart the worker with the new sasl.username and sasl.password "
                f"({ENV_PREFIX}SASL_USERNAME, {ENV_PREFIX}SASL_PASSWORD)"
            )
        return (
            f"{what} {when}: {refused.reason}. The worker is not ready: its commits wait and "
            "nothing is lost or applied twice. It goes on by itself once Kafka accepts it "
            f"again: {fix}"
        )
