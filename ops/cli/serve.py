"""The serving commands' table: ``stepstream dev`` (the embedded engine, its API and web
UI in one process, or in N) and ``stepstream worker`` (a member of a Kafka consumer
group). What they run is in ``serve_run``, imported when one of them starts."""

from __future__ import annotations

import argparse

from stepstream.ops.cli.options import CODEC, JSON, KAFKA, SERVING
from stepstream.ops.cli.table import Command, arg


def _dev(args: argparse.Namespace) -> int:
    from stepstream.ops.cli.serve_run import run_dev

    return run_dev(args)


def _worker(args: argparse.Namespace) -> int:
    from stepstream.ops.cli.serve_run import run_worker

    return run_worker(args)


_PROCESS_TUNING = (
    "It runs on uvloop, libuv's event loop ($STEPSTREAM_EVENT_LOOP=asyncio: the standard "
    "library's), with the garbage collector's thresholds raised ($STEPSTREAM_GC=default: "
    "Python's own). Its RocksDB databases share one memory budget for cached blocks and "
    "write buffers, $STEPSTREAM_ROCKSDB_MEMORY_MB (default 64). Once retention has "
    "forgotten $STEPSTREAM_MALLOC_TRIM_AFTER instances (default 1000; 0: never) it gives "
    "the memory they freed back to the system (glibc's malloc_trim)."
)
_OBSERVED = (
    " It serves Prometheus metrics at /metrics (with the API token when one is set): "
    "stepstream_* (work done, latencies, schedule-to-start, HTTP requests by route, "
    "API calls pending against --max-pending and refused, partitions owned, build "
    "info) and the process_* and python_* collectors; "
    "docs/operations.md lists them. /healthz and /readyz are its probes."
)


_HOST_HELP = "beyond loopback it needs --api-token or --insecure"
_TRACING_HELP = (
    " Traces: with OTEL_EXPORTER_OTLP_ENDPOINT (OTLP over HTTP) or "
    "OTEL_TRACES_EXPORTER=console set, it exports a span for each command it publishes, "
    "each activation of a run (the instance driven by an input: a start, an event, a "
    "timer, a step's outcome, a cancel, a pause) and each step attempt, after "
    "OpenTelemetry's messaging and exception conventions (docs/operations.md, Traces)."
)

COMMANDS = (
    Command(
        "dev",
        "serve the embedded engine, its HTTP API and the web UI (at /ui; it asks for the "
        "API token when one is set)",
        _dev,
        shared=(SERVING, CODEC, JSON),
        serves=True,
        epilog=_PROCESS_TUNING
        + _OBSERVED
        + " It prints one line once it listens (with --json, a JSON object: listening, "
        "data, partitions, processes, workflows). "
        "Example: stepstream dev --workflows examples.order --port 8233." + _TRACING_HELP,
        args=(
            arg(
                "--workflows",
                required=True,
                metavar="MODULES",
                help="comma-separated modules whose @workflow functions are served; the "
                "topics they declare as Source(...) are read from the Kafka cluster named by "
                "STEPSTREAM_SOURCES_BOOTSTRAP (HOST:PORT; prefix from STEPSTREAM_PREFIX); "
                "their ctx.publish(...) records are produced to the Kafka cluster named by "
                "STEPSTREAM_OUTBOX_BOOTSTRAP (HOST:PORT; without it a publish fails)",
            ),
            arg(
                "--data",
                metavar="DIR",
                help="data directory (default: $STEPSTREAM_DATA or ./.stepstream)",
            ),
            arg(
                "--host",
                default="127.0.0.1",
                help=f"address to listen on (%(default)s); {_HOST_HELP}",
            ),
            arg("--port", type=int, default=8233, help="port, 0 for any (%(default)s)"),
            arg(
                "--partitions",
                type=int,
                metavar="N",
                help="partitions of a new data directory (default: 4, or twice --processes)",
            ),
            arg(
                "--processes",
                type=int,
                default=1,
                metavar="N",
                help="engine processes sharing the partitions, to use N cores (default: 1). "
                "Each keeps its partitions in DATA/process-K and serves their API on a port "
                "of its own (GET /v1/processes lists them; the http:// client uses them); "
                "this process serves the API for all of them and starts the others again if "
                "they die. A data directory keeps the count it was made with",
            ),
            arg(
                "--hang-timeout",
                type=float,
                metavar="SECONDS",
                help="with --processes: kill an engine process that has not answered its "
                "health probe for this long and start it again, as a liveness probe would "
                "(default: 60; 0 leaves a hung process alone). Raise it if "
                "workflow code may block its event loop for longer",
            ),
        ),
    ),
    Command(
        "worker",
        "run workflows in a Kafka consumer group, and serve their reads and the web UI (at "
        "/ui, covering every worker's instances); on start it registers its workflows on "
        "<prefix>.definitions, so clients accept them from then on, even while no worker "
        "runs",
        _worker,
        shared=(KAFKA, SERVING, CODEC, JSON),
        serves=True,
        epilog="Workers with one --prefix form one consumer group and share its partitions. "
        "Rebalances are incremental: a worker joining, or leaving on SIGTERM, moves only "
        "the partitions that change hands (their running steps finish first, up to "
        "$STEPSTREAM_DRAIN_TIMEOUT_S); the others keep running. Workers of a stepstream "
        "version with eager rebalancing cannot share the group: stop them all first. A "
        "worker whose Kafka login is refused while it runs (its credential rotated or "
        "deleted on the brokers) logs why, answers 503 on /readyz and goes on by itself once "
        "Kafka accepts it again; $STEPSTREAM_EXIT_AFTER_LOGIN_REFUSED_S=S makes it exit 1 "
        "after S seconds instead, to be started again with the credentials it is given "
        "then (docs/kafka.md). "
        + _PROCESS_TUNING
        + _OBSERVED
        + " Example: stepstream worker --workflows pkg.flows --bootstrap kafka:9092."
        + _TRACING_HELP,
        args=(
            arg(
                "--workflows",
                required=True,
                metavar="MODULES",
                help="comma-separated modules whose @workflow functions are run; the topics "
                "they declare as Source(...) are read as event sources (consumer group "
                "PREFIX.sources; STEPSTREAM_SOURCES_COMMIT_INTERVAL_S); their "
                "ctx.publish(...) records are produced to this cluster, or to "
                "STEPSTREAM_OUTBOX_BOOTSTRAP (HOST:PORT) if set",
            ),
            arg(
                "--state-dir",
                metavar="DIR",
                help="local state, one RocksDB per owned partition (default: "
                "$STEPSTREAM_STATE_DIR or ./.stepstream-worker)",
            ),
            arg("--host", default="127.0.0.1", help=f"API address (%(default)s); {_HOST_HELP}"),
            arg("--port", type=int, default=8233, help="API port, 0 for any (%(default)s)"),
            arg(
                "--advertise",
                metavar="URL",
                help="the API's URL as clients reach it (default: http://HOST:PORT as bound, "
                "https with --tls-cert); its host is allowed in Host headers",
            ),
        ),
    ),
)
