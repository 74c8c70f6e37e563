"""The jars Apache Kafka runs from, and the Java that runs them.

Kafka's broker is published on Maven Central as ``org.apache.kafka:kafka_2.13`` plus its
runtime dependencies; ``apache-kafka.pom.xml`` (beside this module) names them together
with Kafka's command-line tools (``kafka-tools``) and the log4j2 binding Kafka's
distribution ships. ``resolve_jars`` has Maven copy them once into
``~/.cache/stepstream/kafka-<version>-<pom digest>/`` (``$XDG_CACHE_HOME`` is honoured;
``STEPSTREAM_BROKER_JARS`` names another directory) and reuses them afterwards: a
``.complete`` file written last marks a finished copy, and a lock file keeps two
processes from resolving into one directory at once. Maven keeps its own copy under
``~/.m2`` as usual."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.resources
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from stepstream.ops.brokers import BrokerError

KAFKA_VERSION = "4.3.1"
ENV_JARS = "STEPSTREAM_BROKER_JARS"
ENV_VERSION = "STEPSTREAM_BROKER_KAFKA_VERSION"
MIN_JAVA = 17
# Pinned: Maven 3.8's default dependency plugin (2.8) predates copy-dependencies' fixes.
_COPY = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1:copy-dependencies"
_COMPLETE = ".complete"
_POM = "apache-kafka.pom.xml"
_INSTALL_JAVA = (
    "install a Java runtime 17 or newer (Debian/Ubuntu: apt-get install "
    "openjdk-17-jre-headless; elsewhere e.g. Eclipse Temurin 17) or set JAVA_HOME"
)
_INSTALL_MAVEN = "install Apache Maven (Debian/Ubuntu: apt-get install maven; or maven.apache.org)"

Progress = Callable[[str], None]


def kafka_version(environ: dict[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    return env.get(ENV_VERSION) or KAFKA_VERSION


def jar_dir(version: str | None = None) -> Path:
    """Where the jars of ``version`` are (or will be) cached."""
    override = os.environ.get(ENV_JARS)
    if override:
        return Path(override).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    # Named for what the pom lists too: a pom that gains a jar resolves into a new
    # directory, never into one a running broker reads its classes from.
    return Path(cache) / "stepstream" / f"kafka-{version or kafka_version()}-{_pom_digest()}"


def _pom_digest() -> str:
    pom = importlib.resources.files("stepstream.ops.brokers") / _POM
    return hashlib.sha256(pom.read_bytes()).hexdigest()[:8]


def find_java() -> str:
    """The ``java`` to run Kafka with (``$JAVA_HOME/bin/java``, else the one on PATH),
    checked to be Java 17 or newer."""
    home = os.environ.get("JAVA_HOME")
    java = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    if not java or not os.access(java, os.X_OK):
        where = f"$JAVA_HOME/bin/java ({java}) is not executable" if home else "no java on PATH"
        raise BrokerError(f"Apache Kafka needs Java {MIN_JAVA}+ and {where}: {_INSTALL_JAVA}")
    try:
        shown = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=30, check=False
        ).stderr
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BrokerError(f"cannot run {java} -version ({exc}): {_INSTALL_JAVA}") from None
    match = re.search(r'version "(\d+)(?:\.(\d+))?', shown)
    if match is None:
        raise BrokerError(f"cannot tell the Java version of {java} from: {shown.strip()!r}")
    major = int(match.group(2)) if match.group(1) == "1" else int(match.group(1))
    if major < MIN_JAVA:
        raise BrokerError(
            f"Apache Kafka 4 needs Java {MIN_JAVA}+, and {java} is Java {major}: {_INSTALL_JAVA}"
        )
    return java


def classpath(directory: Path) -> str:
    return str(directory / "*")


def is_resolved(directory: Path) -> bool:
    """Whether ``directory`` holds the jars the pom lists now: a directory named by
    ``STEPSTREAM_BROKER_JARS`` and resolved from an older pom is resolved again."""
    try:
        marker = (directory / _COMPLETE).read_text()
    except FileNotFoundError:
        return False
    return marker.startswith(_marker_head())


def _marker_head() -> str:
    return f"# resolved from the pom {_pom_digest()}\n"


def resolve_jars(version: str | None = None, *, progress: Progress | None = None) -> Path:
    """The directory holding Kafka ``version``'s jars, resolved with Maven the first time.

    Raises ``BrokerError`` naming what to install when Java or Maven is missing, or with
    Maven's last lines when resolution fails (no network, an unknown version)."""
    version = version or kafka_version()
    target = jar_dir(version)
    if is_resolved(target):
        return target
    find_java()  # Maven needs it too; say so before Maven does, less clearly
    mvn = shutil.which("mvn")
    if mvn is None:
        raise BrokerError(
            f"the Apache Kafka {version} jars are not in {target} yet, and fetching them "
            f"needs Maven (mvn on PATH): {_INSTALL_MAVEN}"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    with locked(target.parent / f".{target.name}.lock"):
        if is_resolved(target):  # another process finished while this one waited
            return target
        _run_maven(mvn, version, target, progress or (lambda _: None))
    return target


@contextmanager
def locked(path: Path) -> Iterator[None]:
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _run_maven(mvn: str, version: str, target: Path, progress: Progress) -> None:
    started = time.monotonic()
    progress(f"resolving the Apache Kafka {version} jars with Maven into {target} (once)")
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        with importlib.resources.as_file(
            importlib.resources.files("stepstream.ops.brokers") / _POM
        ) as pom:
            command = [
                mvn,
                "--batch-mode",
                "-f",
                str(pom),
                f"-Dkafka.version={version}",
                "-DincludeScope=runtime",
                f"-DoutputDirectory={staging}",
                _COPY,
            ]
            last = _stream(command, cwd=staging, progress=progress)
        jars = sorted(p.name for p in staging.glob("*.jar"))
        if not any(name.startswith("kafka_2.13-") for name in jars):
            raise BrokerError(
                f"Maven finished but copied no Kafka broker jar into {staging}; its last "
                "lines:\n" + "\n".join(last)
            )
        (staging / _COMPLETE).write_text(_marker_head() + "\n".join(jars) + "\n")
        if target.exists():  # an unfinished copy of an earlier, interrupted run
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    size = sum(p.stat().st_size for p in target.glob("*.jar")) / 1e6
    progress(f"resolved {len(jars)} jars ({size:.0f} MB) in {time.monotonic() - started:.0f} s")


def _stream(command: list[str], *, cwd: Path, progress: Progress) -> list[str]:
    """Run Maven, reporting downloads every 2 s; Maven's last lines, or ``BrokerError``."""
    last: deque[str] = deque(maxlen=25)
    downloaded = 0
    reported = time.monotonic()
    try:
        proc = subprocess.Popen(
            command,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
        )
    except OSError as exc:
        raise BrokerError(f"cannot run Maven ({exc}): {_INSTALL_MAVEN}") from None
    assert proc.stdout is not None
    with proc:
        for line in proc.stdout:
            last.append(line.rstrip())
            if "Downloaded from" in line:
                downloaded += 1
                if time.monotonic() - reported >= 2:
                    reported = time.monotonic()
                    progress(f"  ... {downloaded} files downloaded")
    if proc.returncode != 0:
        raise BrokerError(
            f"Maven could not resolve the Apache Kafka jars (exit {proc.returncode}; it needs "
            "Maven Central or a mirror in ~/.m2/settings.xml). Its last lines:\n" + "\n".join(last)
        )
    return list(last)
