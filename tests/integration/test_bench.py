"""``stepstream bench`` through each client path, as a user runs it: the JSON it prints
has the documented shape, names the client, and every workflow of every workload
completed (the figures themselves are not checked: this machine is shared)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from stepstream.ops.cli.table import EXIT_INTERRUPTED
from tests.dev_server import clean_env, run_cli
from tests.kafka_broker import Broker

N = 20


def _bench(tmp_path: Path, *args: str) -> dict[str, Any]:
    # A low young-generation threshold, so that even these few workflows make the
    # collector run and its pauses show in the figures.
    env = clean_env(tmp_path, STEPSTREAM_GC="200,10,10")
    done = run_cli(tmp_path, "bench", "--n", str(N), "--json", *args, env=env, timeout=180)
    assert done.returncode == 0, f"bench failed:\n{done.stderr[-3000:]}"
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def _check_workloads(result: dict[str, Any]) -> None:
    for name in ("W1", "W2", "W3"):
        assert result[name]["workflows"] == N, result[name]
        assert result[name]["completed"] == N, result[name]
    for key in ("steps_per_s", "workflows_per_s", "latency_p50_ms", "latency_p99_ms"):
        assert result["W1"][key] > 0, result["W1"]
    for key in ("lateness_p50_ms", "lateness_p99_ms"):
        assert key in result["W2"], result["W2"]
    assert result["W2"]["early_fires"] == 0, result["W2"]
    # A sleep counts from when its start was taken, never from later than when the
    # engine got to the start (docs/workflows.md, "Workflow time").
    assert result["W2"]["start_taken_p99_ms"] <= result["W2"]["start_to_sleeping_p99_ms"]
    assert result["W3"]["latency_p99_ms"] > 0, result["W3"]


@pytest.mark.parametrize("client", ["inprocess", "http"])
def test_bench_through_the_embedded_clients(tmp_path: Path, client: str) -> None:
    result = _bench(tmp_path, "--client", client)
    assert (result["client"], result["backend"]) == (client, "embedded")
    assert result["event_loop"] == "uvloop", result
    _check_workloads(result)
    # The collector's pauses: the bench's own process, or the server's from its /metrics.
    pauses = result["W1"]["gc_pauses"]
    per_process = pauses if client == "inprocess" else pauses["engine"]
    assert set(per_process) == {"gen0", "gen1", "gen2"}, pauses
    assert per_process["gen0"]["collections"] > 0, pauses


def test_bench_through_the_http_client_on_two_engine_processes(tmp_path: Path) -> None:
    result = _bench(tmp_path, "--client", "http", "--workers", "2", "--workload", "W1")
    assert (result["client"], result["backend"]) == ("http", "embedded")
    w1 = result["W1"]
    assert w1["completed"] == N and w1["processes"] == 2, w1
    assert set(w1["cpu_s"]) == {"client", "worker0", "worker1"}, w1  # both processes
    # The timed burst alone: the engine processes worked in it, and it is part of the
    # workload's CPU (which adds the single-instance runs after it).
    burst = w1["burst_cpu_s"]
    assert set(burst) == set(w1["cpu_s"]), w1
    assert burst["worker0"] + burst["worker1"] > 0, w1
    assert all(burst[role] <= w1["cpu_s"][role] for role in burst), w1
    assert set(w1["gc_pauses"]) == {"process0", "process1"}, w1


@pytest.mark.kafka
def test_bench_through_the_kafka_client_on_two_workers(
    tmp_path: Path, kafka_broker: Broker
) -> None:
    data = tmp_path / "not" / "made" / "yet"  # --data needs no mkdir first
    result = _bench(
        tmp_path,
        *("--client", "kafka", "--workers", "2", "--bootstrap", kafka_broker.bootstrap),
        *("--data", str(data)),
    )
    assert (result["client"], result["backend"]) == ("kafka", "kafka")
    _check_workloads(result)
    assert result["W1"]["workers"] == 2
    assert (data / "W1.worker0.log").exists() and (data / "W1" / "worker1").is_dir()
    assert set(result["W1"]["gc_pauses"]) == {"worker0", "worker1"}, result["W1"]


def _check_scrapes(scrape: dict[str, Any]) -> None:
    """``--scrape-interval``: the engine was scraped all along, each scrape's round trip
    and hold of the engine's loop reported, over the whole run and in each phase."""
    assert scrape["failures"] == 0, scrape
    assert scrape["bytes"] > 10_000, scrape  # a whole /metrics body
    for phase in ("", "idle_", "firing_"):
        assert scrape[f"{phase}scrapes"] > 0, (phase, scrape)
        assert 0 < scrape[f"{phase}duration_p50_ms"] <= scrape[f"{phase}duration_max_ms"], scrape
        assert 0 < scrape[f"{phase}hold_p50_ms"] <= scrape[f"{phase}hold_p99_ms"], scrape
        assert scrape[f"{phase}hold_max_ms"] <= scrape[f"{phase}duration_max_ms"], scrape
    assert scrape["idle_scrapes"] + scrape["firing_scrapes"] <= scrape["scrapes"], scrape


def test_fixed_rate_timers_fire_every_timer_never_early(tmp_path: Path) -> None:
    result = _bench(
        tmp_path,
        *("--workload", "timers", "--pending", "300", "--rate", "500"),
        *("--scrape-interval", "0.1"),
    )
    timers = result["timers"]
    assert timers["scrape"]["interval_s"] == 0.1, timers
    assert timers["pending"] == 300
    assert timers["all_pending_before_first_due"] is True, timers
    assert timers["early_fires"] == 0, timers
    assert timers["rss_mb_all_pending"] > 0, timers
    # 300 due 2 ms apart: the firing spans 0.6 s, so the breakdown has one second.
    by_second = timers["lateness_p99_ms_by_second"]
    assert len(by_second) == 1, timers
    assert by_second[0] == timers["lateness_p99_ms"], timers
    assert timers["late_seconds"] == (1 if by_second[0] >= 100 else 0), timers
    _check_scrapes(timers["scrape"])


def test_scrape_interval_is_for_the_timers_workload(tmp_path: Path) -> None:
    done = run_cli(tmp_path, "bench", "--workload", "W1", "--scrape-interval", "1")
    assert done.returncode != 0
    assert "--scrape-interval" in done.stderr and "--workload timers" in done.stderr, done.stderr


@pytest.mark.kafka
def test_fixed_rate_timers_through_a_kafka_worker(tmp_path: Path, kafka_broker: Broker) -> None:
    result = _bench(
        tmp_path,
        *("--client", "kafka", "--bootstrap", kafka_broker.bootstrap),
        *("--workload", "timers", "--pending", "300", "--rate", "500"),
        *("--scrape-interval", "0.2"),
    )
    timers = result["timers"]
    _check_scrapes(timers["scrape"])  # over HTTP, the hold from the worker's Server-Timing
    # Pending on the worker itself (its /metrics), not only acknowledged by the broker.
    assert timers["all_pending_before_first_due"] is True, timers
    assert timers["all_pending_for_s"] > 0, timers
    assert timers["early_fires"] == 0 and timers["scheduled_after_due"] == 0, timers
    assert timers["gc_pauses"]["engine"]["gen0"]["collections"] > 0, timers


def test_bench_with_large_inputs(tmp_path: Path) -> None:
    result = _bench(tmp_path, "--workload", "W1", "--input-bytes", "50000")
    w1 = result["W1"]
    assert w1["completed"] == N and w1["input_bytes"] == 50_000, w1


def test_bench_buffered_events(tmp_path: Path) -> None:
    result = _bench(tmp_path, "--workload", "buffer", "--input-bytes", "1000")
    figures = result["buffer"]
    assert figures["events"] == N and figures["buffered_before_go"] == N, figures
    assert figures["events_per_s"] > 0 and figures["send_last_tenth_p50_ms"] > 0, figures


def test_bench_many_steps_at_once(tmp_path: Path) -> None:
    figures = _bench(tmp_path, "--workload", "fanout")["fanout"]
    assert figures["n"] == N and figures["completed"] == 3, figures
    assert figures["steps_per_s"] > 0 and figures["children_per_s"] > 0, figures
    assert figures["sleeps_elapsed_s"] >= figures["sleep_s"], figures


def test_bench_loop_iterations_alone_and_after_steps(tmp_path: Path) -> None:
    figures = _bench(tmp_path, "--workload", "loop")["loop"]
    assert figures["iterations"] == N and figures["completed"] == 2, figures
    assert figures["steps_before"] == 2 * N, figures
    assert figures["iterations_per_s_alone"] > 0, figures
    assert figures["iterations_per_s_after_steps"] > 0, figures


def test_retention_forgets_every_instance_and_reports_the_memory_left(tmp_path: Path) -> None:
    figures = _bench(tmp_path, "--workload", "retention")["retention"]
    assert figures["n"] == N and figures["retention_s"] == 1.0, figures
    # every instance ran and was then forgotten (the workload waits until none is left)
    assert figures["all_forgotten_s"] >= figures["ran_s"] > 0, figures
    assert figures["rss_mb_after_retention"] > 0 and figures["rss_mb_peak"] > 0, figures
    # one start per instance, each remembered for publishers that ask (within its window)
    assert figures["settled_commands_kept"] == N, figures
    # what RocksDB holds of its budget, so a reader sees how much of the memory it is
    assert 0 < figures["rocksdb_mb_after_retention"] <= figures["rocksdb_budget_mb"] == 64
    # a heap trim waits for many more forgotten instances (STEPSTREAM_MALLOC_TRIM_AFTER)
    assert figures["heap_trims"] == 0, figures


def test_http_client_with_kafka_backend_says_what_to_use(tmp_path: Path) -> None:
    done = run_cli(tmp_path, "bench", "--client", "http", "--backend", "kafka")
    assert done.returncode != 0
    assert "--client http drives the embedded backend" in done.stderr
    assert "--client kafka" in done.stderr


@pytest.mark.slow
@pytest.mark.kafka
def test_bench_starts_a_three_node_apache_kafka_with_replicated_topics(tmp_path: Path) -> None:
    result = _bench(
        tmp_path,
        *("--client", "kafka", "--broker", "apache", "--broker-nodes", "3", "--workload", "W1"),
    )
    assert result["broker"].startswith("Apache Kafka ") and "3 node(s)" in result["broker"]
    assert result["W1"]["completed"] == N, result["W1"]
    # The topics as the cluster reports them: every commit waited for a second broker.
    assert result["W1"]["topics"] == {
        "brokers": 3,
        "replication_factor": 3,
        "min_insync_replicas": 2,
    }, result["W1"]
    # Each node's CPU is measured on its own: which one bounds the figure shows.
    assert {"broker0", "broker1", "broker2"} <= set(result["W1"]["cpu_s"]), result["W1"]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--workload", "timers", "--rate", "0"), "--rate must be more than 0"),
        (("--client", "kafka", "--workers", "5"), "pass --partitions 5 or more"),
        (("--workload", "W1", "--input-bytes", "-1"), "--input-bytes must be 0 or more"),
        (("--client", "kafka", "--broker-nodes", "3"), "--broker-nodes needs --broker apache"),
        (("--workload", "retention", "--client", "http"), "drop --client or pass"),
    ],
)
def test_bad_bench_flags_say_what_to_pass(tmp_path: Path, args: tuple[str, ...], says: str) -> None:
    done = run_cli(tmp_path, "bench", *args)
    assert done.returncode != 0
    assert says in done.stderr, done.stderr


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


def _kill_if_ours(pid: int, tmp_path: Path) -> None:
    """Kill ``pid`` if it is still an engine this test started (its command line names
    the test's directory): a pid of a process gone may have been given to another."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
        if str(tmp_path).encode() in command:
            os.kill(pid, signal.SIGKILL)
    except (FileNotFoundError, ProcessLookupError):
        pass


def test_sigterm_stops_the_bench_and_the_servers_it_started(tmp_path: Path) -> None:
    """A bench stopped with SIGTERM (a CI timeout, ``kill``) stops the engine it started,
    as Ctrl-C does, rather than leave it running with no one to stop it."""
    servers: list[int] = []
    with subprocess.Popen(
        [
            *(sys.executable, "-m", "stepstream.ops.cli", "bench", "--client", "http"),
            *("--workload", "timers", "--pending", "100000", "--data", str(tmp_path / "d")),
        ],
        cwd=tmp_path,
        env=clean_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as bench:
        try:
            deadline = time.monotonic() + 60
            while not (servers := _children(bench.pid)) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert servers, "the bench started no engine in 60 s"
            time.sleep(2)  # it takes starts
            bench.send_signal(signal.SIGTERM)
            try:
                _, err = bench.communicate(timeout=60)
            except subprocess.TimeoutExpired as exc:
                tail = (exc.stderr or b"")[-3000:]
                raise AssertionError(f"the bench ran on 60 s after SIGTERM:\n{tail!r}") from None
        finally:
            bench.kill()
            for pid in servers:  # never left to take the CPU from the tests after this one
                _kill_if_ours(pid, tmp_path)
    assert bench.returncode == EXIT_INTERRUPTED, err[-3000:]
    for pid in servers:
        assert (
            not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
        ), f"engine {pid} still runs after the bench stopped"
