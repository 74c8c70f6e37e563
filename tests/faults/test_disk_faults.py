"""The embedded engine's disk: full, and corrupted.

A full disk: the data directory lives on a small tmpfs mounted for the test (the tests
run as root; a refused mount fails the test, it never skips). While workflows run, a
filler file takes the rest of the space. The engine must say so (which directory, that
the disk is full, what to do) and stop rather than go on half-working; started again
while the disk is still full it refuses with the same advice; once the filler is gone it
starts, and every command acknowledged before the disk filled is carried out, exactly
once.

A corrupted data directory: ``stepstream dev`` exits non-zero with one clear message
naming the directory and the way out, not a traceback.
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest

from engine.errors import StepstreamError
from engine.views import HistoryEntry
from producers.client import Client

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PARTITIONS = 2
DISK_MB = 48


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of DISK_MB MiB, mounted for this test and unmounted after it."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.fail(
            "this test needs a small disk of its own and could not mount one "
            f"(mount -t tmpfs exited {mounted.returncode}: {mounted.stderr.strip()}); "
            "run the tests as root, or in a container allowed to mount tmpfs"
        )
    try:
        yield mount_point
    finally:
        unmounted = subprocess.run(["umount", str(mount_point)], capture_output=True, text=True)
        if unmounted.returncode != 0:
            subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)


def fill(disk: Path) -> Path:
    """Write a file until the disk has no space left; returns its path."""
    filler = disk / "filler"
    chunk = b"\0" * (1 << 20)
    with open(filler, "wb", buffering=0) as f:
        while True:
            try:
                f.write(chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
        # The last bytes too: a smaller write may still fit.
        size = 4096
        while size >= 1:
            try:
                f.write(b"\0" * size)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                size //= 2
    return filler


class Dev:
    """`stepstream dev` on one data directory, as successive subprocesses."""

    def __init__(self, data: Path, log: Path) -> None:
        self.data = data
        self.log = log
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def spawn(self) -> subprocess.Popen[bytes]:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.starts += 1
        with open(self.log, "ab") as log:
            log.write(f"---- start {self.starts} ----\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "ops.cli",
                    "dev",
                    "--workflows",
                    "tests.fault_workflows",
                    "--data",
                    str(self.data),
                    "--port",
                    str(self.port),
                    "--partitions",
                    str(PARTITIONS),
                ],
                cwd=REPO,
                env={
                    **os.environ,
                    "PYTHONPATH": os.pathsep.join(
                        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p
                    ),
                },
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        return self.proc

    def run_of(self, start: int) -> str:
        """What the ``start``-th process wrote."""
        text = self.log.read_text(errors="replace")
        begin = text.index(f"---- start {start} ----")
        end = text.find(f"---- start {start + 1} ----")
        return text[begin : end if end >= 0 else len(text)]

    async def start(self) -> None:
        proc = self.spawn()
        deadline = time.monotonic() + 30
        async with aiohttp.ClientSession() as http:
            while True:
                if proc.poll() is not None:
                    pytest.fail(f"stepstream dev exited with {proc.returncode}:\n{self.tail()}")
                try:
                    async with http.get(f"{self.url}/healthz") as response:
                        if response.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline:
                    self.kill()
                    pytest.fail(f"stepstream dev never became healthy:\n{self.tail()}")
                await asyncio.sleep(0.05)

    async def exited(self, timeout: float) -> int:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while (code := self.proc.poll()) is None:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"stepstream dev still running after {timeout} s:\n{self.tail()}"
                )
            await asyncio.sleep(0.05)
        return code

    def tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    @asynccontextmanager
    async def client(self) -> AsyncIterator[Client]:
        async with Client.connect(self.url) as client:
            yield client


def check_ticker(instance: str, history: list[HistoryEntry], steps: int) -> None:
    why = f"{instance}: " + ", ".join(
        f"{h.seq}:{h.type}:{h.attributes.get('key')}" for h in history
    )
    assert [h.seq for h in history] == list(range(1, len(history) + 1)), why
    successes = Counter(h.attributes["key"] for h in history if h.type == "StepSucceeded")
    assert successes == Counter(f"t{n}" for n in range(steps)), why
    for h in history:
        if h.type == "StepAttemptStarted":
            assert h.attributes["attempt"] <= h.attributes["max_attempts"], why
    assert [h.type for h in history].count("WorkflowCompleted") == 1, why


STEPS = 30
DISK_FULL_WORDS = ("full", "free space")


async def test_full_disk_stops_the_engine_clearly_and_nothing_acknowledged_is_lost(
    small_disk: Path,
) -> None:
    dev = Dev(small_disk / "data", small_disk.parent / "dev.log")
    await dev.start()
    acknowledged: list[str] = []
    refused: list[str] = []
    filler: Path | None = None
    try:
        async with dev.client() as client:
            for i in range(8):
                acknowledged.append(
                    await client.start(
                        "ticker", {"steps": STEPS, "seconds": 0.05}, instance_id=f"before-{i}"
                    )
                )
            # Mid-flight: steps have been recorded and more are running.
            await asyncio.sleep(0.5)
            status = await client.status(acknowledged[0])
            assert status.status == "running" and status.waits, status
            filler = await asyncio.to_thread(fill, small_disk)
            # Keep starting instances while the disk is full: each one is either
            # acknowledged (then it must not be lost) or refused with the reason.
            for i in range(40):
                try:
                    acknowledged.append(
                        await client.start(
                            "ticker", {"steps": STEPS, "seconds": 0.05}, instance_id=f"full-{i}"
                        )
                    )
                except StepstreamError as exc:
                    refused.append(str(exc))
                    if dev.proc is not None and dev.proc.poll() is not None:
                        break
                await asyncio.sleep(0.05)
        code = await dev.exited(30)
        said = dev.run_of(1)
        assert code != 0, said
        assert str(dev.data) in said and all(w in said for w in DISK_FULL_WORDS), said
        assert "Traceback" not in said.split("error:")[-1], said
        # Refused with the reason while it stops, then it is gone.
        for reason in refused:
            assert "is full" in reason or "cannot reach" in reason, reason

        # Started while the disk is still full: it refuses, with the same advice.
        dev.spawn()
        assert await dev.exited(30) != 0
        said = dev.run_of(2)
        assert "Traceback" not in said, said
        assert str(dev.data) in said and all(w in said for w in DISK_FULL_WORDS), said

        # Space again: everything acknowledged completes, exactly once.
        filler.unlink()
        filler = None
        await dev.start()
        async with dev.client() as client:
            for instance in acknowledged:
                result = await client.result(instance, timeout=60)
                assert result == {"id": instance, "ticks": STEPS}
                check_ticker(instance, await client.history(instance), STEPS)
    finally:
        dev.stop()
        if filler is not None:
            filler.unlink(missing_ok=True)
        print(dev.tail(10000))
