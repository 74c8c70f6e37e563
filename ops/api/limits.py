"""What the API takes at once over all its clients, and what it answers when it cannot.

- ``ApiLimits``: the bound on pending calls (``--max-pending``,
  ``STEPSTREAM_MAX_PENDING``): a session call counts from the moment its frame is read
  until it ends, an HTTP wait (``GET .../result``, ``GET /v1/commands/{id}``) while it
  waits. A call over the bound is answered at once with ``ServerBusy`` (HTTP 503 with
  ``Retry-After``). Waits, which may last as long as
  their timeout, fill at most ``WAITS_SHARE`` of it: the rest stays for the commands and
  reads that end by themselves, among them the events those waits are waiting for. And
  how long a session's client may take to accept a frame of replies before the session
  is cut: a client that does not read would otherwise keep its unwritten replies (at
  most about a frame of calls' worth: the session reads no more frames meanwhile) for
  ever.
- ``Pending``: the count itself, one per app.
- ``server_fault``: a failure of the server's own storage (a full disk) as
  ``ServerUnavailable``: the client's call was fine, it may be made again later.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from stepstream.engine.config.environ import ConfigError, env_int
from stepstream.producers.http.wire import ServerBusy, ServerUnavailable

MAX_PENDING_ENV = "STEPSTREAM_MAX_PENDING"
# About 3 KB each while they wait (a task, its frames, the engine's future): 60 MB at
# most. Waits that end at once (one instance finishing) cost the event loop about 30 us
# each, so bursts stay well under a second; and it is far above what the bench's
# workloads hold at once.
DEFAULT_MAX_PENDING = 20_000
# The share of the bound waits may take (the rest: commands and reads).
WAITS_SHARE = 0.9
# A frame of replies the client has not accepted within this is its last: the session is
# closed and its calls cancelled.
DEFAULT_WRITE_TIMEOUT_S = 10.0
# What Retry-After says: a busy server frees slots as calls finish; a failed disk needs
# an operator, and the server stops meanwhile.
BUSY_RETRY_AFTER_S = 1.0
FAULT_RETRY_AFTER_S = 30.0


@dataclass(frozen=True)
class ApiLimits:
    max_pending: int = DEFAULT_MAX_PENDING
    write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.max_pending < 1:
            raise ConfigError(
                f"the API's limit of pending calls must be at least 1, got {self.max_pending}; "
                f"pass --max-pending N or set {MAX_PENDING_ENV} (default {DEFAULT_MAX_PENDING})"
            )
        if not self.write_timeout_s > 0:
            raise ConfigError(f"write_timeout_s must be > 0, got {self.write_timeout_s}")

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, max_pending: int | None = None
    ) -> ApiLimits:
        """``STEPSTREAM_MAX_PENDING``, unless the flag's ``max_pending`` is given."""
        env = os.environ if environ is None else environ
        if max_pending is None:
            max_pending = env_int(env, MAX_PENDING_ENV, DEFAULT_MAX_PENDING)
        return cls(max_pending=max_pending)


# Why a call was refused (``stepstream_api_refused_calls_total{reason}``): the bound was
# full, or waits had filled their share of it (``Pending``); or the call's session already
# ran as many calls as one session may (``SESSION_MAX_CALLS``).
REFUSED_FULL = "max_pending"
REFUSED_WAITS = "waits_share"
REFUSED_SESSION = "session_calls"
REFUSAL_REASONS = (REFUSED_FULL, REFUSED_WAITS, REFUSED_SESSION)


class Pending:
    """The calls and waits the API holds now, over every client, and how many it
    refused, by reason (``REFUSAL_REASONS``)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.wait_limit = max(1, int(limit * WAITS_SHARE))
        self.count = 0
        self.waits = 0
        self.refused = dict.fromkeys(REFUSAL_REASONS, 0)

    def take(self, *, wait: bool) -> bool:
        """One more (a wait: one that lasts until something happens), if there is room;
        False (counted as refused) if not."""
        if self.count >= self.limit:
            self.refused[REFUSED_FULL] += 1
            return False
        if wait and self.waits >= self.wait_limit:
            self.refused[REFUSED_WAITS] += 1
            return False
        self.count += 1
        self.waits += wait
        return True

    def release(self, n: int = 1, *, waits: int = 0) -> None:
        self.count -= n
        self.waits -= waits

    def busy(self) -> ServerBusy:
        """What a call refused by ``take`` gets."""
        if self.count >= self.limit:
            held = f"{self.limit} pending calls and waits"
        else:
            held = f"{self.wait_limit} pending waits ({WAITS_SHARE:.0%} of its {self.limit} calls)"
        return ServerBusy(
            f"this stepstream server holds {held} over all its clients, the most it takes "
            f"(--max-pending, {MAX_PENDING_ENV}); this call was not taken: retry in "
            f"{BUSY_RETRY_AFTER_S:g} s, wait for fewer results at once, or ask the operator "
            "to raise the limit",
            retry_after=BUSY_RETRY_AFTER_S,
        )


def server_fault(exc: BaseException) -> ServerUnavailable | None:
    """``exc`` as the client should see it if it is the server's own failure (its disk
    is full or failing), else None."""
    # Imported here, on a failure: the embedded package brings RocksDB, which the CLI
    # (reading this module's defaults for --max-pending) should not load.
    from stepstream.consumers.embedded.errors import StorageFailed

    if not isinstance(exc, StorageFailed):
        return None
    return ServerUnavailable(
        f"the server cannot store anything now: {exc}. This is the server's fault, not "
        f"the call's: retry in {FAULT_RETRY_AFTER_S:g} s (what it acknowledged before is "
        "kept)",
        retry_after=FAULT_RETRY_AFTER_S,
    )
