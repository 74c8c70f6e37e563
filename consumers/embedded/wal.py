"""Making RocksDB's write-ahead log durable from outside RocksDB, without holding the GIL.

rocksdict holds the GIL for the whole of ``Rdict.write``, including the fsync that
``WriteOptions.sync`` asks for (measured: a thread doing sync writes takes the event
loop's thread down to ~40% of its speed). So the writer writes with ``sync=False``, which
still hands every record to the OS before returning (that alone survives kill -9), and
then fsyncs the WAL files here with ``os.fsync``, which releases the GIL.

Why fsyncing every ``*.log`` file in the directory is enough: the write went to the WAL
that was current when it ran, and RocksDB deletes a WAL only after the memtables it
covers are flushed to SST files that RocksDB itself syncs. So after the write either that
WAL is still listed and gets synced here, or its contents are already durable elsewhere.
A WAL that appeared since the last sync is a new directory entry, so the directory is
synced too.

Only a WAL that grew since its last sync is synced again: RocksDB appends to one WAL at a
time and never rewrites one (WAL recycling is off), so a WAL whose size is what it was at
its last sync holds nothing the OS could still lose. Syncing every listed WAL each time
cost one fsync per file, and a column family written rarely keeps old WALs listed until
``max_total_wal_size`` forces its flush: measured, commits slowed as WALs piled up.
"""

from __future__ import annotations

import os


class WalSync:
    def __init__(self, db_dir: str) -> None:
        self._dir = db_dir
        self._dir_fd = os.open(db_dir, os.O_RDONLY | os.O_DIRECTORY)
        self._fds: dict[str, int] = {}
        self._synced: dict[str, int] = {}  # WAL name -> its size when last synced
        self.fsyncs = 0  # WAL files synced (for tests and profiles)

    def sync(self) -> None:
        with os.scandir(self._dir) as entries:
            names = {entry.name for entry in entries if entry.name.endswith(".log")}
        for gone in self._fds.keys() - names:
            os.close(self._fds.pop(gone))
            self._synced.pop(gone, None)
        new_entry = False
        for name in sorted(names):
            fd = self._fds.get(name)
            if fd is None:
                try:
                    fd = os.open(os.path.join(self._dir, name), os.O_RDONLY)
                except FileNotFoundError:
                    continue  # flushed and deleted since the listing: durable in SST files
                self._fds[name] = fd
                new_entry = True
            size = os.fstat(fd).st_size
            if self._synced.get(name) == size:
                continue
            os.fdatasync(fd)
            self.fsyncs += 1
            self._synced[name] = size
        if new_entry:
            os.fsync(self._dir_fd)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._synced.clear()
        os.close(self._dir_fd)
