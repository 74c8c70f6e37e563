"""A `stepstream dev` subprocess for tests, and the `stepstream` CLI beside it.

The server runs a workflows module written to a temp directory, on a free port, with an
environment cleaned of the STEPSTREAM_* settings that change who may talk to it (so a
developer's shell cannot change what a test sees); it is stopped by its pid.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.processes import first_line

REPO = str(Path(__file__).resolve().parents[1])
# Settings of the server and the clients that the tests set themselves.
_OWN_SETTINGS = (
    "STEPSTREAM_ROCKSDB_MEMORY_MB",
    "STEPSTREAM_API_TOKEN",
    "STEPSTREAM_TLS_CA",
    "STEPSTREAM_TLS_CERT",
    "STEPSTREAM_TLS_KEY",
    "STEPSTREAM_ALLOWED_HOSTS",
    "STEPSTREAM_PUBLIC_URL",
    "STEPSTREAM_INSECURE",
    "STEPSTREAM_CONNECT",
    "STEPSTREAM_CODEC",
    "STEPSTREAM_CODEC_KEYS",
)


def clean_env(root: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _OWN_SETTINGS}
    env["PYTHONPATH"] = os.pathsep.join([str(root), REPO])
    env.update(extra)
    return env


def free_port() -> int:
    """A loopback port nothing listens at (until something takes it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def run_cli(
    root: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stepstream.ops.cli", *args],
        cwd=root,
        env=env if env is not None else clean_env(root),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@dataclass
class DevServer:
    url: str
    root: Path
    log: Path
    proc: subprocess.Popen[bytes]
    env: dict[str, str] = field(default_factory=dict)

    def cli(self, *args: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
        """The CLI against this server (STEPSTREAM_CONNECT set, no token unless given)."""
        return run_cli(
            self.root, *args, env=clean_env(self.root, STEPSTREAM_CONNECT=self.url, **extra_env)
        )

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"stepstream dev ignored SIGTERM\n{self.log.read_text()}")
        assert code == 0, f"stepstream dev exited {code} on SIGTERM\n{self.log.read_text()}"


def start_dev(
    root: Path, module: str, source: str, *args: str, env: dict[str, str] | None = None
) -> DevServer:
    """``stepstream dev --workflows module --port 0 *args``; fails the test with the
    server's log if it does not say where it listens within 20 s."""
    (root / f"{module}.py").write_text(source)
    command = ["dev", "--workflows", module, "--data", str(root / "data"), "--port", "0", *args]
    server, _ = spawn_dev(root, command, env)
    _until_serving(server)
    return server


def spawn_dev(
    root: Path, command: list[str], env: dict[str, str] | None = None
) -> tuple[DevServer, str]:
    """``stepstream`` with ``command`` (a ``dev`` command line, such as one a README
    block shows), run in ``root``: the server and the line it printed once it listened.
    Fails the test with the server's log if it says nothing within 20 s."""
    log = root / "dev.log"
    env = env if env is not None else clean_env(root)
    with open(log, "wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stepstream.ops.cli", *command],
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
    line = first_line(proc, 20)
    found = re.search(r"listening on (https?://\S+)", line)
    if found is None:
        proc.kill()
        proc.wait()
        pytest.fail(f"stepstream dev did not start: {line!r}\n{log.read_text()}")
    return DevServer(found.group(1), root, log, proc, env), line


def _until_serving(server: DevServer) -> None:
    # The line is printed just before the server installs its SIGTERM handler and starts
    # answering; an answer from /healthz means both are done.
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    deadline = time.monotonic() + 20
    while True:
        try:
            with urllib.request.urlopen(f"{server.url}/healthz", timeout=5, context=context):
                return
        except OSError as exc:
            if time.monotonic() > deadline:
                server.proc.kill()
                server.proc.wait()
                pytest.fail(f"stepstream dev does not answer: {exc}\n{server.log.read_text()}")
            time.sleep(0.05)


def self_signed_certificate(root: Path) -> tuple[Path, Path]:
    """A certificate for localhost and 127.0.0.1 and its key (PEM files), by openssl."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.fail("TLS tests need the openssl command to make a self-signed certificate")
    cert, key = root / "cert.pem", root / "key.pem"
    names = "subjectAltName=DNS:localhost,IP:127.0.0.1"
    command = [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2"]
    command += ["-subj", "/CN=localhost", "-addext", names, "-keyout", str(key), "-out", str(cert)]
    subprocess.run(command, check=True, capture_output=True)
    return cert, key
