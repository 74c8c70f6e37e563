"""Starting a `stepstream dev` or `stepstream worker` subprocess for a fault test: its
stderr appended to a log file, and its address read from the line it prints when it
listens. Fails the test with the log's tail when it does not say it listens in time."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import pytest

REPO = Path(__file__).resolve().parents[1]


def worker_command(
    workflows: str, bootstrap: str, prefix: str, state_dir: Path, options: Sequence[str]
) -> list[str]:
    """`stepstream worker` on any free port, with each librdkafka option given."""
    args = [sys.executable, "-m", "stepstream.ops.cli", "worker", "--workflows", workflows]
    args += ["--bootstrap", bootstrap, "--prefix", prefix, "--state-dir", str(state_dir)]
    args += ["--port", "0"]
    for option in options:
        args += ["--kafka-opt", option]
    return args


def first_line(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """The first line ``proc`` writes to its stdout (a pipe), or "" if none comes within
    ``timeout`` seconds. A thread reads on and drops what follows, and closes the pipe
    once the process has closed its end (it exited): left open, the pipe would be closed
    by the garbage collector with a ResourceWarning, and a process writing more to a full
    pipe would block."""
    stdout = proc.stdout
    assert stdout is not None, "start the process with stdout=subprocess.PIPE"
    ready, _, _ = select.select([stdout], [], [], timeout)
    line = stdout.readline().decode() if ready else ""
    threading.Thread(target=_drain, args=(stdout,), daemon=True).start()
    return line


def _drain(stdout: IO[bytes]) -> None:
    with stdout:
        while stdout.read(1 << 16):
            pass


def repo_env(**extra: str) -> dict[str, str]:
    """This environment, with the repository importable."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def launch(
    command: Sequence[str],
    *,
    env: dict[str, str],
    log: Path,
    what: str = "worker",
    header: str = "",
    timeout: float = 30,
) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``command``; returns the process and the URL it says it listens on."""
    with open(log, "ab") as out:
        if header:
            out.write(header.encode())
            out.flush()
        proc = subprocess.Popen(
            list(command),
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=out,
            stdin=subprocess.DEVNULL,
        )
    line = first_line(proc, timeout)
    found = re.search(r"listening on (https?://\S+)", line)
    if found is None:
        proc.kill()
        proc.wait()
        pytest.fail(f"{what} did not start: {line!r}\n{log.read_text()[-3000:]}")
    return proc, found.group(1)
