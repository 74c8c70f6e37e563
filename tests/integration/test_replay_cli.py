"""``stepstream replay`` and ``stepstream history --export`` through the command line.

Histories from a running ``stepstream dev`` (its data directory, read-only, and its API),
from export files and from a Kafka history topic; a changed deploy is refused with exit
status 1 and one line per instance; 10,000 histories replay in well under a minute.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from stepstream.consumers import state_keys
from stepstream.consumers.embedded.db import EmbeddedDB
from stepstream.consumers.embedded.partition import EmbeddedPartition
from stepstream.engine.api.workflow import definition_of
from stepstream.engine.replay.runtime import InstanceRuntime, Output, StepOutcome
from stepstream.engine.replay.state import InstanceState
from stepstream.engine.seams import CommitBatch
from stepstream.engine.wire.codec import JsonCodec
from stepstream.engine.wire.records import HistoryRecord, SendEvent, StartWorkflow
from stepstream.engine.wire.serde import default_serde
from stepstream.engine.wire.topics import partition_for
from tests.dev_server import clean_env, run_cli, start_dev
from tests.fakes import FakeClock

SHOP = """
from stepstream import Context, workflow


def charge(n):
    return {"charged": n}


@workflow("order")
async def order(ctx: Context, n: int) -> dict:
    charged = await ctx.step("charge", charge, n)
    approval = await ctx.wait_for_event("approval", timeout=3600)
    shipped = await ctx.step("ship", charge, n + 1)
    return {"charged": charged, "approval": approval, "shipped": shipped}


@workflow("other")
async def other(ctx: Context, n: int) -> dict:
    return await ctx.step("one", charge, n)
"""
# The deploy under test: "ship" was renamed, which breaks orders past their approval.
SHOP_CHANGED = SHOP.replace('ctx.step("ship"', 'ctx.step("send"')


def lines(stdout: str) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in stdout.splitlines() if line and line[0] != " ")


def files_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def shop(tmp_path: Path) -> Any:
    (tmp_path / "shop_changed.py").write_text(SHOP_CHANGED)
    server = start_dev(tmp_path, "shop", SHOP)
    try:
        for args in (
            ("start", "order", "--input", "1", "--id", "o-1"),
            ("start", "order", "--input", "2", "--id", "o-2"),
            ("start", "other", "--input", "3", "--id", "x-1", "--wait"),
        ):
            run = server.cli(*args)
            assert run.returncode == 0, run.stderr
        waiting_for_approval(server, "o-2")  # so that its history is the same every time
        run = server.cli("send", "o-2", "approval", "--payload", '{"by": "ada"}')
        assert run.returncode == 0, run.stderr
        run = server.cli("start", "order", "--input", "2", "--id", "o-2", "--wait")
        assert run.returncode == 0, run.stderr  # o-2 finished
        yield server
    finally:
        if server.proc.poll() is None:
            server.stop()


def waiting_for_approval(server: Any, instance_id: str) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        status = json.loads(server.cli("status", instance_id, "--json").stdout)
        if any(w["key"] == "approval" for w in status["waits"]):
            return
        time.sleep(0.05)
    pytest.fail(f"{instance_id} never waited for approval: {status}")


def replay(root: Path, *args: str) -> Any:
    return run_cli(root, "replay", *args, env=clean_env(root), timeout=120)


def export(server: Any, root: Path, instance: str) -> Path:
    exported = root / f"{instance}.json"
    assert server.cli("history", instance, "--export", str(exported)).returncode == 0
    return exported


def replayed_ok(root: Path, workflows: str) -> dict[str, str]:
    """The outcome of each history in ``root``'s data directory, which all replay."""
    run = replay(root, "--workflows", workflows, "--data", str(root / "data"))
    assert run.returncode == 0, run.stdout + run.stderr
    return lines(run.stdout)


def test_a_running_engines_data_replays_read_only_and_a_breaking_deploy_exits_1(
    shop: Any, tmp_path: Path
) -> None:
    data = str(tmp_path / "data")
    run = replay(tmp_path, "--workflows", "shop", "--data", data)
    assert run.returncode == 0, run.stdout + run.stderr
    assert lines(run.stdout) == {"o-1": "ok", "o-2": "ok", "x-1": "ok"}
    assert "replayed 3 histories" in run.stderr

    run = replay(tmp_path, "--workflows", "shop_changed", "--data", data)
    assert run.returncode == 1, run.stdout + run.stderr
    assert lines(run.stdout) == {
        "o-1": "ok",  # still waiting for approval: it will take the new path
        "o-2": "diverged key=ship recorded=step reached=step:send",
        "x-1": "ok",
    }

    run = replay(tmp_path, "--workflows", "shop_changed", "--data", data, "--workflow", "other")
    assert (run.returncode, lines(run.stdout)) == (0, {"x-1": "ok"})

    run = replay(tmp_path, "--workflows", "shop_changed", "--data", data, "--json")
    report = json.loads(run.stdout)
    assert report["summary"]["ok"] == 2 and report["summary"]["diverged"] == 1
    (o2,) = [r for r in report["instances"] if r["instance_id"] == "o-2"]
    assert (o2["key"], o2["recorded"], o2["reached"]) == ("ship", "step", "step:send")

    # Nothing in the directory changes (compared with the server stopped).
    shop.stop()
    before = files_digest(tmp_path / "data")
    assert replay(tmp_path, "--workflows", "shop_changed", "--data", data).returncode == 1
    assert files_digest(tmp_path / "data") == before


RESTARTS = """
from stepstream import Context, workflow


def check(args):
    if args.get("fail"):
        raise ValueError("declined")
    return args["tag"]


@workflow("flaky")
async def flaky(ctx: Context, args: dict) -> str:
    return await ctx.step("check", check, args, retry={"max_attempts": 1})


@workflow("gate")
async def gate(ctx: Context, _: dict) -> str:
    return await ctx.wait_for_event("go")
"""


def test_instances_restarted_after_they_ended_replay_their_last_run(tmp_path: Path) -> None:
    """``if_exists="restart_if_failed"`` begins a new run (perhaps of another workflow)
    after a failed, cancelled or terminated one: replay runs the code of the last run."""
    server = start_dev(tmp_path, "restarts", RESTARTS)
    try:
        restart = ("--if-exists", "restart_if_failed", "--wait")
        for args in (
            ("start", "flaky", "--input", '{"tag": "a", "fail": true}', "--id", "k-1", "--wait"),
            ("start", "flaky", "--input", '{"tag": "b"}', "--id", "k-1", *restart),
            ("start", "gate", "--input", "{}", "--id", "c-1"),
            ("cancel", "c-1"),
            ("start", "flaky", "--input", '{"tag": "c"}', "--id", "c-1", *restart),
        ):
            run = server.cli(*args)
            assert run.returncode in (0, 1), run.stderr  # k-1's first run fails: exit 1
        assert json.loads(server.cli("status", "k-1", "--json").stdout)["run"] == 2
        assert json.loads(server.cli("status", "c-1", "--json").stdout)["run"] == 2
        assert "run:      2 (restarted 1 time(s))" in server.cli("status", "c-1").stdout
        exported = export(server, tmp_path, "c-1")
    finally:
        server.stop()
    assert replayed_ok(tmp_path, "restarts") == {"k-1": "ok", "c-1": "ok"}
    run = replay(tmp_path, "--workflows", "restarts", "--file", str(exported), "--json")
    [c1] = json.loads(run.stdout)["instances"]
    assert (c1["outcome"], c1["workflow"]) == ("ok", "flaky"), c1  # the run's, not "gate"


LIMITS = """
from stepstream import Context, Queue, workflow

desk = Queue("desk", concurrency=1)


def one(n):
    return n + 1


@workflow("limited", queue=desk, timeout=3600)
async def limited(ctx: Context, n: int) -> int:
    return await ctx.step("one", one, n)
"""


def test_a_workflow_replays_with_its_queue_and_timeout(tmp_path: Path) -> None:
    """The code replays as registered: a workflow's queue admission is in its history."""
    server = start_dev(tmp_path, "limits", LIMITS)
    try:
        run = server.cli("start", "limited", "--input", "1", "--id", "l-1", "--wait")
        assert run.returncode == 0, run.stderr
        exported = export(server, tmp_path, "l-1")
    finally:
        server.stop()
    assert replayed_ok(tmp_path, "limits") == {"l-1": "ok", "~queue/desk": "ok"}
    run = replay(tmp_path, "--workflows", "limits", "--file", str(exported))
    assert (run.returncode, run.stdout) == (0, "l-1 ok\n"), run.stdout + run.stderr


def test_an_exported_history_replays_from_its_file(shop: Any, tmp_path: Path) -> None:
    exported = tmp_path / "o-2.json"
    run = shop.cli("history", "o-2", "--export", str(exported))
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"wrote 9 records of o-2 to {exported}"
    document = json.loads(exported.read_text())
    assert (document["instance_id"], document["workflow"], document["version"]) == (
        "o-2",
        "order",
        "1",
    )

    run = replay(tmp_path, "--workflows", "shop", "--file", str(exported))
    assert (run.returncode, run.stdout) == (0, "o-2 ok\n"), run.stderr
    run = replay(tmp_path, "--workflows", "shop_changed", "--file", str(exported))
    assert run.returncode == 1
    assert run.stdout.splitlines()[0] == "o-2 diverged key=ship recorded=step reached=step:send"
    assert "no longer reaches it" in run.stdout  # the runtime's own words, for one instance


def test_histories_through_the_api_and_time_travel_with_a_trace(shop: Any, tmp_path: Path) -> None:
    run = replay(tmp_path, "--workflows", "shop_changed", "--connect", shop.url)
    assert run.returncode == 1
    assert lines(run.stdout)["o-2"] == "diverged key=ship recorded=step reached=step:send"

    # o-2 as it stood after its charge: the changed code is fine up to there.
    run = replay(
        tmp_path,
        "--workflows",
        "shop_changed",
        "--connect",
        shop.url,
        "--instance",
        "o-2",
        "--until-seq",
        "3",
        "--trace",
    )
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout.splitlines()
    assert out[0] == "o-2 ok"
    assert out[1].split() == ["seq", "2", "step", "charge", "->", '{"charged":', "2}"]
    assert out[2].split()[:3] == ["new", "wait", "approval"]

    run = replay(
        tmp_path, "--workflows", "shop", "--data", str(tmp_path / "data"), "--instance", "o-2",
        "--trace",
    )  # fmt: skip
    assert run.returncode == 0
    assert [line.split()[3] for line in run.stdout.splitlines()[1:]] == [
        "charge",
        "approval",
        "ship",
    ]
    assert '{"by": "ada"}' in run.stdout


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--data", "d", "--from-offset", "3"], "--from-offset only applies with --bootstrap"),
        (["--data", "d", "--until-seq", "3"], "--until-seq replays one instance"),
        (["--connect", "embedded:d"], "read-only with --data DIR"),
        (["--data", "d", "--file", "f"], "not allowed with argument"),
        ([], "one of the arguments"),
    ],
)
def test_usage_errors_exit_2_and_say_why(tmp_path: Path, args: list[str], says: str) -> None:
    run = replay(tmp_path, "--workflows", "json", *args)
    assert run.returncode == 2, run.stdout + run.stderr
    assert says in run.stderr


def test_a_missing_data_directory_or_instance_exits_1(tmp_path: Path) -> None:
    (tmp_path / "shop.py").write_text(SHOP)
    run = replay(tmp_path, "--workflows", "shop", "--data", str(tmp_path / "none"))
    assert run.returncode == 1 and "not an embedded data directory" in run.stderr
    # A misspelt --workflow would replay nothing and pass a deploy gate: refused.
    (tmp_path / "data").mkdir()
    run = replay(
        tmp_path, "--workflows", "shop", "--data", str(tmp_path / "data"), "--workflow", "odrer"
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "--workflow 'odrer' is not a workflow of shop; it has order" in run.stderr


# ---- 10,000 histories ---------------------------------------------------------------------------


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("shop_for_template", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _template(module: ModuleType) -> list[HistoryRecord]:
    """A completed order, recorded by driving the runtime (no backend)."""
    codec = JsonCodec()
    definition = definition_of(module.order)
    assert definition is not None

    clock = FakeClock()
    runtime = InstanceRuntime(InstanceState("t"), definition, codec=codec, clock=clock, epoch=1)
    records: list[HistoryRecord] = []

    def feed(msg: Any) -> Output:
        out = Output()
        runtime.handle(msg, out)
        records.extend(out.history)
        for launch in out.launches:
            value = codec.encode(launch.fn(*launch.args, **launch.kwargs))
            feed(StepOutcome("t", launch.key, launch.attempt, value))
        return out

    feed(StartWorkflow(instance_id="t", command_id="s", workflow="order", input=codec.encode(5)))
    feed(SendEvent(instance_id="t", command_id="e", name="approval", payload=codec.encode("ok")))
    runtime.close()
    assert records[-1].type == "WorkflowCompleted", records
    return records


async def test_ten_thousand_histories_replay_in_well_under_a_minute(tmp_path: Path) -> None:
    (tmp_path / "shop.py").write_text(SHOP)
    template = _template(_load(tmp_path / "shop.py"))
    serde = default_serde()
    count, partitions = 10_000, 4
    db = await EmbeddedDB.open(tmp_path / "data", partitions)
    try:
        batches = [CommitBatch() for _ in range(partitions)]
        for n in range(count):
            instance_id = f"o-{n}"
            batch = batches[partition_for(instance_id, partitions)]
            for record in template:
                copy = dataclasses.replace(record, instance_id=instance_id)
                batch.put(state_keys.history(instance_id, record.seq), serde.encode(copy))
        for p, batch in enumerate(batches):
            await EmbeddedPartition(db, p).commit(batch)
    finally:
        await db.close()

    began = time.monotonic()
    run = replay(tmp_path, "--workflows", "shop", "--data", str(tmp_path / "data"))
    took = time.monotonic() - began
    assert run.returncode == 0, run.stderr[-2000:]
    assert len(run.stdout.splitlines()) == count
    assert set(lines(run.stdout).values()) == {"ok"}
    assert "replayed 1000 histories in" in run.stderr  # progress on long runs
    assert f"replayed {count} histories" in run.stderr
    print(f"stepstream replay --data: {count} histories in {took:.1f} s (process included)")
    assert took < 60, f"{count} histories took {took:.1f} s"


# ---- Kafka: the history topic itself ------------------------------------------------------------

ARITH_CHANGED = """
from stepstream import Context, workflow
from tests.workflows import add, async_double


@workflow("arith")
async def arith(ctx: Context, n: int) -> dict:
    total = await ctx.step("add", add, n, 1)
    doubled = await ctx.step("twice", async_double, total)  # was "double"
    return {"total": total, "doubled": doubled}
"""


@pytest.mark.kafka
async def test_the_history_topic_replays_folded_by_the_reader_rules(
    kafka_worker: Any, tmp_path: Path
) -> None:
    from stepstream.producers.client import Client
    from tests.conftest import kafka_url

    settings = kafka_worker.settings
    async with Client.connect(kafka_url(settings)) as client:
        for n in range(4):
            await client.start("arith", n, instance_id=f"a-{n}")
        for n in range(4):
            assert (await client.result(f"a-{n}", timeout=60))["total"] == n + 1
    (tmp_path / "arith_changed.py").write_text(ARITH_CHANGED)
    source = ("--bootstrap", settings.bootstrap, "--prefix", settings.prefix)

    run = replay(tmp_path, "--workflows", "tests.workflows", *source)
    assert run.returncode == 0, run.stdout + run.stderr
    assert lines(run.stdout) == {f"a-{n}": "ok" for n in range(4)}

    run = replay(tmp_path, "--workflows", "arith_changed", *source, "--instance", "a-2")
    assert run.returncode == 1
    assert lines(run.stdout) == {"a-2": "diverged key=double recorded=step reached=step:twice"}

    # From an offset past the start of the first instance of each partition: what began
    # before it cannot be replayed, and is skipped (not failed).
    run = replay(tmp_path, "--workflows", "tests.workflows", *source, "--from-offset", "3")
    assert run.returncode == 0, run.stdout + run.stderr
    outcomes = list(lines(run.stdout).values())
    assert all(
        o == "ok" or o.startswith("skipped: the history read starts at seq") for o in outcomes
    )
    assert any(o.startswith("skipped") for o in outcomes), run.stdout
    run = replay(tmp_path, "--workflows", "tests.workflows", *source, "--from-offset", "100000")
    assert (run.returncode, run.stdout) == (0, "")
    assert "replayed 0 histories" in run.stderr
