"""Forwarding commands between the engine processes' data directories: in order, once
each, whatever fails in between (real RocksDB directories)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from stepstream.consumers.embedded import EmbeddedDB, forwarding
from stepstream.consumers.embedded.forwarding import (
    Entries,
    Forwarder,
    ForwardGap,
    ForwardReceiver,
    decode_batch,
    encode_batch,
)
from stepstream.engine.seams import Append
from stepstream.engine.wire.topics import COMMANDS


def commands(db: EmbeddedDB, partition: int) -> list[bytes]:
    return [e.value for e in db.log.read(COMMANDS, partition, 0, 1000)]


def test_a_batch_survives_its_encoding_and_a_damaged_one_says_what_is_wrong() -> None:
    entries = [(b"k1", b"v1"), (b"", b""), (b"k3", bytes(range(256)))]
    body = encode_batch(1, 3, 17, entries)
    assert decode_batch(body) == (1, 3, 17, entries)
    with pytest.raises(ValueError, match="ends inside record 2 of 3"):
        decode_batch(body[:-1])
    with pytest.raises(ValueError, match="bytes after its 3 records"):
        decode_batch(body + b"x")
    with pytest.raises(ValueError, match="shorter than its header"):
        decode_batch(b"abc")


async def test_the_owner_appends_a_batch_sent_twice_once(tmp_path: Path) -> None:
    async with await EmbeddedDB.open(tmp_path / "owner", 4) as db:
        receiver = ForwardReceiver(db, [1, 3])
        batch = [(b"a", b"1"), (b"b", b"2")]
        assert await receiver.receive(0, 1, 0, batch) == 2
        assert await receiver.receive(0, 1, 0, batch) == 2  # a retry after a lost answer
        assert await receiver.receive(0, 1, 1, [(b"b", b"2"), (b"c", b"3")]) == 3  # overlap
        assert commands(db, 1) == [b"1", b"2", b"3"]
        assert receiver.position(0, 1) == 3 and receiver.position(2, 1) == 0  # per source
        with pytest.raises(ForwardGap, match="only up to 3"):
            await receiver.receive(0, 1, 5, [(b"x", b"x")])
        with pytest.raises(ValueError, match="not owned by this process"):
            await receiver.receive(0, 2, 0, batch)
    async with await EmbeddedDB.open(tmp_path / "owner", 4) as db:  # the position is durable
        receiver = ForwardReceiver(db, [1, 3])
        assert await receiver.receive(0, 1, 0, batch) == 3
        assert commands(db, 1) == [b"1", b"2", b"3"]


@contextlib.asynccontextmanager
async def forwarding_to(
    source: EmbeddedDB, receiver: ForwardReceiver, *, lose_first_answer: bool = False
) -> AsyncIterator[list[int]]:
    """A forwarder of ``source``'s partition 1 to ``receiver``; yields the first offsets
    of the batches it sent."""
    sent: list[int] = []

    async def send(partition: int, first: int, entries: Entries) -> int:
        sent.append(first)
        following = await receiver.receive(0, partition, first, entries)
        if lose_first_answer and len(sent) == 1:
            raise ConnectionError("the answer was lost")  # the owner has it anyway
        return following

    async def position(partition: int) -> int:
        return receiver.position(0, partition)

    forwarder = Forwarder(source, [1], send, position)
    forwarder.start()
    try:
        yield sent
    finally:
        await forwarder.close()


async def until_owner_has(owner: EmbeddedDB, count: int) -> None:
    async with asyncio.timeout(10):
        while len(commands(owner, 1)) < count:
            await asyncio.sleep(0.02)


async def append(db: EmbeddedDB, value: int) -> None:
    await db.write(appends=[Append(COMMANDS, b"k", str(value).encode(), 1)])


async def test_the_forwarder_delivers_in_order_through_failures(tmp_path: Path) -> None:
    async with (
        await EmbeddedDB.open(tmp_path / "source", 2) as source,
        await EmbeddedDB.open(tmp_path / "owner", 2) as owner,
    ):
        receiver = ForwardReceiver(owner, [1])
        async with forwarding_to(source, receiver, lose_first_answer=True) as sent:
            for i in range(5):
                await append(source, i)
            await until_owner_has(owner, 5)
            await asyncio.sleep(0.2)  # nothing more comes
        assert commands(owner, 1) == [b"0", b"1", b"2", b"3", b"4"]
        # After the lost answer it asked the owner where to go on from: nothing twice.
        assert len(sent) >= 2 and sent == sorted(set(sent))


async def test_forwarded_records_leave_the_source_log_but_its_end_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(forwarding, "TRIM_EVERY", 2)
    async with (
        await EmbeddedDB.open(tmp_path / "source", 2) as source,
        await EmbeddedDB.open(tmp_path / "owner", 2) as owner,
    ):
        async with forwarding_to(source, ForwardReceiver(owner, [1])):
            for i in range(5):
                await append(source, i)
                await until_owner_has(owner, i + 1)
            await asyncio.sleep(0.2)
        kept = commands(source, 1)
        assert kept and len(kept) < 5 and kept[-1] == b"4"
    async with await EmbeddedDB.open(tmp_path / "source", 2) as source:
        assert source.log.end_offset(COMMANDS, 1) == 5  # offsets go on from where they were
