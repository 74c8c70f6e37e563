"""The CLI as a user runs it, against a `stepstream dev` subprocess: `--version`, `--json`
on the commands that change an instance, `result` (value, failure, timeout), `list`
(default limit, cursors, order) and `history --follow`."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import shlex
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import stepstream
from stepstream.producers.client import Client
from tests.dev_server import REPO, DevServer, clean_env, run_cli, start_dev

WORKFLOWS = "from tests.workflows import *  # noqa: F403\n"


@pytest.fixture(scope="module")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevServer]:
    server = start_dev(tmp_path_factory.mktemp("cli"), "cli_flows", WORKFLOWS)
    yield server
    server.stop()


def ok(dev: DevServer, *args: str) -> str:
    done = dev.cli(*args)
    assert done.returncode == 0, f"stepstream {' '.join(args)}: {done.stderr}\n{done.stdout}"
    assert done.stderr == "", done.stderr
    return done.stdout


def as_json(dev: DevServer, *args: str) -> Any:
    return json.loads(ok(dev, *args, "--json"))


def _history_types(dev: DevServer, instance_id: str) -> list[str]:
    return [h["type"] for h in as_json(dev, "history", instance_id)]


def _until(predicate: Any, what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


# ---- --version ------------------------------------------------------------------------


def test_version_is_pyprojects(tmp_path: Path) -> None:
    with open(Path(REPO) / "pyproject.toml", "rb") as f:
        expected = tomllib.load(f)["project"]["version"]
    assert stepstream.__version__ == expected
    done = run_cli(tmp_path, "--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"stepstream {expected}"


# ---- usage errors ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "says", "command"),
    [
        (["status", "o-1", "--jsn"], "unrecognized arguments: --jsn", "status"),
        (["result", "o-1", "--timeout", "abc"], "invalid float value: 'abc'", "result"),
        (["start"], "the following arguments are required: workflow", "start"),
        (["topics", "remove"], "invalid choice: 'remove'", "topics"),
        (["status", "o-1", "--connect", "127.0.0.1:8233"], "'127.0.0.1:8233' has no", "status"),
    ],
)
def test_a_wrong_command_line_exits_2_naming_the_commands_help(
    tmp_path: Path, args: list[str], says: str, command: str
) -> None:
    done = run_cli(tmp_path, *args)
    assert done.returncode == 2, done
    assert says in done.stderr, done.stderr
    assert f"(see `stepstream {command} --help`)" in done.stderr, done.stderr


def test_a_read_of_an_embedded_path_that_does_not_exist_makes_nothing_there(
    tmp_path: Path,
) -> None:
    for command in (["status", "o-1"], ["history", "o-1"], ["list"], ["schedule", "list"]):
        done = run_cli(tmp_path, *command, "--connect", "embedded:./typo")
        assert done.returncode == 2, done
        assert "there is no data directory at './typo'" in done.stderr, done.stderr
        assert not (tmp_path / "typo").exists()
    # A start does make it: test_an_embedded_client_command_finds_the_workflows_...


def test_an_unknown_scheme_in_the_environment_is_a_usage_error_too(tmp_path: Path) -> None:
    env = clean_env(tmp_path, STEPSTREAM_CONNECT="localhost:8233")
    done = run_cli(tmp_path, "list", env=env)
    assert done.returncode == 2, done
    assert "$STEPSTREAM_CONNECT 'localhost:8233' has no scheme" in done.stderr, done.stderr
    assert "http://HOST:PORT" in done.stderr


def test_an_embedded_client_command_finds_the_workflows_of_the_working_directory(
    tmp_path: Path,
) -> None:
    """``--connect embedded:`` runs the engine in the command, which imports
    $STEPSTREAM_WORKFLOWS from where the user is, as ``run`` and ``dev`` do."""
    (tmp_path / "greeting.py").write_text(
        "from stepstream import Context, workflow\n\n"
        "@workflow('greet')\n"
        "async def greet(ctx: Context, name: str) -> str:\n"
        "    return f'hello {name}'\n"
    )
    env = clean_env(tmp_path, STEPSTREAM_CONNECT="embedded:./data")
    env.update(STEPSTREAM_WORKFLOWS="greeting", PYTHONPATH=REPO)  # not the directory itself
    # The console script, as a user runs it (``python -m`` would put the directory on
    # the path by itself).
    script = str(Path(sys.executable).parent / "stepstream")
    start = [script, "start", "greet", "--input", '"ada"', "--id", "g-1", "--wait"]
    done = subprocess.run(start, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "hello ada" in done.stdout


# ---- --json on the commands that change an instance -------------------------------------


def test_send_cancel_pause_resume_print_json(dev: DevServer) -> None:
    ok(dev, "start", "waiter", "--id", "j-1")
    sent = as_json(dev, "send", "j-1", "approval", "--payload", '{"by": "ada"}', "--event-id", "e1")
    assert sent == {"instance_id": "j-1", "command": "send", "event": "approval", "event_id": "e1"}
    assert json.loads(ok(dev, "result", "j-1", "--timeout", "20")) == {"by": "ada"}

    ok(dev, "start", "waiter", "--id", "j-2")
    _until(lambda: "WaitStarted" in _history_types(dev, "j-2"), "j-2 to wait")
    assert as_json(dev, "pause", "j-2") == {"instance_id": "j-2", "command": "pause"}
    assert as_json(dev, "status", "j-2")["status"] == "paused"
    assert as_json(dev, "resume", "j-2") == {"instance_id": "j-2", "command": "resume"}
    assert as_json(dev, "status", "j-2")["status"] == "running"
    cancelled = as_json(dev, "cancel", "j-2", "--reason", "not needed")
    assert cancelled == {"instance_id": "j-2", "command": "cancel", "reason": "not needed"}
    # Without --json the text is what it always was.
    ok(dev, "start", "waiter", "--id", "j-3")
    assert ok(dev, "pause", "j-3").strip() == "paused j-3"


# ---- result ---------------------------------------------------------------------------


def test_result_prints_the_value_the_failure_or_the_timeout(dev: DevServer) -> None:
    ok(dev, "start", "arith", "--input", "2", "--id", "r-ok")
    assert json.loads(ok(dev, "result", "r-ok")) == {"total": 3, "doubled": 6}
    assert as_json(dev, "result", "r-ok") == {
        "instance_id": "r-ok",
        "status": "completed",
        "result": {"total": 3, "doubled": 6},
    }

    ok(dev, "start", "fatal", "--id", "r-failed")
    failed = dev.cli("result", "r-failed")
    assert failed.returncode == 1, failed
    assert failed.stdout == ""
    assert failed.stderr.startswith("error: instance r-failed failed: "), failed.stderr
    assert "card declined" in failed.stderr and "Traceback" not in failed.stderr
    failed = dev.cli("result", "r-failed", "--json")
    assert failed.returncode == 1, failed
    said = json.loads(failed.stdout)
    assert said["status"] == "failed" and said["error"]["type"] == "WorkflowFailed"
    assert said["error"]["error_type"] and "card declined" in said["error"]["message"]

    ok(dev, "start", "waiter", "--id", "r-waits")
    began = time.monotonic()
    waited = dev.cli("result", "r-waits", "--timeout", "0.5")
    assert waited.returncode == 3, waited
    assert time.monotonic() - began < 15
    assert "did not finish within" in waited.stderr and "status now: running" in waited.stderr
    waited = dev.cli("result", "r-waits", "--timeout", "0.5", "--json")
    assert waited.returncode == 3, waited
    assert json.loads(waited.stdout)["error"]["type"] == "ResultTimeout"
    # start --wait --json says the same on stdout as result --json.
    failed = dev.cli("start", "fatal", "--id", "s-failed", "--wait", "--json")
    assert failed.returncode == 1, failed
    said = json.loads(failed.stdout)
    assert (said["instance_id"], said["status"]) == ("s-failed", "failed")
    waited = dev.cli("start", "waiter", "--id", "s-waits", "--wait", "--timeout", "0.5", "--json")
    assert waited.returncode == 3, waited
    assert json.loads(waited.stdout)["error"]["type"] == "ResultTimeout"

    wrong = dev.cli("result", "r-waits", "--timeout", "0")
    assert wrong.returncode == 2, wrong
    assert "--timeout must be a positive number" in wrong.stderr
    assert "stepstream result --help" in wrong.stderr
    unknown = dev.cli("result", "r-nobody")
    assert unknown.returncode == 1 and "r-nobody" in unknown.stderr, unknown


# ---- list ----------------------------------------------------------------------------


async def _start_many(url: str, ids: list[str]) -> None:
    async with Client.connect(url) as client:
        for instance_id in ids:  # one at a time: their created times are in this order
            await client.start("waiter", None, instance_id=instance_id)


def test_list_newest_first_paged_with_a_cursor(dev: DevServer) -> None:
    ids = [f"l-{n:02d}" for n in range(53)]
    asyncio.run(_start_many(dev.url, ids))
    newest_first = list(reversed(ids))

    # The default: the newest 50, and a last line saying how to get the rest.
    text = ok(dev, "list", "--prefix", "l-").splitlines()
    assert text[0].split()[:4] == ["INSTANCE", "WORKFLOW", "VERSION", "STATUS"]
    assert [line.split()[0] for line in text[1:51]] == newest_first[:50]
    assert text[51].startswith("more instances than the 50 shown (--limit 0 lists them all)")
    hint = shlex.split(text[51].split("next page: ", 1)[1])
    assert hint[:4] == ["stepstream", "list", "--prefix", "l-"] and hint[4] == "--after"
    rest = as_json(dev, *hint[1:])
    assert [i["instance_id"] for i in rest["instances"]] == newest_first[50:]
    assert rest["next"] is None and rest["order"] == "newest"

    # The hint is the whole command line with the next cursor: followed as printed, it
    # keeps the order, the filters and the limit, and pages through everything once.
    command = ["list", "--order", "oldest", "--prefix", "l-", "--limit", "20"]
    oldest_first: list[str] = []
    for _ in range(5):
        page = ok(dev, *command).splitlines()
        oldest_first += [line.split()[0] for line in page[1:] if line.startswith("l-")]
        if not page[-1].startswith("more instances"):
            break
        command = shlex.split(page[-1].split("next page: ", 1)[1])[1:]
        assert command.count("--after") == 1 and "--order" in command, command
    assert oldest_first == ids

    # Page by page with --json: every instance once, in order.
    seen: list[str] = []
    after: list[str] = []
    for _ in range(20):
        page = as_json(dev, "list", "--prefix", "l-", "--limit", "20", *after)
        seen += [i["instance_id"] for i in page["instances"]]
        if page["next"] is None:
            break
        after = ["--after", page["next"]]
    assert seen == newest_first

    oldest = as_json(dev, "list", "--prefix", "l-", "--order", "oldest", "--limit", "3")
    assert [i["instance_id"] for i in oldest["instances"]] == ids[:3]
    by_id = as_json(dev, "list", "--prefix", "l-", "--order", "id", "--limit", "2")
    assert [i["instance_id"] for i in by_id["instances"]] == sorted(ids)[:2]
    assert by_id["next"] == sorted(ids)[1]
    everything = as_json(dev, "list", "--prefix", "l-", "--limit", "0")
    assert len(everything["instances"]) == 53 and everything["next"] is None

    # The plain `list --json` is an array as it always was, cut at the default limit,
    # and says on stderr that there is more.
    plain = dev.cli("list", "--json")
    assert plain.returncode == 0, plain.stderr
    assert isinstance(json.loads(plain.stdout), list) and len(json.loads(plain.stdout)) == 50
    assert "more exist; next page: stepstream list --json --after " in plain.stderr

    bad = dev.cli("list", "--after", "l-01")
    assert bad.returncode == 2 and "is not a cursor of --order newest/oldest" in bad.stderr
    assert "stepstream list --help" in bad.stderr


# ---- history --follow ----------------------------------------------------------------


def _follow(dev: DevServer, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "stepstream.ops.cli", "history", *args, "--follow"],
        cwd=dev.root,
        env=clean_env(dev.root, STEPSTREAM_CONNECT=dev.url),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _lines(proc: subprocess.Popen[str]) -> tuple[queue.Queue[str], threading.Thread]:
    """The lines the process prints, as they come, read by the thread (it ends with
    the output)."""
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        with proc.stdout:  # closed once the output ends
            for line in proc.stdout:
                lines.put(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return lines, reader


def test_history_follow_prints_new_records_until_the_end(dev: DevServer) -> None:
    ok(dev, "start", "waiter", "--id", "f-1")
    proc = _follow(dev, "f-1")
    printed, reader = _lines(proc)
    try:
        lines = [printed.get(timeout=20)]
        while "WaitStarted" not in lines[-1]:
            lines.append(printed.get(timeout=20))
        time.sleep(1.5)  # longer than it waits between reads: still there
        assert proc.poll() is None, "it must keep following a running instance"
        assert printed.empty(), "nothing new was appended"
        ok(dev, "send", "f-1", "approval", "--payload", '"yes"')
        code = proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.stderr is not None
    with proc.stderr:
        assert code == 0, proc.stderr.read()
    reader.join(timeout=10)
    while not printed.empty():
        lines.append(printed.get())
    types = [line.split()[2] for line in lines]
    assert types[0] == "WorkflowStarted" and types[-1] == "WorkflowCompleted", lines
    assert "WaitSatisfied" in types[types.index("WaitStarted") :], lines
    seqs = [int(line.split()[0]) for line in lines]
    assert seqs == sorted(set(seqs)), "each record once, in order"


def test_history_follow_as_json_lines_and_of_a_finished_instance(dev: DevServer) -> None:
    ok(dev, "start", "arith", "--input", "1", "--id", "f-2", "--wait")
    proc = _follow(dev, "f-2", "--json")
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert records == as_json(dev, "history", "f-2")

    refused = dev.cli("history", "f-2", "--follow", "--export", os.devnull)
    assert refused.returncode == 2 and "stepstream history --help" in refused.stderr


def test_schedule_create_refuses_a_bad_spec_as_a_usage_error(dev: DevServer) -> None:
    """Checked before connecting, and said with the flags' names (exit 2)."""
    for flags, says in (
        (["--every", "0"], "--every 0 must be a whole number of seconds"),
        (["--every", "5", "--catchup-window", "-1"], "--catchup-window -1 must be"),
        (["--cron", "61 * * * *"], "is not valid: Bad minute"),
        (["--every", "5", "--timezone", "Mars/Base"], "unknown time zone 'Mars/Base'"),
    ):
        done = dev.cli("schedule", "create", "s-bad", "--workflow", "arith", *flags)
        assert done.returncode == 2, done
        assert says in done.stderr and "stepstream schedule create --help" in done.stderr
    listed = dev.cli("schedule", "list", "--json")
    assert listed.returncode == 0 and json.loads(listed.stdout) == []


def test_schedule_list_and_describe_say_a_cancelled_schedule_runs_no_more(
    dev: DevServer,
) -> None:
    done = dev.cli("schedule", "create", "s-ends", "--workflow", "arith", "--every", "3600")
    assert done.returncode == 0, done.stderr
    listed = dev.cli("schedule", "list").stdout
    assert listed.splitlines()[0].split()[:4] == ["NAME", "WORKFLOW", "SPEC", "STATE"]
    assert "active" in listed.splitlines()[1], listed
    assert dev.cli("cancel", "~schedule/s-ends").returncode == 0
    deadline = time.monotonic() + 20
    while "cancelled" not in (listed := dev.cli("schedule", "list").stdout):
        assert time.monotonic() < deadline, listed
        time.sleep(0.1)
    [row] = [line for line in listed.splitlines() if line.startswith("s-ends")]
    assert row.split()[-4:-1] == ["cancelled", "-", "-"], row  # STATE, NEXT RUN, LAST
    described = dev.cli("schedule", "describe", "s-ends").stdout
    assert re.search(r"state:\s+cancelled", described), described
    assert re.search(r"next run:\s+-", described), described
