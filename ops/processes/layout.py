"""How a data directory's partitions are spread over the engine processes:
``DATA/processes.json`` (how many processes and partitions it was made for) and
``DATA/process-G/``, process G's own data directory."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass

from stepstream.engine.errors import StepstreamError
from stepstream.engine.wire.topics import partition_for
from stepstream.ops.embedded import PROCESSES_FILE

LAYOUT_FILE = PROCESSES_FILE


@dataclass(frozen=True)
class ProcessLayout:
    """How partitions are spread over the engine processes."""

    processes: int
    partitions: int

    def owner(self, partition: int) -> int:
        return partition % self.processes

    def process_of(self, instance_id: str) -> int:
        return self.owner(partition_for(instance_id, self.partitions))

    def partitions_of(self, process: int) -> list[int]:
        return [p for p in range(self.partitions) if self.owner(p) == process]

    def others(self, process: int) -> list[int]:
        """The partitions other processes own: this process forwards to them."""
        return [p for p in range(self.partitions) if self.owner(p) != process]

    def owns(self, process: int) -> Callable[[int], bool]:
        return lambda partition: self.owner(partition) == process


def process_dir(data_dir: str, process: int) -> str:
    return os.path.join(data_dir, f"process-{process}")


def is_split(data_dir: str) -> bool:
    """Whether ``data_dir`` holds the partitions of several engine processes."""
    return os.path.exists(os.path.join(data_dir, LAYOUT_FILE))


def prepare_layout(data_dir: str, processes: int, partitions: int | None) -> ProcessLayout:
    """The layout of ``data_dir`` for ``processes`` processes: made if the directory is
    new, checked against what it was made with otherwise (partitions cannot move between
    processes' directories, so the counts cannot change)."""
    path = os.path.join(data_dir, LAYOUT_FILE)
    try:
        with open(path) as f:
            stored = json.load(f)
        layout = ProcessLayout(int(stored["processes"]), int(stored["partitions"]))
    except FileNotFoundError:
        if os.path.isdir(data_dir) and os.listdir(data_dir):
            raise StepstreamError(
                f"data directory {data_dir} was written by one engine process: run it without "
                "--processes (or with --processes 1), or give --processes another --data"
            ) from None
        count = partitions if partitions is not None else max(4, 2 * processes)
        if count < processes:
            raise StepstreamError(
                f"--partitions {count} cannot be spread over {processes} processes: pass "
                f"--partitions {processes} or more"
            ) from None
        layout = ProcessLayout(processes, count)
        os.makedirs(data_dir, exist_ok=True)
        temporary = path + ".tmp"
        with open(temporary, "w") as f:
            json.dump(dataclasses.asdict(layout), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
        return layout
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StepstreamError(
            f"cannot read {path}: {exc}; is it a stepstream data directory?"
        ) from None
    if layout.processes != processes:
        raise StepstreamError(
            f"data directory {data_dir} holds partitions spread over {layout.processes} "
            f"processes: pass --processes {layout.processes}, or another --data"
        )
    if partitions is not None and partitions != layout.partitions:
        raise StepstreamError(
            f"data directory {data_dir} was created with {layout.partitions} partitions: pass "
            f"--partitions {layout.partitions}, or another --data"
        )
    there = [os.path.exists(process_dir(data_dir, g)) for g in range(layout.processes)]
    if any(there) and not all(there):
        # Made anew, the missing one's instances would be gone without a word.
        gone = [g for g, found in enumerate(there) if not found]
        missing = ", ".join(process_dir(data_dir, g) for g in gone)
        lost = [p for g in gone for p in layout.partitions_of(g)]
        raise StepstreamError(
            f"data directory {data_dir} is missing {missing}, the data of partitions {lost}; "
            "put it back (from where it was moved, or a backup): started without it, their "
            "instances would be gone"
        )
    return layout
