"""``stepstream bench``: the standard workloads, measured end to end, printed as JSON.

W1: N instances x 10 sequential steps (throughput and latency), plus single-instance
    latency of a 10-step and a 100-step workflow run one at a time.
W2: N instances sleeping 1 s (timer lateness: when the sleep was recorded as elapsed,
    minus when it was due; never negative).
W3: N instances waiting for an event a client sends (event sent -> result seen).
Progress goes to stderr; the JSON object goes to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from engine.context import Context
from engine.errors import StepstreamError
from engine.workflow import Registry, workflow
from ops.embedded import EmbeddedConfig, open_embedded
from producers.client import Client

DEFAULT_N = {"W1": 2000, "W2": 2000, "W3": 500}


async def _noop(i: int) -> int:
    return i + 1


def _noop_sync(i: int) -> int:
    return i + 1


@workflow("bench-steps")
async def bench_steps(ctx: Context, args: dict[str, Any]) -> int:
    fn = _noop_sync if args.get("sync") else _noop
    value = 0
    for i in range(args["steps"]):
        value = await ctx.step(f"s{i}", fn, value)
    return value


@workflow("bench-sleep")
async def bench_sleep(ctx: Context, seconds: float) -> None:
    await ctx.sleep("nap", seconds)


@workflow("bench-event")
async def bench_event(ctx: Context, _: Any) -> Any:
    return await ctx.wait_for_event("go")


def _pct(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(p / 100 * len(ordered) + 0.5) - 1))
    return round(ordered[index], 2)


class _Progress:
    def __init__(self, label: str, total: int) -> None:
        self._label, self._total, self._done, self._last = label, total, 0, 0.0

    def tick(self) -> None:
        self._done += 1
        now = time.monotonic()
        if now - self._last > 1.0 or self._done == self._total:
            self._last = now
            print(f"{self._label}: {self._done}/{self._total}", file=sys.stderr, flush=True)


async def _gather_limited(jobs: list[Callable[[], Awaitable[Any]]], limit: int) -> list[Any]:
    semaphore = asyncio.Semaphore(limit)

    async def one(job: Callable[[], Awaitable[Any]]) -> Any:
        async with semaphore:
            return await job()

    return await asyncio.gather(*(one(j) for j in jobs))


async def w1(client: Client, n: int, *, sync: bool) -> dict[str, Any]:
    steps = 10
    progress = _Progress("W1", n)
    latencies: list[float] = []

    async def one(i: int) -> None:
        t0 = time.perf_counter()
        instance = await client.start(
            "bench-steps", {"steps": steps, "sync": sync}, instance_id=f"w1-{i}"
        )
        assert await client.result(instance, timeout=600) == steps
        latencies.append((time.perf_counter() - t0) * 1000)
        progress.tick()

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    elapsed = time.perf_counter() - start

    async def single(prefix: str, count: int, steps: int) -> list[float]:
        out = []
        for i in range(count):
            t0 = time.perf_counter()
            instance = await client.start(
                "bench-steps", {"steps": steps, "sync": sync}, instance_id=f"{prefix}-{i}"
            )
            await client.result(instance, timeout=60)
            out.append((time.perf_counter() - t0) * 1000)
        return out

    single10 = await single("w1-single10", 50, 10)
    single100 = await single("w1-single100", 10, 100)
    per_step_10 = _pct(single10, 50) / 10
    per_step_100 = _pct(single100, 50) / 100
    return {
        "workflows": n,
        "steps_per_workflow": steps,
        "steps_per_s": round(n * steps / elapsed, 1),
        "workflows_per_s": round(n / elapsed, 1),
        "latency_p50_ms": _pct(latencies, 50),
        "latency_p99_ms": _pct(latencies, 99),
        "single_10_steps_p50_ms": _pct(single10, 50),
        "single_100_steps_p50_ms": _pct(single100, 50),
        "per_step_ratio_100_vs_10": round(per_step_100 / per_step_10, 2) if per_step_10 else None,
        "step_bodies": "sync (thread pool)" if sync else "async",
    }


async def w2(client: Client, n: int) -> dict[str, Any]:
    seconds = 1.0
    progress = _Progress("W2", n)

    async def one(i: int) -> None:
        instance = await client.start("bench-sleep", seconds, instance_id=f"w2-{i}")
        await client.result(instance, timeout=600)
        progress.tick()

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    elapsed = time.perf_counter() - start
    lateness: list[float] = []
    for i in range(n):
        history = await client.history(f"w2-{i}")
        due = next(h.attributes["wake_at_ms"] for h in history if h.type == "SleepStarted")
        woke = next(h for h in history if h.type == "SleepElapsed")
        woke_ms = _parse_ms(woke.time)
        lateness.append(woke_ms - due)
    return {
        "workflows": n,
        "sleep_s": seconds,
        "workflows_per_s": round(n / elapsed, 1),
        "elapsed_s": round(elapsed, 3),
        "lateness_p50_ms": _pct(lateness, 50),
        "lateness_p99_ms": _pct(lateness, 99),
        "lateness_min_ms": round(min(lateness), 2) if lateness else None,
        "lateness_max_ms": round(max(lateness), 2) if lateness else None,
    }


def _parse_ms(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso).timestamp() * 1000


def _starter(client: Client, workflow: str, instance: str) -> Callable[[], Awaitable[str]]:
    return lambda: client.start(workflow, None, instance_id=instance)


async def w3(client: Client, n: int) -> dict[str, Any]:
    progress = _Progress("W3 waiting", n)
    ids = [f"w3-{i}" for i in range(n)]
    await _gather_limited([_starter(client, "bench-event", i) for i in ids], 200)
    for instance in ids:
        while not (await client.status(instance)).waits:
            await asyncio.sleep(0.005)
        progress.tick()
    latencies: list[float] = []
    done = _Progress("W3 events", n)

    async def one(instance: str) -> None:
        t0 = time.perf_counter()
        await client.send_event(instance, "go", {"at": t0})
        await client.result(instance, timeout=600)
        latencies.append((time.perf_counter() - t0) * 1000)
        done.tick()

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in ids))
    elapsed = time.perf_counter() - start
    return {
        "workflows": n,
        "workflows_per_s": round(n / elapsed, 1),
        "event_to_completion_p50_ms": _pct(latencies, 50),
        "event_to_completion_p99_ms": _pct(latencies, 99),
        "latency_p50_ms": _pct(latencies, 50),
        "latency_p99_ms": _pct(latencies, 99),
    }


async def _run_workload(client: Client, name: str, count: int, sync: bool) -> dict[str, Any]:
    if name == "W1":
        return await w1(client, count, sync=sync)
    if name == "W2":
        return await w2(client, count)
    return await w3(client, count)


@contextlib.asynccontextmanager
async def _embedded(path: str) -> AsyncIterator[tuple[Client, dict[str, Any]]]:
    registry = Registry([bench_steps, bench_sleep, bench_event])
    engine = await open_embedded(registry, EmbeddedConfig(data_dir=path))
    extra: dict[str, Any] = {}
    try:
        yield Client(engine.make_transport()), extra
        extra["fsyncs"] = engine.db.batches_written
    finally:
        await engine.close()
    # Restore: reopening the data directory the workload left (state is local: the
    # engine resumes the unfinished instances; the log is not replayed).
    began = time.perf_counter()
    engine = await open_embedded(registry, EmbeddedConfig(data_dir=path))
    extra["restore_s"] = round(time.perf_counter() - began, 3)
    await engine.close()


async def _kafka_restore(bootstrap: str, prefix: str, partitions: int) -> dict[str, Any]:
    """What a worker without local state spends restoring every partition, from the
    newest snapshots and from the whole history, on the topics a workload left."""
    from consumers.kafka import (
        HistoryReader,
        LogProducer,
        OutRecord,
        PartitionDB,
        restore_partition,
    )
    from consumers.kafka.snapshots import SnapshotReader
    from engine.kafka_settings import KafkaSettings
    from engine.records import PartitionFenced
    from engine.seams import SystemClock
    from engine.serde import default_serde
    from engine.topics import SNAPSHOTS, TopicNames

    settings = KafkaSettings(bootstrap=bootstrap, prefix=prefix)
    serde = default_serde()
    producer = await asyncio.to_thread(LogProducer, settings, client_id="stepstream-bench")
    reader = await asyncio.to_thread(HistoryReader, settings)
    snapshots = SnapshotReader(await asyncio.to_thread(HistoryReader, settings, SNAPSHOTS), serde)
    out: dict[str, Any] = {}
    try:
        # The producer's first send waits for its producer id (about 0.5 s): not part of
        # either way of restoring, so it is paid before the clock starts.
        # (A fence of epoch 0 changes nothing for any reader.)
        warm = PartitionFenced(instance_id="", command_id="bench-warm-up", epoch=0, partition=0)
        await producer.send([OutRecord(TopicNames(prefix).history, 0, b"", serde.encode(warm))])
        for label, source in (("snapshot", snapshots), ("full", None)):
            seconds = 0.0
            records = from_snapshot = 0
            with tempfile.TemporaryDirectory(prefix="stepstream-restore-") as tmp:
                for partition in range(partitions):
                    db = PartitionDB.open(os.path.join(tmp, str(partition)), partition, partitions)
                    began = time.perf_counter()
                    db, restored = await restore_partition(
                        db,
                        partition,
                        reader=reader,
                        producer=producer,
                        serde=serde,
                        clock=SystemClock(),
                        topics=TopicNames(prefix),
                        group_offsets={},
                        snapshots=source,
                    )
                    seconds += time.perf_counter() - began
                    records += restored.records
                    from_snapshot += restored.snapshot is not None
                    db.close()
            out[label] = {
                "restore_s": round(seconds, 3),
                "history_records_folded": records,
                "partitions_from_snapshot": from_snapshot,
            }
    finally:
        await asyncio.to_thread(reader.close)
        await asyncio.to_thread(snapshots.close)
        await asyncio.to_thread(producer.close)
    return out


@contextlib.asynccontextmanager
async def _kafka(
    bootstrap: str, state_dir: str, partitions: int
) -> AsyncIterator[tuple[Client, dict[str, Any]]]:
    """A worker process (real parallelism: the client here, the worker there, the broker
    in a third) on fresh topics, and a kafka:// client."""
    from consumers.kafka import create_topics
    from engine.kafka_settings import KafkaSettings

    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    settings = KafkaSettings(bootstrap=bootstrap, prefix=prefix)
    await asyncio.to_thread(create_topics, settings, partitions)
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ops.cli",
            "worker",
            "--workflows",
            "ops.bench",
            "--bootstrap",
            bootstrap,
            "--prefix",
            prefix,
            "--state-dir",
            state_dir,
            "--port",
            "0",
            "--log-level",
            "WARNING",
        ],
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    extra: dict[str, Any] = {"partitions": partitions}
    try:
        async with Client.connect(f"kafka://{bootstrap}?prefix={prefix}") as client:
            await _until_ready(client, worker)
            yield client, extra
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(worker.wait, 30)
        except subprocess.TimeoutExpired:
            worker.kill()
    print("restore: timing a worker without local state", file=sys.stderr, flush=True)
    extra["restore"] = await _kafka_restore(bootstrap, prefix, partitions)


async def _until_ready(client: Client, worker: subprocess.Popen[bytes]) -> None:
    """Until a worker announced the bench workflows and ran one end to end."""
    deadline = time.monotonic() + 60
    while True:
        if worker.poll() is not None:
            raise SystemExit(f"bench: the worker exited with {worker.returncode}")
        try:
            probe = await client.start("bench-steps", {"steps": 1}, instance_id="ready")
            await client.result(probe, timeout=30)
            return
        except StepstreamError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def run_bench(
    backend: str,
    workloads: list[str],
    n: int | None,
    data: str | None,
    sync: bool,
    bootstrap: str | None = None,
    partitions: int = 4,
) -> dict[str, Any]:
    if backend not in ("embedded", "kafka"):
        raise SystemExit(f"bench: unknown backend {backend!r} (embedded or kafka)")
    result: dict[str, Any] = {
        "backend": backend,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }
    broker = None
    if backend == "kafka" and bootstrap is None:
        from ops.broker import start_broker

        broker = start_broker()
        bootstrap = broker.bootstrap
        result["broker"] = "local test broker (Tansu), same machine"
    try:
        with tempfile.TemporaryDirectory(prefix="stepstream-bench-") as tmp:
            for name in workloads:
                # Fresh state per workload, so one does not slow the next.
                path = os.path.join(data or tmp, name)
                session = (
                    _kafka(bootstrap or "", path, partitions)
                    if backend == "kafka"
                    else _embedded(path)
                )
                async with session as (client, extra):
                    result[name] = await _run_workload(client, name, n or DEFAULT_N[name], sync)
                result[name].update(extra)
    finally:
        if broker is not None:
            broker.stop()
    return result


def main(args: argparse.Namespace) -> int:
    import json

    workloads = [args.workload] if getattr(args, "workload", None) else ["W1", "W2", "W3"]
    result = asyncio.run(
        run_bench(
            args.backend,
            workloads,
            getattr(args, "n", None),
            getattr(args, "data", None),
            getattr(args, "sync_steps", False),
            getattr(args, "bootstrap", None),
            getattr(args, "partitions", None) or 4,
        )
    )
    print(json.dumps(result, indent=None if getattr(args, "json", False) else 2))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="stepstream bench")
    parser.add_argument("--backend", default="embedded")
    parser.add_argument("--workload", choices=["W1", "W2", "W3"])
    parser.add_argument("--n", type=int)
    parser.add_argument("--data")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--sync-steps", action="store_true")
    parser.add_argument("--bootstrap")
    parser.add_argument("--partitions", type=int, default=4)
    sys.exit(main(parser.parse_args()))
