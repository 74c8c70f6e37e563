"""Which partition owns an instance: Kafka's murmur2, so every Kafka client (the Java
one's default partitioner included) puts an instance's records where the workers
expect them."""

from __future__ import annotations

import random

import pytest

from stepstream.engine.wire.topics import murmur2, partition_for

# Kafka's own test vectors for Utils.murmur2 (a Java int: signed).
KAFKA_VECTORS = {
    b"21": -973932308,
    b"foobar": -790332482,
    b"a-little-bit-long-string": -985981536,
    b"a-little-bit-longer-string": -1486304829,
    b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
    b"abc": 479470107,
}


def _signed(h: int) -> int:
    return h - 2**32 if h >= 2**31 else h


@pytest.mark.parametrize(("data", "expected"), KAFKA_VECTORS.items())
def test_murmur2_matches_kafka(data: bytes, expected: int) -> None:
    assert _signed(murmur2(data)) == expected


def _murmur2_bytewise(data: bytes) -> int:
    """The reference: Kafka's Java loop, one byte at a time."""
    m, h = 0x5BD1E995, (0x9747B28C ^ len(data)) & 0xFFFFFFFF
    for i in range(len(data) // 4):
        k = int.from_bytes(data[i * 4 : i * 4 + 4], "little")
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> 24
        k = (k * m) & 0xFFFFFFFF
        h = ((h * m) & 0xFFFFFFFF) ^ k
    tail = data[len(data) // 4 * 4 :]
    for shift, byte in reversed(list(enumerate(tail))):
        h ^= byte << (8 * shift)
    if tail:
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    return h ^ (h >> 15)


def test_murmur2_agrees_with_the_bytewise_reference_on_every_length() -> None:
    rng = random.Random(7)
    for length in range(0, 70):
        for _ in range(20):
            data = bytes(rng.getrandbits(8) for _ in range(length))
            assert murmur2(data) == _murmur2_bytewise(data), data


def test_partition_for_is_the_positive_hash_modulo_the_partitions() -> None:
    for instance in ("order-1", "w2-1999", "ünïcode-id", ""):
        h = murmur2(instance.encode())
        assert partition_for(instance, 12) == (h & 0x7FFFFFFF) % 12
