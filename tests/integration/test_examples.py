"""The workflow-language examples of docs/workflows.md, run exactly as the page shows them.

Every ``stepstream run examples.X:func --input '...'`` line of its section "The
workflow language" runs in a subprocess (``python -m ops.cli`` with the repository on
``PYTHONPATH``, from an empty directory) on a throwaway embedded engine; the printed
result and the rows of the timeline are checked, so neither the examples nor the page
can drift from what the engine does. The section's ``client.request`` snippet runs as
written against the ``stepstream dev`` its first line names.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from stepstream import Client
from tests.processes import first_line

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "workflows.md"
SECTION = "## The workflow language"


@dataclass(frozen=True)
class Expected:
    result: Any
    # (kind, key, outcome) timeline rows, in order; "{id}" in a key is the instance's id
    rows: tuple[tuple[str, str, str], ...]


EXPECTED = {
    "examples.attributes:purchase": Expected(
        {"charge": "ch-25.00"},
        (
            ("attributes", "attributes#1", "set"),
            ("step", "charge", "ok"),
            ("attributes", "attributes#2", "set"),
        ),
    ),
    "examples.scopes:checkout": Expected(
        {"items": 22.0, "shipping": 5.5},
        (
            ("step", "charge", "ok"),
            ("step", "charge#2", "ok"),
            ("step", "charge#3", "ok"),
            ("step", "shipping/charge", "ok"),
        ),
    ),
    "examples.try_step:price": Expected(
        {
            "price": 12.5,
            "live": {"kind": "timeout", "attempts": 2},
            "coupon": {"kind": "non_retryable", "attempts": 1},
        },
        (
            ("step", "live-price", "retry"),
            ("step", "live-price", "failed"),
            ("step", "cached-price", "ok"),
            ("step", "coupon", "failed"),
        ),
    ),
    "examples.join:quote": Expected(
        {"shipping": 4.5, "tax": 0.19, "stock": "book x1 reserved"},
        (
            ("step", "join/shipping/rate", "ok"),
            ("step", "join/tax/rate", "ok"),
            ("step", "join/stock/count", "ok"),
            ("step", "join/stock/reserve", "ok"),
        ),
    ),
    "examples.race:quote": Expected(
        {"winner": "fast", "quote": {"supplier": "fast", "price": 10.0}},
        (
            ("sleep", "race/deadline/deadline", "abandoned"),
            ("step", "race/fast/quote", "ok"),
            ("step", "race/slow/quote", "abandoned"),
            ("race", "race", "won"),
        ),
    ),
    "examples.loop:poll": Expected(
        {"checks": 20, "progress": 100},
        (("step", "poll/19/check", "ok"),),
    ),
    "examples.saga:trip": Expected(
        {"booked": False, "why": "card declined by the issuer"},
        (
            ("step", "booking/flight", "ok"),
            ("step", "booking/hotel", "ok"),
            ("step", "booking/pay", "failed"),
            ("step", "booking/hotel/undo", "ok"),
            ("step", "booking/flight/undo", "ok"),
        ),
    ),
    "examples.retry_forever:sync_stock": Expected(
        {"attempts": 4},
        (
            ("step", "push-inventory", "retry"),
            ("step", "push-inventory", "retry"),
            ("step", "push-inventory", "retry"),
            ("step", "push-inventory", "ok"),
        ),
    ),
    "examples.children:resize": Expected(
        {"resized": ["a-small.jpg", "b-small.jpg", "c-small.jpg", "d-small.jpg"]},
        (
            ("child", "{id}/left", "completed"),
            ("child", "{id}/right", "completed"),
            ("wait", "left/result", "received"),
            ("wait", "right/result", "received"),
        ),
    ),
    "examples.messages:digest": Expected(
        {"lead": "rain", "digests": ["sun | fog", "snow | hail"]},
        (
            ("sleep", "press-time", "elapsed"),
            ("event", "story", "buffered"),
            ("step", "mail", "ok"),
            ("step", "mail#2", "ok"),
            ("wait", "story#4", "timed out"),  # the last next_batch: []
        ),
    ),
    "examples.workflow_time:reminder": Expected(
        {"sent": "reminded ada", "on_time": True},
        (("sleep", "wait", "elapsed"), ("step", "remind", "ok")),
    ),
}


def _section() -> str:
    page = PAGE.read_text()
    assert SECTION in page, f"{PAGE.relative_to(REPO)} has no {SECTION!r} section"
    return page.split(SECTION, 1)[1].split("\n## ", 1)[0]


def _commands() -> dict[str, str]:
    """The section's ``stepstream run`` lines, by target."""
    found: dict[str, str] = {}
    for line in _section().splitlines():
        if line.strip().startswith("stepstream run "):
            target = shlex.split(line)[2]
            assert target not in found, f"two commands run {target}"
            found[target] = line.strip()
    return found


def _cli(argv: list[str], cwd: Path) -> tuple[str, float]:
    """Run ``stepstream ...`` as ``python -m ops.cli ...``; its stdout and how long it took."""
    assert argv[:2] == ["stepstream", "run"], argv
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "stepstream.ops.cli", *argv[1:]],
        cwd=cwd,  # an empty directory: only the module path may matter
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    took = time.monotonic() - started
    assert done.returncode == 0, f"{shlex.join(argv)}\n{done.stdout}{done.stderr}"
    return done.stdout, took


def _instance(stdout: str) -> str:
    match = re.search(r"^instance:\s+(\S+)$", stdout, re.M)
    assert match, stdout
    return match.group(1)


def _result(stdout: str) -> Any:
    match = re.search(r"^result:\s+(.*)$", stdout, re.M)
    assert match, stdout
    return json.loads(match.group(1))


def _row(stdout: str, kind: str, key: str, outcome: str, start: int) -> int:
    """Where the timeline row (kind, key, outcome) starts, looking from ``start``."""
    pattern = rf"^\s*\+\S+(?: m?s)?\s+{re.escape(kind)}\s+{re.escape(key)}"
    pattern += rf"\s+{outcome}(\s|$)" if outcome else r"(\s|$)"
    match = re.compile(pattern, re.M).search(stdout, start)
    assert match, f"no row {kind} {key} {outcome} after offset {start}:\n{stdout}"
    return match.end()


def test_the_section_runs_every_example_it_links() -> None:
    commands = _commands()
    assert sorted(commands) == sorted(EXPECTED)
    linked = set(re.findall(r"\(\.\./examples/(\w+)\.py\)", _section()))
    assert linked == {target.split(":")[0].removeprefix("examples.") for target in EXPECTED}
    for module in linked:
        assert (REPO / "examples" / f"{module}.py").is_file(), module
    assert "(seeds.md)" in _section()
    assert (REPO / "docs" / "seeds.md").is_file()


@pytest.mark.parametrize("target", sorted(EXPECTED))
def test_the_documented_command_runs_to_its_result(target: str, tmp_path: Path) -> None:
    command = _commands().get(target)
    assert command is not None, f"the section runs no {target}"
    stdout, took = _cli(shlex.split(command), tmp_path)
    assert re.search(r"^status:\s+completed$", stdout, re.M), stdout
    expected = EXPECTED[target]
    assert _result(stdout) == expected.result, stdout
    at = 0
    for kind, key, outcome in expected.rows:
        at = _row(stdout, kind, key.format(id=_instance(stdout)), outcome, at)
    assert list(tmp_path.iterdir()) == []  # nothing left in the working directory
    if target == "examples.race:quote":
        # The slow supplier's attempt (5 s) was given up, not waited for at shutdown.
        assert took < 4, f"took {took:.1f} s:\n{stdout}"
    if target == "examples.loop:poll":
        checks = re.findall(r"\spoll/(\d+)/check\s", stdout)
        assert len(checks) <= 4, stdout  # keep=3: the older iterations were pruned


def test_the_saga_compensates_newest_first(tmp_path: Path) -> None:
    stdout, _ = _cli([*shlex.split(_commands()["examples.saga:trip"]), "--json"], tmp_path)
    undone = {
        h["attributes"]["key"]: h["attributes"]["result"]
        for h in json.loads(stdout)["history"]
        if h["type"] == "StepSucceeded" and h["attributes"]["key"].endswith("/undo")
    }
    assert undone == {
        "booking/hotel/undo": "cancelled hotel-Lisbon",
        "booking/flight/undo": "cancelled flight-Lisbon",
    }


def _history(target: str, tmp_path: Path) -> tuple[str, list[dict[str, Any]]]:
    """The page's command for ``target`` run with ``--json``: the id and history."""
    stdout, _ = _cli([*shlex.split(_commands()[target]), "--json"], tmp_path)
    out = json.loads(stdout)
    assert out["status"] == "completed", stdout
    return out["instance_id"], out["history"]


def test_the_children_are_instances_of_their_own(tmp_path: Path) -> None:
    parent, history = _history("examples.children:resize", tmp_path)
    started = [h["attributes"] for h in history if h["type"] == "ChildStarted"]
    assert [(a["child_id"], a["workflow"], a["input"]) for a in started] == [
        (f"{parent}/left", "resize", ["a.jpg", "b.jpg"]),
        (f"{parent}/right", "resize", ["c.jpg", "d.jpg"]),
    ]
    assert not [h for h in history if h["type"] == "StepAttemptStarted"]  # all in children


def test_the_digest_takes_its_messages_in_arrival_order(tmp_path: Path) -> None:
    instance, history = _history("examples.messages:digest", tmp_path)
    sent = [h["attributes"] for h in history if h["type"] == "MessageSent"]
    assert [(a["target"], a["name"], a["payload"]) for a in sent] == [
        (instance, "story", story) for story in ("rain", "sun", "fog", "snow", "hail")
    ]
    taken = [h["attributes"]["payloads"] for h in history if h["type"] == "MessagesReceived"]
    assert taken == [["rain"], ["sun", "fog"], ["snow", "hail"]]  # each sent once


def _request_snippet() -> tuple[list[str], str]:
    """The section's ``client.request`` snippet: the server its first line starts, and
    the code."""
    blocks = re.findall(r"```python\n(.*?)```", _section(), re.S)
    [snippet] = [b for b in blocks if "client.request(" in b]
    first, code = snippet.split("\n", 1)
    assert first.startswith("# stepstream dev "), first
    return shlex.split(first.removeprefix("# ")), code


async def test_the_request_snippet_gets_its_answer_from_stepstream_dev(tmp_path: Path) -> None:
    argv, code = _request_snippet()
    readme_url = "http://127.0.0.1:8233"
    assert code.count(readme_url) == 1, code
    log = tmp_path / "dev.log"
    with open(log, "wb") as stderr:
        server = subprocess.Popen(
            [sys.executable, "-m", "stepstream.ops.cli", *argv[1:], "--port", "0"],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(REPO), "STEPSTREAM_DATA": str(tmp_path / "d")},
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
    try:
        line = first_line(server, 20)
        found = re.search(r"listening on (http://\S+)", line)
        assert found, f"{shlex.join(argv)} did not start: {line!r}\n{log.read_text()}"
        url = found.group(1)
        namespace: dict[str, Any] = {"Client": Client}
        exec(
            f"async def snippet():\n{textwrap.indent(code.replace(readme_url, url), '    ')}",
            namespace,
        )
        await namespace["snippet"]()
        async with Client.connect(url) as client:
            assert await client.result("desk-1", timeout=20) == 1  # one quote answered
            history = await client.history("desk-1")
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    answers = [h.attributes["result"] for h in history if h.type == "MessageCompleted"]
    promised = re.search(r"client\.request\(.*#\s*(\{.*\})$", code, re.M)
    assert promised, code
    assert answers == [json.loads(promised.group(1))]  # what the page's comment says


def _join_failed(r: Any) -> bool:
    return (
        set(r["failed"]) == {"shipping"}
        and "no carrier ships to AQ" in r["failed"]["shipping"]
        and r["settled"] == {"tax": 0.0, "stock": "book x1 reserved"}
    )


# Other inputs the page suggests for the same examples: (target, the input as the
# page words it, the input, what the result must satisfy).
VARIANTS: list[tuple[str, str, Any, Callable[[Any], bool]]] = [
    ("examples.join:quote", '"AQ"', {"country": "AQ", "sku": "book"}, _join_failed),
    (
        "examples.race:quote",
        "`0.01`",
        {"deadline_s": 0.01},
        lambda r: r == {"winner": "deadline", "quote": None},
    ),
    (
        "examples.children:resize",
        '`"broken.png"`',
        ["a.jpg", "b.jpg", "c.jpg", "broken.png"],
        lambda r: (
            r["resized"] == ["a-small.jpg", "b-small.jpg"]
            and list(r["failed"]) == ["right"]
            and r["failed"]["right"].startswith("failed: ")
            and "broken.png is not an image" in r["failed"]["right"]
        ),
    ),
    (
        "examples.saga:trip",
        '`"4242"`',
        {"to": "Lisbon", "card": "4242"},
        lambda r: r == {"booked": True, "flight": "flight-Lisbon", "hotel": "hotel-Lisbon"},
    ),
]


@pytest.mark.parametrize(
    ("target", "words", "value", "check"), VARIANTS, ids=[v[0] for v in VARIANTS]
)
def test_the_variants_the_page_mentions(
    target: str, words: str, value: Any, check: Callable[[Any], bool], tmp_path: Path
) -> None:
    assert target in _commands()
    assert words in _section(), f"the page no longer suggests {words} for {target}"
    stdout, _ = _cli(["stepstream", "run", target, "--input", json.dumps(value)], tmp_path)
    assert check(_result(stdout)), stdout
