"""The commands the chart renders, run as Kubernetes would run them, against the test
broker: the topic Job's container creates the topics (twice: a hook runs on every
upgrade), and the worker container, with exactly the rendered arguments and environment
(Secrets resolved, `$(POD_NAME)` expanded, /data on a volume), serves its probes, takes
the token from its Secret, answers to the Service's and its own advertised names, runs a
workflow, and stops cleanly on SIGTERM within the grace period the chart gives it.
"""

from __future__ import annotations

import asyncio
import base64
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from confluent_kafka import Producer

from stepstream import Client, ConnectionFailed
from stepstream.consumers.kafka.admin import existing_partitions
from stepstream.engine.config.kafka import KafkaSettings
from tests.helm.chart import NAMESPACE, ROOT, Rendered, container, env_of, render
from tests.kafka_broker import Broker
from tests.processes import first_line

pytestmark = pytest.mark.kafka

TOKEN = "chart-test-token"
POD = "shop-stepstream-0"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _pod_environment(spec: dict[str, Any], rendered: Rendered) -> dict[str, str]:
    """The container's environment as the kubelet builds it."""
    env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", "/tmp"),
        # The image would hold the workflow modules; here they are the repository's.
        "PYTHONPATH": str(ROOT),
    }
    for var in spec.get("env", []):
        if "value" in var:
            env[var["name"]] = re.sub(
                r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), var["value"]
            )
        elif "secretKeyRef" in var["valueFrom"]:
            ref = var["valueFrom"]["secretKeyRef"]
            secret = rendered.named("Secret", ref["name"])
            env[var["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
        else:
            assert var["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
            env[var["name"]] = POD
    return env


def _command(spec: dict[str, Any], env: dict[str, str], mounts: dict[str, Path]) -> list[str]:
    """command + args with `$(VAR)` expanded and mount paths mapped to local directories."""
    words = []
    for word in [*spec["command"], *spec["args"]]:
        word = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), word)
        words.append(str(mounts.get(word, word)))
    # The image's `stepstream` is this environment's console script.
    assert words[0] == "stepstream"
    words[0] = str(Path(sys.executable).parent / "stepstream")
    return words


@pytest.fixture
def chart_release(kafka_broker: Broker) -> Rendered:
    return render(
        {
            "kafka": {
                "bootstrapServers": kafka_broker.bootstrap,
                "prefix": f"helm{os.getpid()}{_free_port()}",
                # The test broker's group settings (tests/conftest.py), as an operator
                # passes any client property.
                "config": {"session.timeout.ms": 2000, "heartbeat.interval.ms": 300},
            },
            "topics": {"partitions": 2, "replication": 1},
            "workers": {"workflows": "tests.workflows", "drainTimeoutSeconds": 2},
            "api": {"port": _free_port(), "token": TOKEN},
        }
    )


@pytest.fixture
def worker_process(chart_release: Rendered, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    statefulset = chart_release.one("StatefulSet")
    spec = container(statefulset, "worker")
    env = _pod_environment(spec, chart_release)
    mounts = {m["mountPath"]: tmp_path / m["name"] for m in spec["volumeMounts"]}
    for path in mounts.values():
        path.mkdir()
    log = tmp_path / "worker.log"
    with open(log, "wb") as stderr:
        proc = subprocess.Popen(
            _command(spec, env, mounts),
            cwd=tmp_path,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
    try:
        line = first_line(proc, 60)
        assert "listening on" in line, f"worker did not start: {line!r}\n{log.read_text()[-3000:]}"
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _a_bad_command_is_dead_lettered_and_the_guide_reads_it(
    env: dict[str, Any], tmp_path: Path
) -> None:
    """docs/operations.md, "Dead letters": its snippet finds what the worker refused."""
    bootstrap = env["STEPSTREAM_KAFKA_BOOTSTRAP_SERVERS"]["value"]
    prefix = env["STEPSTREAM_PREFIX"]["value"]
    producer = Producer({"bootstrap.servers": bootstrap})
    producer.produce(f"{prefix}.commands", b"not avro", key=b"chart-2", partition=0)
    assert producer.flush(30) == 0
    guide = (ROOT / "docs" / "operations.md").read_text()
    snippet = re.search(
        r"```python\n(from confluent_kafka import Consumer.*?)```", guide, re.DOTALL
    )
    assert snippet, "docs/operations.md lost its dead-letter reader"
    code = (
        snippet.group(1)
        .replace('"kafka:9092"', repr(bootstrap))
        .replace('"shop.dead-letters"', repr(f"{prefix}.dead-letters"))
        .replace("range(24)", "range(2)")
    )
    deadline = time.monotonic() + 60
    while True:  # the worker dead-letters it once it owns partition 0
        read = subprocess.run(
            [sys.executable, "-c", code],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            timeout=120,
        )
        assert read.returncode == 0, read.stderr.decode()[-3000:]
        out = read.stdout.decode()
        if out or time.monotonic() > deadline:
            break
    assert out.startswith(f"{prefix}.commands 0 ") and "undecodable record" in out, out


def _run_topic_job(rendered: Rendered, tmp_path: Path) -> None:
    spec = container(rendered.one("Job"), "topics")
    env = _pod_environment(spec, rendered)
    done = subprocess.run(
        _command(spec, env, {"/tmp": tmp_path}),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]


def test_the_topic_job_creates_the_topics_and_runs_again(
    chart_release: Rendered, kafka_broker: Broker, tmp_path: Path
) -> None:
    _run_topic_job(chart_release, tmp_path)
    _run_topic_job(chart_release, tmp_path)  # pre-upgrade: idempotent
    prefix = container(chart_release.one("StatefulSet"), "worker")["args"]
    settings = KafkaSettings.load(
        kafka_broker.bootstrap, prefix[prefix.index("--prefix") + 1], environ={}
    )
    partitions = existing_partitions(settings)
    assert partitions[f"{settings.prefix}.commands"] == 2
    assert partitions[f"{settings.prefix}.history"] == 2


async def test_the_worker_container_serves_runs_and_stops_as_rendered(
    chart_release: Rendered, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    _run_topic_job(chart_release, tmp_path)
    proc: subprocess.Popen[bytes] = request.getfixturevalue("worker_process")
    statefulset = chart_release.one("StatefulSet")
    spec = container(statefulset, "worker")
    port = spec["ports"][0]["containerPort"]
    base = f"http://127.0.0.1:{port}"
    service_host = f"shop-stepstream.{NAMESPACE}.svc.cluster.local"
    own_host = f"{POD}.shop-stepstream-workers.{NAMESPACE}.svc.cluster.local"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession(base) as http:
        # The kubelet probes the pod's IP without a token: first the startup probe, then
        # liveness.
        for probe in ("startupProbe", "livenessProbe"):
            async with http.get(spec[probe]["httpGet"]["path"]) as r:
                assert r.status == 200, (probe, await r.text())
        for host in (service_host, f"{own_host}:{port}"):
            async with http.get("/v1/workflows", headers={**auth, "Host": host}) as r:
                assert r.status == 200, (host, await r.text())
        async with http.get("/v1/workflows", headers={"Host": service_host}) as r:
            assert r.status == 401
    async with Client.connect(base, token=TOKEN) as client:
        # A worker takes commands for the partitions it owns: all of them, once the
        # group has assigned them to this only member.
        deadline = asyncio.get_running_loop().time() + 60
        while True:
            try:
                await client.start("arith", 20, instance_id="chart-1")
                break
            except ConnectionFailed:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.2)
        assert await client.result("chart-1", timeout=60) == {"total": 21, "doubled": 42}
    _a_bad_command_is_dead_lettered_and_the_guide_reads_it(env_of(spec), tmp_path)
    proc.send_signal(signal.SIGTERM)
    grace = statefulset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert proc.wait(grace) == 0
    assert list((tmp_path / "data").iterdir()), "the worker kept no state on its volume"
