"""Freed memory goes back to the system once retention has forgotten many instances."""

from __future__ import annotations

import asyncio
import ctypes
import logging
from pathlib import Path

import pytest

from stepstream.consumers import heap_trim


def test_trim_gives_freed_heap_memory_back_to_the_system() -> None:
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    # Blocks below glibc's mmap threshold come from the heap; the last one, still held,
    # keeps the freed ones below it from being returned by free() itself.
    size, count = 24 * 1024, 2048  # 48 MB
    blocks = [libc.malloc(size) for _ in range(count)]
    for block in blocks:
        ctypes.memset(block, 1, size)
    for block in blocks[:-1]:
        libc.free(block)
    held = heap_trim.resident_bytes()
    assert heap_trim.available(), "this process runs on glibc: malloc_trim is there"
    assert heap_trim.trim()
    returned = held - heap_trim.resident_bytes()
    libc.free(blocks[-1])
    assert returned > 32 * 2**20, f"only {returned / 2**20:.1f} MB of 48 MB freed went back"


async def _forget(tmp_path: Path, n: int) -> heap_trim.HeapTrim:
    """Run ``n`` instances on an engine with a short retention until all are forgotten;
    the engine's heap trimmer, once nothing more is due."""
    from stepstream.ops.embedded import EmbeddedConfig, open_embedded
    from stepstream.producers.client import Client
    from tests.conftest import test_registry

    config = EmbeddedConfig(
        data_dir=str(tmp_path / "data"), partitions=2, retention_s=0.5, sweep_interval_s=0.05
    )
    engine = await open_embedded(test_registry(), config)
    async with Client(engine.make_transport(owns_engine=True)) as client:
        for i in range(n):
            await client.start("arith", i, instance_id=f"short-{i}")
            await client.result(f"short-{i}", timeout=10)
        for _ in range(400):
            if not (await client.list_page(prefix="short-", limit=1)).instances:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the finished instances were never forgotten")
        trimmer = engine.host.heap_trim
        for _ in range(400):
            if not trimmer.due:
                break
            await asyncio.sleep(0.05)
        return trimmer


async def test_retention_trims_the_heap_after_forgetting_many(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(heap_trim.ENV, "20")
    with caplog.at_level(logging.INFO, logger="stepstream.memory"):
        trimmer = await _forget(tmp_path, 30)
    assert trimmer.trims >= 1
    said = [r.getMessage() for r in caplog.records if r.name == "stepstream.memory"]
    assert said and "of freed memory to the system (malloc_trim" in said[0], said
    assert "after retention forgot" in said[0], said


async def test_no_trim_when_it_is_turned_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(heap_trim.ENV, "0")
    trimmer = await _forget(tmp_path, 30)
    assert trimmer.trims == 0


def test_a_negative_setting_says_what_to_pass() -> None:
    from stepstream.errors import ConfigError

    with pytest.raises(ConfigError, match=f"{heap_trim.ENV}='-1' must be at least 0"):
        heap_trim.HeapTrim.from_env({heap_trim.ENV: "-1"})


@pytest.mark.parametrize("command", ["dev", "worker"])
def test_help_says_how_to_turn_it_off(tmp_path: Path, command: str) -> None:
    from tests.dev_server import run_cli

    done = run_cli(tmp_path, command, "--help")
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    assert f"${heap_trim.ENV} instances (default 1000; 0: never)" in text, text
