"""A worker whose Kafka credential goes bad while it runs, and comes back.

Apache Kafka with a SASL_SSL listener that makes every connection log in again after 5 s
(``connections.max.reauth.ms``, KIP-368); a ``stepstream worker`` (a subprocess, with the
documented variables) runs workflows; then the worker's SCRAM credential is changed (the
password rotated) or deleted on the broker with the admin API, as an operator would. The
worker must say so once in its log (ERROR, naming the cause and what to do), report not
ready on ``/readyz`` with the reason and ``stepstream_kafka_login_refused`` 1 on
``/metrics``, and, once the credential is restored, go on by itself: ready again, and
every workflow started before, during (by a client logged in as another user) and after
the outage completes exactly once.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.admin import (
    AdminClient,
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialDeletion,
    UserScramCredentialUpsertion,
)

from stepstream import Client
from tests.conftest import KAFKA_TEST_OPTIONS
from tests.integration.test_kafka_sasl import _cli
from tests.kafka_broker import discard
from tests.processes import launch, repo_env, worker_command
from tests.secure_kafka import (
    BROKER_USER,
    MECHANISM,
    PASSWORD,
    USER,
    SecureKafka,
    start_secure_kafka,
)

REAUTH_MS = 5000
REFUSED_LINE = "refused this worker's SASL login"


@pytest.fixture(scope="module")
def reauth_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureKafka]:
    root = tmp_path_factory.mktemp("reauth-kafka")
    kafka = start_secure_kafka(root, {"connections.max.reauth.ms": str(REAUTH_MS)})
    yield kafka
    discard(kafka.cluster)


def _properties(kafka: SecureKafka, user: str, password: str) -> dict[str, str]:
    return {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": MECHANISM,
        "sasl.username": user,
        "sasl.password": password,
        "ssl.ca.location": str(kafka.ca),
    }


def _set_credential(kafka: SecureKafka, password: str | None) -> None:
    """What an operator does with ``kafka-configs --alter --entity-type users``: the
    worker's user gets ``password``, or (None) loses its SCRAM credential."""
    admin = AdminClient(
        {
            "bootstrap.servers": kafka.bootstrap,
            **_properties(kafka, BROKER_USER.name, BROKER_USER.password),
        }
    )
    mechanism = ScramMechanism.SCRAM_SHA_512
    change: UserScramCredentialUpsertion | UserScramCredentialDeletion
    if password is None:
        change = UserScramCredentialDeletion(USER, mechanism)
    else:
        change = UserScramCredentialUpsertion(
            USER, ScramCredentialInfo(mechanism, 8192), password.encode()
        )
    for future in admin.alter_user_scram_credentials([change]).values():
        future.result(timeout=30)


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _gauge(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


async def _until(check: Any, what: str, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.25)


def _refusal_errors(log: Path) -> list[str]:
    return [
        line for line in log.read_text().splitlines() if REFUSED_LINE in line and "ERROR" in line
    ]


async def _exactly_once(client: Client, instance: str) -> None:
    history = await client.history(instance)
    kinds = Counter(h.type for h in history)
    successes = Counter(h.attributes["key"] for h in history if h.type == "StepSucceeded")
    shown = [(h.seq, h.type) for h in history]
    assert kinds["WorkflowStarted"] == 1 and kinds["WorkflowCompleted"] == 1, shown
    assert all(n == 1 for n in successes.values()), shown


@pytest.mark.slow
async def test_a_worker_locked_out_while_it_runs_says_so_and_goes_on_when_let_back_in(
    reauth_kafka: SecureKafka, tmp_path: Path
) -> None:
    """The worker's SCRAM credential is deleted on the broker, then made again. (A
    rotated password is refused the same way; the next test rotates one.)"""
    kafka = reauth_kafka
    env = kafka.sasl_env()
    prefix = f"cred{uuid.uuid4().hex[:8]}"
    where = ["--bootstrap", kafka.bootstrap, "--prefix", prefix]
    created = _cli("topics", "create", *where, "--partitions", "2", env=env)
    assert created.returncode == 0, created.stderr

    log = tmp_path / "worker.log"
    # The tests' group session (2 s), so that being locked out outlasts it soon.
    state = tmp_path / "state"
    command = worker_command("tests.workflows", kafka.bootstrap, prefix, state, KAFKA_TEST_OPTIONS)
    proc, api = launch(command, env=repo_env(**env), log=log)
    url = f"kafka://{kafka.bootstrap}?prefix={prefix}"
    worker_login = _properties(kafka, USER, PASSWORD)
    # Another user's client: it can still publish while the worker's user is locked out.
    other_login = _properties(kafka, BROKER_USER.name, BROKER_USER.password)
    try:
        await _until(lambda: _get(f"{api}/readyz")[0] == 200, "the worker to be ready", 60)
        async with Client.connect(url, kafka=worker_login) as client:
            await client.start("arith", 1, instance_id="before")
            assert await client.result("before", timeout=60) == {"total": 2, "doubled": 4}
            await client.start("waiter", None, instance_id="spanning")
            assert (await client.status("spanning")).status == "running"

        _set_credential(kafka, None)
        # Within the re-authentication interval every connection is refused.
        await _until(lambda: _refusal_errors(log), "the worker's ERROR line", 30)
        _, body = await _until(
            lambda: (r := _get(f"{api}/readyz"))[0] == 503 and r, "/readyz 503", 15
        )
        reason = json.loads(body)["reason"]
        assert "refused" in reason and "STEPSTREAM_KAFKA_SASL_PASSWORD" in reason, reason
        metrics = _get(f"{api}/metrics")[1]
        assert _gauge(metrics, "stepstream_kafka_login_refused") == 1
        assert _gauge(metrics, "stepstream_ready") == 0

        async with Client.connect(url, kafka=other_login) as client:
            for n in range(3):
                await client.start("arith", 10 + n, instance_id=f"during-{n}")
        # Locked out past its group session (2 s): the partitions are lost and taken again.
        await asyncio.sleep(5)
        errors = _refusal_errors(log)
        assert len(errors) == 1, errors  # one line, not one per reconnect
        assert "sasl.password" in errors[0] and "restart the worker" in errors[0], errors[0]
        assert PASSWORD not in log.read_text()
        flood = [line for line in log.read_text().splitlines() if "SASL authentication" in line]
        assert len(flood) <= 1, flood[:5]
        assert _get(f"{api}/readyz")[0] == 503

        _set_credential(kafka, PASSWORD)
        let_in = time.monotonic()
        await _until(lambda: _get(f"{api}/readyz")[0] == 200, "ready again", 90)
        recovered_s = time.monotonic() - let_in
        assert _gauge(_get(f"{api}/metrics")[1], "stepstream_kafka_login_refused") == 0
        assert "accepts this worker's login again" in log.read_text()

        async with Client.connect(url, kafka=worker_login) as client:
            await client.start("arith", 20, instance_id="after")
            await client.send_event("spanning", "approval", {"by": "ada"})
            assert await client.result("after", timeout=60) == {"total": 21, "doubled": 42}
            assert await client.result("spanning", timeout=60) == {"by": "ada"}
            for n in range(3):
                expected = {"total": 11 + n, "doubled": 2 * (11 + n)}
                assert await client.result(f"during-{n}", timeout=60) == expected
            for instance in ("before", "spanning", "after", "during-0", "during-1", "during-2"):
                await _exactly_once(client, instance)
        print(f"ready again {recovered_s:.1f} s after the credential was restored")
    finally:
        _set_credential(kafka, PASSWORD)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]


@pytest.mark.slow
async def test_a_worker_told_to_exit_when_locked_out_does_and_restarts_with_the_new_password(
    reauth_kafka: SecureKafka, tmp_path: Path
) -> None:
    """``STEPSTREAM_EXIT_AFTER_LOGIN_REFUSED_S``: a password rotated on purpose needs the
    worker started again with the new one (as Kubernetes does, reading the Secret again)."""
    kafka = reauth_kafka
    rotated = "app-secret-2"
    prefix = f"cred{uuid.uuid4().hex[:8]}"
    where = ["--bootstrap", kafka.bootstrap, "--prefix", prefix]
    created = _cli("topics", "create", *where, "--partitions", "2", env=kafka.sasl_env())
    assert created.returncode == 0, created.stderr
    log = tmp_path / "worker.log"
    command = worker_command("tests.workflows", kafka.bootstrap, prefix, tmp_path / "state", [])
    exits = {"STEPSTREAM_EXIT_AFTER_LOGIN_REFUSED_S": "5"}
    proc, api = launch(command, env=repo_env(**kafka.sasl_env(), **exits), log=log)
    url = f"kafka://{kafka.bootstrap}?prefix={prefix}"
    try:
        await _until(lambda: _get(f"{api}/readyz")[0] == 200, "the worker to be ready", 60)
        async with Client.connect(url, kafka=_properties(kafka, USER, PASSWORD)) as client:
            await client.start("waiter", None, instance_id="spanning")
            assert (await client.status("spanning")).status == "running"

        _set_credential(kafka, rotated)
        began = time.monotonic()
        code = await asyncio.to_thread(proc.wait, 90)
        took = time.monotonic() - began
        text = log.read_text()
        assert code == 1, text[-3000:]
        errors = [line for line in text.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1, text[-3000:]
        for expected in ("refused this worker for 5 s", "sasl.password", "start it again"):
            assert expected in errors[0], errors[0]
        assert rotated not in text and PASSWORD not in text

        again = repo_env(**kafka.sasl_env(password=rotated))
        proc, api = launch(command, env=again, log=log)
        await _until(lambda: _get(f"{api}/readyz")[0] == 200, "the new worker to be ready", 60)
        async with Client.connect(url, kafka=_properties(kafka, USER, rotated)) as client:
            await client.send_event("spanning", "approval", {"by": "ada"})
            assert await client.result("spanning", timeout=60) == {"by": "ada"}
            await client.start("arith", 1, instance_id="after")
            assert await client.result("after", timeout=60) == {"total": 2, "doubled": 4}
            for instance in ("spanning", "after"):
                await _exactly_once(client, instance)
        print(f"exited {took:.1f} s after the password was rotated")
    finally:
        _set_credential(kafka, PASSWORD)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
