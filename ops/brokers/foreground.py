"""``stepstream broker``: a local broker in the foreground until Ctrl-C or SIGTERM.

The bootstrap servers go to stdout alone on one line once every node serves metadata
(scripts read that line); what is running and where its logs are goes to stderr. A
signal stops the broker (Apache Kafka: a controlled shutdown of every node) and the
command exits 0; a node that dies on its own makes it exit 1 with that node's log tail.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

from stepstream.ops.brokers import BrokerError
from stepstream.ops.brokers.apache import DEFAULT_PORT, prepare_apache, start_apache
from stepstream.ops.brokers.jars import kafka_version

EXIT_OK = 0
EXIT_ERROR = 1


@dataclass(frozen=True)
class BrokerOptions:
    """The ``stepstream broker`` command line."""

    apache: bool = False
    nodes: int = 1
    port: int = DEFAULT_PORT
    data: str | None = None
    prepare: bool = False
    # Print the serving broker as one JSON object instead of the bare bootstrap list.
    json: bool = False


class _Stop(BaseException):
    """SIGINT or SIGTERM arrived: stop the broker and exit 0 (raised by the handler so a
    start in progress is interrupted too, and cleans up what it started)."""


def _announce(
    options: BrokerOptions, bootstrap: str, kind: str, nodes: int, data: str | None
) -> None:
    """The one line on stdout, once the broker serves: what clients connect to."""
    if options.json:
        line = json.dumps({"bootstrap": bootstrap, "broker": kind, "nodes": nodes, "data": data})
        print(line, flush=True)
    else:
        print(bootstrap, flush=True)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run(options: BrokerOptions) -> int:
    """Run the broker ``options`` describe; the exit status."""
    if options.prepare:
        return _prepare(options)
    if options.nodes != 1 and not options.apache:
        raise BrokerError("--nodes needs --apache: the development broker has one node")
    previous = {
        signum: signal.signal(signum, _raise_stop) for signum in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        return _serve(options)
    except _Stop:
        return EXIT_OK
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop


def _prepare(options: BrokerOptions) -> int:
    if not options.apache:
        raise BrokerError("--prepare needs --apache: the development broker needs no download")
    directory = prepare_apache(progress=_say)
    _say(f"Apache Kafka {kafka_version()} jars ready in {directory}")
    return EXIT_OK


def _serve(options: BrokerOptions) -> int:
    if options.apache:
        cluster = start_apache(options.nodes, options.port, options.data, progress=_say)
        try:
            _announce(options, cluster.bootstrap, "apache", cluster.nodes, str(cluster.data))
            _say(
                f"Apache Kafka {cluster.version}, {cluster.nodes} node(s) (KRaft), data in "
                f"{cluster.data}, logs in {cluster.data}/node-*/server.log; Ctrl-C stops it"
            )
            while True:
                time.sleep(0.5)
                for index in range(cluster.nodes):
                    if not cluster.running(index):
                        _say(
                            f"error: Apache Kafka node {index} exited on its own:\n"
                            f"{cluster.log_tail(index)}"
                        )
                        return EXIT_ERROR
        finally:
            # Runs again if a second signal lands during the first stop: stop() is
            # idempotent and a node already stopping only gets the same SIGTERM.
            _stop_uninterrupted(cluster.stop)
    from stepstream.ops.brokers.dev import start_broker

    try:
        broker = start_broker(options.port, data_dir=options.data)
    except RuntimeError as exc:
        raise BrokerError(str(exc)) from None
    try:
        _announce(options, broker.bootstrap, "development", 1, options.data)
        _say(
            f"development broker (Tansu, records in memory only), log in {broker.log_path}; "
            "Ctrl-C stops it"
        )
        while broker.proc.poll() is None:
            time.sleep(0.5)
        _say(f"error: the development broker exited on its own:\n{broker.log_tail()}")
        return EXIT_ERROR
    finally:
        _stop_uninterrupted(broker.stop)


def _stop_uninterrupted(stop: Callable[[], None]) -> None:
    """Call ``stop`` with SIGINT and SIGTERM ignored, so an impatient second Ctrl-C does
    not leave nodes half stopped."""
    previous = {
        signum: signal.signal(signum, signal.SIG_IGN) for signum in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        stop()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
