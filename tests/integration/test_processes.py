"""`stepstream dev --processes 2`: the embedded engine's partitions in two processes, used
the way a user would: the CLI starts it, an http:// client drives it, the processes are
killed with -9."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from stepstream.ops.bench.sessions import engine_children
from stepstream.ops.processes import ProcessLayout
from stepstream.producers.client import Client
from tests.dev_server import REPO, DevServer, clean_env, run_cli, spawn_dev, start_dev

pytestmark = pytest.mark.slow

WORKFLOWS = """
from stepstream import workflow


async def double(n):
    return 2 * n


def say(n):
    print(f"said {n}", flush=True)
    return n


@workflow("shout")
async def shout(ctx, n):
    return await ctx.step("say", say, n)


@workflow("kid")
async def kid(ctx, n):
    await ctx.wait_for_event("go")
    return await ctx.step("double", double, n)


@workflow("parent")
async def parent(ctx, args):
    first = await ctx.child("kid", args["n"], instance_id=args["kid"])
    await ctx.messages.send(args["peer"], "tally", first)
    return first


@workflow("collector")
async def collector(ctx, count):
    got = []
    while len(got) < count:
        got.append((await ctx.messages.next(["tally"])).payload)
    return sorted(got)
"""

LAYOUT = ProcessLayout(processes=2, partitions=4)


def ids_in(process: int, prefix: str, count: int) -> list[str]:
    """Instance ids whose partitions process ``process`` owns."""
    found = []
    i = 0
    while len(found) < count:
        candidate = f"{prefix}-{i}"
        if LAYOUT.process_of(candidate) == process:
            found.append(candidate)
        i += 1
    return found


def engine_child(dev: DevServer) -> int:
    (child,) = engine_children(dev.proc.pid)
    return child


def get_json(url: str, timeout: float = 10) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def until(check: object, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting: {what}")
        time.sleep(0.1)


async def parents_across_processes(
    url: str, parents: list[str], kids: list[str], *, first: int = 0, collect: int = 0
) -> None:
    """Each parent starts a kid (each in the process the test chose) and messages the
    collector, which ``collect`` (if not 0) starts first."""
    async with Client.connect(url) as client:
        if collect:
            await client.start("collector", collect, instance_id="collector")
        for n, (p, k) in enumerate(zip(parents, kids, strict=True), start=first):
            await client.start("parent", {"n": n, "kid": k, "peer": "collector"}, instance_id=p)


async def release_kids(url: str, kids: list[str]) -> None:
    async with Client.connect(url) as client:
        for kid in kids:
            await client.send_event(kid, "go", None)


async def results(url: str, ids: list[str]) -> list[object]:
    async with Client.connect(url) as client:
        return [await client.result(i, timeout=30) for i in ids]


def test_children_messages_reads_and_metrics_span_both_processes(tmp_path: Path) -> None:
    dev = start_dev(tmp_path, "flows", WORKFLOWS, "--processes", "2")
    try:
        parents = ids_in(0, "p", 3) + ids_in(1, "p", 3)
        kids = ids_in(1, "k", 3) + ids_in(0, "k", 3)  # each kid in the other process
        asyncio.run(parents_across_processes(dev.url, parents, kids, collect=6))
        asyncio.run(release_kids(dev.url, kids))
        assert asyncio.run(results(dev.url, parents)) == [0, 2, 4, 6, 8, 10]
        assert asyncio.run(results(dev.url, ["collector"])) == [[0, 2, 4, 6, 8, 10]]
        # Reads and listings cover both processes, through the public API and the CLI.
        listed = dev.cli("list", "--json")
        assert listed.returncode == 0, listed.stderr
        assert {i["instance_id"] for i in json.loads(listed.stdout)} == {
            *parents,
            *kids,
            "collector",
        }
        history = dev.cli("history", kids[0], "--json")
        assert "WorkflowCompleted" in history.stdout
        # Each process's series, labelled with it; together they count what ran.
        with urllib.request.urlopen(dev.url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        started = {
            process: sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("stepstream_workflows_total{")
                and 'outcome="started"' in line
                and f'process="{process}"' in line
            )
            for process in ("0", "1")
        }
        assert started["0"] > 0 and started["1"] > 0
        assert started["0"] + started["1"] == len(parents) + len(kids) + 1
        assert 'stepstream_engine_process_restarts_total{process="1"} 0.0' in text
        # Each process's own collectors and ownership, under its own label: process 1
        # serves partitions 1 and 3, process 0 the others.
        for process in ("0", "1"):
            assert f'process="{process}"' in _line(text, "process_resident_memory_bytes", process)
            assert 'backend="embedded"' in _line(text, "stepstream_build_info", process)
        owned = sorted(
            line.split(" ")[0]
            for line in text.splitlines()
            if line.startswith("stepstream_partition_owned{")
        )
        assert owned == [
            f'stepstream_partition_owned{{partition="{p}",process="{g}"}}'
            for p, g in ((0, 0), (1, 1), (2, 0), (3, 1))
        ]
        # Requests are counted where they arrived (the start probe: process 0); the
        # processes' own traffic (forwarded messages, process 0 scraping 1) is not.
        assert 'route="/healthz"' in _line(text, "stepstream_http_requests_total", "0")
        counted = [line for line in text.splitlines() if line.startswith("stepstream_http_")]
        assert not [line for line in counted if "forward" in line]
        assert not [line for line in counted if 'process="1"' in line and "/metrics" in line]
        assert get_json(dev.url + "/readyz") == (200, {"ready": True})
    finally:
        dev.stop()
    assert engine_children(dev.proc.pid) == []
    # Every log line says which process wrote it.
    lines = dev.log.read_text().splitlines()
    assert any("process=1 " in line and "serving partitions [1, 3]" in line for line in lines)
    assert any("process=0 " in line and "shutting down" in line for line in lines)


def _line(text: str, prefix: str, process: str) -> str:
    """The first sample line of ``prefix`` labelled with ``process``."""
    found = [
        line
        for line in text.splitlines()
        if line.startswith(prefix) and f'process="{process}"' in line
    ]
    assert found, f"no {prefix} series of process {process}"
    return found[0]


def test_a_killed_engine_process_is_started_again_and_loses_nothing(tmp_path: Path) -> None:
    dev = start_dev(tmp_path, "flows", WORKFLOWS, "--processes", "2")
    try:
        parents = ids_in(0, "p", 4)
        kids = ids_in(1, "k", 4)  # waiting in process 1 when it is killed
        asyncio.run(parents_across_processes(dev.url, parents[:2], kids[:2], collect=4))
        until(lambda: get_json(f"{dev.url}/v1/instances/{kids[1]}")[0] == 200, "kids started")
        victim = engine_child(dev)
        os.kill(victim, signal.SIGKILL)
        # While it is down: starts of kids in its partitions wait in process 0's log.
        asyncio.run(parents_across_processes(dev.url, parents[2:], kids[2:], first=2))
        until(
            lambda: engine_children(dev.proc.pid) not in ([], [victim]),
            "the engine process started again",
        )
        until(lambda: get_json(dev.url + "/readyz")[0] == 200, "ready again")
        asyncio.run(release_kids(dev.url, kids))
        assert asyncio.run(results(dev.url, parents)) == [0, 2, 4, 6]
        assert asyncio.run(results(dev.url, ["collector"])) == [[0, 2, 4, 6]]
        assert "engine process 1" in dev.log.read_text()  # the restart is logged
        with urllib.request.urlopen(dev.url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        assert 'stepstream_engine_process_restarts_total{process="1"} 1.0' in text
    finally:
        dev.stop()


def test_after_kill_9_of_the_server_the_others_stop_and_a_restart_resumes(
    tmp_path: Path,
) -> None:
    dev = start_dev(tmp_path, "flows", WORKFLOWS, "--processes", "2")
    parents = ids_in(0, "p", 2) + ids_in(1, "p", 2)
    kids = ids_in(1, "k", 2) + ids_in(0, "k", 2)
    try:
        asyncio.run(parents_across_processes(dev.url, parents, kids, collect=4))
        until(
            lambda: all(get_json(f"{dev.url}/v1/instances/{k}")[0] == 200 for k in kids),
            "kids started",
        )
        child = engine_child(dev)
    finally:
        dev.proc.kill()
        dev.proc.wait()
    until(lambda: not os.path.exists(f"/proc/{child}"), "the orphaned engine process stops", 15)
    again = start_dev(tmp_path, "flows", WORKFLOWS, "--processes", "2")
    try:
        asyncio.run(release_kids(again.url, kids))
        assert asyncio.run(results(again.url, parents)) == [0, 2, 4, 6]
        assert asyncio.run(results(again.url, ["collector"])) == [[0, 2, 4, 6]]
    finally:
        again.stop()


def test_a_data_directory_keeps_its_process_count(tmp_path: Path) -> None:
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
    single = start_dev(tmp_path / "one", "flows", WORKFLOWS)
    single.stop()
    refused = run_cli(
        tmp_path / "one",
        *("dev", "--workflows", "flows", "--data", str(tmp_path / "one" / "data")),
        *("--port", "0", "--processes", "2"),
    )
    assert refused.returncode == 1
    assert "written by one engine process" in refused.stderr
    split = start_dev(tmp_path / "two", "flows", WORKFLOWS, "--processes", "2")
    split.stop()
    data = str(tmp_path / "two" / "data")
    for extra, says in (
        ((), "serve it with `stepstream dev --processes 2`"),
        (("--processes", "3"), "pass --processes 2"),
        (("--processes", "2", "--partitions", "8"), "pass --partitions 4"),
    ):
        run = run_cli(
            tmp_path / "two", "dev", "--workflows", "flows", "--data", data, "--port", "0", *extra
        )
        assert run.returncode == 1, run.stderr
        assert says in run.stderr, run.stderr

    # A process's directory gone (moved away): refused, not made anew and empty.
    os.rename(f"{data}/process-1", f"{data}/moved")
    run = run_cli(
        tmp_path / "two", "dev", "--workflows", "flows", "--data", data, "--port", "0",
        "--processes", "2",
    )  # fmt: skip
    assert run.returncode == 1 and f"is missing {data}/process-1" in run.stderr, run.stderr
    assert "partitions [1, 3]" in run.stderr

    # One that cannot open its data: said once it died a few times, not after minutes.
    (tmp_path / "two" / "data" / "process-1").write_text("not a directory")
    began = time.monotonic()
    run = run_cli(
        tmp_path / "two", "dev", "--workflows", "flows", "--data", data, "--port", "0",
        "--processes", "2", timeout=120,
    )  # fmt: skip
    assert run.returncode == 1, run.stderr
    assert "engine process 1 died 3 times before it was ready" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr
    assert time.monotonic() - began < 60


def test_a_hung_engine_process_is_named_not_waited_for(tmp_path: Path) -> None:
    """Its socket is the server's: a process that hangs (or died) does not refuse calls.
    A listing and /readyz say which process does not answer, in seconds."""
    dev = start_dev(tmp_path, "flows", WORKFLOWS, "--processes", "2")
    try:
        child = engine_child(dev)
        os.kill(child, signal.SIGSTOP)
        try:
            began = time.monotonic()
            status, answer = get_json(f"{dev.url}/readyz", timeout=30)
            assert status == 503 and "engine process 1: not answering" in str(answer), answer
            status, answer = get_json(f"{dev.url}/v1/instances", timeout=40)
            assert status == 503, answer
            assert "engine process 1 did not answer within 20 s" in str(answer), answer
            assert time.monotonic() - began < 40
        finally:
            os.kill(child, signal.SIGCONT)
        until(lambda: get_json(f"{dev.url}/v1/instances")[0] == 200, "listing again")
    finally:
        dev.stop()


def test_a_server_with_a_stopped_engine_process_stops_at_once(tmp_path: Path) -> None:
    """SIGTERM reaches a child stopped with SIGSTOP too: the server does not wait out
    the minute it gives a child to finish its steps."""
    dev = start_dev(tmp_path, "flows", WORKFLOWS, "--processes", "2", "--hang-timeout", "0")
    child = engine_child(dev)
    os.kill(child, signal.SIGSTOP)
    dev.stop()  # fails the test unless it exits 0 within 15 s
    assert not os.path.exists(f"/proc/{child}")
    assert "did not stop in" not in dev.log.read_text()


def test_a_hung_engine_process_is_killed_and_a_wait_on_it_goes_on(tmp_path: Path) -> None:
    """`--hang-timeout`: a process that stops answering its health probe is killed and
    started again, as a liveness probe would; a client's wait on one of its instances,
    cut off by the kill, is asked again and gets the result."""
    dev = start_dev(tmp_path, "flows", WORKFLOWS, "--processes", "2", "--hang-timeout", "3")
    refused = run_cli(tmp_path, "dev", "--workflows", "flows", "--hang-timeout", "5")
    assert refused.returncode == 2, refused.stderr
    assert "--hang-timeout watches the engine processes of --processes 2" in refused.stderr
    refused = run_cli(
        tmp_path, "dev", "--workflows", "flows", "--processes", "2", "--hang-timeout", "0.2"
    )
    assert refused.returncode == 2, refused.stderr
    assert "--hang-timeout must be 0 (never) or 1 second or more" in refused.stderr
    (kid,) = ids_in(1, "k", 1)

    async def scenario() -> object:
        async with Client.connect(dev.url) as client:
            await client.start("kid", 21, instance_id=kid)
            waiting = asyncio.ensure_future(client.result(kid, timeout=120))
            await asyncio.sleep(0.5)  # the wait is on process 1's own session now
            hung = engine_child(dev)
            os.kill(hung, signal.SIGSTOP)
            began = time.monotonic()
            while engine_children(dev.proc.pid) in ([], [hung]):
                assert time.monotonic() - began < 60, "the hung process was not replaced"
                await asyncio.sleep(0.2)
            assert not waiting.done()
            await client.send_event(kid, "go", None)
            return await waiting

    try:
        assert asyncio.run(scenario()) == 42
        assert "has not answered its health probe for" in dev.log.read_text()
        with urllib.request.urlopen(dev.url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        assert 'stepstream_engine_process_hangs_total{process="1"} 1.0' in text
        assert 'stepstream_engine_process_restarts_total{process="1"} 1.0' in text
    finally:
        dev.stop()


def test_the_documented_example_runs_as_written(tmp_path: Path) -> None:
    """docs/running.md, "Using more cores": its two commands, as written."""
    page = (Path(REPO) / "docs" / "running.md").read_text()
    block = page.split("## Using more cores", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    serve, start = (shlex.split(line) for line in block.strip().splitlines())
    assert serve[:2] == ["stepstream", "dev"] and "--processes" in serve
    dev, line = spawn_dev(tmp_path, [*serve[1:], "--data", str(tmp_path / "d"), "--port", "0"])
    try:
        assert "in 2 processes" in line, line
        done = dev.cli(*start[1:])
        assert done.returncode == 0, done.stdout + done.stderr
        assert "status:      completed" in done.stdout, done.stdout
        result = done.stdout.split("result:", 1)[1].strip()
        assert json.loads(result)["resized"] == [f"{p}-small.jpg" for p in "abcde"]
        kids = json.loads(dev.cli("list", "--json").stdout)
        assert len(kids) > 3  # the batch was split into children
        owners = {LAYOUT.process_of(k["instance_id"]) for k in kids}
        assert owners == {0, 1}, "the instances ran in both processes"
    finally:
        dev.stop()


def test_the_http_client_sends_an_instances_calls_to_its_owner(tmp_path: Path) -> None:
    """Told where each process serves its own partitions (GET /v1/processes), the client
    talks to the owner itself: with the server frozen, an instance of the other process
    still takes an event, runs, and answers."""
    dev = start_dev(tmp_path, "flows", WORKFLOWS, "--processes", "2")
    (kid,) = ids_in(1, "k", 1)

    async def while_the_server_is_frozen() -> tuple[object, str]:
        async with Client.connect(dev.url) as client:
            await client.start("kid", 3, instance_id=kid)
            os.kill(dev.proc.pid, signal.SIGSTOP)
            try:
                await client.send_event(kid, "go", None)
                return await client.result(kid, timeout=20), (await client.status(kid)).status
            finally:
                os.kill(dev.proc.pid, signal.SIGCONT)

    try:
        status, answer = get_json(dev.url + "/v1/processes")
        assert status == 200 and answer["partitions"] == 4, answer
        assert [p["process"] for p in answer["processes"]] == [0, 1]  # type: ignore[union-attr]
        assert asyncio.run(while_the_server_is_frozen()) == (6, "completed")
    finally:
        dev.stop()


def test_a_wrong_data_directory_or_partition_count_is_said_plainly(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    (tmp_path / "flows.py").write_text(WORKFLOWS)
    for args, code, says in (
        (("--partitions", "0"), 2, "--partitions must be 1 or more, got 0"),
        (("--data", str(tmp_path / "afile")), 1, "is a file, not a data directory"),
    ):
        run = run_cli(tmp_path, "dev", "--workflows", "flows", "--port", "0", *args)
        assert run.returncode == code, run.stderr
        assert says in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_what_workflow_code_prints_in_any_process_reaches_the_server_s_output(
    tmp_path: Path,
) -> None:
    (tmp_path / "flows.py").write_text(WORKFLOWS)
    out = tmp_path / "stdout.txt"
    command = ["dev", "--workflows", "flows", "--data", str(tmp_path / "data"), "--port", "0"]
    with open(out, "wb") as stdout, open(tmp_path / "dev.log", "wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stepstream.ops.cli", *command, "--processes", "2"],
            cwd=tmp_path,
            env=clean_env(tmp_path),
            stdout=stdout,
            stderr=stderr,
        )
    try:
        until(lambda: "listening on" in out.read_text(), "the server listening")
        url = re.search(r"listening on (\S+)", out.read_text()).group(1)  # type: ignore[union-attr]
        until(lambda: get_json(f"{url}/readyz")[0] == 200, "ready")
        far, near = ids_in(1, "s", 1)[0], ids_in(0, "s", 1)[0]

        async def run() -> list[object]:
            async with Client.connect(url) as client:
                for n, instance in enumerate((far, near)):
                    await client.start("shout", n, instance_id=instance)
                return [await client.result(i, timeout=30) for i in (far, near)]

        assert asyncio.run(run()) == [0, 1]
        until(lambda: "said 0" in out.read_text() and "said 1" in out.read_text(), "printed")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
