"""Every construct of the round-2 workflow language reaches the same state after a forced
replay (issue 7), beyond the pause/resume of tests/integration/test_workflows.py:

- eviction: an engine that keeps one live instance per partition (embedded, and a Kafka
  worker) runs several instances of each construct at once, so nearly every input loads
  its instance from state and replays its code from history;
- kill -9: a `stepstream dev` process is killed with SIGKILL after the starts, after half
  of the inputs and after the rest, and started again on the same data directory.

Each case is driven with the inputs its normal test sends and must end as that test says;
every history (parents' children too) keeps increasing seqs (contiguous where no loop
pruned it) and never records a step key's success twice.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from stepstream import HistoryEntry, UnknownInstance, WorkflowCancelled
from stepstream.consumers.partition import ProcessorConfig
from stepstream.engine.api.workflow import Registry
from stepstream.ops.embedded import EmbeddedConfig, open_embedded
from stepstream.producers.client import Client
from tests.conftest import ThreadedWorker, kafka_settings, kafka_url
from tests.kafka_broker import Broker
from tests.workflows import ledger_count

REPO = Path(__file__).resolve().parents[2]
MODULES = ("tests.workflows", "tests.replay_workflows")
PARTITIONS = 2

Driver = Callable[[Client, str], Awaitable[None]]
Check = Callable[[str, list[HistoryEntry]], None]
After = Callable[[Client, str, Path], Awaitable[None]]


# ---- the cases ------------------------------------------------------------------------


async def _nothing(client: Client, instance: str) -> None:
    return None


async def _after_nothing(client: Client, instance: str, ledger: Path) -> None:
    return None


def _no_check(instance: str, history: list[HistoryEntry]) -> None:
    return None


@dataclass(frozen=True)
class Case:
    """One construct: how it starts, the two halves of its inputs and how it must end."""

    name: str
    workflow: str
    input: Callable[[str], Any]
    expect: Callable[[str], Any]  # the result, or the exception type result() raises
    first: Driver = _nothing
    second: Driver = _nothing
    check: Check = _no_check  # what its history must show
    after: After = _after_nothing  # what else must hold once it finished
    before: Driver = _nothing  # run before the start (another instance it talks to)
    children: Callable[[str], list[str]] = field(default=lambda instance: [])
    pruned: bool = False  # a loop pruned its history: seqs increase but leave gaps
    # A running step keeps its instance cached: one that runs steps from its start to its
    # end is never evicted (a variant with a wait or a sleep stands in for it).
    evictable: bool = True
    # The result after kill -9s, from the history, where a lost attempt may change it.
    killed: Callable[[str, list[HistoryEntry]], Any] | None = None


def _render(instance: str, history: list[HistoryEntry]) -> str:
    lines = [f"history of {instance}:"]
    lines += [f"  {h.seq:3d} {h.type} {h.command_id} {h.attributes}" for h in history]
    return "\n".join(lines)


def _of(history: list[HistoryEntry], kind: str) -> list[HistoryEntry]:
    return [h for h in history if h.type == kind]


def _keys(history: list[HistoryEntry], kind: str) -> list[str]:
    return [h.attributes["key"] for h in _of(history, kind)]


async def _until(probe: Callable[[], Awaitable[bool]], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not await probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def _waits_on(client: Client, instance: str, kind: str, key: str | None = None) -> None:
    async def probe() -> bool:
        try:
            status = await client.status(instance)
        except UnknownInstance:  # a child its parent has not started yet
            return False
        return any(w.kind == kind and key in (None, w.key) for w in status.waits)

    await _until(probe, f"{instance} to wait on {kind} {key or ''}")


def _send_when_waiting(name: str, payload: Any, to: Callable[[str], str] = str) -> Driver:
    """Sends the event once a wait for it is open: meanwhile the instance sits idle, and
    the other instances' inputs evict it from the cache."""

    async def send(client: Client, instance: str) -> None:
        target = to(instance)

        async def waiting() -> bool:
            try:
                status = await client.status(target)
            except UnknownInstance:  # a child its parent has not started yet
                return False
            return any(w.kind == "wait" and w.event == name for w in status.waits)

        await _until(waiting, f"{target} to wait for {name!r}")
        await client.send_event(target, name, payload)

    return send


def _send(name: str, payload: Any) -> Driver:
    async def send(client: Client, instance: str) -> None:
        await client.send_event(instance, name, payload)

    return send


def _sends(*events: tuple[str, Any]) -> Driver:
    async def send(client: Client, instance: str) -> None:
        for name, payload in events:
            await client.send_event(instance, name, payload)

    return send


# reuse: repeated names in a loop and a scope


def _check_reuse(instance: str, history: list[HistoryEntry]) -> None:
    assert _keys(history, "StepSucceeded") == ["same", "same#2", "tail/same"]
    assert _keys(history, "WaitSatisfied") == ["item", "item#2"]


# race-events: a winner recorded, a withdrawn wait that takes no event


def _check_race_rejected(instance: str, history: list[HistoryEntry]) -> None:
    assert [h.attributes["winner"] for h in _of(history, "RaceDecided")] == ["rejected"]
    assert _keys(history, "WaitSatisfied") == ["race/rejected/reject", "approve"]


async def _approve_after_the_deadline(client: Client, instance: str) -> None:
    await _waits_on(client, instance, "wait", "approve")  # the wait after the race
    await client.send_event(instance, "approve", "too late")


def _check_race_expired(instance: str, history: list[HistoryEntry]) -> None:
    assert [h.attributes["winner"] for h in _of(history, "RaceDecided")] == ["expired"]
    assert _keys(history, "WaitSatisfied") == ["approve"]


# join-parts: named branches, each in its own scope


def _check_join(instance: str, history: list[HistoryEntry]) -> None:
    assert sorted(_keys(history, "StepSucceeded")) == [
        "join/ab/fetch",
        "join/ab/fetch#2",
        "join/cde/fetch",
        "join/cde/fetch#2",
    ]


# polling: a loop with carried state and pruning


def _check_polling(instance: str, history: list[HistoryEntry]) -> None:
    assert _keys(history, "StepSucceeded") == [f"poll/{i}/tick" for i in range(36, 40)]
    assert len(history) < 25  # 40 iterations, bounded


# trip: a saga that books, and one that rolls back newest first


def _check_rolled_back(instance: str, history: list[HistoryEntry]) -> None:
    assert _keys(history, "StepSucceeded") == [
        "booking/flight",
        "booking/hotel",
        "booking/hotel/undo",
        "booking/flight/undo",
    ]


def _check_booked(instance: str, history: list[HistoryEntry]) -> None:
    assert _keys(history, "StepSucceeded") == ["booking/flight", "booking/hotel"]


async def _refuse_until_compensating(client: Client, instance: str) -> None:
    """Refuses the trip, and returns once its first compensation runs (the kill -9 that
    follows lands in the middle of compensating)."""
    await _send_when_waiting("confirm", False)(client, instance)
    await _waits_on(client, instance, "step", "booking/hotel/undo")


async def _released_once_each(client: Client, instance: str, ledger: Path) -> None:
    """Each compensation ran (a killed run ran again) and none ran more often than it has
    recorded attempts."""
    history = await client.history(instance)
    for what in ("hotel", "flight"):
        attempts = _keys(history, "StepAttemptStarted").count(f"booking/{what}/undo")
        started = ledger_count(ledger, f"{instance}-{what}-release-started")
        assert ledger_count(ledger, f"{instance}-{what}-released") >= 1, _render(instance, history)
        assert 1 <= started <= attempts, _render(instance, history)


# parent / kid: child workflows, failure propagation, cancellation


def _kids(instance: str) -> list[str]:
    return [f"{instance}/kid", f"{instance}/kid#2", f"{instance}-bad"]


def _family(n: int) -> Callable[[str], Any]:
    def expect(instance: str) -> Any:
        return [
            {"kid": f"{instance}/kid", "doubled": 2 * n},
            {"kid": f"{instance}/kid#2", "doubled": 2 * (n + 1)},
            "failed",
            "StepFailed",
        ]

    return expect


async def _kids_settled(client: Client, instance: str, ledger: Path) -> None:
    statuses = [(await client.status(kid)).status for kid in _kids(instance)]
    assert statuses == ["completed", "completed", "failed"], statuses


async def _cancel_the_parent(client: Client, instance: str) -> None:
    await _waits_on(client, f"{instance}/kid#2", "wait")
    await client.cancel(instance, reason="changed my mind")


async def _kid_cancelled_too(client: Client, instance: str, ledger: Path) -> None:
    kid = f"{instance}/kid#2"
    with pytest.raises(WorkflowCancelled, match=f"its parent {instance} was cancelled"):
        await client.result(kid, timeout=30)


# mailbox: message batches, completion, a message sent to another instance once


def _listener(instance: str) -> str:
    return f"{instance}-listener"


async def _start_listener(client: Client, instance: str) -> None:
    await client.start("waiter", None, instance_id=_listener(instance))


def _check_mailbox(instance: str, history: list[HistoryEntry]) -> None:
    types = [h.type for h in history]
    assert types.count("MessageSent") == 1 and types.count("MessageCompleted") == 4


async def _tally_once(client: Client, instance: str, ledger: Path) -> None:
    listener = _listener(instance)

    async def arrived() -> bool:
        return bool((await client.status(listener)).buffered_events)

    await _until(arrived, f"the tally to reach {listener}")
    history = await client.history(listener)
    tally = [
        (h.attributes["event_name"], h.attributes["payload"]) for h in _of(history, "EventBuffered")
    ]
    assert tally == [("tally", 4)], _render(listener, history)
    await client.cancel(listener)  # it waits for ever otherwise


# quoter: requests answered by msg.complete


async def _one_request(client: Client, instance: str) -> None:
    assert await client.request(instance, "quote", {"qty": 1}, timeout=30) == {"price": 3}


async def _more_requests_then_stop(client: Client, instance: str) -> None:
    answers = await asyncio.gather(
        *(client.request(instance, "quote", {"qty": n}, timeout=30) for n in (2, 3))
    )
    assert sorted(a["price"] for a in answers) == [6, 9]
    await client.send_event(instance, "stop", None, event_id=f"{instance}-stop")
    await client.send_event(instance, "stop", None, event_id=f"{instance}-stop")  # applied once


def _check_quoter(instance: str, history: list[HistoryEntry]) -> None:
    assert [h.type for h in history].count("MessageCompleted") == 3


# ephemeral and cancelled-step


def _check_ephemeral(instance: str, history: list[HistoryEntry]) -> None:
    types = [h.type for h in history]
    assert types.count("StepSucceeded") == 5 and "StepAttemptStarted" not in types


def _check_cancelled_step(instance: str, history: list[HistoryEntry]) -> None:
    failed = [
        (h.attributes["attempt"], h.attributes["error_type"]) for h in _of(history, "StepFailed")
    ]
    # A kill -9 during the first attempt loses it (AttemptLost): the second succeeds.
    first_lost = (1, "AttemptLost") in failed
    raised = [f for f in failed if f[1] != "AttemptLost"]
    assert raised == ([] if first_lost else [(1, "CancelledError")])


# tries (tests.replay_workflows): ctx.try_step's failure kinds


TRIES = [
    [False, "exhausted", 2, "RuntimeError"],
    [False, "non_retryable", 1, "NonRetryableError"],
    [False, "timeout", 1, "StepTimeout"],
    "went",
    True,
    3,
]
_KINDS = {"StepTimeout": "timeout", "NonRetryableError": "non_retryable"}


def _tries_expected(instance: str, history: list[HistoryEntry]) -> Any:
    """Without a lost attempt, TRIES. A kill -9 during an attempt uses it up (AttemptLost):
    then each result is the one the step's last recorded failure says."""
    failed = _of(history, "StepFailed")
    if not any(h.attributes["error_type"] == "AttemptLost" for h in failed):
        return TRIES

    def last(key: str) -> list[Any]:
        [*_, a] = [h.attributes for h in failed if h.attributes["key"] == key]
        return [False, _KINDS.get(a["error_type"], "exhausted"), a["attempt"], a["error_type"]]

    return [last("flaky"), last("fatal"), last("slow"), "went", True, 3]


def _check_tries(instance: str, history: list[HistoryEntry]) -> None:
    assert _keys(history, "StepSucceeded") == ["fine"]


# race-step (tests.replay_workflows): a losing branch's running step


async def _go_while_working(client: Client, instance: str) -> None:
    await _waits_on(client, instance, "step", "race/slow/work")
    await client.send_event(instance, "go", "now")


async def _late_success_dropped(client: Client, instance: str, ledger: Path) -> None:
    """Once the abandoned body returned (a sync body cannot be cancelled), its success is
    not recorded; no attempt of the losing step starts after the race was decided, and
    each run of the body belongs to a recorded attempt."""
    started = f"{instance}-started"
    deadline = time.monotonic() + 2  # a body takes 1 s (one killed by kill -9 never ends)
    while ledger_count(ledger, f"{instance}-finished") < ledger_count(ledger, started):
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)  # its outcome reached the engine
    history = await client.history(instance)
    why = _render(instance, history)
    assert _keys(history, "StepSucceeded") == ["after"], why
    [decided] = [h.seq for h in _of(history, "RaceDecided")]
    work = [
        h for h in _of(history, "StepAttemptStarted") if h.attributes["key"] == "race/slow/work"
    ]
    assert all(h.seq < decided for h in work), why
    assert ledger_count(ledger, started) <= len(work), why


def _check_attributes(instance: str, history: list[HistoryEntry]) -> None:
    recorded = [h.attributes["attributes"] for h in _of(history, "AttributesSet")]
    assert recorded == [{"customer": instance}, {"stage": "paid"}], (instance, recorded)


async def _attributes_merged(client: Client, instance: str, ledger: Path) -> None:
    assert (await client.status(instance)).attributes == {"customer": instance, "stage": "paid"}
    page = await client.list_page(where={"customer": instance, "stage": "paid"})
    assert [i.instance_id for i in page.instances] == [instance]


CASES = [
    Case(
        "attributes",
        "tagged",
        lambda i: {"customer": i},
        lambda i: {"stage": "paid"},
        second=_send_when_waiting("more", {"stage": "paid"}),
        check=_check_attributes,
        after=_attributes_merged,
    ),
    Case(
        "reuse",
        "reuse",
        lambda i: 2,
        lambda i: [1, "a", 2, "b", 101],
        first=_send_when_waiting("item", "a"),
        second=_send_when_waiting("item", "b"),
        check=_check_reuse,
    ),
    Case(
        "race-rejected",
        "race-events",
        lambda i: 3600,
        lambda i: ["rejected", "no", "yes"],
        # No wait between the two: "approve" may reach the engine before the code that
        # withdraws the losing wait ran, and must still go to the wait after the race.
        first=_send("reject", "no"),
        second=_send("approve", "yes"),
        check=_check_race_rejected,
    ),
    Case(
        "race-expired",
        "race-events",
        lambda i: 0.3,
        lambda i: ["expired", None, "too late"],
        second=_approve_after_the_deadline,
        check=_check_race_expired,
    ),
    Case(
        "join",
        "join-parts",
        lambda i: ["ab", "cde"],
        lambda i: {"ab": [2, 2], "cde": [3, 2]},
        check=_check_join,
        evictable=False,
    ),
    Case(
        "join-waits",
        "join-waits",
        lambda i: ["ab", "cde"],
        lambda i: {"ab": [2, "x", 2], "cde": [3, "y", 2]},
        first=_send_when_waiting("ab", "x"),
        second=_send_when_waiting("cde", "y"),
        check=_check_join,
    ),
    Case(
        "polling",
        "polling",
        lambda i: {"n": 40, "pause_at": 20, "keep": 3},
        lambda i: 40,
        second=_send_when_waiting("go-on", None),
        check=_check_polling,
        pruned=True,
    ),
    Case(
        "trip-back",
        "trip",
        lambda i: True,
        lambda i: "rolled back: payment failed",
        second=_send_when_waiting("payment-failed", None),
        check=_check_rolled_back,
    ),
    Case(
        "trip-ok",
        "trip",
        lambda i: False,
        lambda i: "booked",
        check=_check_booked,
        evictable=False,
    ),
    Case(
        "trip-confirmed",
        "trip-confirm",
        lambda i: None,
        lambda i: "booked",
        second=_send_when_waiting("confirm", True),
        check=_check_booked,
    ),
    Case(
        "trip-refused",
        "trip-confirm",
        lambda i: None,
        lambda i: "rolled back: not confirmed",
        second=_send_when_waiting("confirm", False),
        check=_check_rolled_back,
    ),
    Case(
        "trip-slow-undo",
        "trip-slow-undo",
        lambda i: None,
        lambda i: "rolled back: not confirmed",
        second=_refuse_until_compensating,
        check=_check_rolled_back,
        after=_released_once_each,
    ),
    Case(
        "parent",
        "parent",
        lambda i: {"n": 5},
        _family(5),
        after=_kids_settled,
        children=_kids,
    ),
    Case(
        "parent-wait",
        "parent",
        lambda i: {"n": 1, "wait": True},
        _family(1),
        second=_send_when_waiting("kid-go", None, to=lambda i: f"{i}/kid#2"),
        after=_kids_settled,
        children=_kids,
    ),
    Case(
        "parent-cancel",
        "parent",
        lambda i: {"n": 1, "wait": True},
        lambda i: WorkflowCancelled,
        second=_cancel_the_parent,
        after=_kid_cancelled_too,
        children=lambda i: [f"{i}/kid", f"{i}/kid#2"],
    ),
    Case(
        "mailbox",
        "mailbox",
        lambda i: {"count": 4, "notify": _listener(i)},
        lambda i: [["line", "a"], ["line", "b"], ["urgent", "c"], ["line", "d"]],
        before=_start_listener,
        first=_sends(("line", "a"), ("line", "b")),
        second=_sends(("urgent", "c"), ("line", "d")),
        check=_check_mailbox,
        after=_tally_once,
    ),
    Case(
        "quoter",
        "quoter",
        lambda i: None,
        lambda i: 3,
        first=_one_request,
        second=_more_requests_then_stop,
        check=_check_quoter,
    ),
    Case(
        "ephemeral",
        "ephemeral",
        lambda i: 5,
        lambda i: 10,
        check=_check_ephemeral,
        evictable=False,
    ),
    Case("ephemeral-naps", "ephemeral-naps", lambda i: 5, lambda i: 10, check=_check_ephemeral),
    Case(
        "cancelled-step",
        "cancelled-step",
        lambda i: None,
        lambda i: "second attempt",
        check=_check_cancelled_step,
    ),
    Case(
        "tries",
        "tries",
        lambda i: None,
        lambda i: TRIES,
        killed=_tries_expected,
        second=_send_when_waiting("go", "went"),
        check=_check_tries,
    ),
    Case(
        "race-step",
        "race-step",
        lambda i: 1.0,
        lambda i: ["go", "now", "yes", 2],
        first=_go_while_working,
        second=_send_when_waiting("done", "yes"),
        after=_late_success_dropped,
    ),
]


# ---- checks ----------------------------------------------------------------------------


_ENDS = ("WorkflowCompleted", "WorkflowFailed", "WorkflowCancelled")


def check_invariants(instance: str, history: list[HistoryEntry], *, pruned: bool) -> None:
    """What every history must satisfy, however often it was replayed."""
    why = _render(instance, history)
    seqs = [h.seq for h in history]
    if pruned:
        assert seqs == sorted(set(seqs)) and seqs[0] == 1, why
    else:
        assert seqs == list(range(1, len(history) + 1)), why
    twice = [k for k, n in Counter(_keys(history, "StepSucceeded")).items() if n > 1]
    assert twice == [], why
    types = [h.type for h in history]
    assert types.count("WorkflowStarted") == 1, why
    ends = [i for i, t in enumerate(types) if t in _ENDS]
    assert len(ends) <= 1, why
    # After its end an instance records only the commands it ignores.
    assert not ends or all(t == "CommandIgnored" for t in types[ends[0] + 1 :]), why


async def start(client: Client, case: Case, instance: str) -> None:
    await case.before(client, instance)
    await client.start(case.workflow, case.input(instance), instance_id=instance)


async def finish(
    client: Client, case: Case, instance: str, ledger: Path, *, killed: bool = False
) -> None:
    """Waits for the instance's end and checks everything the case says about it."""
    try:
        expected = case.expect(instance)
        if isinstance(expected, type) and issubclass(expected, BaseException):
            with pytest.raises(expected):
                await client.result(instance, timeout=45)
            history = await client.history(instance)
        else:
            result = await client.result(instance, timeout=45)
            history = await client.history(instance)
            if killed and case.killed is not None:
                expected = case.killed(instance, history)
            assert result == expected
        check_invariants(instance, history, pruned=case.pruned)
        case.check(instance, history)
        await case.after(client, instance, ledger)
        for child in case.children(instance):
            check_invariants(child, await client.history(child), pruned=False)
    except Exception:
        try:
            print(_render(instance, await client.history(instance)))
            for child in case.children(instance):
                print(_render(child, await client.history(child)))
        except Exception as exc:
            print(f"could not read the history of {instance}: {exc!r}")
        raise


async def all_of(calls: Iterable[Awaitable[None]]) -> None:
    """Runs every call to its end (each failing one prints its instance's history)."""
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    failures = [o for o in outcomes if isinstance(o, BaseException)]
    if len(failures) == 1:
        raise failures[0]
    if failures:
        raise BaseExceptionGroup(f"{len(failures)} instances failed", failures)


def instances(copies: int) -> list[tuple[Case, str]]:
    return [(case, f"{case.name}-{n}") for case in CASES for n in range(copies)]


# ---- eviction: a cache of one live instance per partition ----------------------------


def registry() -> Registry:
    built = Registry()
    built.add_modules(",".join(MODULES))
    return built


@asynccontextmanager
async def evicting(backend: str, tmp_path: Path, broker: Broker | None) -> AsyncIterator[Client]:
    if backend == "embedded":
        config = EmbeddedConfig(
            data_dir=str(tmp_path / "data"), partitions=PARTITIONS, cache_size=1
        )
        engine = await open_embedded(registry(), config)
        async with Client(engine.make_transport(owns_engine=True)) as client:
            yield client
        return
    from stepstream.consumers.kafka import create_topics

    assert broker is not None
    settings = kafka_settings(broker)
    create_topics(settings, PARTITIONS)
    worker = ThreadedWorker(
        settings, tmp_path / "worker", registry(), processor=ProcessorConfig(cache_size=1)
    )
    try:
        worker.start(PARTITIONS)
        async with Client.connect(kafka_url(settings)) as client:
            yield client
    finally:
        worker.stop()


COPIES = 3


@pytest.mark.parametrize("backend", ["embedded", "kafka"])
async def test_every_construct_ends_the_same_when_every_input_replays_it(
    backend: str,
    tmp_path: Path,
    ledger: Path,
    replays: Counter[str],
    request: pytest.FixtureRequest,
) -> None:
    broker = request.getfixturevalue("kafka_broker") if backend == "kafka" else None

    async def run(client: Client, case: Case, instance: str) -> None:
        await start(client, case, instance)
        await case.first(client, instance)
        await case.second(client, instance)
        await finish(client, case, instance, ledger)

    async with evicting(backend, tmp_path, broker) as client:
        runs = instances(COPIES)
        await all_of(run(client, case, instance) for case, instance in runs)
    # The cache of one really made them replay (each instance that sits idle at some
    # point is evicted then, if the partition's other instances are busy enough).
    print(f"replays per instance: {dict(replays)}")
    for case in CASES:
        replayed = [i for c, i in runs if c is case and replays[i]]
        assert replayed or not case.evictable, f"no {case.name} instance was replayed"


# ---- kill -9 of `stepstream dev` and a restart on the same data directory -------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Dev:
    """One data directory served by successive `stepstream dev` processes."""

    def __init__(self, root: Path) -> None:
        self.data = root / "data"
        self.ledger = root / "ledger"
        self.ledger.mkdir()
        self.log = root / "dev.log"
        self.url = f"http://127.0.0.1:{_free_port()}"
        self.proc: subprocess.Popen[bytes] | None = None

    async def start(self) -> None:
        assert self.proc is None, "already running"
        path = os.environ.get("PYTHONPATH", "")
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), path) if p),
            "STEPSTREAM_TEST_LEDGER": str(self.ledger),
        }
        port = self.url.rsplit(":", 1)[1]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "stepstream.ops.cli",
                    "dev",
                    "--workflows",
                    ",".join(MODULES),
                    "--data",
                    str(self.data),
                    "--port",
                    port,
                    "--partitions",
                    str(PARTITIONS),
                    "--log-level",
                    "WARNING",
                ],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 30
        async with aiohttp.ClientSession() as http:
            while True:
                if self.proc.poll() is not None:
                    code, self.proc = self.proc.returncode, None
                    pytest.fail(f"stepstream dev exited with {code}:\n{self.log.read_text()}")
                try:
                    async with http.get(f"{self.url}/healthz") as response:
                        if response.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline:
                    self.kill9()
                    pytest.fail(f"stepstream dev never became healthy:\n{self.log.read_text()}")
                await asyncio.sleep(0.05)

    def kill9(self) -> None:
        assert self.proc is not None, "not running"
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


KILLED_COPIES = 2


def _lost(history: list[HistoryEntry]) -> list[str]:
    failed = _of(history, "StepFailed")
    return [h.attributes["key"] for h in failed if h.attributes["error_type"] == "AttemptLost"]


@pytest.mark.slow
async def test_every_construct_ends_the_same_across_kill9_and_restarts(tmp_path: Path) -> None:
    dev = Dev(tmp_path)
    runs = instances(KILLED_COPIES)

    async def each(phase: Callable[[Client, Case, str], Awaitable[None]]) -> None:
        async with Client.connect(dev.url) as client:
            await all_of(phase(client, case, instance) for case, instance in runs)

    async def first(client: Client, case: Case, instance: str) -> None:
        await case.first(client, instance)

    async def second(client: Client, case: Case, instance: str) -> None:
        await case.second(client, instance)

    async def finished(client: Client, case: Case, instance: str) -> None:
        await finish(client, case, instance, dev.ledger, killed=True)

    await dev.start()
    try:
        await each(start)
        dev.kill9()  # after the starts: steps, timers and children under way
        await dev.start()
        await each(first)
        dev.kill9()  # after half of the inputs
        await dev.start()
        await each(second)
        dev.kill9()  # after the rest, before anything was waited for
        await dev.start()
        await each(finished)
        async with Client.connect(dev.url) as client:
            lost = {i: _lost(await client.history(i)) for _, i in runs}
        print("attempts the kills interrupted:", {i: k for i, k in lost.items() if k})
    except BaseException:
        print(f"server log:\n{dev.log.read_text()[-5000:]}")
        raise
    finally:
        dev.stop()
