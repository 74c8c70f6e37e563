"""docs/queues.md's "Try it", run as the page shows it: `stepstream dev --workflows
examples.queues`, then each command of the block, checking what each prints."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from tests.dev_server import REPO, spawn_dev
from tests.dev_server import _until_serving as until_serving

pytestmark = pytest.mark.slow

PAGE = Path(REPO) / "docs" / "queues.md"


def block() -> list[str]:
    text = PAGE.read_text().split("## Try it", 1)[1]
    code = re.search(r"```bash\n(.*?)```", text, re.S)
    assert code is not None, "docs/queues.md has no bash block under Try it"
    return [line for line in code.group(1).splitlines() if line and not line.startswith("#")]


def test_the_try_it_block_runs_as_shown(tmp_path: Path) -> None:
    lines = block()
    assert lines[0] == "stepstream dev --workflows examples.queues"
    # The page's own command line, with a throwaway data directory and a free port.
    command = [*shlex.split(lines[0])[1:], "--data", str(tmp_path / "data"), "--port", "0"]
    dev, _ = spawn_dev(tmp_path, command)
    until_serving(dev)
    try:
        out = {}
        for line in lines[1:]:
            args = shlex.split(line)
            assert args[0] == "stepstream", line
            done = dev.cli(*args[1:])
            assert done.returncode == 0, f"{line}\n{done.stderr}"
            out[line] = done.stdout
            if args[1:4] == ["start", "hold", "--id"] and args[4] == "h-1":
                for _ in range(100):  # h-1 takes the slot before h-2 asks
                    if '"running"' in dev.cli("status", "h-1", "--json").stdout:
                        break
            if args[1:3] == ["status", "h-2"]:
                for _ in range(100):  # its request may still be on its way to the queue
                    waits = json.loads(done.stdout)["waits"]
                    if waits and waits[0]["position"] is not None:
                        break
                    done = dev.cli(*args[1:])
                out[line] = done.stdout
        charged = out[lines[1]]
        assert "receipt-25.00" in charged and "notified receipt-25.00" in charged, charged
        shown = json.loads(out["stepstream status h-2 --json"])
        assert shown["status"] == "pending"
        assert [(w["kind"], w["queue"], w["position"], w["waiting"]) for w in shown["waits"]] == [
            ("queue", "~queue/front-desk", 1, 1)
        ]
        assert out["stepstream result h-2"].strip() == "released"
    finally:
        dev.stop()
