"""TLS and SASL/SCRAM against an Apache Kafka node configured for them.

Every part connects with the settings docs/kafka.md documents and nothing else:
``STEPSTREAM_KAFKA_SECURITY_PROTOCOL``, ``_SASL_MECHANISM``, ``_SASL_USERNAME``,
``_SASL_PASSWORD`` and ``_SSL_CA_LOCATION`` for the CLI and the worker (subprocesses, as
a user runs them), ``Client.connect(url, kafka={...})`` or the same variables for the
``kafka://`` client. A wrong password or an untrusted certificate fails within seconds
with one error that names the setting to check, from each of them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from stepstream import Client
from stepstream.errors import KafkaAuthenticationFailed
from tests.integration.test_kafka_edges import _STOP_JOBS_NEWEST_FIRST
from tests.kafka_broker import discard
from tests.processes import REPO, launch, repo_env, worker_command
from tests.secure_kafka import (
    MECHANISM,
    PASSWORD,
    USER,
    SecureKafka,
    make_certificates,
    start_secure_kafka,
)

# A refused login must not wait out a timeout: the admin client's is 10 s, aiokafka's 15 s.
FAST_S = 8.0


@pytest.fixture(scope="module")
def secure_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureKafka]:
    kafka = start_secure_kafka(tmp_path_factory.mktemp("secure-kafka"))
    yield kafka
    discard(kafka.cluster)


def _cli(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stepstream.ops.cli", *args],
        cwd=REPO,
        env=repo_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _prefix() -> str:
    return f"sec{uuid.uuid4().hex[:8]}"


def _listener(kafka: SecureKafka, protocol: str) -> tuple[str, dict[str, str]]:
    if protocol == "SASL_SSL":
        return kafka.bootstrap, kafka.sasl_env()
    return kafka.tls_bootstrap, kafka.tls_env()


@pytest.mark.parametrize("protocol", ["SASL_SSL", "SSL"])
def test_topics_create_and_check(secure_kafka: SecureKafka, protocol: str) -> None:
    bootstrap, env = _listener(secure_kafka, protocol)
    where = ["--bootstrap", bootstrap, "--prefix", _prefix()]
    created = _cli("topics", "create", *where, "--partitions", "2", "--json", env=env)
    assert created.returncode == 0, created.stderr
    topics = json.loads(created.stdout)
    assert len(topics) == 7 and all(t["created"] for t in topics), topics

    checked = _cli("topics", "check", *where, "--json", env=env)
    # It read every topic's configuration; on one broker only the replication factor
    # (1) is below what production needs.
    findings = json.loads(checked.stdout)
    assert {f["topic"] for f in findings} == {t["topic"] for t in topics}, checked.stderr
    assert all(f["problem"].startswith("replication factor 1") for f in findings), findings


@pytest.mark.parametrize("protocol", ["SASL_SSL", "SSL"])
async def test_a_worker_runs_what_the_client_and_the_cli_start(
    secure_kafka: SecureKafka,
    protocol: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bootstrap, env = _listener(secure_kafka, protocol)
    prefix = _prefix()
    where = ["--bootstrap", bootstrap, "--prefix", prefix]
    created = _cli("topics", "create", *where, "--partitions", "2", env=env)
    assert created.returncode == 0, created.stderr

    command = worker_command("tests.workflows", bootstrap, prefix, tmp_path / "state", [])
    log = tmp_path / "worker.log"
    proc, _ = launch(command, env=repo_env(**env), log=log)
    try:
        url = f"kafka://{bootstrap}?prefix={prefix}"
        if protocol == "SASL_SSL":  # the Python form docs/kafka.md shows
            properties = {
                "security.protocol": "SASL_SSL",
                "sasl.mechanism": MECHANISM,
                "sasl.username": USER,
                "sasl.password": PASSWORD,
                "ssl.ca.location": str(secure_kafka.ca),
            }
            connected = Client.connect(url, kafka=properties)
        else:  # the variables, as a process started with them reads them
            for name, value in env.items():
                monkeypatch.setenv(name, value)
            connected = Client.connect(url)
        async with connected as client:
            await client.start("arith", 4, instance_id="a-1")
            assert await client.result("a-1", timeout=60) == {"total": 5, "doubled": 10}

        cli = ["--connect", url]
        run = ["start", "arith", "--input", "9", "--id", "a-2", "--wait", "--json", *cli]
        started = _cli(*run, env=env)
        assert started.returncode == 0, started.stderr
        assert json.loads(started.stdout)["result"] == {"total": 10, "doubled": 20}
        status = _cli("status", "a-1", "--json", *cli, env=env)
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["status"] == "completed"
        listed = _cli("list", "--json", *cli, env=env)
        assert listed.returncode == 0, listed.stderr
        assert sorted(i["instance_id"] for i in json.loads(listed.stdout)) == ["a-1", "a-2"]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]


@pytest.mark.parametrize("protocol", ["SASL_SSL", "SSL"])
def test_cli_calls_over_tls_each_finish_within_seconds(
    secure_kafka: SecureKafka, protocol: str, tmp_path: Path
) -> None:
    """A CLI call ends by closing its TLS connections to Kafka; under uvloop (the CLI's
    loop) such a close could wait out a 30 s TLS shutdown timeout, one call in two."""
    bootstrap, env = _listener(secure_kafka, protocol)
    env = {**env, "STEPSTREAM_EVENT_LOOP": "uvloop"}
    prefix = _prefix()
    where = ["--bootstrap", bootstrap, "--prefix", prefix]
    assert _cli("topics", "create", *where, "--partitions", "2", env=env).returncode == 0
    command = worker_command("tests.workflows", bootstrap, prefix, tmp_path / "state", [])
    log = tmp_path / "worker.log"
    proc, _ = launch(command, env=repo_env(**env), log=log)
    try:
        cli = ["--connect", f"kafka://{bootstrap}?prefix={prefix}"]
        started = _cli("start", "arith", "--input", "1", "--id", "t-1", "--wait", *cli, env=env)
        assert started.returncode == 0, started.stderr
        took = []
        for _ in range(6):
            began = time.monotonic()
            status = _cli("status", "t-1", "--json", *cli, env=env)
            took.append(round(time.monotonic() - began, 1))
            assert status.returncode == 0, status.stderr
            assert json.loads(status.stdout)["status"] == "completed"
        assert max(took) < 10, f"`stepstream status` calls took {took} s"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]


def _one_clear_line(done: subprocess.CompletedProcess[str], *expected: str) -> str:
    assert done.returncode == 1, (done.stdout, done.stderr)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    # No log flood before it: at most the client library's one line on the same failure.
    assert len(errors) == 1 and len(lines) <= 2, done.stderr
    for text in expected:
        assert text in errors[0], errors[0]
    return errors[0]


SASL_HINTS = ("refused the SASL login", "STEPSTREAM_KAFKA_SASL_PASSWORD", "invalid credentials")


async def test_a_wrong_password_fails_at_once_and_says_what_to_check(
    secure_kafka: SecureKafka, tmp_path: Path
) -> None:
    good = secure_kafka.sasl_env()
    prefix = _prefix()
    where = ["--bootstrap", secure_kafka.bootstrap, "--prefix", prefix]
    assert _cli("topics", "create", *where, "--partitions", "2", env=good).returncode == 0
    wrong = secure_kafka.sasl_env(password="not-the-password")

    began = time.monotonic()
    done = _cli("topics", "create", *where, "--partitions", "2", env=wrong)
    _one_clear_line(done, *SASL_HINTS)
    assert time.monotonic() - began < FAST_S

    began = time.monotonic()
    command = worker_command("tests.workflows", secure_kafka.bootstrap, prefix, tmp_path, [])
    worker = subprocess.run(
        command, cwd=REPO, env=repo_env(**wrong), capture_output=True, text=True, timeout=120
    )
    _one_clear_line(worker, *SASL_HINTS)
    assert time.monotonic() - began < FAST_S

    url = f"kafka://{secure_kafka.bootstrap}?prefix={prefix}"
    began = time.monotonic()
    status = _cli("status", "x-1", "--connect", url, env=wrong)
    _one_clear_line(status, *SASL_HINTS)
    assert time.monotonic() - began < FAST_S

    properties = {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": MECHANISM,
        "sasl.username": USER,
        "sasl.password": "not-the-password",
        "ssl.ca.location": str(secure_kafka.ca),
    }
    began = time.monotonic()
    with pytest.raises(KafkaAuthenticationFailed, match=r"sasl\.password") as raised:
        async with Client.connect(url, kafka=properties):
            pass
    assert time.monotonic() - began < FAST_S
    assert "not-the-password" not in str(raised.value)


async def test_an_untrusted_certificate_names_the_ca_setting(
    secure_kafka: SecureKafka, tmp_path: Path
) -> None:
    other = make_certificates(tmp_path / "other")  # a CA that signed nothing of the broker's
    env = {**secure_kafka.sasl_env(), "STEPSTREAM_KAFKA_SSL_CA_LOCATION": str(other.ca)}
    where = ["--bootstrap", secure_kafka.bootstrap, "--prefix", _prefix()]
    done = _cli("topics", "check", *where, env=env)
    _one_clear_line(done, "TLS with Kafka", "certificate verify failed", "ssl.ca.location")

    url = f"kafka://{secure_kafka.tls_bootstrap}?prefix=any"
    properties = {"security.protocol": "SSL", "ssl.ca.location": str(other.ca)}
    with pytest.raises(KafkaAuthenticationFailed, match=r"ssl\.ca\.location"):
        async with Client.connect(url, kafka=properties):
            pass


def _docs_example() -> str:
    """The shell block of docs/kafka.md's TLS and SASL/SCRAM section."""
    page = (REPO / "docs" / "kafka.md").read_text()
    section = page.split("\n### Security: TLS and SASL/SCRAM\n", 1)[1]
    return section.split("```bash\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
def test_the_docs_example_runs_as_typed(tmp_path: Path) -> None:
    """Its own secured broker, topics, a worker and a workflow, line after line. Only the
    worker's port changes (tests run side by side) and the examples are copied in."""
    script = _docs_example().replace("--port 8233", "--port 0")
    assert script.startswith("python -m tests.secure_kafka ./secure-kafka &"), script
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    bin_dir = Path(sys.executable).parent
    env = repo_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    env = {k: v for k, v in env.items() if not k.startswith("STEPSTREAM_")}
    done = subprocess.run(
        ["bash", "-c", f"set -e\ntrap '{_STOP_JOBS_NEWEST_FIRST}' EXIT\n{script}"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0, (script, done.stdout, done.stderr[-3000:])
    assert "receipt for o-1" in done.stdout, done.stdout
    assert "SASL_SSL on 127.0.0.1:" in done.stdout, done.stdout
    assert not (tmp_path / "secure-kafka" / "sasl.env").exists()  # removed when it stopped
