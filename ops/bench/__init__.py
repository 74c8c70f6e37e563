"""``stepstream bench``: the standard workloads, measured end to end through a real
client path, printed as JSON.

``--client inprocess`` (the embedded engine in this process), ``http`` (``stepstream
dev`` as a subprocess, an ``http://`` client) or ``kafka`` (``stepstream worker``
subprocess(es), a ``kafka://`` client); the workloads are in ``stepstream.ops.bench.workloads``,
the engines they drive in ``stepstream.ops.bench.sessions``, the fixed-rate timer workload in
``stepstream.ops.bench.timers``. Progress goes to stderr; the JSON object goes to stdout.

The engine subprocesses load their workflows from this module (``--workflows
stepstream.ops.bench``), hence the workflow re-exports below.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import platform
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from stepstream.ops import event_loop
from stepstream.ops.bench.profile import check_profiler, profiled
from stepstream.ops.bench.retention import RETENTION_S, SWEEP_INTERVAL_S, retention
from stepstream.ops.bench.sessions import (
    CLIENTS,
    Session,
    cpu_by_role,
    http,
    inprocess,
    kafka,
    process_roles,
    server_gc_pauses,
)
from stepstream.ops.bench.timers import fixed_rate_timers
from stepstream.ops.bench.workloads import DEFAULT_N, run_workload

__all__ = ["main", "run_bench"]

WORKLOADS = ("W1", "W2", "W3", "timers", "buffer", "fanout", "loop", "retention")
DEFAULT_PENDING = 1_000_000
DEFAULT_RATE = 2000.0
DEFAULT_RETAINED = 10_000


def resolve_client(client: str | None, backend: str | None) -> tuple[str, str]:
    """(client, backend) from the flags: each client path drives one backend."""
    if backend not in (None, "embedded", "kafka"):
        raise SystemExit(f"bench: unknown backend {backend!r} (embedded or kafka)")
    if client is None:
        client = "kafka" if backend == "kafka" else "inprocess"
    if client not in CLIENTS:
        raise SystemExit(f"bench: unknown client {client!r} ({', '.join(CLIENTS)})")
    wanted = "kafka" if client == "kafka" else "embedded"
    if backend is not None and backend != wanted:
        raise SystemExit(
            f"bench: --client {client} drives the {wanted} backend, not {backend}; "
            f"drop --backend, or use --client {'kafka' if backend == 'kafka' else 'http'}"
        )
    return client, wanted


def _check_positive(**values: float | None) -> None:
    for flag, value in values.items():
        if value is not None and value <= 0:
            raise SystemExit(f"bench: --{flag} must be more than 0, got {value:g}")


@contextlib.asynccontextmanager
async def _session(
    client: str,
    path: str,
    bootstrap: str,
    partitions: int,
    workers: int,
    replication: int = 1,
    workload: str = "",
) -> AsyncIterator[Session]:
    if client == "inprocess":
        config: dict[str, Any] = {}
        if workload == "retention":
            config = {"retention_s": RETENTION_S, "sweep_interval_s": SWEEP_INTERVAL_S}
        async with inprocess(path, **config) as session:
            yield session
    elif client == "http":
        async with http(path, workers) as session:
            yield session
    else:
        async with kafka(bootstrap, path, partitions, workers, replication) as session:
            yield session


async def run_bench(
    workloads: list[str],
    *,
    client: str | None = None,
    backend: str | None = None,
    n: int | None = None,
    data: str | None = None,
    sync: bool = False,
    input_bytes: int = 0,
    bootstrap: str | None = None,
    partitions: int = 4,
    workers: int = 1,
    pending: int | None = None,
    rate: float = DEFAULT_RATE,
    profile: str | None = None,
    broker_kind: str = "dev",
    broker_nodes: int = 1,
    scrape_interval: float | None = None,
) -> dict[str, Any]:
    client, backend = resolve_client(client, backend)
    _check_positive(n=n, pending=pending, rate=rate, workers=workers, partitions=partitions)
    _check_positive(**{"scrape-interval": scrape_interval})
    if scrape_interval is not None and workloads != ["timers"]:
        raise SystemExit(
            "bench: --scrape-interval scrapes the engine while --workload timers fires; "
            "pass --workload timers"
        )
    if input_bytes < 0:
        raise SystemExit(f"bench: --input-bytes must be 0 or more, got {input_bytes}")
    if workers != 1 and client == "inprocess":
        raise SystemExit(
            "bench: --workers is for --client http (engine processes of `stepstream dev "
            "--processes K`) and --client kafka (worker processes)"
        )
    if client == "kafka" and workers > partitions:
        raise SystemExit(
            f"bench: --workers {workers} needs at least as many partitions; "
            f"pass --partitions {workers} or more"
        )
    if "retention" in workloads and client != "inprocess":
        raise SystemExit(
            "bench: --workload retention runs on the in-process engine (it sets the "
            "engine's retention to 1 s and sweeps every 0.5 s); drop --client or pass "
            "--client inprocess"
        )
    if profile is not None:
        check_profiler()
    result: dict[str, Any] = {
        "backend": backend,
        "client": client,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "event_loop": event_loop.running_loop_name(),
    }
    if broker_nodes != 1 and broker_kind != "apache":
        raise SystemExit("bench: --broker-nodes needs --broker apache")
    broker: Any = None
    broker_pids: list[int] = []
    if client == "kafka" and bootstrap is None:
        if broker_kind == "apache":
            from stepstream.ops.brokers.apache import start_apache

            print(f"bench: starting Apache Kafka, {broker_nodes} node(s)", file=sys.stderr)
            broker = start_apache(broker_nodes)
            bootstrap = broker.bootstrap
            broker_pids = broker.pids
            result["broker"] = (
                f"Apache Kafka {broker.version}, {broker_nodes} node(s) (KRaft), same machine"
            )
        else:
            from stepstream.ops.brokers.dev import start_broker

            broker = start_broker()
            bootstrap = broker.bootstrap
            broker_pids = [broker.proc.pid]
            result["broker"] = "development broker (Tansu), same machine"
    replication = min(3, broker_nodes) if broker_kind == "apache" else 1
    if data:
        # Made here, as `dev --data` and `worker --state-dir` make theirs: the engines'
        # logs are written beside their state before any engine starts.
        os.makedirs(data, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(prefix="stepstream-bench-") as tmp:
            for name in workloads:
                # Fresh state per workload, so one does not slow the next.
                path = os.path.join(data or tmp, name)
                session = _session(
                    client, path, bootstrap or "", partitions, workers, replication, name
                )
                async with session as s:
                    roles = process_roles(s.engine_pids, broker_pids)
                    cpu_now = functools.partial(cpu_by_role, roles)
                    cpu = cpu_now()
                    with profiled(profile, f"{name}-{client}", s.engine_pids):
                        if name == "timers":
                            count = pending or n or DEFAULT_PENDING
                            figures = await fixed_rate_timers(s, count, rate, scrape_interval)
                        elif name == "retention":
                            figures = await retention(s, n or DEFAULT_RETAINED)
                        else:
                            figures = await run_workload(
                                s.client,
                                name,
                                n or DEFAULT_N[name],
                                sync,
                                input_bytes,
                                cpu=cpu_now,
                            )
                    # CPU each process spent on the workload: which one is the bottleneck,
                    # and whether a second process would have a core to run on.
                    after = cpu_now()
                    figures["cpu_s"] = {role: round(after[role] - cpu[role], 2) for role in roles}
                    if s.servers:  # the subprocesses' collector pauses, from their /metrics
                        figures["gc_pauses"] = await server_gc_pauses(s.servers)
                result[name] = {**figures, **s.extra}
                if client == "kafka" and name != "timers":
                    from stepstream.ops.bench.restore import kafka_restore

                    print("restore: timing a worker without local state", file=sys.stderr)
                    prefix = s.extra["prefix"]
                    result[name]["restore"] = await kafka_restore(
                        bootstrap or "", prefix, partitions
                    )
    finally:
        if broker is not None:
            broker.stop()
    return result


def _given(args: argparse.Namespace, name: str, default: Any) -> Any:
    """The flag's value if it was passed (0 included, so it is refused, not replaced)."""
    value = getattr(args, name, None)
    return default if value is None else value


_T = TypeVar("_T")


async def _stopped_by_sigterm(run: Coroutine[Any, Any, _T]) -> _T:
    """``run``, which SIGTERM cancels as Ctrl-C does: the servers and brokers the bench
    started stop with it (left running, a worker and three JVMs went on taking the CPU),
    and it exits 130. Handled by the loop itself, so it works also where SIGINT is
    ignored, as it is for a job a non-interactive shell starts in the background."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    stopped = False

    def stop() -> None:
        nonlocal stopped
        stopped = True
        task.cancel()

    loop.add_signal_handler(signal.SIGTERM, stop)
    try:
        return await run
    except asyncio.CancelledError:
        if stopped:
            raise KeyboardInterrupt from None  # the CLI's exit status for Ctrl-C
        raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def main(args: argparse.Namespace) -> int:
    workload = getattr(args, "workload", None)
    workloads = [workload] if workload else ["W1", "W2", "W3"]
    result = event_loop.run(
        _stopped_by_sigterm(
            run_bench(
                workloads,
                client=getattr(args, "client", None),
                backend=getattr(args, "backend", None),
                n=getattr(args, "n", None),
                data=getattr(args, "data", None),
                sync=getattr(args, "sync_steps", False),
                input_bytes=getattr(args, "input_bytes", None) or 0,
                bootstrap=getattr(args, "bootstrap", None),
                partitions=_given(args, "partitions", 4),
                workers=_given(args, "workers", 1),
                pending=getattr(args, "pending", None),
                rate=_given(args, "rate", DEFAULT_RATE),
                profile=getattr(args, "profile", None),
                broker_kind=getattr(args, "broker", None) or "dev",
                broker_nodes=_given(args, "broker_nodes", 1),
                scrape_interval=getattr(args, "scrape_interval", None),
            )
        )
    )
    print(json.dumps(result, indent=None if getattr(args, "json", False) else 2))
    return 0
