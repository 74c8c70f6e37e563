"""A class-data sharing archive for Apache Kafka's JVMs, so that a node starts faster.

A broker JVM spends most of its start on a small machine loading, parsing and verifying
its classes. Java's dynamic class-data sharing archives (JEP 350, Java 13 and later) keep
them, already parsed and verified, in one file that every later JVM maps. On the 2-core
machine the project is tested on, one node was serving in 1.7-2.2 s instead of 2.7-2.9 s
(2.1-2.3 CPU seconds instead of 3.2-3.5), three nodes in 4.6-5.0 s instead of 7.5-8.1.

The archive is made once, by a throwaway one-node broker started with
``-XX:ArchiveClassesAtExit`` and stopped; every node then starts with
``-XX:SharedArchiveFile``. It lives beside the jars, named for the Java runtime and the
JVM options it was made with, since the JVM maps an archive only for the same runtime
and class path. Should it not match all the same, the JVM runs without it and says so in
the node's log. ``STEPSTREAM_BROKER_CDS=0`` turns it off; an archive that cannot be made
(another JVM, a read-only jar directory) is skipped with a warning."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from stepstream.ops.brokers import BrokerError
from stepstream.ops.brokers.jars import Progress, locked

log = logging.getLogger("stepstream.broker")

ENV_CDS = "STEPSTREAM_BROKER_CDS"


def archive_path(jars: Path, java: str, jvm_options: Sequence[str]) -> Path:
    """Where the archive for ``java`` (its binary, as installed now) running the jars in
    ``jars`` with ``jvm_options`` is kept."""
    binary = os.path.realpath(java)
    try:
        installed = os.stat(binary).st_mtime_ns
    except OSError:
        installed = 0
    key = "\0".join([binary, str(installed), *jvm_options])
    return jars / f"classes-{hashlib.sha256(key.encode()).hexdigest()[:12]}.jsa"


def archive_options(
    jars: Path,
    java: str,
    jvm_options: Sequence[str],
    make: Callable[[Sequence[str]], None],
    progress: Progress | None = None,
) -> list[str]:
    """The JVM options that map the archive, making it first if there is none yet:
    ``make`` runs a broker with the options it is given until it serves, and stops it.
    Empty when turned off or when the archive cannot be made."""
    if os.environ.get(ENV_CDS, "1").strip() in ("0", "false", "no", "off"):
        return []
    path = archive_path(jars, java, jvm_options)
    uses = [f"-XX:SharedArchiveFile={path}"]
    if path.exists():
        return uses
    try:
        with locked(jars / ".classes.lock"):
            if path.exists():  # another process made it while this one waited
                return uses
            if progress is not None:
                progress("archiving the broker's classes for faster starts (once)")
            _make(path, make)
    except (BrokerError, OSError) as exc:
        log.warning(
            "Apache Kafka starts without a class-data archive (%s): each node takes about "
            "a second more to start; set %s=0 to stop trying",
            str(exc).splitlines()[0],
            ENV_CDS,
        )
        return []
    return uses


def _make(path: Path, make: Callable[[Sequence[str]], None]) -> None:
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        make([f"-XX:ArchiveClassesAtExit={partial}"])
        if not partial.exists() or partial.stat().st_size == 0:
            raise BrokerError("the JVM wrote no archive at exit")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
