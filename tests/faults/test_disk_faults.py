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
import contextlib
import errno
import logging
import os
import re
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

from stepstream.consumers.embedded import DiskFull, EmbeddedPartition
from stepstream.consumers.kafka import create_topics
from stepstream.engine.api.workflow import Registry
from stepstream.engine.errors import StepstreamError
from stepstream.engine.reads.views import HistoryEntry
from stepstream.engine.seams import CommitBatch
from stepstream.ops.embedded import EmbeddedConfig, open_embedded
from stepstream.producers.client import Client
from tests.conftest import (
    KAFKA_TEST_PARTITIONS,
    ThreadedWorker,
    kafka_settings,
    kafka_url,
)
from tests.conftest import test_registry as registry_of_test_workflows
from tests.fakes import CommitFaults
from tests.kafka_broker import Broker
from tests.workflows import ledger_count

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PARTITIONS = 2
DISK_MB = 48
# Generous deadlines: they bound waits for conditions (started, stopped, finished), so a
# loaded machine is slower to meet them but only a broken engine misses them.
STOP_DEADLINE_S = 60
RESULT_TIMEOUT_S = 120


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


async def long_poll(url: str) -> None:
    async with aiohttp.ClientSession() as http, http.get(url) as response:
        await response.read()
        raise AssertionError(f"answered {response.status}: {await response.text()}")


class Dev:
    """`stepstream dev` on one data directory, as successive subprocesses."""

    def __init__(self, data: Path, log: Path, processes: int = 1) -> None:
        self.data = data
        self.log = log
        self.processes = processes
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
                    "stepstream.ops.cli",
                    "dev",
                    "--workflows",
                    "tests.fault_workflows",
                    "--data",
                    str(self.data),
                    "--port",
                    str(self.port),
                    "--partitions",
                    str(PARTITIONS),
                    "--processes",
                    str(self.processes),
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
        deadline = time.monotonic() + STOP_DEADLINE_S
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


async def until_stepping(client: Client, instance: str) -> None:
    """Until ``instance`` has recorded a step: commits are under way."""
    deadline = time.monotonic() + RESULT_TIMEOUT_S
    while not any(h.type == "StepSucceeded" for h in await client.history(instance)):
        if time.monotonic() > deadline:
            raise AssertionError(f"{instance} recorded no step in {RESULT_TIMEOUT_S} s")
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("processes", [1, 2])
async def test_full_disk_stops_the_engine_clearly_and_nothing_acknowledged_is_lost(
    small_disk: Path, processes: int
) -> None:
    """On one engine process and on two (``dev --processes 2``), where each process
    writes its own partitions and the first answers the clients."""
    dev = Dev(small_disk / "data", small_disk.parent / "dev.log", processes)
    await dev.start()
    acknowledged: list[str] = []
    refused: list[str] = []
    filler: Path | None = None
    held = "held"  # waits for an event: its result cannot come before the disk fills
    try:
        async with dev.client() as client:
            await client.start("gate", None, instance_id=held)
            for i in range(8):
                acknowledged.append(
                    await client.start(
                        "ticker", {"steps": STEPS, "seconds": 0.05}, instance_id=f"before-{i}"
                    )
                )
            await until_stepping(client, acknowledged[0])
            # Clients waiting for a result when the disk fills (over the session
            # websocket, and a plain HTTP long poll): they must not be kept waiting, nor
            # keep the engine from stopping, until some timeout.
            waiting = asyncio.ensure_future(client.result(held, timeout=300))
            polling = asyncio.ensure_future(
                long_poll(f"{dev.url}/v1/instances/{held}/result?timeout=300")
            )
            filler = await asyncio.to_thread(fill, small_disk)
            # Keep starting instances while the disk is full, until the engine has
            # stopped: each one is either acknowledged (then it must not be lost) or
            # refused with the reason.
            assert dev.proc is not None
            deadline = time.monotonic() + STOP_DEADLINE_S
            i = 0
            while dev.proc.poll() is None and time.monotonic() < deadline:
                try:
                    acknowledged.append(
                        await client.start(
                            "ticker", {"steps": STEPS, "seconds": 0.05}, instance_id=f"full-{i}"
                        )
                    )
                except StepstreamError as exc:
                    refused.append(str(exc))
                i += 1
                await asyncio.sleep(0.05)  # pacing only: the loop ends on the exit
            code = await dev.exited(STOP_DEADLINE_S)
            with pytest.raises(
                StepstreamError, match=r"lost the (connection|session)|cannot reach"
            ):
                await asyncio.wait_for(waiting, STOP_DEADLINE_S)
            with pytest.raises(aiohttp.ClientError):
                await asyncio.wait_for(polling, STOP_DEADLINE_S)
        said = dev.run_of(1)
        assert code != 0, said
        assert str(dev.data) in said and all(w in said for w in DISK_FULL_WORDS), said
        assert "Traceback" not in said.split("error:")[-1], said
        # It stopped because the disk is full, not after retries with growing backoff.
        assert "reloading from the last commit" not in said, said
        # Refused with the reason while it stops, then it is gone.
        for reason in refused:
            assert re.search("is full|cannot reach|lost the (connection|session)", reason), reason

        # Started while the disk is still full: it refuses, with the same advice.
        dev.spawn()
        assert await dev.exited(STOP_DEADLINE_S) != 0
        said = dev.run_of(2)
        assert "Traceback" not in said, said
        assert str(dev.data) in said and all(w in said for w in DISK_FULL_WORDS), said

        # Space again: everything acknowledged completes, exactly once.
        filler.unlink()
        filler = None
        await dev.start()
        async with dev.client() as client:
            await client.send_event(held, "open", "at last")
            assert await client.result(held, timeout=RESULT_TIMEOUT_S) == "at last"
            for instance in acknowledged:
                result = await client.result(instance, timeout=RESULT_TIMEOUT_S)
                assert result == {"id": instance, "ticks": STEPS}
                check_ticker(instance, await client.history(instance), STEPS)
    finally:
        dev.stop()
        if filler is not None:
            filler.unlink(missing_ok=True)
        print(dev.tail(10000))


def damage(rocks_dir: Path, what: str) -> str:
    """Damage one kind of RocksDB file in ``rocks_dir``; returns the file's name."""
    files = sorted(rocks_dir.iterdir(), key=lambda f: f.stat().st_size)
    if what == "CURRENT":
        target = rocks_dir / "CURRENT"
        target.write_text("MANIFEST-999999\n")  # names a manifest that is not there
        return target.name
    if what.startswith("MANIFEST"):
        target = next(f for f in files if f.name.startswith("MANIFEST-"))
        if what == "MANIFEST":  # cut short: RocksDB reads it as a torn write
            os.truncate(target, target.stat().st_size // 2)
        else:  # damaged bytes: a checksum mismatch
            with open(target, "r+b") as f:
                f.seek(target.stat().st_size // 2)
                f.write(os.urandom(32))
        return target.name
    suffix = ".log" if what == "WAL" else ".sst"
    target = [f for f in files if f.name.endswith(suffix)][-1]  # the largest
    with open(target, "r+b") as f:
        if what == "table":
            f.seek(-64, os.SEEK_END)  # the footer: checked when the table is opened
        elif what == "data-block":
            f.seek(16)  # the first data block: found only when it is read
        else:
            f.seek(target.stat().st_size // 2)  # mid-log: acknowledged writes follow
        f.write(os.urandom(64))
    return target.name


@pytest.mark.parametrize("what", ["CURRENT", "MANIFEST", "table", "WAL"])
async def test_a_damaged_data_directory_is_refused_with_the_way_out(
    tmp_path: Path, what: str
) -> None:
    dev = Dev(tmp_path / "data", tmp_path / "dev.log")
    await dev.start()
    try:
        async with dev.client() as client:
            ids = [f"t-{i}" for i in range(50)]
            for instance in ids:
                await client.start("ticker", {"steps": 5, "seconds": 0}, instance_id=instance)
            for instance in ids:
                await client.result(instance, timeout=30)
    finally:
        if what == "WAL":
            dev.kill()  # the log still holds every write (a clean stop flushes it away)
        else:
            dev.stop()
    damaged = damage(dev.data / "rocksdb", what)

    dev.spawn()
    try:
        code = await dev.exited(30)
    finally:
        dev.kill()
    said = dev.run_of(2)
    assert code == 1, said
    assert "Traceback" not in said, said
    assert f"error: the embedded data directory {dev.data} is damaged" in said, said
    assert "Restore it from a backup" in said and f"mv {dev.data} " in said, said
    print(f"{what} ({damaged}): {said}")


# ---- the Kafka backend: a damaged partition directory is rebuilt from the topics ------


async def until_waiting(client: Client, instance: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not any(w.kind == "wait" for w in (await client.status(instance)).waits):
        if time.monotonic() > deadline:
            raise AssertionError(f"{instance} never waited for its event")
        await asyncio.sleep(0.05)


@pytest.mark.kafka
@pytest.mark.parametrize("what", ["CURRENT", "MANIFEST-bytes", "table", "data-block"])
async def test_a_damaged_partition_directory_is_quarantined_and_rebuilt(
    kafka_broker: Broker,
    tmp_path: Path,
    ledger: Path,
    what: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = kafka_settings(kafka_broker)
    await asyncio.to_thread(create_topics, settings, KAFKA_TEST_PARTITIONS)
    state = tmp_path / "worker"
    worker = ThreadedWorker(settings, state, registry_of_test_workflows())
    gated = [f"gate-{i}" for i in range(6)]
    chains = [f"chain-{i}" for i in range(6)]
    try:
        worker.start()
        async with Client.connect(kafka_url(settings)) as client:
            for instance in chains:
                await client.start("chain", 20, instance_id=instance)
            for instance in gated:
                await client.start("gated", instance, instance_id=instance)
            for instance in chains:
                assert await client.result(instance, timeout=30) == 20
            for instance in gated:
                await until_waiting(client, instance)
    finally:
        worker.stop()
    partition_dir = state / settings.prefix / "partition-0"
    damaged = damage(partition_dir, what)

    caplog.set_level(logging.INFO)
    worker = ThreadedWorker(settings, state, registry_of_test_workflows())
    try:
        worker.start()
        async with Client.connect(kafka_url(settings)) as client:
            for instance in gated:
                await client.send_event(instance, "go", "green")
            for instance in gated:
                assert await client.result(instance, timeout=30) == [
                    f"{instance}-before",
                    "green",
                    f"{instance}-after",
                ]
                history = await client.history(instance)
                keys = [h.attributes["key"] for h in history if h.type == "StepSucceeded"]
                assert keys == ["before", "after"], history
            for instance in chains:
                assert await client.result(instance, timeout=30) == 20
                history = await client.history(instance)
                keys = [h.attributes["key"] for h in history if h.type == "StepSucceeded"]
                assert keys == [f"s{n}" for n in range(20)], history
    finally:
        worker.stop()
    # The state was rebuilt from the topics, not re-run: every body ran once.
    for instance in gated:
        assert ledger_count(ledger, f"{instance}-before") == 1
        assert ledger_count(ledger, f"{instance}-after") == 1
    aside = sorted(p.name for p in partition_dir.parent.glob("partition-0.corrupt-*"))
    assert len(aside) == 1, sorted(p.name for p in partition_dir.parent.iterdir())
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert f"partition=0 state in {partition_dir} is damaged" in said, said
    assert f"moved it to {partition_dir.parent / aside[0]}" in said, said
    (moved,) = [r for r in caplog.records if "moved it to" in r.getMessage()]
    assert getattr(moved, "partition", None) == 0  # a field log pipelines can select on
    print(f"{what} ({damaged}) -> {aside[0]}")


# ---- the processor: a full disk stops its partition, whichever write meets it ---------


class Hiccup(Exception):
    """A failure the processor recovers from by reloading (a lost acknowledgement)."""


class DiskFillsAtCommit(CommitFaults):
    """An embedded partition whose disk fills at its ``fill_at``-th commit: from then on
    every RocksDB write of the directory fails with ENOSPC, as a full disk makes it fail.
    ``hiccup_first``: that commit fails with a ``Hiccup`` instead, so the first write to
    meet the full disk is the processor's reload after it."""

    def __init__(self, inner: EmbeddedPartition, fill_at: int, *, hiccup_first: bool) -> None:
        super().__init__(inner)
        self._db = inner._db
        self._fill_at = fill_at
        self._hiccup_first = hiccup_first
        self.refused: list[BaseException] = []  # the commits made once the disk was full

    async def commit(self, batch: CommitBatch) -> None:
        self.commits += 1
        if self.commits == self._fill_at:

            def full_disk(batch: object) -> None:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            self._db._write_durably = full_disk  # type: ignore[method-assign]
            if self._hiccup_first:
                raise Hiccup("the write's acknowledgement was lost")
        try:
            await self.inner.commit(batch)
        except BaseException as exc:
            self.refused.append(exc)
            raise


@pytest.mark.parametrize("where", ["commit", "reload"])
async def test_a_full_disk_stops_the_partition_at_once_also_in_its_reload(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    """A DiskFull says "stepstream stops": the processor must stop its partition then,
    never reload and retry with growing backoff, wherever the write that met it was."""
    caplog.set_level(logging.INFO)
    registry = Registry()
    registry.add_module("tests.workflows")
    engine = await open_embedded(registry, EmbeddedConfig(data_dir=str(tmp_path), partitions=1))
    starting: asyncio.Future[str] | None = None
    try:
        await engine.host.revoke(0)
        # Commit 1 fences the partition as it is assigned; 2 applies the start.
        partition = DiskFillsAtCommit(
            EmbeddedPartition(engine.db, 0), 2, hiccup_first=where == "reload"
        )
        await engine.host.assign(partition)
        client = Client(engine.make_transport())
        starting = asyncio.ensure_future(client.start("chain", 3, instance_id="full"))
        processor = engine.host.processor(0)
        try:
            await asyncio.wait_for(processor.join(), 30)
        except TimeoutError:
            pytest.fail(
                f"the partition still runs 30 s after its disk filled ({where}): "
                f"{len(partition.refused)} commits refused since\n{caplog.text}"
            )
        assert isinstance(engine.db.failure, DiskFull), engine.db.failure
        assert [type(exc) for exc in partition.refused] == [DiskFull], partition.refused
        said = [r.getMessage() for r in caplog.records if r.name == "stepstream.partition"]
        stopped = [m for m in said if "stopped processing" in m]
        assert len(stopped) == 1 and "is full" in stopped[0], said
        reloads = [m for m in said if "reloading" in m]
        assert len(reloads) == (1 if where == "reload" else 0), said
    finally:
        if starting is not None:
            starting.cancel()
            with contextlib.suppress(BaseException):
                await starting
        await engine.close()
