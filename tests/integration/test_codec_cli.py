"""Payload codecs from the command line, as a user runs them: ``--codec
examples.aes_gcm_codec:codec`` on ``run``, ``dev``, ``worker``, ``history``, ``replay``
and the client commands.

What a user relies on: with the codec no payload is on disk or on a topic in plaintext;
``history`` with the codec shows the values, without it says which codec and key id
wrote them; keys rotate (records under k1 stay readable once k2 encrypts, and dropping
k1 is refused naming k1); a ``--codec`` that does not load says why.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from stepstream.consumers.kafka import create_topics
from stepstream.engine.wire.topics import COMMANDS, HISTORY
from stepstream.ops.cli.app import parser
from tests.conftest import kafka_settings, kafka_url
from tests.dev_server import REPO, DevServer, clean_env, run_cli, start_dev
from tests.integration.test_kafka_backend import read_topic
from tests.kafka_broker import Broker
from tests.processes import first_line

CODEC = "examples.aes_gcm_codec:codec"
MARKER = "SECRET-4242-MARKER"
_KEYS = {name: base64.b64encode(bytes([n]) * 32).decode() for n, name in enumerate(["k1", "k2"])}


def keys(*names: str) -> str:
    """A STEPSTREAM_CODEC_KEYS value: these key ids, the first encrypting."""
    return ",".join(f"{name}:{_KEYS[name]}" for name in names)


def cli(root: Path, *args: str, key_ids: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    extra = {"STEPSTREAM_CODEC_KEYS": keys(*key_ids)} if key_ids else {}
    return run_cli(root, *args, env=clean_env(root, **extra))


def ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, f"{done.args}: {done.stderr}\n{done.stdout}"
    return done.stdout


def files_hold(directory: Path, text: str) -> list[Path]:
    """The files under ``directory`` whose bytes contain ``text``."""
    needle = text.encode()
    return [p for p in directory.rglob("*") if p.is_file() and needle in p.read_bytes()]


def records(stdout: str, record_type: str) -> list[dict[str, Any]]:
    found = [r["attributes"] for r in json.loads(stdout) if r["type"] == record_type]
    assert found, f"no {record_type} in {stdout}"
    return found


def content_types(stdout: str) -> set[str]:
    """The content types of the payloads a history's JSON holds undecoded."""
    seen: set[str] = set()

    def visit(value: Any) -> None:
        if isinstance(value, dict):
            if set(value) == {"content_type", "base64"}:
                seen.add(value["content_type"])
            for item in value.values():
                visit(item)
        elif isinstance(value, list):
            for item in value:
                visit(item)

    visit(json.loads(stdout))
    return seen


# ---- run, history, replay on an embedded data directory --------------------------------


def test_run_with_the_codec_keeps_plaintext_off_disk_and_history_needs_it(tmp_path: Path) -> None:
    order = json.dumps({"card": MARKER})
    # The same run without a codec: the marker is on disk, so the search below can see it.
    ok(cli(tmp_path, "run", "examples.order:order", "--input", order, "--data", "plain"))
    assert files_hold(tmp_path / "plain", MARKER)

    run = ["run", "examples.order:order", "--input", order, "--data", "sealed", "--json"]
    done = json.loads(ok(cli(tmp_path, *run, "--codec", CODEC, key_ids=("k1",))))
    assert done["status"] == "completed", done
    instance = done["instance_id"]
    assert done["result"]["receipt"].startswith(f"receipt for {instance}")
    assert files_hold(tmp_path / "sealed", "key-id=k1"), "no sealed payload on disk"
    assert files_hold(tmp_path / "sealed", MARKER) == []

    read = ["history", instance, "--connect", "embedded:sealed", "--json"]
    with_codec = cli(tmp_path, *read, "--codec", CODEC, key_ids=("k1",))
    assert ok(with_codec) and with_codec.stderr == ""
    assert records(with_codec.stdout, "WorkflowStarted")[0]["input"] == {"card": MARKER}

    # Without it: shown as stored, and stderr says which codec and key id wrote them.
    bare = cli(tmp_path, *read)
    assert MARKER not in ok(bare)
    assert content_types(bare.stdout) == {"application/vnd.stepstream.aes-gcm+json; key-id=k1"}, (
        bare.stdout
    )
    assert bare.stderr.startswith("warning: "), bare.stderr
    assert "payloads shown as stored" in bare.stderr
    assert "'application/vnd.stepstream.aes-gcm+json; key-id=k1'" in bare.stderr
    assert "pass --codec MODULE:OBJECT" in bare.stderr
    result = cli(tmp_path, "result", instance, "--connect", "embedded:sealed")
    assert result.returncode == 1 and "key-id=k1" in result.stderr, result.stderr

    # An export is written encoded again: no plaintext in the file; replay reads it back.
    export = ["history", instance, "--connect", "embedded:sealed", "--export", "o.json"]
    ok(cli(tmp_path, *export, "--codec", CODEC, key_ids=("k1",)))
    assert MARKER not in (tmp_path / "o.json").read_text()
    replay = ["replay", "--workflows", "examples.order", "--codec", CODEC]
    assert "ok" in ok(cli(tmp_path, *replay, "--file", "o.json", key_ids=("k1",)))
    ok(cli(tmp_path, *replay, "--data", "sealed", key_ids=("k1",)))


# ---- dev, and rotating keys under an instance in flight ---------------------------------

FLOWS = "from examples.order import *  # noqa: F403\n"


def _start_dev(root: Path, *key_ids: str) -> DevServer:
    env = clean_env(root, STEPSTREAM_CODEC_KEYS=keys(*key_ids))
    return start_dev(root, "codec_flows", FLOWS, "--codec", CODEC, env=env)


def _until_waiting(dev: DevServer, instance: str) -> None:
    deadline = time.monotonic() + 20
    while True:
        seen = [r["type"] for r in json.loads(ok(dev.cli("history", instance, "--json")))]
        if "WaitStarted" in seen:
            return
        assert time.monotonic() < deadline, f"{instance} never waited: {seen}"
        time.sleep(0.1)


def test_keys_rotate_under_an_instance_in_flight(tmp_path: Path) -> None:
    dev = _start_dev(tmp_path, "k1")
    try:
        order = json.dumps({"card": MARKER, "needs_approval": True})
        ok(dev.cli("start", "order", "--input", order, "--id", "o-1"))
        _until_waiting(dev, "o-1")
    finally:
        dev.stop()

    # k1 dropped too soon: the instance cannot be read, so it is parked, not failed, and
    # an event sent meanwhile is kept.
    dev = _start_dev(tmp_path, "k2")
    try:
        status = json.loads(ok(dev.cli("status", "o-1", "--json")))
        assert status["status"] == "running", status
        assert "key id 'k1', which STEPSTREAM_CODEC_KEYS does not hold" in status["error"]
        ok(dev.cli("send", "o-1", "approval", "--payload", '{"by": "ada"}'))
    finally:
        dev.stop()

    # k2 encrypts from now on, k1 still reads: the instance replays its k1 records and
    # goes on with the event it was sent while parked.
    dev = _start_dev(tmp_path, "k2", "k1")
    try:
        result = json.loads(ok(dev.cli("result", "o-1", "--timeout", "30")))
        assert result["approval"] == {"by": "ada"}
        history = dev.cli("history", "o-1", "--json")
        assert records(ok(history), "WorkflowStarted")[0]["input"]["card"] == MARKER
    finally:
        dev.stop()
    assert files_hold(tmp_path / "data", MARKER) == []

    read = ["history", "o-1", "--connect", "embedded:data", "--json"]
    assert content_types(ok(cli(tmp_path, *read))) == {
        "application/vnd.stepstream.aes-gcm+json; key-id=k1",
        "application/vnd.stepstream.aes-gcm+json; key-id=k2",
    }
    both = cli(tmp_path, *read, "--codec", CODEC, key_ids=("k2", "k1"))
    assert content_types(ok(both)) == set() and both.stderr == ""

    # Without k1: what k2 sealed still reads, what k1 sealed is refused naming k1.
    only_k2 = cli(tmp_path, *read, "--codec", CODEC, key_ids=("k2",))
    completed = records(ok(only_k2), "WorkflowCompleted")[0]
    assert completed["result"]["approval"] == {"by": "ada"}
    assert "key id 'k1', which STEPSTREAM_CODEC_KEYS does not hold (it has k2)" in only_k2.stderr
    assert "add k1:BASE64KEY to STEPSTREAM_CODEC_KEYS" in only_k2.stderr
    replay = ["replay", "--workflows", "examples.order", "--data", "data", "--codec", CODEC]
    ok(cli(tmp_path, *replay, key_ids=("k2", "k1")))
    refused = cli(tmp_path, *replay, key_ids=("k2",))
    assert refused.returncode == 1, refused.stdout
    assert "key id 'k1'" in refused.stdout + refused.stderr, refused.stdout


# ---- worker and the kafka:// client -----------------------------------------------------


@pytest.mark.slow
def test_a_worker_with_the_codec_keeps_plaintext_off_the_topics(
    kafka_broker: Broker, tmp_path: Path
) -> None:
    settings = kafka_settings(kafka_broker)
    create_topics(settings, 2)
    env = clean_env(tmp_path, STEPSTREAM_CODEC_KEYS=keys("k1"))
    command = [sys.executable, "-m", "stepstream.ops.cli", "worker", "--workflows"]
    command += ["examples.order", "--bootstrap", settings.bootstrap, "--prefix", settings.prefix]
    command += ["--state-dir", str(tmp_path / "state"), "--port", "0", "--codec", CODEC]
    with open(tmp_path / "worker.log", "wb") as log:
        worker = subprocess.Popen(
            command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=log
        )
    try:
        line = first_line(worker, 60)
        assert "listening on" in line, (tmp_path / "worker.log").read_text()[-3000:]
        url = kafka_url(settings)
        instance = f"k-{uuid.uuid4().hex[:6]}"
        order = json.dumps({"card": MARKER})
        # The kafka:// client encodes the input itself: it needs the codec too.
        start = ["start", "order", "--input", order, "--id", instance, "--wait"]
        start += ["--timeout", "60", "--connect", url, "--codec", CODEC]
        assert f"receipt for {instance}" in ok(cli(tmp_path, *start, key_ids=("k1",)))
        # Reads are answered by the worker, which decodes with its codec.
        history = ok(cli(tmp_path, "history", instance, "--connect", url, "--json"))
        assert records(history, "WorkflowStarted")[0]["input"] == {"card": MARKER}

        for kind in (COMMANDS, HISTORY):
            values = [r.value for r in read_topic(settings, kind)]
            assert any(b"key-id=k1" in v for v in values), kind
            assert not any(MARKER.encode() in v for v in values), kind
        replay = ["replay", "--workflows", "examples.order", "--bootstrap", settings.bootstrap]
        replay += ["--prefix", settings.prefix, "--instance", instance, "--codec", CODEC]
        assert "ok" in ok(cli(tmp_path, *replay, key_ids=("k1",)))
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=60)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
    assert worker.returncode == 0, (tmp_path / "worker.log").read_text()[-3000:]


# ---- what --codec says when it does not load, and --help --------------------------------

SEALED = '''
from stepstream import JsonCodec, Payload


class Reversed:
    """A codec class of no arguments: JSON, reversed, under its own content type."""

    def encode(self, value):
        return Payload("application/x-reversed", JsonCodec().encode(value).data[::-1])

    def decode(self, payload):
        return JsonCodec().decode(Payload("application/json", payload.data[::-1]))
'''


def test_a_codec_class_in_the_working_directory_is_made_and_used(tmp_path: Path) -> None:
    (tmp_path / "mycodecs.py").write_text(SEALED)
    env = {**clean_env(tmp_path), "PYTHONPATH": REPO}  # only the working directory finds it
    run = ["run", "examples.order:order", "--input", json.dumps({"card": MARKER})]
    done = run_cli(tmp_path, *run, "--data", "d", "--codec", "mycodecs:Reversed", env=env)
    assert "completed" in ok(done)
    assert files_hold(tmp_path / "d", MARKER[::-1]) and not files_hold(tmp_path / "d", MARKER)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("examples.aes_gcm_codec", "--codec expects MODULE:OBJECT"),
        ("examples.nope:codec", "cannot import 'examples.nope'"),
        ("examples.aes_gcm_codec:nope", "module 'examples.aes_gcm_codec' has no 'nope'"),
        ("examples.aes_gcm_codec:CONTENT_TYPE", "str 'application/vnd.stepstream.aes-gcm+json'"),
        ("examples.order:order", "is not a payload codec; it must be an object with encode"),
        (CODEC, "making the codec failed: KeyConfigError: STEPSTREAM_CODEC_KEYS is not set"),
    ],
)
def test_a_codec_that_does_not_load_says_why(tmp_path: Path, spec: str, expected: str) -> None:
    done = cli(tmp_path, "run", "examples.order:order", "--codec", spec)
    assert done.returncode == 2, done.stderr
    assert expected in done.stderr, done.stderr
    assert done.stderr.rstrip().endswith("(see `stepstream run --help`)"), done.stderr


def test_the_variable_names_a_codec_too_and_says_so_when_it_fails(tmp_path: Path) -> None:
    env = clean_env(tmp_path, STEPSTREAM_CODEC="examples.nope:codec")
    done = run_cli(tmp_path, "run", "examples.order:order", env=env)
    assert done.returncode == 2
    assert done.stderr.startswith("error: $STEPSTREAM_CODEC examples.nope:codec: cannot import")
    # Over http(s) the server's codec applies: the variable is ignored, the flag refused.
    status = ["status", "x", "--connect", "http://127.0.0.1:9"]
    assert "does not apply" not in run_cli(tmp_path, *status, env=env).stderr
    refused = cli(tmp_path, *status, "--codec", CODEC)
    assert refused.returncode == 2
    assert "--codec does not apply to http://127.0.0.1:9" in refused.stderr
    assert "start the server (stepstream dev or worker) with --codec" in refused.stderr


@pytest.mark.parametrize(
    "command", ["run", "dev", "worker", "history", "replay", "start", "send", "status", "result"]
)
def test_help_explains_the_codec(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        parser().parse_args([command, "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--codec MODULE:OBJECT" in text
    assert "a stepstream.PayloadCodec, or a class or function of no arguments" in text
    assert "$STEPSTREAM_CODEC" in text
    if command in ("start", "send", "status", "result", "history"):
        assert "over http(s):// the server's codec applies" in text


# ---- the docs page, as typed -------------------------------------------------------------


def test_the_encryption_page_runs_as_typed(tmp_path: Path) -> None:
    """The "Try it" block of docs/encryption.md, line after line in one shell."""
    page = (Path(REPO) / "docs" / "encryption.md").read_text()
    script = page.split("\n## Try it\n", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    bin_dir = Path(sys.executable).parent
    env = clean_env(tmp_path, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    done = subprocess.run(
        ["bash", "-e", "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, (done.stdout, done.stderr)
    out = done.stdout.splitlines()
    assert "no plaintext on disk" in out, done.stdout
    assert out.count("4242-secret") == 2 and "key-id=k2" in out, done.stdout
    assert not files_hold(tmp_path / "sealed", "4242-secret")
    warnings = done.stderr.splitlines()
    assert len(warnings) == 3, done.stderr
    assert "'application/vnd.stepstream.aes-gcm+json; key-id=k1'" in warnings[0]
    assert "key id 'k1', which STEPSTREAM_CODEC_KEYS does not hold (it has k2)" in warnings[2]


ECHO = """
from stepstream import workflow

@workflow("echo")
async def echo(ctx, value):
    return value
"""


def test_a_value_shaped_like_an_undecoded_payload_reads_as_the_value(tmp_path: Path) -> None:
    """A payload shown as stored is said to be apart from the value: a workflow's own
    dict of the same shape (``content_type`` and ``base64``) is read, exported and
    replayed as the value it is, never taken for bytes (nor refused as bad base64)."""
    (tmp_path / "echoes.py").write_text(ECHO)
    env = {**clean_env(tmp_path), "PYTHONPATH": REPO}
    for n, value in enumerate(
        [
            {"content_type": "text/plain", "base64": "abc"},  # not even base64
            {"content_type": "text/plain", "base64": "aGk="},
        ]
    ):
        run = ["run", "echoes:echo", "--input", json.dumps(value), "--data", f"d{n}", "--json"]
        done = json.loads(ok(run_cli(tmp_path, *run, env=env)))
        assert done["result"] == value
        instance = done["instance_id"]
        read = ["history", instance, "--connect", f"embedded:d{n}", "--json"]
        shown = run_cli(tmp_path, *read, env=env)
        assert ok(shown) and shown.stderr == "", shown.stderr
        [started] = [r for r in json.loads(shown.stdout) if r["type"] == "WorkflowStarted"]
        assert started["attributes"]["input"] == value and started["undecoded"] == [], started
        export = ["history", instance, "--connect", f"embedded:d{n}", "--export", f"e-{n}.json"]
        ok(run_cli(tmp_path, *export, env=env))
        exported = json.loads((tmp_path / f"e-{n}.json").read_text())
        [start] = [r for r in exported["records"] if r["type"] == "WorkflowStarted"]
        assert start["attributes"]["input"] == {"content_type": "application/json", "json": value}
        replay = ["replay", "--workflows", "echoes", "--file", f"e-{n}.json"]
        assert "ok" in ok(run_cli(tmp_path, *replay, env=env))


ROTATION_FLOWS = """
from stepstream import Context, workflow


def note(value):
    return value


@workflow("two-approvals")
async def two_approvals(ctx: Context, _: object) -> dict:
    first = await ctx.wait_for_event("first", timeout=3600)
    noted = await ctx.step("note", note, first)
    second = await ctx.wait_for_event("second", timeout=3600)
    return {"first": noted, "second": second}
"""


def _waits(dev: DevServer, instance: str, count: int) -> None:
    deadline = time.monotonic() + 20
    while True:
        seen = [r["type"] for r in json.loads(ok(dev.cli("history", instance, "--json")))]
        if seen.count("WaitStarted") >= count:
            return
        assert time.monotonic() < deadline, f"{instance} never waited {count} times: {seen}"
        time.sleep(0.1)


def test_a_new_key_rolled_out_unevenly_parks_what_an_old_engine_cannot_read(
    tmp_path: Path,
) -> None:
    """k2 encrypts on one engine while another still has only k1: what k2 sealed (an
    event taken, a step's result) parks the instance on the k1 engine instead of
    failing it, an event sent there meanwhile is kept, and once every engine has both
    keys the instance goes on."""

    def dev_with(*key_ids: str) -> DevServer:
        env = clean_env(tmp_path, STEPSTREAM_CODEC_KEYS=keys(*key_ids))
        return start_dev(tmp_path, "rotation_flows", ROTATION_FLOWS, "--codec", CODEC, env=env)

    dev = dev_with("k1")
    try:
        ok(dev.cli("start", "two-approvals", "--id", "t-1"))
        _waits(dev, "t-1", 1)
    finally:
        dev.stop()
    dev = dev_with("k2", "k1")  # rotated first: seals under k2
    try:
        ok(dev.cli("send", "t-1", "first", "--payload", '{"by": "ada"}'))
        _waits(dev, "t-1", 2)
    finally:
        dev.stop()
    dev = dev_with("k1")  # not rotated yet
    try:
        status = json.loads(ok(dev.cli("status", "t-1", "--json")))
        assert status["status"] == "running", status
        assert status["error"].startswith("InvalidPayload: instance t-1: the event 'first'")
        assert "key id 'k2', which STEPSTREAM_CODEC_KEYS does not hold" in status["error"]
        ok(dev.cli("send", "t-1", "second", "--payload", '{"by": "bob"}'))
    finally:
        dev.stop()
    dev = dev_with("k2", "k1")
    try:
        result = json.loads(ok(dev.cli("result", "t-1", "--timeout", "30")))
    finally:
        dev.stop()
    assert result == {"first": {"by": "ada"}, "second": {"by": "bob"}}


QUEUED_FLOWS = """
from stepstream import Context, Queue, workflow

desk = Queue("desk", concurrency=1)


@workflow("hold", queue=desk)
async def hold(ctx: Context, _: object) -> str:
    await ctx.wait_for_event("release")
    return "released"
"""


def test_queued_work_sealed_by_a_codec_waits_for_an_engine_that_has_it(
    tmp_path: Path,
) -> None:
    """An engine started without the codec, over instances whose queue requests the
    codec sealed, serves on: each such instance is parked (it used to stop the engine
    at start), and an engine with the codec runs them to the end."""

    def dev_with(*args: str, key_ids: tuple[str, ...] = ()) -> DevServer:
        extra = {"STEPSTREAM_CODEC_KEYS": keys(*key_ids)} if key_ids else {}
        env = clean_env(tmp_path, **extra)
        return start_dev(tmp_path, "queued_flows", QUEUED_FLOWS, *args, env=env)

    dev = dev_with("--codec", CODEC, key_ids=("k1",))
    try:
        for instance in ("h-1", "h-2", "h-3"):
            ok(dev.cli("start", "hold", "--id", instance))
        _waits(dev, "h-1", 1)  # admitted: h-2 and h-3 wait behind it
    finally:
        dev.stop()
    dev = dev_with()
    try:
        for instance in ("h-1", "h-2"):
            status = json.loads(ok(dev.cli("status", instance, "--json")))
            assert status["error"].startswith(
                f"InvalidPayload: instance {instance}: the queue request 'queue#acquire'"
            ), status
        ok(dev.cli("send", "h-1", "release"))  # kept, read once the codec is back
        ok(dev.cli("cancel", "h-3"))  # its slot request is withdrawn all the same
        status = json.loads(ok(dev.cli("status", "h-3", "--json")))
        assert status["status"] == "cancelled", status
    finally:
        dev.stop()
    dev = dev_with("--codec", CODEC, key_ids=("k1",))
    try:
        assert ok(dev.cli("result", "h-1", "--timeout", "30")).strip() == "released"
        ok(dev.cli("send", "h-2", "release"))
        assert ok(dev.cli("result", "h-2", "--timeout", "30")).strip() == "released"
    finally:
        dev.stop()
