"""Commands for partitions another engine process owns (``stepstream dev --processes N``).

With several engine processes, each has a data directory of its own and owns a share of
the partitions. Every directory's log has the whole topic and partition space, so a
commit that emits a command for an instance on another process's partition (a child's
start, a message, a parent's notice) writes it to this process's log of that partition,
in the same atomic, durable write as the rest of the commit. A ``Forwarder`` sends those
records on, in log order, to the owner, whose ``ForwardReceiver`` appends them to its
own log exactly once: it keeps, per source process and partition, the next source
offset it expects, in the same write as the records. A record is forwarded until the
owner says it has it, so neither process's crash loses one or applies one twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence

from stepstream.consumers.embedded import keys
from stepstream.consumers.embedded.db import EmbeddedDB
from stepstream.engine.seams import Append
from stepstream.engine.wire.topics import COMMANDS

log = logging.getLogger("stepstream.embedded.forwarding")

FORWARD_BATCH = 500  # records per request to the owner
RETRY_S = 0.5  # after a failed send (the owner is restarting): the first wait, doubled to 5 s
TRIM_EVERY = 1_000  # forwarded records kept before the log is trimmed
WARN_AFTER_S = 5.0  # failing this long is worth a warning (an owner starting is not)
WARN_EVERY_S = 10.0

_HEADER = struct.Struct(">IIQI")  # source process, partition, first offset, records
_LENGTH = struct.Struct(">I")

Entries = Sequence[tuple[bytes, bytes]]  # (record key, record value)
Send = Callable[[int, int, Entries], Awaitable[int]]  # partition, first offset -> next
Position = Callable[[int], Awaitable[int]]  # partition -> the owner's next offset


def encode_batch(source: int, partition: int, first: int, entries: Entries) -> bytes:
    """A request body: the header, then each record's key and value, length-prefixed."""
    parts = [_HEADER.pack(source, partition, first, len(entries))]
    for key, value in entries:
        parts += (_LENGTH.pack(len(key)), key, _LENGTH.pack(len(value)), value)
    return b"".join(parts)


def decode_batch(data: bytes) -> tuple[int, int, int, list[tuple[bytes, bytes]]]:
    """``encode_batch``'s inverse; ``ValueError`` saying what is wrong with a bad body."""
    if len(data) < _HEADER.size:
        raise ValueError(f"forwarded batch of {len(data)} bytes is shorter than its header")
    source, partition, first, count = _HEADER.unpack_from(data)
    at = _HEADER.size
    entries: list[tuple[bytes, bytes]] = []
    for _ in range(count):
        pair = []
        for _part in (0, 1):
            if at + _LENGTH.size > len(data):
                raise ValueError(f"forwarded batch ends inside record {len(entries)} of {count}")
            (length,) = _LENGTH.unpack_from(data, at)
            at += _LENGTH.size
            if at + length > len(data):
                raise ValueError(f"forwarded batch ends inside record {len(entries)} of {count}")
            pair.append(bytes(data[at : at + length]))
            at += length
        entries.append((pair[0], pair[1]))
    if at != len(data):
        raise ValueError(f"forwarded batch has {len(data) - at} bytes after its {count} records")
    return source, partition, first, entries


class ForwardGap(ValueError):
    """A batch starts past the next offset the owner expects from its source."""


class ForwardReceiver:
    """The owner's side: appends forwarded records to its log once each."""

    def __init__(self, db: EmbeddedDB, owned: Iterable[int]) -> None:
        self._db = db
        self._owned = frozenset(owned)
        self._locks: dict[tuple[int, int], asyncio.Lock] = {}

    def position(self, source: int, partition: int) -> int:
        """The next offset of ``source``'s log of ``partition`` this process expects."""
        self._check(partition)
        stored = self._db.get(keys.STATE_CF, keys.state_forward_key(partition, source))
        return 0 if stored is None else keys.decode_u64(stored)

    async def receive(self, source: int, partition: int, first: int, entries: Entries) -> int:
        """Append the records of ``first`` on that this process does not have yet; return
        the next offset it expects from ``source`` for ``partition``."""
        lock = self._locks.setdefault((source, partition), asyncio.Lock())
        async with lock:
            expected = self.position(source, partition)
            if first > expected:
                raise ForwardGap(
                    f"process {source} forwarded partition {partition} from offset {first}, "
                    f"but this process has it only up to {expected}: was a data directory "
                    "of one process replaced or restored from an older copy?"
                )
            fresh = entries[expected - first :]
            if not fresh:
                return expected
            following = first + len(entries)
            await self._db.write(
                appends=[Append(COMMANDS, key, value, partition) for key, value in fresh],
                puts=[(keys.state_forward_key(partition, source), keys.encode_u64(following))],
            )
            return following

    def _check(self, partition: int) -> None:
        if partition not in self._owned:
            raise ValueError(
                f"partition {partition} is not owned by this process (it owns "
                f"{sorted(self._owned)}): the processes disagree on who owns what"
            )


class Forwarder:
    """The source's side: one task per partition another process owns, sending what this
    process's log holds for it to that owner."""

    def __init__(
        self, db: EmbeddedDB, partitions: Iterable[int], send: Send, position: Position
    ) -> None:
        self._db = db
        self._partitions = sorted(partitions)
        self._send = send
        self._position = position
        self._tasks: list[asyncio.Task[None]] = []
        self.forwarded = 0  # records the owners took
        self._failing: dict[int, float] = {}  # partition -> since when its sends fail
        self._warned: dict[int, float] = {}

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._run(p), name=f"stepstream-forward:{p}") for p in self._partitions
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    async def _run(self, partition: int) -> None:
        db = self._db
        following: int | None = None
        trimmed = 0
        backoff = RETRY_S
        while True:
            try:
                if following is None:
                    following = await self._position(partition)
                entries = db.log.read(COMMANDS, partition, following, FORWARD_BATCH)
                if not entries:
                    await db.log.wait(COMMANDS, partition, following, 1.0)
                    if db.closed:
                        return
                    continue
                pairs = [(entry.key, entry.value) for entry in entries]
                following = await self._send(partition, entries[0].offset, pairs)
                self.forwarded += len(pairs)
                backoff = RETRY_S
                self._failing.pop(partition, None)
                if following - trimmed >= TRIM_EVERY:
                    # Keep the last forwarded record: the log's end is found from it.
                    await db.write(
                        trims=[
                            (
                                keys.log_key(COMMANDS, partition, 0),
                                keys.log_key(COMMANDS, partition, following - 1),
                            )
                        ]
                    )
                    trimmed = following - 1
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if db.closed or db.failure is not None:
                    return
                self._warn(partition, exc)
                following = None  # ask the owner again where to go on from
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    def _warn(self, partition: int, exc: Exception) -> None:
        now = time.monotonic()
        since = self._failing.setdefault(partition, now)
        if now - since < WARN_AFTER_S:
            return
        if now - self._warned.get(partition, -WARN_EVERY_S) >= WARN_EVERY_S:
            self._warned[partition] = now
            log.warning(
                "cannot forward commands of partition %d to the process that owns it yet "
                "(%s: %s); they stay in this data directory and go when it answers",
                partition,
                type(exc).__name__,
                exc,
            )
