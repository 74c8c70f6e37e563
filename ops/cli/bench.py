"""``stepstream bench``: throughput and latency through a real client path."""

from __future__ import annotations

import argparse

from stepstream.ops.cli.options import JSON
from stepstream.ops.cli.table import Command, arg
from stepstream.ops.gc_tuning import tune_for_serving

_BENCH_DESCRIPTION = """\
measure throughput and latency through a real client path; prints one JSON object.

clients:
  inprocess  the embedded engine in the bench process, the in-process client
  http       `stepstream dev` (embedded) as a subprocess, driven by an http:// client
  kafka      `stepstream worker` subprocess(es) on fresh topics, driven by a kafka://
             client (a broker is started unless --bootstrap is given: --broker dev,
             the development broker, or --broker apache [--broker-nodes N])

workloads (all three unless --workload):
  W1      N x 10 sequential steps started at once, results awaited (N=2000):
          steps_per_s, workflows_per_s, latency_p50_ms, latency_p99_ms, and
          burst_cpu_s (each process's CPU seconds during the timed burst: which one
          bound it); with --input-bytes B each instance's input carries B more bytes
  W2      N one-second sleepers started at once (N=2000): lateness_p50_ms,
          lateness_p99_ms and early_fires (timers fired before due; must be 0);
          client_lateness_p50_ms / _p99_ms (result seen - start called - 1 s), and
          its parts: start_taken_p99_ms (called -> the log took the start, where
          the sleep counts from), elapsed_to_result_p99_ms (fired -> result seen);
          start_to_sleeping_p99_ms is when the engine got to the start
  W3      N instances waiting for an event a client sends (N=500)
  timers  --pending N timers on one engine, due 1/--rate s apart (1,000,000 at
          2,000/s): lateness, its p99 per tenth and per second of the firing
          (lateness_p99_ms_by_second; late_seconds: those at 100 ms or more) and
          the engine's resident memory (rss_mb_*); --scrape-interval S scrapes
          the engine's /metrics every S s meanwhile (scrape: duration_*_ms, the
          round trip, and hold_*_ms, the time each scrape held the engine's loop)
  buffer  N events sent in turn to one instance that asks for none yet (N=1000),
          then taken at once: events_per_s, send_first_tenth_p50_ms against
          send_last_tenth_p50_ms (--input-bytes B: B more bytes per event)
  fanout  one instance running N steps at once, one N sleeps, one N child
          workflows (N=4000): steps_per_s, sleeps_elapsed_s, children_per_s
  loop    one instance running a ctx.loop of N one-step iterations, one running
          2N steps first (N=1000): iterations_per_s_alone against
          iterations_per_s_after_steps (an iteration must not cost more later)
  retention
          N one-step instances run and then forgotten by retention (N=10000; in
          process only: retention 1 s, swept every 0.5 s): rss_mb_after_run and
          rss_mb_after_retention (the memory forgotten work leaves behind),
          settled_commands_kept

examples:
  stepstream bench --client http --workload W1 --json
  stepstream bench --client kafka --workers 2 --workload W1
  stepstream bench --workload timers --pending 100000 --rate 2000
  stepstream bench --client kafka --workload timers --pending 200000 --scrape-interval 1
  stepstream bench --workload retention --n 100000 --json

Every workload's JSON has cpu_s: the CPU seconds each process used on it, follow-up
measurements included, by role: client+engine (in process), client, engine or
worker<i>, and broker (broker<i> for each node of an --broker-nodes cluster). Its
gc_pauses are each engine's garbage collections, read from /metrics (engine,
worker<i>, or process<K> for the engine processes of one server).

The bench and the servers it starts run on uvloop unless STEPSTREAM_EVENT_LOOP=asyncio
(the standard library's loop, to compare); the JSON says which ("event_loop").
"""


def _bench(args: argparse.Namespace) -> int:
    # Imported here: the benchmark registers its own workflows, which no other command needs.
    from stepstream.ops import bench

    tune_for_serving()
    return bench.main(args)  # SIGTERM stops it as Ctrl-C does (``_stopped_by_sigterm``)


COMMANDS = (
    Command(
        "bench",
        "measure throughput and latency (see docs)",
        _bench,
        shared=(JSON,),
        description=_BENCH_DESCRIPTION,
        verbatim=True,
        args=(
            arg(
                "--client",
                choices=("inprocess", "http", "kafka"),
                help="the client path to measure (default: inprocess, or kafka with "
                "--backend kafka)",
            ),
            arg(
                "--backend",
                choices=("embedded", "kafka"),
                help="embedded (clients inprocess, http) or kafka (client kafka); implied by "
                "--client",
            ),
            arg(
                "--bootstrap",
                metavar="H:P",
                help="Kafka bootstrap servers (default: start a broker, see --broker)",
            ),
            arg(
                "--broker",
                choices=("dev", "apache"),
                help="the broker --client kafka starts when no --bootstrap is given: the "
                "development broker (dev, the default) or Apache Kafka from its jars (apache)",
            ),
            arg(
                "--broker-nodes",
                type=int,
                metavar="N",
                help="with --broker apache: a cluster of N nodes; the topics get replication "
                "factor min(3, N) and min.insync.replicas 2 from 3 replicas (1); the JSON's "
                "topics says what the cluster reports",
            ),
            arg(
                "--workload",
                choices=("W1", "W2", "W3", "timers", "buffer", "fanout", "loop", "retention"),
                help="run only this one",
            ),
            arg("--n", type=int, metavar="N", help="instances per workload"),
            arg("--data", metavar="DIR", help="where the engines keep their state (default: temp)"),
            arg(
                "--sync-steps",
                action="store_true",
                help="W1 with sync step functions (thread pool)",
            ),
            arg(
                "--input-bytes",
                type=int,
                metavar="B",
                help="a string of B bytes in each W1 instance's input and each buffer event (0)",
            ),
            arg("--partitions", type=int, metavar="N", help="partitions of the Kafka topics (4)"),
            arg(
                "--workers",
                type=int,
                metavar="K",
                help="engine processes sharing the partitions: workers with --client kafka, "
                "`stepstream dev --processes K` with --client http (1)",
            ),
            arg(
                "--pending", type=int, metavar="N", help="timers pending at once, --workload timers"
            ),
            arg(
                "--rate", type=float, metavar="R", help="timers fired per second, --workload timers"
            ),
            arg(
                "--scrape-interval",
                type=float,
                metavar="S",
                help="with --workload timers: scrape the engine's /metrics every S seconds, "
                "as Prometheus would, from the first start to the last timer due; the JSON's "
                "scrape object has each scrape's round trip and how long it held the "
                "engine's loop (p50/p99/max; idle_*: with nothing else to do, firing_*: "
                "while timers came due)",
            ),
            arg(
                "--profile",
                metavar="DIR",
                help="sample every bench process with py-spy into DIR (collapsed stacks)",
            ),
        ),
    ),
)
