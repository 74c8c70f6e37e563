"""The state key layout is collision-free by construction: whatever bytes instance ids
hold, no key of one instance falls under a prefix of another, and every id reads back."""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st

from stepstream.consumers import state_keys as keys

# Ids of any text, weighted towards the bytes the escaping is about.
ids = st.text(alphabet=st.sampled_from("a\x00\x01\x02/#é") | st.characters(), min_size=1)


def every_key(instance_id: str) -> list[bytes]:
    return [
        keys.meta(instance_id),
        keys.active(instance_id),
        keys.entry(instance_id, "step"),
        keys.entry(instance_id, "x\x00y"),
        keys.history(instance_id, 1),
        keys.history(instance_id, 2**40),
        keys.command(instance_id, "c-1"),
        keys.finished(7, instance_id),
        keys.started(7, instance_id),
        keys.timer(7, instance_id, "sleep/1/nap"),
        keys.timer_by_id(instance_id, "sleep/1/nap"),
    ]


def prefixes(instance_id: str) -> list[bytes]:
    return list(keys.instance_prefixes(instance_id))


@st.composite
def related_ids(draw: st.DrawFn) -> tuple[str, str]:
    """Two ids, often one the other plus a separator and more (the attack)."""
    b = draw(ids)
    a = draw(st.one_of(ids, st.builds(lambda s: b + "\x00" + s, ids)))
    return (a, b) if draw(st.booleans()) else (b, a)


@given(related_ids())
@example(("victim\x00x", "victim"))
def test_no_key_of_one_instance_is_under_a_prefix_of_another(pair: tuple[str, str]) -> None:
    a, b = pair
    if a == b:
        return
    try:
        a.encode(), b.encode()
    except UnicodeEncodeError:
        return  # lone surrogates are refused before any key is made (engine.wire.names)
    for key in every_key(a):
        assert key not in every_key(b)
        for prefix in prefixes(b):
            assert not key.startswith(prefix), (a, b, key, prefix)


@given(ids)
def test_ids_read_back_from_their_keys(instance_id: str) -> None:
    try:
        instance_id.encode()
    except UnicodeEncodeError:
        return
    assert keys.split_meta(keys.meta(instance_id)) == instance_id
    assert keys.split_active(keys.active(instance_id)) == instance_id
    assert keys.split_finished(keys.finished(99, instance_id)) == (99, instance_id)
    assert keys.split_started(keys.started(99, instance_id)) == (99, instance_id)
    assert keys.split_timer(keys.timer(5, instance_id, "t/1/k#2")) == (5, instance_id, "t/1/k#2")
    assert keys.unescape_id(keys.escape_id(instance_id)) == instance_id


def test_plain_ids_are_stored_as_they_are() -> None:
    """Ids without 0x00 and 0x01 (all that clients may send) keep the layout of state
    written before ids were escaped, so no migration is needed."""
    assert keys.meta("order-1") == b"m\x00order-1"
    assert keys.entry("order-1", "charge") == b"e\x00order-1\x00charge"
    assert keys.escape_id("a\x00b\x01c") == b"a\x01\x02b\x01\x01c"


def test_the_old_timer_index_layout_is_recognised() -> None:
    old_key = keys.TIMER + (5).to_bytes(8, "big") + b"o-1/sleep/2/nap"
    assert keys.legacy_timer(old_key, b"o-1") == (5, "o-1", "o-1/sleep/2/nap")
    assert keys.legacy_timer(keys.timer(5, "o-1", "o-1/sleep/2/nap"), b"") is None
    assert keys.legacy_timer_by_id(keys.TIMER_BY_ID + b"o-1/sleep/2/nap")
    assert not keys.legacy_timer_by_id(keys.timer_by_id("o-1", "o-1/sleep/2/nap"))


@given(st.text(min_size=1, max_size=20))
def test_every_family_of_an_instances_keys_is_a_family_snapshots_copy(instance_id: str) -> None:
    """A Kafka snapshot copies the families whole (``INSTANCE_FAMILIES``): each of an
    instance's key prefixes lies in one of them, so none of its keys is left out."""
    prefixes = keys.instance_prefixes(instance_id)
    assert len(prefixes) == len(keys.INSTANCE_FAMILIES)
    for prefix, family in zip(prefixes, keys.INSTANCE_FAMILIES, strict=True):
        assert prefix.startswith(family), (prefix, family)
