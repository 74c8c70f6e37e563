"""``stepstream bench --profile DIR``: py-spy sampling of the bench's processes while a
workload runs, one collapsed-stack file per process (``<workload>-<client>-<role>.txt``,
role ``client``, ``engine`` or ``worker<i>``), readable by speedscope or flamegraph.pl.

py-spy is not a dependency of stepstream (``pip install py-spy``); it samples another
process from outside, so the figures of a profiled run are slower and not to be quoted.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator

from stepstream.ops.bench.sessions import process_roles


def check_profiler() -> str:
    found = shutil.which("py-spy")
    if found is None:
        raise SystemExit("bench: --profile needs py-spy on PATH (pip install py-spy)")
    return found


@contextlib.contextmanager
def profiled(directory: str | None, label: str, engine_pids: list[int]) -> Iterator[None]:
    """Sample the bench process and the engine processes (once each) until the block ends."""
    if directory is None:
        yield
        return
    py_spy = check_profiler()
    os.makedirs(directory, exist_ok=True)
    roles = process_roles(engine_pids, [])
    samplers = []
    for role, pid in roles.items():
        out = os.path.join(directory, f"{label}-{role}.txt")
        command = [py_spy, "record", "--pid", str(pid), "--format", "raw", "--output", out]
        # --nonblocking: sampling never pauses the process measured.
        command += ["--rate", "100", "--nonblocking", "--threads"]
        samplers.append(
            subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )
    try:
        yield
    finally:
        for sampler in samplers:
            sampler.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        for sampler in samplers:
            try:
                sampler.wait(60)
            except subprocess.TimeoutExpired:
                sampler.kill()
