"""A worker's state directory: ``<dir>/<topic prefix>/`` holds one RocksDB per partition
it owns (``partition-<n>``), the worker's id (stable across restarts, so a restarted
worker replaces its own announcement) and a lock, so two workers never share one."""

from __future__ import annotations

import fcntl
import os
import uuid
from pathlib import Path

from stepstream.consumers.kafka import keys
from stepstream.consumers.rocks_memory import RocksMemory
from stepstream.engine.errors import StepstreamError


class StateDirInUse(StepstreamError):
    """Another worker process holds this state directory."""


class StateDir:
    """Open with ``StateDir.claim(root, prefix)``; ``release()`` when the worker stops."""

    def __init__(
        self, path: Path, lock_fd: int, worker_id: str, memory: RocksMemory | None = None
    ) -> None:
        self.path = path
        self.worker_id = worker_id
        # The RocksDB memory budget the partitions' databases share.
        self.memory = memory or RocksMemory()
        self._lock_fd: int | None = lock_fd

    @classmethod
    def claim(
        cls, root: str | os.PathLike[str], prefix: str, memory: RocksMemory | None = None
    ) -> StateDir:
        path = Path(root) / prefix
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / keys.LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            raise StateDirInUse(
                f"state directory {path} is in use by another worker"
                f"{f' (pid {holder})' if holder.isdigit() else ''}; give each worker its own "
                "--state-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        id_file = path / keys.WORKER_ID_FILE
        try:
            worker_id = id_file.read_text().strip()
        except FileNotFoundError:
            worker_id = ""
        if not worker_id:
            worker_id = uuid.uuid4().hex
            id_file.write_text(worker_id + "\n")
        return cls(path, fd, worker_id, memory)

    def partition_path(self, partition: int) -> str:
        return str(self.path / keys.partition_dir(partition))

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
