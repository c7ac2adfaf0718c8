"""What every part of the cache shares: its folders, its index (opened read-write, or
read-only when the disk refuses writes), and the errors for a disk that refuses them."""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

from fastload.cache import keys
from fastload.cache.disk import (
    KIND_WORDS,
    ReadOnlyIndex,
    cannot_write,
    file_in_path,
    unwritable_kind,
    user_name,
)
from fastload.cache.entry import Entry
from fastload.cache.held import held_for, hook_exit
from fastload.cache.index import FileLock, GatedIndex
from fastload.config import Settings
from fastload.errors import CacheError, CacheFullError, CacheReadOnlyError

_log = logging.getLogger("fastload")

MEMO_MAX = 1 << 20  # entries remembered per Cache (about 440 B each, its key shared with the caller's)
MEMO_EVICT = 8  # at MEMO_MAX, the memo forgets its oldest 1/MEMO_EVICT (reads.py _remember)

# Reservations this process holds for writes in flight (token -> (file system, bytes)); any
# other reservation under our PID was left behind by a failed release (a full disk) and is
# stale. Their bytes are not on the disk yet, so the disk's free space does not show them:
# the reserve check takes off those bound for the same file system, and only those: a cache
# on another disk does not spend this one's room
# (tests/reliability/test_disk_full.py::test_default_limit_keeps_a_free_margin and
# ::test_writes_in_flight_to_another_disk_leave_this_ones_room).
IN_FLIGHT: dict[str, tuple[int, int]] = {}


def in_flight_on(device: int) -> int:
    """Bytes this process is writing to file system ``device`` (``st_dev``) right now."""
    return sum(n for dev, n in list(IN_FLIGHT.values()) if dev == device)  # a copy: other threads add and remove


def open_error(root: Path, err: BaseException, kind: str | None) -> CacheError:
    """Why the cache folder ``root`` cannot be created or opened, and the fix.

    Every failure here once ended in "fix: free space there" (issue 24): a cache dir
    that is a file, a path under a file and a folder this user may not write each
    name their own cause (tests/unit/test_cache_open_errors.py).
    """
    also = "or set FASTLOAD_CACHE_DIR (--cache-dir) to a folder this user can write"
    if kind == "read-only":
        return CacheReadOnlyError(f"cache dir {root} cannot be created or opened: the file system is read-only ({err}); "
                                  f"fix: remount it read-write, {also}")
    if kind == "full":
        return CacheFullError(f"cache dir {root} cannot be created or opened: the disk is full ({err}); "
                              f"fix: free space there, {also}")
    blocker = file_in_path(root)
    if blocker == root:
        return CacheError(f"cache dir {root} exists as a file, not a directory; fix: move that file away, {also}")
    if blocker is not None:
        return CacheError(f"cache dir {root} cannot be created: {blocker} is a file, not a directory; "
                          f"fix: give a path under a folder, {also}")
    denied = isinstance(err, PermissionError) or (isinstance(err, sqlite3.Error) and not os.access(root, os.W_OK))
    if denied:
        where = getattr(err, "filename", None) or root
        user = user_name()
        return CacheError(f"cache dir {root} cannot be created or opened: permission denied on {where} for user "
                          f"{user} (uid {os.geteuid()}); fix: give {user} write access to it (e.g. `chown -R {user} "
                          f"{root}`), {also}")
    return CacheError(f"cache dir {root} cannot be created or opened ({err}); fix: {also}")


class CacheBase:
    """The cache's folders and index; :class:`fastload.cache.Cache` adds its jobs."""

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or Settings.from_env()
        self.root = self.settings.cache_dir
        self.data_dir = self.root / "data"
        self.data_prefix = str(self.data_dir) + os.sep  # a payload's path as text, without pathlib's ~5 us per join
        self.tmp_dir = self.root / "tmp"
        self.index: GatedIndex | ReadOnlyIndex
        # Why this cache cannot store (None: it can): "read-only" or "full". It then
        # serves what it holds from a read-only index (disk.py), and callers stream.
        self.unwritable: str | None = None
        try:
            for folder in (self.root, self.data_dir, self.tmp_dir):
                folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            if self.root.stat().st_mode & 0o777 != 0o700:
                os.chmod(self.root, 0o700)  # mkdir's mode is filtered by the umask
            self._open_index()
        except (OSError, sqlite3.Error) as err:
            kind = unwritable_kind(err, self.root)
            try:
                if kind is None:
                    raise
                self.index = ReadOnlyIndex(self.root / "index", KIND_WORDS[kind])
                self.unwritable = kind
            except (OSError, sqlite3.Error):
                raise open_error(self.root, err, kind) from err
        self._lock_path = self.root / "evict.lock"
        self.device = self.data_dir.stat().st_dev if self.data_dir.is_dir() else -1  # its file system, for IN_FLIGHT
        self._held = held_for(self.root)  # last uses not yet written, the writer row (held.py)
        # Entries this process has looked up or written. Safe to reuse: a payload's
        # name carries a nonce and every read checks its bytes, so a memo gone stale
        # (evicted, refetched elsewhere) finds its file missing and is looked up again.
        self._memo: dict[str, Entry] = {}
        # Entries remembered at most (0: none). The Fetcher reads the memo to see blocks this
        # process stored since a caller missed (fetch/fetcher.py), so a process that fetches keeps it.
        self.memo_max = MEMO_MAX
        self._dirs: set[str] = set()  # data/ fan-out folders known to exist
        self.corrupt_seen = 0

    def _open_index(self) -> None:
        # SQLite checkpoints its write-ahead log only once it holds 1,000 pages (4 MB), and
        # never shrinks it: on a 3 MB disk the log took 2.9 MB and the payloads were evicted
        # for it. On a small disk the log is checkpointed (and truncated) at 1% of the disk.
        try:
            st = os.statvfs(self.root)
            pages = max(16, min(1000, st.f_blocks * st.f_frsize // 100 // 4096))
        except OSError:
            pages = 1000
        self.index = GatedIndex(self.root / "index", wal_pages=pages)
        self.unwritable = None

    def _reopen_writable(self) -> bool:
        """Open the index read-write again (space was freed); False if it still cannot be."""
        try:
            self._open_index()
        except (OSError, sqlite3.Error) as err:
            if unwritable_kind(err, self.root) is None:
                raise
            return False
        return True

    def unwritable_error(self, err: BaseException, what: str) -> CacheFullError:
        """The error for a write that failed because the disk is full or read-only."""
        if self.unwritable == "read-only" or unwritable_kind(err, self.root) == "read-only":
            return CacheReadOnlyError(
                f"cache dir {self.root} is read-only ({err}) while {what}; it serves what it holds and does not store "
                "more; fix: remount it read-write, or set FASTLOAD_CACHE_DIR to a writable folder for new data"
            )
        return CacheFullError(
            f"disk under {self.root} is full while {what} ({err}); fix: free space, lower "
            "--cache-limit below the free space, or move FASTLOAD_CACHE_DIR"
        )

    def __getstate__(self) -> dict[str, Any]:
        return {"settings": self.settings}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["settings"])  # type: ignore[misc]

    def close(self) -> None:
        self.flush_recency()
        self.index.close()

    def register_writer(self) -> None:
        """Record, inside the caller's write transaction, that this process writes here (once
        per process): a row its clean end removes (held.py), so one left behind by a dead
        process says it crashed mid-write (:meth:`fastload.cache.repair.CacheRepair.recover`)."""
        if not self._held.writer:
            self.index.set(keys.writer(os.getpid()), time.time())

    def registered_writer(self) -> None:
        """The writer row's transaction committed: remove the row at this process's clean end."""
        if not self._held.writer:
            self._held.writer = True
            hook_exit()

    def flush_recency(self) -> None:
        """Write the last uses this process holds in memory for this cache (reads.py), in one
        transaction.

        LRU order is advisory: a disk that refuses the write (full, read-only) loses them,
        and an entry then keeps its last recorded use (or its write time)."""
        clocks = self._held.clocks
        if not clocks or self.unwritable is not None:
            clocks.clear()
            return
        rows = {keys.last_use(c): t for c, t in clocks.items()}
        clocks.clear()
        try:
            self.index.set_many(rows)
        except sqlite3.OperationalError as err:
            if not cannot_write(err):
                raise

    def _flock(self) -> FileLock:
        return FileLock(self._lock_path, self.settings.lock_timeout_s)

    def _refuse_if_read_only(self, what: str) -> None:
        if self.unwritable == "read-only":
            raise CacheReadOnlyError(f"cache dir {self.root} is read-only; cannot {what}; fix: remount it read-write")
