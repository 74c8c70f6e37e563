"""``python -m ops.bench.top_costs``: shares of a py-spy collapsed-stack profile."""

from __future__ import annotations

from pathlib import Path

from stepstream.ops.bench.top_costs import top_costs

LOOP = "thread (1): MainThread;run_forever (/x/asyncio/base_events.py:600)"
PROFILE = f"""\
{LOOP};_process (/w/consumers/partition.py:10);encode (/w/engine/serde.py:5) 30
{LOOP};_process (/w/consumers/partition.py:10) 50
{LOOP};select (/x/selectors.py:1) 20
thread (2): writer;fsync (/w/consumers/embedded/wal.py:3) 100
"""


def test_shares_of_the_loop_threads(tmp_path: Path) -> None:
    path = tmp_path / "W1-http-engine.txt"
    path.write_text(PROFILE)
    report = top_costs(str(path), top=3)
    lines = report.splitlines()
    assert lines[0].endswith("100 samples (event-loop threads)")
    self_part = lines[lines.index("-- self") + 1 : lines.index("-- inclusive")]
    assert self_part[0] == " 50.0% _process (consumers/partition.py)"
    assert " 30.0% encode (engine/serde.py)" in self_part
    assert " 80.0% _process (consumers/partition.py)" in report  # inclusive
    assert "fsync" not in report


def test_uvloop_threads_count_as_loop_threads(tmp_path: Path) -> None:
    # uvloop runs the loop in C: the deepest Python frame above the callbacks is Runner.run.
    path = tmp_path / "p.txt"
    uvloop = "thread (1): MainThread;run (/w/ops/event_loop.py:63);Runner.run (/x/runners.py:118)"
    path.write_text(f"{uvloop};_process (/w/consumers/partition.py:10) 40\n" + PROFILE)
    report = top_costs(str(path), top=1)
    assert report.splitlines()[0].endswith("140 samples (event-loop threads)")


def test_all_threads(tmp_path: Path) -> None:
    path = tmp_path / "p.txt"
    path.write_text(PROFILE)
    report = top_costs(str(path), loop_only=False, top=1)
    assert report.splitlines()[0].endswith("200 samples")
    assert " 50.0% fsync (consumers/embedded/wal.py)" in report
