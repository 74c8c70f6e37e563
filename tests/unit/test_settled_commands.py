"""The commands a host remembers as settled, for publishers that ask how theirs ended
after the commit (a kafka:// client asks the owner once the broker acknowledged it).

A refused command's reason is found nowhere else, so it is kept long past any client's
wait (``RECENT_SETTLED_S``); and no longer, nor more than ``RECENT_SETTLED`` of them, so
the memory a burst of commands leaves behind is given back."""

from __future__ import annotations

from stepstream.consumers.host import RECENT_SETTLED, RECENT_SETTLED_S, PartitionHost
from stepstream.consumers.partition import Committed
from stepstream.engine.api.workflow import Registry
from stepstream.engine.virtual_clock import VirtualClock
from stepstream.engine.wire.codec import JsonCodec
from stepstream.engine.wire.serde import default_serde
from stepstream.engine.wire.settle import settled_key

REFUSED = "unknown_instance: no instance i-9"


def _host(clock: VirtualClock) -> PartitionHost:
    return PartitionHost(
        Registry(),
        partitions=1,
        serde=default_serde(),
        codec=JsonCodec(),
        clock=clock,
        max_payload_bytes=1 << 20,
    )


def _commit(host: PartitionHost, commands: dict[str, str | None], instance_id: str = "i-1") -> None:
    # What a partition processor tells its host after each commit.
    host._committed(Committed([], {settled_key(instance_id, c): r for c, r in commands.items()}))


async def test_a_refusal_is_told_to_a_publisher_that_asks_after_the_commit() -> None:
    clock = VirtualClock()
    host = _host(clock)
    _commit(host, {"c-applied": None, "c-refused": REFUSED})
    clock.advance(RECENT_SETTLED_S - 1)  # a client that asks late, but within the window
    assert host.settled_recently("i-1", "c-applied") == (True, None)
    asked = host.settled("i-1", "c-refused")
    assert asked.done() and asked.result() == REFUSED
    host.forget("i-1", "c-refused")


async def test_settled_commands_are_forgotten_after_the_window() -> None:
    clock = VirtualClock()
    host = _host(clock)
    _commit(host, {"old": REFUSED})
    clock.advance(RECENT_SETTLED_S / 2)
    _commit(host, {"newer": None, "old": REFUSED})  # settled again (a redelivery): kept on
    clock.advance(RECENT_SETTLED_S / 2 + 1)
    _commit(host, {"newest": None})
    assert host.settled_recently("i-1", "old") == (True, REFUSED)
    assert host.recent_settled == 3
    clock.advance(RECENT_SETTLED_S + 1)
    assert host.settled_recently("i-1", "newest") == (False, None)  # asking expires them too
    assert host.recent_settled == 0


async def test_a_burst_leaves_at_most_the_cap_behind() -> None:
    host = _host(VirtualClock())
    _commit(host, {f"c-{i}": None for i in range(RECENT_SETTLED + 100)})
    assert host.recent_settled == RECENT_SETTLED
    assert host.settled_recently("i-1", "c-99") == (False, None)  # the oldest went first
    assert host.settled_recently("i-1", f"c-{RECENT_SETTLED + 99}") == (True, None)


async def test_a_refusal_leaves_with_its_command() -> None:
    clock = VirtualClock()
    host = _host(clock)
    _commit(host, {"refused": REFUSED})
    _commit(host, {f"c-{i}": None for i in range(RECENT_SETTLED)})  # pushes it out
    assert host.settled_recently("i-1", "refused") == (False, None)
    assert host._refused == {}  # its reason is not kept without it
    _commit(host, {"again": REFUSED})
    _commit(host, {"again": None})  # settled again, applied this time
    assert host.settled_recently("i-1", "again") == (True, None)


async def test_one_command_id_on_two_instances_is_two_commands() -> None:
    """An event id is unique on its instance only: one used on two instances settles
    each on its own, and a publisher is told its own instance's outcome."""
    host = _host(VirtualClock())
    _commit(host, {"order-7": REFUSED}, instance_id="finished-one")
    assert host.settled_recently("live-one", "order-7") == (False, None)
    waiting = host.settled("live-one", "order-7")
    assert not waiting.done()
    _commit(host, {"order-7": None}, instance_id="live-one")
    assert waiting.done() and waiting.result() is None
    host.forget("live-one", "order-7")
    assert host.settled_recently("finished-one", "order-7") == (True, REFUSED)
