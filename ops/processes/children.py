"""Processes 1..N-1, the children of ``stepstream dev``: what each is told (``Spec``),
starting them and starting one again when it dies or hangs, waiting until they are
ready, and the loopback sockets their internal APIs listen on."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from stepstream.engine.errors import StepstreamError
from stepstream.ops.processes.observability import PROBE_TIMEOUT_S, not_ready
from stepstream.producers.http.security import client_headers

log = logging.getLogger("stepstream.processes")

SPEC_ENV = "STEPSTREAM_PROCESS_SPEC"  # set for a child: which process it is, and its peers
PARENT_POLL_S = 0.5  # how often a child looks whether its parent is still there
READY_TIMEOUT_S = 120.0  # the longest the parent waits for a child to restore and serve
# A child that dies is started again after RESTART_DELAY_S, twice as long after each death
# in a row (up to MAX_RESTART_DELAY_S); one that ran RAN_WELL_S first starts the count over.
RESTART_DELAY_S = 1.0
MAX_RESTART_DELAY_S = 30.0
RAN_WELL_S = 60.0
# At start, a child that dies this many times before it is ready will not be: say why.
DEATHS_BEFORE_READY = 3
READY_PROBE_S = 1.0  # how long one probe of a child not ready yet waits for an answer
STOP_TIMEOUT_S = 60.0
# A child that has not answered its health probe (``/healthz``) for ``hang_timeout``
# seconds (``--hang-timeout``) is killed and started again, as a liveness probe would
# have it; before its first answer it has READY_TIMEOUT_S to open its data. A probe goes
# out every third of the timeout, at most every HEALTH_PERIOD_S.
HANG_TIMEOUT_S = 60.0
HEALTH_PERIOD_S = 10.0


@dataclass
class Spec:
    """What a child is told: which process it is and how to reach the others."""

    process: int
    processes: int
    partitions: int
    urls: list[str]  # every process's internal API URL, by process
    token: str
    fd: int  # the listening socket the parent opened for this child's internal API
    public_fd: int  # and the one for its own partitions' public API

    def to_env(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_env(cls, text: str) -> Spec:
        return cls(**json.loads(text))


class Children:
    """Processes 1..N-1: started, started again when one dies, stopped at the end."""

    def __init__(self, specs: Sequence[Spec], hang_timeout: float = HANG_TIMEOUT_S) -> None:
        self._specs = specs
        self._hang_timeout = hang_timeout  # 0: a child that hangs is left to hang
        self._procs: dict[int, asyncio.subprocess.Process] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self.restarts: dict[int, int] = {}  # process -> times started again
        self.hangs: dict[int, int] = {}  # process -> times killed for not answering
        self.exits: dict[int, int] = {}  # process -> the status it last exited with

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._keep(spec)) for spec in self._specs]

    async def _keep(self, spec: Spec) -> None:
        loop = asyncio.get_running_loop()
        delay = RESTART_DELAY_S
        while not self._stopping:
            began = loop.time()
            env = {**os.environ, SPEC_ENV: spec.to_env()}
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "stepstream.ops.cli",
                *sys.argv[1:],
                env=env,
                pass_fds=(spec.fd, spec.public_fd),
                stdin=subprocess.DEVNULL,
                # The server's own: what workflow code prints, and spans a console
                # exporter writes (a child prints nothing else there).
                stdout=None,
                # Out of the terminal's process group: Ctrl-C stops the server, which
                # stops its children, rather than racing it to them (and a restart).
                start_new_session=True,
            )
            self._procs[spec.process] = proc
            watch = loop.create_task(self._watch(spec, proc)) if self._hang_timeout else None
            try:
                code = await proc.wait()
            finally:
                if watch is not None:
                    watch.cancel()
                    (failed,) = await asyncio.gather(watch, return_exceptions=True)
                    if isinstance(failed, Exception):  # the watch broke, not the child
                        log.error("watching engine process %d failed: %r", spec.process, failed)
            if self._stopping:
                return
            self.restarts[spec.process] = self.restarts.get(spec.process, 0) + 1
            self.exits[spec.process] = code
            if loop.time() - began >= RAN_WELL_S:
                delay = RESTART_DELAY_S
            log.error(
                "an engine process exited; starting it again (its partitions wait until it "
                "is back, nothing is lost)",
                extra={
                    "engine_process": spec.process,
                    "pid": proc.pid,
                    "exit_status": code,
                    "restart_in_s": delay,
                },
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, MAX_RESTART_DELAY_S)

    async def _watch(self, spec: Spec, proc: asyncio.subprocess.Process) -> None:
        """Kills ``proc`` once it has not answered its health probe for the hang
        timeout (READY_TIMEOUT_S before its first answer); ``_keep`` starts it again."""
        loop = asyncio.get_running_loop()
        period = min(HEALTH_PERIOD_S, self._hang_timeout / 3)
        url = spec.urls[spec.process] + "/healthz"
        answered, limit = loop.time(), max(self._hang_timeout, READY_TIMEOUT_S)
        async with aiohttp.ClientSession(headers=client_headers(spec.token)) as http:
            while proc.returncode is None and not self._stopping:
                await asyncio.sleep(period)
                try:
                    async with asyncio.timeout(min(period, PROBE_TIMEOUT_S)):
                        async with http.get(url) as response:
                            if response.status == 200:
                                answered, limit = loop.time(), self._hang_timeout
                                continue
                except (aiohttp.ClientError, TimeoutError):
                    pass
                silent = loop.time() - answered
                if silent < limit or proc.returncode is not None or self._stopping:
                    continue
                self.hangs[spec.process] = self.hangs.get(spec.process, 0) + 1
                log.error(
                    "an engine process has not answered its health probe for %.0f s; killing "
                    "it to start it again (--hang-timeout)",
                    silent,
                    extra={"engine_process": spec.process, "pid": proc.pid},
                )
                with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                    proc.kill()
                return

    async def stop(self) -> None:
        self._stopping = True
        for proc in self._procs.values():
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                    proc.terminate()
                    # One stopped (SIGSTOP) would not act on it until continued.
                    proc.send_signal(signal.SIGCONT)
        for process, proc in self._procs.items():
            try:
                await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
            except TimeoutError:
                log.warning(
                    "engine process %d did not stop in %.0f s; killing it", process, STOP_TIMEOUT_S
                )
                proc.kill()
                await proc.wait()
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def wait_ready(urls: Sequence[str], token: str, children: Children) -> None:
    """Until every child's ``/readyz`` says ready; says which one did not, and why."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + READY_TIMEOUT_S
    async with aiohttp.ClientSession(headers=client_headers(token)) as http:
        for process, url in enumerate(urls[1:], start=1):
            reason = "not started"
            while (left := deadline - loop.time()) > 0:
                deaths = children.restarts.get(process, 0)
                if deaths >= DEATHS_BEFORE_READY:
                    raise StepstreamError(
                        f"engine process {process} died {deaths} times before it was ready "
                        f"(last exit status {children.exits.get(process)}); its log lines "
                        "above say why"
                    )
                # Short probes: a child that keeps dying is seen at its third death.
                reason = await not_ready(http, url, min(left, READY_PROBE_S))
                if not reason:
                    break
                await asyncio.sleep(0.1)
            else:
                exited = children.exits.get(process)
                said = "" if exited is None else f", and it exited with status {exited}"
                raise StepstreamError(
                    f"engine process {process} was not ready in {READY_TIMEOUT_S:.0f} s "
                    f"({reason}{said}); its log lines above say why"
                )


def loopback_sockets(count: int) -> list[socket.socket]:
    """Listening loopback sockets, one for each process's internal API."""
    from stepstream.ops.api.serving import listen

    return [listen("127.0.0.1", 0) for _ in range(count)]


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{host}:{port}"


async def parent_gone(parent: int) -> None:
    """Returns once the process that started this one is gone (killed with -9, say)."""
    while os.getppid() == parent:
        await asyncio.sleep(PARENT_POLL_S)
