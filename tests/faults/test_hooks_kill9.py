"""Hooks across kill -9: a hook call owed when its process dies is made again after the
restart (at least once), and an attempt lost with the process is reported to on_error.

A `stepstream dev` (embedded) and a `stepstream worker` (Kafka, restarted on the same
state directory) run ``tests.hook_workflows``, whose hooks note their calls in a file;
they are killed by pid with SIGKILL while a slow hook (or a long step) runs.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from stepstream import ConnectionFailed, UnknownWorkflow
from stepstream.consumers.kafka import create_topics
from stepstream.engine.config.kafka import KafkaSettings
from stepstream.producers.client import Client
from tests.conftest import KAFKA_TEST_OPTIONS, KAFKA_TEST_PARTITIONS, kafka_settings, kafka_url
from tests.dev_server import DevServer, clean_env, start_dev
from tests.hook_workflows import read_notes
from tests.kafka_broker import Broker
from tests.processes import first_line

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
MODULE = "ss_hook_flows"
SOURCE = "from tests.hook_workflows import hooked_lost, hooked_slow  # noqa: F401\n"
Notes = list[dict[str, Any]]


async def _until_notes(
    root: Path, check: Callable[[Notes], bool], what: str, log: Path, timeout: float = 30
) -> Notes:
    deadline = time.monotonic() + timeout
    while True:
        notes = read_notes(root)
        if check(notes):
            return notes
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}; notes:\n{notes}\n{log.read_text()[-4000:]}")
        await asyncio.sleep(0.05)


def _count(notes: Notes, instance_id: str, hook: str, **fields: Any) -> int:
    return sum(
        1
        for n in notes
        if n["instance_id"] == instance_id
        and n["hook"] == hook
        and all(n.get(k) == v for k, v in fields.items())
    )


def _dev(root: Path, notes: Path, **env: str) -> DevServer:
    extra = {"STEPSTREAM_TEST_HOOKS": str(notes), **env}
    return start_dev(root, MODULE, SOURCE, "--partitions", "2", env=clean_env(root, **extra))


def _kill9(proc: subprocess.Popen[bytes]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)


async def test_a_hook_killed_mid_call_runs_again_after_the_restart(tmp_path: Path) -> None:
    notes = tmp_path / "notes"
    notes.mkdir()
    dev = _dev(tmp_path, notes, STEPSTREAM_TEST_HOOK_SLEEP="60")
    try:
        async with Client.connect(dev.url) as client:
            instance = await client.start("hooked-slow", 10, instance_id="slow-1")
            assert await client.result(instance, timeout=20) == 11
        await _until_notes(
            notes, lambda n: _count(n, "slow-1", "slow-begin") == 1, "the slow hook", dev.log
        )
    finally:
        _kill9(dev.proc)  # while the hook sleeps: the call is owed, and durable

    dev = _dev(tmp_path, notes, STEPSTREAM_TEST_HOOK_SLEEP="0")
    try:
        got = await _until_notes(
            notes, lambda n: _count(n, "slow-1", "slow-end") == 1, "the call again", dev.log
        )
        assert _count(got, "slow-1", "slow-begin") == 2, got
        assert _count(got, "slow-1", "slow-end", new_status="completed") == 1, got
        await asyncio.sleep(0.5)
    finally:
        dev.stop()
    # Made and deleted: a third start owes nothing.
    dev = _dev(tmp_path, notes, STEPSTREAM_TEST_HOOK_SLEEP="0")
    try:
        await asyncio.sleep(1.0)
        assert _count(read_notes(notes), "slow-1", "slow-begin") == 2
        async with Client.connect(dev.url) as client:
            assert (await client.status("slow-1")).status == "completed"
    finally:
        dev.stop()


async def test_an_attempt_lost_with_its_process_is_reported_to_on_error(tmp_path: Path) -> None:
    notes = tmp_path / "notes"
    notes.mkdir()
    dev = _dev(tmp_path, notes, STEPSTREAM_TEST_STEP_SLEEP="60")
    try:
        async with Client.connect(dev.url) as client:
            await client.start("hooked-lost", None, instance_id="lost-1")
        await _until_notes(
            notes, lambda n: _count(n, "lost-1", "mark", name="long-1") == 1, "attempt 1", dev.log
        )
    finally:
        _kill9(dev.proc)

    dev = _dev(tmp_path, notes, STEPSTREAM_TEST_STEP_SLEEP="0")
    try:
        async with Client.connect(dev.url) as client:
            assert await client.result("lost-1", timeout=20) == 2
        got = await _until_notes(
            notes,
            lambda n: _count(n, "lost-1", "status", new_status="completed") == 1,
            "completion",
            dev.log,
        )
        errors = [n for n in got if n["instance_id"] == "lost-1" and n["hook"] == "error"]
        assert [(e["step"], e["attempt"], e["error_type"], e["will_retry"]) for e in errors] == [
            ("long", 1, "AttemptLost", True)
        ], got
        assert errors[0]["retry_at"] is not None
        statuses = [
            (n["old_status"], n["new_status"])
            for n in got
            if n["instance_id"] == "lost-1" and n["hook"] == "status"
        ]
        # At least once: the kill may land after the start's status hook was called and
        # before its call was recorded as made (the step's body starts at the same
        # commit), and the restart calls it again. Each change comes, in order.
        assert list(dict.fromkeys(statuses)) == [
            (None, "pending"),
            ("pending", "running"),
            ("running", "completed"),
        ], statuses
        assert all(statuses.count(s) <= 2 for s in statuses), statuses
    finally:
        dev.stop()


# ---- Kafka: a worker killed and started again on the same state directory ----------------


class _Worker:
    def __init__(self, settings: KafkaSettings, state_dir: Path, log: Path) -> None:
        self.settings = settings
        self.state_dir = state_dir
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, **env: str) -> None:
        args = [
            sys.executable,
            "-m",
            "stepstream.ops.cli",
            "worker",
            "--workflows",
            "tests.hook_workflows",
        ]
        args += ["--bootstrap", self.settings.bootstrap, "--prefix", self.settings.prefix]
        args += ["--state-dir", str(self.state_dir), "--port", "0"]
        for option in KAFKA_TEST_OPTIONS:
            args += ["--kafka-opt", option]
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                args,
                cwd=REPO,
                env={**os.environ, "PYTHONPATH": path, **env},
                stdout=subprocess.PIPE,
                stderr=log,
                stdin=subprocess.DEVNULL,
            )
        line = first_line(self.proc, 30)
        if re.search(r"listening on (http://\S+)", line) is None:
            self.kill()
            pytest.fail(f"worker did not start: {line!r}\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            _kill9(self.proc)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


async def _start_when_owned(client: Client, workflow: str, arg: Any, instance_id: str) -> str:
    """Start once the worker announced its partitions (it listens before it owns them)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return await client.start(workflow, arg, instance_id=instance_id)
        except UnknownWorkflow:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


@pytest.mark.kafka
async def test_kafka_a_hook_killed_mid_call_runs_again_on_the_same_state_dir(
    kafka_broker: Broker, tmp_path: Path
) -> None:
    settings = kafka_settings(kafka_broker)
    await asyncio.to_thread(create_topics, settings, KAFKA_TEST_PARTITIONS)
    notes = tmp_path / "notes"
    notes.mkdir()
    log = tmp_path / "worker.log"
    worker = _Worker(settings, tmp_path / "state", log)
    env = {"STEPSTREAM_TEST_HOOKS": str(notes)}
    worker.start(**env, STEPSTREAM_TEST_HOOK_SLEEP="60")
    try:
        async with Client.connect(kafka_url(settings)) as client:
            instance = await _start_when_owned(client, "hooked-slow", 1, "kslow-1")
            assert await client.result(instance, timeout=60) == 2
            await _until_notes(
                notes, lambda n: _count(n, "kslow-1", "slow-begin") == 1, "the slow hook", log
            )
            worker.kill()
            worker.start(**env, STEPSTREAM_TEST_HOOK_SLEEP="0")
            got = await _until_notes(
                notes, lambda n: _count(n, "kslow-1", "slow-end") == 1, "the call again", log, 60
            )
            assert _count(got, "kslow-1", "slow-begin") == 2, got
            # Until the restarted worker announces its new address, a read names the
            # killed one at once; ask again.
            async with asyncio.timeout(60):
                while True:
                    try:
                        status = await client.status(instance)
                        break
                    except ConnectionFailed:
                        await asyncio.sleep(0.1)
            assert status.status == "completed"
    finally:
        worker.stop()
        worker.kill()
