"""Where a bench workload runs: the engine each client path drives, started and stopped.

- ``inprocess``: the embedded engine in the bench's own process, with the in-process
  client (no encoding, no network: what the engine alone can do).
- ``http``: ``stepstream dev`` (embedded) as a subprocess, driven by an ``http://``
  client from the bench process: the path of an application talking to the API.
- ``kafka``: ``stepstream worker`` subprocess(es) on fresh topics of a broker, driven by
  a ``kafka://`` client that publishes commands itself.

Each session yields a ``Session``: the client, the process ids of the engine (for memory
and profiles) and figures it adds to the workload's JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import IO, Any

from stepstream.engine.api.workflow import Registry
from stepstream.engine.errors import StepstreamError
from stepstream.ops.bench.workloads import WORKFLOWS
from stepstream.ops.embedded import EmbeddedConfig, open_embedded
from stepstream.ops.telemetry import tracing
from stepstream.ops.telemetry.gc_pauses import GcPauses
from stepstream.producers.client import Client

CLIENTS = ("inprocess", "http", "kafka")
# The module the engine subprocesses load the bench workflows from.
WORKFLOWS_MODULE = "stepstream.ops.bench.workloads"
START_TIMEOUT_S = 60.0


@dataclass
class Session:
    client: Client
    engine_pids: list[int]
    extra: dict[str, Any] = field(default_factory=dict)
    # The base URLs of engine processes that serve /metrics (the subprocesses).
    servers: list[str] = field(default_factory=list)
    # The engine's partition host, when it runs in this process (--client inprocess).
    host: Any = None


async def server_gc_pauses(servers: list[str]) -> dict[str, Any]:
    """Each engine subprocess's collector pauses since it started (``/metrics``), as the
    in-process bench reports its own: per generation, collections, total and longest ms."""
    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, Any] = {}
    async with aiohttp.ClientSession() as http:
        for index, url in enumerate(servers):
            async with http.get(url.rstrip("/") + "/metrics") as response:
                text = await response.text()
            # One server; or, from `stepstream dev --processes`, its processes' series,
            # each labelled with its process.
            by_process: dict[str, dict[str, dict[str, float]]] = {}
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    generation = sample.labels.get("generation")
                    if generation is None:
                        continue
                    process = sample.labels.get("process", "")
                    figures = by_process.setdefault(process, {f"gen{g}": {} for g in range(3)})
                    gen = figures.get(f"gen{generation}")
                    if gen is None:
                        continue
                    if sample.name == "stepstream_gc_pause_seconds_count":
                        gen["collections"] = int(sample.value)
                    elif sample.name == "stepstream_gc_pause_seconds_sum":
                        gen["total_ms"] = round(sample.value * 1000, 1)
                    elif sample.name == "stepstream_gc_pause_max_seconds":
                        gen["longest_ms"] = round(sample.value * 1000, 1)
            for process, figures in by_process.items():
                if process:
                    found[f"process{process}"] = figures
                else:
                    found["engine" if len(servers) == 1 else f"worker{index}"] = figures
    return found


async def server_gauge_total(servers: list[str], name: str) -> float:
    """One gauge of the engine subprocesses' ``/metrics``, summed over every server and
    label (partitions, processes): e.g. the timers they hold pending."""
    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    async with aiohttp.ClientSession() as http:
        for url in servers:
            async with http.get(url.rstrip("/") + "/metrics") as response:
                text = await response.text()
            for family in text_string_to_metric_families(text):
                total += sum(s.value for s in family.samples if s.name == name)
    return total


def registry() -> Registry:
    return Registry(list(WORKFLOWS))


@contextlib.asynccontextmanager
async def inprocess(path: str, **config: Any) -> AsyncIterator[Session]:
    """``config``: more ``EmbeddedConfig`` settings (the retention workload's)."""
    engine = await open_embedded(registry(), EmbeddedConfig(data_dir=path, **config))
    # Spans, as `stepstream dev` exports them, when the OTEL_* variables ask for them
    # (the http and kafka clients' server processes read the same variables).
    traced = tracing.setup(engine.host, service="stepstream-bench")
    # The exporter process's start-up (imports, about 0.3 s of CPU) is not the workload's.
    if traced is not None and not await asyncio.to_thread(traced.exporter.wait_ready, 30.0):
        print("bench: the span exporter process did not start in 30 s", file=sys.stderr)
    session = Session(Client(engine.make_transport()), [os.getpid()], host=engine.host)
    session.extra["tracing"] = traced is not None
    pauses = GcPauses()
    gc.callbacks.append(pauses)
    try:
        yield session
        session.extra["fsyncs"] = engine.db.batches_written
    finally:
        gc.callbacks.remove(pauses)
        session.extra["gc_pauses"] = pauses.figures()
        await engine.close()
        if traced is not None:
            traced.close()
    # Restore: reopening the data directory the workload left (state is local: the
    # engine resumes the unfinished instances; the log is not replayed).
    began = time.perf_counter()
    engine = await open_embedded(registry(), EmbeddedConfig(data_dir=path))
    session.extra["restore_s"] = round(time.perf_counter() - began, 3)
    await engine.close()


def _spawn(args: list[str], log_path: str) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "stepstream.ops.cli", *args, "--log-level", "WARNING"],
            stdout=subprocess.PIPE,
            stderr=log,
            start_new_session=True,
        )


async def _listening(proc: subprocess.Popen[bytes], what: str, log_path: str) -> str:
    """The URL a ``stepstream dev|worker`` prints once it serves."""
    stdout: IO[bytes] | None = proc.stdout
    assert stdout is not None
    try:
        line = await asyncio.wait_for(asyncio.to_thread(stdout.readline), START_TIMEOUT_S)
    except TimeoutError:
        line = b""
    found = re.search(r"listening on (https?://\S+)", line.decode(errors="replace"))
    if found is None:
        _stop(proc)
        with open(log_path, errors="replace") as log:
            tail = log.read()[-2000:]
        raise SystemExit(f"bench: {what} did not start (its log {log_path}):\n{tail}")
    return found.group(1)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.asynccontextmanager
async def http(path: str, processes: int = 1) -> AsyncIterator[Session]:
    """``stepstream dev`` (with ``processes`` engine processes) on a free loopback port,
    and an ``http://`` client to it."""
    log_path = f"{path}.dev.log"
    args = ["dev", "--workflows", WORKFLOWS_MODULE, "--data", path, "--port", "0"]
    if processes > 1:
        args += ["--processes", str(processes)]
    proc = _spawn(args, log_path)
    try:
        url = await _listening(proc, "stepstream dev", log_path)
        pids = [proc.pid, *engine_children(proc.pid)]
        extra: dict[str, Any] = {"server": "stepstream dev (embedded)"}
        if processes > 1:
            extra.update(server=f"stepstream dev --processes {processes} (embedded)")
            extra.update(processes=processes)
        async with Client.connect(url) as client:
            yield Session(client, pids, extra, [url])
    finally:
        await asyncio.to_thread(_stop, proc)


@contextlib.asynccontextmanager
async def kafka(
    bootstrap: str, state_dir: str, partitions: int, workers: int, replication: int = 1
) -> AsyncIterator[Session]:
    """``workers`` worker processes on fresh topics, and a ``kafka://`` client; yields
    once every partition has an owner and a probe ran end to end."""
    from stepstream.consumers.kafka import create_topics
    from stepstream.consumers.kafka.topic_rules import replication as replicated
    from stepstream.engine.config.kafka import KafkaSettings

    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    settings = KafkaSettings(bootstrap=bootstrap, prefix=prefix)
    await asyncio.to_thread(create_topics, settings, partitions, replication=replication)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        # All at once: they start side by side and join the group in one rebalance.
        for index in range(workers):
            args = ["worker", "--workflows", WORKFLOWS_MODULE, "--bootstrap", bootstrap]
            args += ["--prefix", prefix, "--state-dir", f"{state_dir}/worker{index}"]
            args += ["--port", "0"]
            procs.append(_spawn(args, f"{state_dir}.worker{index}.log"))
        urls = await asyncio.gather(
            *(
                _listening(proc, f"stepstream worker {index}", f"{state_dir}.worker{index}.log")
                for index, proc in enumerate(procs)
            )
        )
        await _until_spread(settings, partitions, workers, procs)
        async with Client.connect(f"kafka://{bootstrap}?prefix={prefix}") as client:
            await _until_ready(client, procs)
            extra = {"partitions": partitions, "workers": workers, "prefix": prefix}
            # As the cluster reports them, not as asked: what every commit waited for.
            extra["topics"] = await asyncio.to_thread(replicated, settings)
            yield Session(client, [p.pid for p in procs], extra, urls)
    finally:
        for proc in procs:
            await asyncio.to_thread(_stop, proc)


async def _until_spread(
    settings: Any, partitions: int, workers: int, procs: list[subprocess.Popen[bytes]]
) -> None:
    """Until the members topic shows ``workers`` workers owning all the partitions (the
    group has settled, so no rebalance lands inside the measurement)."""
    from stepstream.engine.wire.topics import MEMBERS, TopicNames
    from stepstream.producers.kafka.members import MembersView
    from stepstream.producers.kafka.settings import aiokafka_options

    view = await MembersView.open(
        TopicNames(settings.prefix).name(MEMBERS),
        timeout=START_TIMEOUT_S,
        **aiokafka_options(settings, "consumer"),
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while True:
            owned = {p for m in view.live() for p in m.partitions}
            if len(view.live()) == workers and len(owned) == partitions:
                return
            for proc in procs:
                if proc.poll() is not None:
                    raise SystemExit(f"bench: a worker exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"bench: after {START_TIMEOUT_S:.0f} s, {len(view.live())} of {workers} "
                    f"workers own {len(owned)} of {partitions} partitions"
                )
            await view.changed(1.0)
    finally:
        await view.close()


async def _until_ready(client: Client, procs: list[subprocess.Popen[bytes]]) -> None:
    """Until the workers announced the bench workflows and ran one end to end."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        for proc in procs:
            if proc.poll() is not None:
                raise SystemExit(f"bench: a worker exited with {proc.returncode}")
        try:
            probe = await client.start("bench-steps", {"steps": 1}, instance_id="ready")
            await client.result(probe, timeout=30)
            return
        except StepstreamError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


def rss_mb(pids: list[int]) -> float:
    """The resident memory of these processes together (MB), from /proc."""
    total_kb = 0
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    total_kb += int(line.split()[1])
    return round(total_kb / 1024, 1)


def engine_children(pid: int) -> list[int]:
    """The engine processes ``stepstream dev --processes`` started (not its helpers,
    such as the span exporter)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        return []
    found = []
    for child in children:
        with contextlib.suppress(OSError), open(f"/proc/{child}/cmdline", "rb") as f:
            if b"stepstream.ops.cli\0dev\0" in f.read():
                found.append(child)
    return found


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process has used so far (s), from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # Fields after the parenthesised command name; utime and stime are 14 and 15.
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_by_role(roles: dict[str, int]) -> dict[str, float]:
    """``cpu_seconds`` of each process of ``process_roles``."""
    return {role: cpu_seconds(pid) for role, pid in roles.items()}


def process_roles(engine_pids: list[int], broker_pids: list[int]) -> dict[str, int]:
    """Role -> pid of every process a workload runs on (the bench itself is the client)."""
    own = os.getpid()
    roles = {"client" if own not in engine_pids else "client+engine": own}
    others = [pid for pid in engine_pids if pid != own]
    names = ["engine"] if len(others) == 1 else [f"worker{i}" for i in range(len(others))]
    roles.update(zip(names, others, strict=True))
    if len(broker_pids) == 1:
        roles["broker"] = broker_pids[0]
    else:
        roles.update((f"broker{i}", pid) for i, pid in enumerate(broker_pids))
    return roles
