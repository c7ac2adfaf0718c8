"""Fetches in flight across the processes of a node: one marker per block, so two never fetch it at once.

The Fetcher's table of fetches in flight (:mod:`fastload.fetch.fetcher`) is per process. Its
**markers** are what the other processes sharing the cache folder see: a write lock (an
``fcntl`` byte-range lock) on one byte per block, in one of :data:`SHARDS` files under
``<cache>/flights/``, at an offset hashed from the block's name (its URL and block number,
so a marker exists before the block's size, and so its cache key, is known). A process that
finds a block's marker held waits for it, then looks the block up again
(``Fetcher.fetch``); the marker is dropped once the block is stored.

* **No stale markers.** The kernel drops a process's locks when it dies, SIGKILL included
  (tests/unit/test_flights.py kills a holder).
* **Open file description locks** (Linux ``F_OFD_SETLK``) where the platform has them: owned by
  the open file, so closing another descriptor of the same file drops nothing. Elsewhere classic
  POSIX record locks (``lockf``), which closing *any* descriptor of the file drops: only this
  module opens these files, and it closes them only when it holds nothing there (a forked
  child; the last Fetcher of the folder collected, :meth:`Markers.attach`).
* **Per process, not per thread.** A process's threads share its markers: its own table keeps
  them from fetching one block twice, and a count per byte keeps two of its blocks that land on
  one byte (a collision) from dropping each other's marker.
* **Forked children.** A child inherits its parent's descriptors, and with them its OFD locks
  (owned by the shared open file): it closes them and opens its own, holding nothing.
* **Collisions cost a wait, never a wrong block.** Names hash (xxh3) to one of SHARDS x 2**40
  bytes; two blocks in flight on one byte make one wait for the other, then find its block
  missing and fetch it. With at most ~1,000 blocks in flight at once on a node, a block shares
  its byte with another with odds of 1,000 / 2**46 (1.4e-11): about 1.4e-5 collisions in a
  million fetches.
* **Why shards.** The kernel keeps one list of locks per file and walks it on every lock and
  unlock. Holding and dropping a marker (hash included, 64 at a time) took 3.2 us a block
  beside 0 markers of another process on one file, 11.6 us beside 500 and 46 us beside 2,000;
  over 64 files 3.0, 3.1 and 3.5 us (2-core VM, timeit). A node of 8 ranks with 2 readers
  each, fetching ahead 512 blocks, holds thousands. The files cost 9 ms to create, once per
  cache folder, and 0.2 ms to open, once per process.

A process waiting for another's marker says so (:meth:`Markers.waiting`: a shared lock on one
more byte, :data:`WAIT_BYTE`), so holders that can store what they hold sooner do
(``Fetcher._harvest``): one lookup (``F_OFD_GETLK``) tells a holder whether anyone waits.

A process that holds markers says it is here (a shared lock on :data:`PRESENT_BYTE`, from its
first hold until its files close), so :meth:`Markers.others_here` tells with one lookup whether
another process fetches into the folder. Then a block whose marker was free may have been
stored by the other between the caller's look and its hold, and is looked up again
(``Fetcher.contended``). Having never found a marker held is no proof of being alone: the other
may have fetched, stored and dropped it in that gap, and it was so that two readers of a
folder fetched one batch of 8 twice (tests/integration/test_one_get_per_node.py, CI 2026-12-03).

A disk that refuses the lock files (read-only, no locks over NFS) turns the markers off:
every hold succeeds, and each process still fetches a block once.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import xxhash

_log = logging.getLogger("fastload")

FOLDER = "flights"  # under the cache folder
SHARDS = 64  # lock files (a power of 2; see the module docstring, "Why shards")
OFFSET_BITS = 40  # bytes per lock file that markers spread over (locks past a file's end need no space)
_SHARD_SHIFT = 64 - SHARDS.bit_length() + 1  # the top bits of the hash pick the file
_OFFSET_MASK = (1 << OFFSET_BITS) - 1
SEEN_S = 30.0  # another process seen fetching counts as here this long after (Markers.others_here)

WAIT_BYTE = 1 << OFFSET_BITS  # an offset past every marker's, in shard 0's file: shared-locked by each waiting process
PRESENT_BYTE = WAIT_BYTE + 1  # shared-locked by each process holding markers in the folder (Markers.others_here)

# struct flock for F_OFD_SETLK (short type, short whence, off_t start, off_t len, pid_t pid, padding);
# 64-bit Linux only: elsewhere lockf packs it.
_OFD = getattr(fcntl, "F_OFD_SETLK", None) if sys.platform.startswith("linux") and sys.maxsize > 2**32 else None
_OFD_GET = getattr(fcntl, "F_OFD_GETLK", None) if _OFD is not None else None
_FLOCK = struct.Struct("hhqqi4x")
_BUSY = (errno.EAGAIN, errno.EACCES)  # the byte is locked by another owner


def slot(url: str, block: int) -> int:
    """The marker of ``url``'s block ``block``: its lock file (top bits) and byte (low OFFSET_BITS)."""
    h = xxhash.xxh3_64_intdigest(f"{block}:{url}".encode())
    return (h >> _SHARD_SHIFT << OFFSET_BITS) | (h & _OFFSET_MASK)


class Markers:
    """This process's markers in one cache folder (one object per folder: :func:`markers_for`).

    Args:
        folder: ``<cache>/flights``, created with mode 0700 on first use.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._lock = threading.RLock()  # reentrant: a collected Fetcher's _detach may run inside a hold
        self._fds: dict[int, int] = {}  # shard -> descriptor
        self._counts: dict[int, int] = {}  # slot -> holds in this process
        self._waiting = 0  # this process's threads waiting for another's marker (WAIT_BYTE held while > 0)
        self._users = 0  # live users (Fetchers) in this process: the files close when the last goes
        self._here = False  # PRESENT_BYTE shared-locked by this process (from its first hold)
        self._pid = os.getpid()
        self.off: str | None = None  # why markers are off here (None: on)
        # When another process was last seen fetching here (a marker found held, or a process
        # waiting: time.monotonic): one that has gone since may have stored what the caller looked for.
        self.seen = float("-inf")

    def attach(self, user: object, held: Callable[[], Iterable[int]]) -> None:
        """Count ``user`` (a Fetcher) until it is collected; then drop the markers ``held()`` names
        (its fetches ahead no read took), and with the last user close the files: a file open
        for writing keeps ``mount -o remount,ro`` failing (tests/reliability/test_disk_full.py)."""
        with self._lock:
            self._users += 1
        weakref.finalize(user, self._detach, held).atexit = False  # at exit the kernel drops them

    def _detach(self, held: Callable[[], Iterable[int]]) -> None:
        self.release(held())
        with self._lock:
            self._users -= 1
            if self._users > 0 or self._forked():
                return
            self._close()
            self.off = None  # the next user tries again (a disk remounted read-write)

    def hold(self, slots: Sequence[int]) -> list[bool]:
        """Hold each marker; False where another process holds it (this process's holds count up)."""
        out = [True] * len(slots)
        if self.off is not None:
            return out
        with self._lock:
            self._forked()
            if not self._here:
                try:
                    self._lock_byte(self._fd(0), PRESENT_BYTE, fcntl.F_RDLCK)
                except OSError as err:
                    self._turn_off(err)
                    return out
                self._here = True
            counts = self._counts
            for k, s in enumerate(slots):
                n = counts.get(s, 0)
                if n == 0:
                    try:
                        self._set(s, fcntl.F_WRLCK)
                    except OSError as err:
                        if err.errno in _BUSY:
                            out[k] = False
                            self.seen = time.monotonic()
                            continue
                        self._turn_off(err)
                        return [True] * len(slots)
                counts[s] = n + 1
        return out

    def release(self, slots: Iterable[int]) -> None:
        """Drop one hold of each marker; the last hold of a marker unlocks it."""
        with self._lock:
            if self.off is not None or self._forked():
                return
            counts = self._counts
            for s in slots:
                n = counts.get(s, 0)
                if n > 1:
                    counts[s] = n - 1
                elif n == 1:
                    del counts[s]
                    try:
                        self._set(s, fcntl.F_UNLCK)
                    except OSError as err:
                        self._turn_off(err)
                        return

    def held(self) -> int:
        """Markers this process holds now."""
        return len(self._counts)

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Say, while in the block, that this process waits for another's marker (:meth:`others_wait`)."""
        with self._lock:
            on = self.off is None and not self._forked()
            if on:
                self._waiting += 1
                if self._waiting == 1:
                    self._lock_wait_byte(fcntl.F_RDLCK)
        try:
            yield
        finally:
            if on:
                with self._lock:
                    if not self._forked() and self.off is None:
                        self._waiting -= 1
                        if self._waiting == 0:
                            self._lock_wait_byte(fcntl.F_UNLCK)

    def others_wait(self) -> bool:
        """Whether another process waits for a marker now (any marker: one lookup). Where the
        platform cannot tell (no OFD locks), True."""
        if self.off is not None:
            return False
        if not self._held_by_another(WAIT_BYTE):
            return False
        self.seen = time.monotonic()
        return True

    def others_here(self) -> bool:
        """Whether another process holds markers in this folder now, or was seen holding one in the last
        :data:`SEEN_S` (one lookup). Where the platform cannot tell (no OFD locks), True."""
        if self.off is not None:
            return False
        return time.monotonic() - self.seen < SEEN_S or self._held_by_another(PRESENT_BYTE)

    def _held_by_another(self, offset: int) -> bool:
        """Whether another process locks byte ``offset`` of shard 0's file (one F_OFD_GETLK); True where
        the platform cannot tell (no OFD locks, a forked child), False once markers turn off."""
        if _OFD_GET is None:
            return True
        with self._lock:
            if self._forked():
                return True
            try:
                got = fcntl.fcntl(self._fd(0), _OFD_GET, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0))
            except OSError as err:
                self._turn_off(err)
                return False
            return _FLOCK.unpack(got)[0] != fcntl.F_UNLCK

    def _lock_wait_byte(self, kind: int) -> None:
        try:
            self._lock_byte(self._fd(0), WAIT_BYTE, kind)  # past every marker's offset
        except OSError as err:
            self._turn_off(err)

    def _fd(self, shard: int) -> int:
        fd = self._fds.get(shard)
        return self._open(shard) if fd is None else fd

    def _set(self, s: int, kind: int) -> None:
        self._lock_byte(self._fd(s >> OFFSET_BITS), s & _OFFSET_MASK, kind)

    @staticmethod
    def _lock_byte(fd: int, offset: int, kind: int) -> None:
        if _OFD is not None:
            fcntl.fcntl(fd, _OFD, _FLOCK.pack(kind, os.SEEK_SET, offset, 1, 0))
        else:
            cmd = {fcntl.F_UNLCK: fcntl.LOCK_UN, fcntl.F_RDLCK: fcntl.LOCK_SH | fcntl.LOCK_NB}.get(kind, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.lockf(fd, cmd, 1, offset)

    def _open(self, shard: int) -> int:
        if not self._fds:
            self.folder.mkdir(mode=0o700, exist_ok=True)
        fd = self._fds[shard] = os.open(self.folder / f"{shard:02x}.lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        return fd

    def _turn_off(self, err: OSError) -> None:
        self.off = f"{self.folder}: {err}"
        _log.debug("fastload: fetches in flight are not marked across processes (%s); each process fetches on its own",
                   self.off)

    def _forked(self) -> bool:
        """In a forked child, start holding nothing (True); the parent's locks stay the parent's."""
        if self._pid == os.getpid():
            return False
        self.after_fork()
        return True

    def after_fork(self) -> None:
        """Close what the parent opened (its OFD locks live on while any copy of the open file does)."""
        self._close()
        self._pid = os.getpid()
        self._lock = threading.RLock()

    def _close(self) -> None:
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError as err:  # already closed by the child's own clean-up: nothing of ours to drop
                _log.debug("fastload: closing a marker file: %s", err)
        self._fds, self._counts, self._waiting, self._here = {}, {}, 0, False


_MARKERS: dict[Path, Markers] = {}
_REGISTRY_LOCK = threading.Lock()


def markers_for(root: Path) -> Markers:
    """The markers of the cache folder ``root`` in this process (one object per folder and process)."""
    root = root.resolve()
    with _REGISTRY_LOCK:
        found = _MARKERS.get(root)
        if found is None:
            found = _MARKERS[root] = Markers(root / FOLDER)
        return found


def _after_fork_child() -> None:
    global _REGISTRY_LOCK
    _REGISTRY_LOCK = threading.Lock()
    for m in _MARKERS.values():
        m.after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_child)
