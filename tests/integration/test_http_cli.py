"""The HTTP API and the CLI against a real `stepstream dev` process.

One `dev` subprocess serves a small workflows module written to a temp directory; the
tests drive it through the `stepstream` CLI (more subprocesses) and through
`Client.connect("http://...")`, and check both the answers and the errors users get.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from stepstream import (
    Client,
    ConnectionFailed,
    InstanceFinished,
    InvalidPayload,
    PayloadTooLarge,
    ResultTimeout,
    UnknownInstance,
    UnknownWorkflow,
    WorkflowCancelled,
    WorkflowFailed,
)
from tests.dev_server import clean_env, free_port, spawn_dev
from tests.processes import first_line

REPO = str(Path(__file__).resolve().parents[2])
MODULE = "ss_http_cli_flows"
WORKFLOWS = """
from stepstream import Context, NonRetryableError, workflow


def hello(name):
    return f"hello {name}"


def decline():
    raise NonRetryableError("card declined")


@workflow("greet")
async def greet(ctx: Context, args):
    return {"greeting": await ctx.step("hello", hello, args["name"])}


@workflow("gate")
async def gate(ctx: Context, args):
    before = await ctx.step("before", hello, "gate")
    event = await ctx.wait_for_event("go")
    return {"before": before, "event": event}


@workflow("echo")
async def echo(ctx: Context, args):
    return args


@workflow("declined")
async def declined(ctx: Context, args):
    await ctx.step("charge", decline)
"""
MiB = 1024 * 1024


@dataclass(frozen=True)
class Dev:
    url: str
    root: Path
    log: Path

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(self.root), REPO]),
            "STEPSTREAM_CONNECT": self.url,
        }


def _start_dev(root: Path) -> tuple[subprocess.Popen[bytes], Dev]:
    (root / f"{MODULE}.py").write_text(WORKFLOWS)
    log = root / "dev.log"
    dev = Dev("", root, log)
    args = ["dev", "--workflows", MODULE, "--data", str(root / "data"), "--port", "0"]
    with open(log, "wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stepstream.ops.cli", *args],
            cwd=root,
            env=dev.env(),
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
    line = first_line(proc, 20)
    found = re.search(r"listening on (http://\S+)", line)
    if found is None:
        proc.kill()
        proc.wait()
        pytest.fail(f"stepstream dev did not start: {line!r}\n{log.read_text()}")
    return proc, Dev(found.group(1), root, log)


def _stop_dev(proc: subprocess.Popen[bytes], dev: Dev) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"stepstream dev ignored SIGTERM\n{dev.log.read_text()}")
    assert code == 0, f"stepstream dev exited {code} on SIGTERM\n{dev.log.read_text()}"


@pytest.fixture(scope="module")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dev]:
    proc, server = _start_dev(tmp_path_factory.mktemp("http-cli"))
    yield server
    _stop_dev(proc, server)


@pytest.fixture
def fresh_dev(tmp_path: Path) -> Iterator[Dev]:
    """A server of its own, for tests that need to see an empty engine."""
    proc, server = _start_dev(tmp_path)
    yield server
    _stop_dev(proc, server)


def cli(dev: Dev, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stepstream.ops.cli", *args],
        cwd=dev.root,
        env=dev.env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def ok(dev: Dev, *args: str) -> str:
    done = cli(dev, *args)
    assert done.returncode == 0, f"stepstream {' '.join(args)}: {done.stderr}\n{done.stdout}"
    return done.stdout


def refused(dev: Dev, *args: str, code: int = 1) -> str:
    done = cli(dev, *args)
    assert done.returncode == code, f"{done.returncode}: {done.stdout}{done.stderr}"
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("error: "), done.stderr
    return done.stderr


def cli_json(dev: Dev, *args: str) -> Any:
    return json.loads(ok(dev, *args, "--json"))


async def waiting_for(client: Client, instance_id: str, event: str) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        status = await client.status(instance_id)
        if any(w.event == event for w in status.waits):
            return
        await asyncio.sleep(0.02)
    history = [h.to_json() for h in await client.history(instance_id)]
    pytest.fail(f"{instance_id} never waited for {event!r}: {status}\n{history}")


# ---- the happy paths ------------------------------------------------------------------


def test_start_wait_prints_the_result(dev: Dev) -> None:
    out = ok(dev, "start", "greet", "--input", '{"name": "ada"}', "--id", "g-1", "--wait")
    assert "completed" in out and "hello ada" in out

    answer = cli_json(dev, "start", "greet", "--input", '{"name": "bob"}', "--id", "g-2", "--wait")
    assert answer == {
        "instance_id": "g-2",
        "status": "completed",
        "result": {"greeting": "hello bob"},
    }

    assert ok(dev, "start", "greet", "--input", '{"name": "cy"}', "--id", "g-3").strip() == "g-3"


def test_status_history_and_list(dev: Dev) -> None:
    ok(dev, "start", "greet", "--input", '{"name": "ada"}', "--id", "read-1", "--wait")

    status = cli_json(dev, "status", "read-1")
    assert status["instance_id"] == "read-1"
    assert status["status"] == "completed"
    assert (status["workflow"], status["version"]) == ("greet", "1")
    assert status["created_at"] <= status["updated_at"]
    assert status["waits"] == []

    history = cli_json(dev, "history", "read-1")
    types = [h["type"] for h in history]
    assert types[0] == "WorkflowStarted" and types[-1] == "WorkflowCompleted", types
    assert "StepSucceeded" in types
    assert [h["seq"] for h in history] == sorted(h["seq"] for h in history)

    listed = {i["instance_id"]: i for i in cli_json(dev, "list")}
    assert listed["read-1"]["status"] == "completed"
    completed = [i["instance_id"] for i in cli_json(dev, "list", "--status", "completed")]
    assert "read-1" in completed
    running = [i["instance_id"] for i in cli_json(dev, "list", "--status", "running")]
    assert "read-1" not in running

    human = ok(dev, "status", "read-1", "--connect", dev.url)
    assert re.search(r"^status:\s+completed$", human, re.M), human
    assert re.search(r"^waits:\s+none$", human, re.M), human
    timeline = ok(dev, "history", "read-1")
    assert re.search(r"step\s+hello\s+ok", timeline), timeline
    assert "completed" in timeline
    table = ok(dev, "list")
    assert table.splitlines()[0].split()[:4] == ["INSTANCE", "WORKFLOW", "VERSION", "STATUS"]
    assert "read-1" in table


async def test_client_over_http(dev: Dev) -> None:
    async with Client.connect(dev.url) as client:
        odd = "odd id/with slash"
        assert await client.start("greet", {"name": "zoe"}, instance_id=odd) == odd
        assert await client.result(odd, timeout=10) == {"greeting": "hello zoe"}
        assert (await client.status(odd)).status == "completed"
        assert [h.type for h in await client.history(odd)][-1] == "WorkflowCompleted"
        assert odd in [s.instance_id for s in await client.list(status="completed")]


async def test_send_event_to_a_waiting_workflow(dev: Dev) -> None:
    ok(dev, "start", "gate", "--id", "ev-1")
    async with Client.connect(dev.url) as client:
        await waiting_for(client, "ev-1", "go")
        human = ok(dev, "status", "ev-1")
        assert re.search(r"^waits:\s+wait .*event go", human, re.M), human

        assert "sent go to ev-1" in ok(dev, "send", "ev-1", "go", "--payload", '{"by": "ada"}')
        result = await client.result("ev-1", timeout=10)
    assert result == {"before": "hello gate", "event": {"by": "ada"}}


async def test_pause_resume_cancel(dev: Dev) -> None:
    async with Client.connect(dev.url) as client:
        await client.start("gate", None, instance_id="ctl-1")
        await waiting_for(client, "ctl-1", "go")

        ok(dev, "pause", "ctl-1")
        assert (await client.status("ctl-1")).status == "paused"
        ok(dev, "resume", "ctl-1")
        assert (await client.status("ctl-1")).status == "running"
        ok(dev, "cancel", "ctl-1", "--reason", "no longer needed")

        with pytest.raises(WorkflowCancelled) as cancelled:
            await client.result("ctl-1", timeout=10)
        assert cancelled.value.reason == "no longer needed"
        assert cancelled.value.instance_id == "ctl-1"
        status = await client.status("ctl-1")
        assert status.status == "cancelled"
        assert "no longer needed" in (status.error or "")
    # What it was waiting for ended with it: nothing shows as waiting any more.
    timeline = ok(dev, "history", "ctl-1")
    assert re.search(r"wait\s+\S+\s+abandoned\s.*the workflow was cancelled", timeline), timeline
    assert "waiting" not in timeline, timeline


# ---- what users get wrong -------------------------------------------------------------


def test_bad_json_flag_is_rejected_and_nothing_is_started(fresh_dev: Dev) -> None:
    err = refused(fresh_dev, "start", "greet", "--input", "{bad", "--id", "bad-1", code=2)
    assert "--input" in err and "JSON" in err
    assert len(err.strip().splitlines()) == 1, err
    assert cli_json(fresh_dev, "list") == []
    assert "no instance 'bad-1'" in refused(fresh_dev, "status", "bad-1")

    err = refused(fresh_dev, "send", "bad-1", "go", "--payload", "[1,", code=2)
    assert "--payload" in err and "JSON" in err


def test_unusable_flags_and_settings_are_refused_and_nothing_is_started(fresh_dev: Dev) -> None:
    err = refused(fresh_dev, "start", "greet", "--id", "", code=2)
    assert "--id is empty" in err
    assert "only applies with --wait" in refused(
        fresh_dev, "start", "greet", "--id", "t-1", "--timeout", "5", code=2
    )
    for bad in ("-1", "nan", "inf"):
        assert "positive" in refused(
            fresh_dev, "start", "greet", "--id", "t-1", "--wait", "--timeout", bad, code=2
        )
    assert cli_json(fresh_dev, "list") == []
    # A misspelt flag: refused with the usage of the command it was given to.
    done = cli(fresh_dev, "start", "greet", "--id", "t-1", "--wiat")
    assert done.returncode == 2 and done.stderr.startswith("usage: stepstream start "), done
    assert "stepstream start: error: unrecognized arguments: --wiat" in done.stderr
    done = cli(fresh_dev, "topics", "create", "--partitions", "1", "--prefx", "p")
    assert done.returncode == 2, done
    assert "stepstream topics create: error: unrecognized arguments: --prefx p" in done.stderr
    assert cli_json(fresh_dev, "list") == []
    done = subprocess.run(
        [sys.executable, "-m", "stepstream.ops.cli", "run", f"{MODULE}:greet"],
        cwd=fresh_dev.root,
        env={**fresh_dev.env(), "STEPSTREAM_MAX_PAYLOAD_BYTES": "1MiB"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "STEPSTREAM_MAX_PAYLOAD_BYTES='1MiB' is not a whole number" in done.stderr
    # A logging setting from the environment is named as such, not as the command's flag.
    for variable, value in (("STEPSTREAM_LOG_LEVEL", "loud"), ("STEPSTREAM_LOG_FORMAT", "xml")):
        done = subprocess.run(
            [sys.executable, "-m", "stepstream.ops.cli", "list"],
            cwd=fresh_dev.root,
            env={**fresh_dev.env(), variable: value},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, done
        assert done.stderr.startswith(f"error: {variable}='{value}' (from the environment)")
        assert "--help" not in done.stderr, done.stderr
    assert "--log-level 'loud' is not one of" in refused(
        fresh_dev, "list", "--log-level", "loud", code=2
    )


async def test_unknown_workflow(dev: Dev) -> None:
    err = refused(dev, "start", "nope", "--input", "{}")
    assert "unknown workflow 'nope'" in err and "greet" in err
    async with Client.connect(dev.url) as client:
        with pytest.raises(UnknownWorkflow, match="nope"):
            await client.start("nope", {})


async def test_event_for_an_unknown_instance(dev: Dev) -> None:
    async with Client.connect(dev.url) as client:
        with pytest.raises(UnknownInstance, match="missing-1"):
            await client.send_event("missing-1", "go", {"by": "ada"})
    assert "missing-1" in refused(dev, "send", "missing-1", "go")


async def test_payload_too_large(dev: Dev) -> None:
    async with Client.connect(dev.url) as client:
        before = len(await client.list())
        with pytest.raises(PayloadTooLarge, match="over the limit"):
            await client.start("echo", "x" * (MiB + 1), instance_id="big-1")
        # over the request body limit too: refused before it reaches the engine
        with pytest.raises(PayloadTooLarge, match="over the limit"):
            await client.start("echo", "x" * (5 * MiB), instance_id="big-2")
        assert len(await client.list()) == before

        await client.start("gate", None, instance_id="big-3")
        with pytest.raises(PayloadTooLarge):
            await client.send_event("big-3", "go", ["y" * MiB])
        with pytest.raises(InvalidPayload, match="not JSON-encodable"):
            await client.send_event("big-3", "go", {1, 2})
        await client.cancel("big-3")


async def test_cancel_of_a_completed_instance(dev: Dev) -> None:
    async with Client.connect(dev.url) as client:
        await client.start("echo", 1, instance_id="done-1")
        assert await client.result("done-1", timeout=10) == 1
        with pytest.raises(InstanceFinished, match="done-1"):
            await client.cancel("done-1", reason="too late")
    assert "already completed" in refused(dev, "cancel", "done-1")


async def test_failed_workflow_and_result_timeout(dev: Dev) -> None:
    err = refused(dev, "start", "declined", "--id", "fail-1", "--wait")
    assert "fail-1" in err and "card declined" in err
    async with Client.connect(dev.url) as client:
        with pytest.raises(WorkflowFailed) as failed:
            await client.result("fail-1", timeout=10)
        assert failed.value.instance_id == "fail-1"
        assert failed.value.error_type

        await client.start("gate", None, instance_id="slow-1")
        began = time.monotonic()
        with pytest.raises(ResultTimeout, match="slow-1"):
            await client.result("slow-1", timeout=0.3)
        assert time.monotonic() - began < 5
        await client.cancel("slow-1")


async def test_raw_http_errors(dev: Dev) -> None:
    async with aiohttp.ClientSession(dev.url) as http:
        json_body = {"Content-Type": "application/json"}
        async with http.post(
            "/v1/instances", data=b'{"workflow": "greet",', headers=json_body
        ) as r:
            body = await r.json()
            assert r.status == 400, body
            assert body["error"]["type"] == "InvalidPayload"
            assert "not valid JSON" in body["error"]["message"]
        async with http.post("/v1/instances", json={"workflow": "greet", "inptu": 1}) as r:
            assert r.status == 400 and "inptu" in (await r.json())["error"]["message"]
        async with http.get("/v1/instances", params={"status": "runing"}) as r:
            assert r.status == 400 and "runing" in (await r.json())["error"]["message"]
        async with http.get("/v1/instances/nobody") as r:
            assert r.status == 404 and (await r.json())["error"]["type"] == "UnknownInstance"
        async with http.get("/v1/nothing-here") as r:
            assert r.status == 404 and "error" in await r.json()
        async with http.get("/healthz") as r:
            assert r.status == 200 and (await r.json()) == {"ok": True}
        async with http.get("/v1/workflows") as r:
            workflows = (await r.json())["workflows"]
            assert workflows["greet"] == ["1"] and "gate" in workflows


async def test_nobody_listening(dev: Dev) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    async with Client.connect(url) as client:
        with pytest.raises(ConnectionFailed, match="is `stepstream dev` running"):
            await client.status("x")
    assert "cannot reach stepstream" in refused(dev, "status", "x", "--connect", url, code=4)


def test_run_prints_result_and_timeline(dev: Dev) -> None:
    out = ok(dev, "run", f"{MODULE}:greet", "--input", '{"name": "ada"}')
    assert "hello ada" in out
    assert re.search(r"step\s+hello\s+ok", out), out

    done = cli(dev, "run", f"{MODULE}:declined")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "card declined" in done.stderr
    # The step's own traceback is logged with its failure (ERROR, docs/operations.md);
    # the command itself ends with its message, not a traceback of its own.
    assert "stepstream/ops/cli" not in done.stderr, done.stderr
    assert done.stderr.rstrip().splitlines()[-1].endswith("card declined"), done.stderr
    assert re.search(r"step\s+charge\s+failed", done.stdout), done.stdout

    # Out of time: the engine stops with the command, and it says where the instance is.
    done = cli(dev, "run", f"{MODULE}:gate", "--timeout", "0.5")
    assert done.returncode == 3, done.stdout + done.stderr
    assert "throwaway data directory: give a longer --timeout" in done.stderr, done.stderr
    done = cli(dev, "run", f"{MODULE}:gate", "--timeout", "0.5", "--data", "kept")
    assert done.returncode == 3, done.stdout + done.stderr
    [instance] = re.findall(r"instance (\S+) did not finish within 0.5 s", done.stderr)
    assert f"it waits in kept: `stepstream dev --data kept --workflows {MODULE}`" in done.stderr
    status = cli(dev, "status", instance, "--connect", "embedded:kept", "--json")
    assert json.loads(status.stdout)["status"] == "running", status.stdout + status.stderr


def test_readme_quick_start_runs_the_example(tmp_path: Path) -> None:
    """The second command of the README's quick start, exactly as written there."""
    readme = (Path(REPO) / "README.md").read_text()
    quick_start = readme.split("## Quick start", 1)[1].split("```", 2)[1]
    [command] = [line for line in quick_start.splitlines() if line.startswith("stepstream run")]
    # A directory holding the examples, as the repository's root does: they are not
    # installed with the package, the console script imports them from the working one.
    shutil.copytree(Path(REPO) / "examples", tmp_path / "examples")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [str(Path(sys.executable).parent / "stepstream"), *shlex.split(command)[1:]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"status:\s+completed", done.stdout), done.stdout
    assert '"receipt": "receipt for' in done.stdout
    for step in ("reserve-stock", "charge", "send-receipt"):
        assert re.search(rf"step\s+{step}\s+ok", done.stdout), done.stdout
    assert re.search(r"sleep\s+cool-off\s+elapsed", done.stdout), done.stdout
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["examples"], left  # nothing left behind in the working directory


def test_output_cut_short_by_its_reader_is_no_traceback(tmp_path: Path) -> None:
    """``stepstream ... | head -1``: the reader leaving early is not an error to report."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "stepstream.ops.cli",
                "run",
                "examples.order:order",
                "--input",
                "{}",
            ],
            cwd=tmp_path,
            env=clean_env(tmp_path),
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
    assert done.returncode == 1


def test_the_readme_running_it_commands_work_as_written(tmp_path: Path) -> None:
    """The commands of the README's "Running it", typed in order against the server the
    first one starts (on a free port here): the order waits for its approval, the event
    lets it finish, and a start with --wait prints the result."""
    readme = (Path(REPO) / "README.md").read_text()
    block = readme.split("## Running it", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    serve, *commands = (shlex.split(line, comments=True) for line in block.strip().splitlines())
    assert serve[:2] == ["stepstream", "dev"], serve
    dev, _ = spawn_dev(tmp_path, [*serve[1:], "--data", "d", "--port", "0"])
    try:
        outputs = []
        for command in commands:
            assert command[0] == "stepstream", command
            done = dev.cli(*command[1:])
            assert done.returncode == 0, f"{shlex.join(command)}:\n{done.stdout}{done.stderr}"
            outputs.append(done.stdout)
        assert "status:      completed" in outputs[-1] and '"by": "auto"' in outputs[-1]
        waited = dev.cli("start", "order", "--id", "o-1", "--wait")  # the same id: its result
        assert '"by": "ada"' in waited.stdout, waited.stdout + waited.stderr
        log = dev.log.read_text()
        assert "event_loop=uvloop" in log  # the server's loop, in its log
        # Each CLI call asked where the engine processes serve: one, and no 404 for it.
        asked = "method=GET path=/v1/processes status=200"
        assert asked in log and "status=404" not in log, log[-2000:]
    finally:
        dev.stop()
