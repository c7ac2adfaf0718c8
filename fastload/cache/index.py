"""The SQLite index's concurrency plumbing: forks, threads, write queues and the evict lock.

The index is a diskcache (SQLite, WAL) shared by the threads of one process and by
many processes. What makes that safe lives here, and nothing else of the cache's:

* :class:`ForkGate` (:data:`FORK_GATE`): every index call holds it; ``fork()`` waits
  for the calls in flight, so a child never inherits SQLite's lock state mid-write.
* :func:`write_lock`: one lock per cache folder per process around index writes, so
  a process's threads queue in Python, not in SQLite's sleeping busy handler.
* :class:`GatedIndex`: the diskcache index with both of the above applied to every
  call, and each thread's connection closed when that thread ends
  (:class:`ConnectionCloser`).
* :class:`FileLock`: an ``flock`` with a bounded wait, taken while evicting or
  repairing; the kernel releases it if its holder dies.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import diskcache

from fastload.errors import CacheError

_log = logging.getLogger("fastload")


class ForkGate:
    """Index operations hold it (shared, re-entrant per thread); ``fork()`` waits for them.

    SQLite keeps its lock bookkeeping in process memory. A child forked while a
    thread of its parent was inside an index write inherits "this process holds
    the write lock" with no thread left to release it, so every write in the
    child is SQLITE_BUSY until diskcache's 60 s timeout: a DataLoader worker
    forked while an abandoned epoch's read-ahead threads were still caching hung
    for 60 s and died (tests/reliability/test_hostile_input.py, corrupt JPEG).
    ``os.register_at_fork`` makes the forking thread wait (``WAIT_S`` at most, then
    it warns and forks) until no index operation is in flight. Operations take
    milliseconds; a longer wait means a gc finalizer blocked inside one.
    """

    WAIT_S = 5.0

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._active = 0
        self._forking = False
        self._depth = threading.local()

    def enter(self) -> None:
        """Start an index operation (nested calls, e.g. get inside transact, never wait)."""
        depth = self._depth
        n = getattr(depth, "n", 0)
        if n == 0:
            with self._cond:
                while self._forking:
                    self._cond.wait()
                self._active += 1
        depth.n = n + 1

    def try_enter(self) -> bool:
        """:meth:`enter` without waiting for a fork (False: do not operate)."""
        depth = self._depth
        n = getattr(depth, "n", 0)
        if n == 0:
            # A timeout, not a block: a finalizer may run in the very thread that holds
            # the lock (a gc pass inside enter(), or in the forking thread).
            if not self._cond.acquire(timeout=0.05):
                return False
            try:
                if self._forking:
                    return False
                self._active += 1
            finally:
                self._cond.release()
        depth.n = n + 1
        return True

    def leave(self) -> None:
        depth = self._depth
        depth.n -= 1
        if depth.n == 0:
            with self._cond:
                self._active -= 1
                if self._forking and not self._active:
                    self._cond.notify_all()

    @contextmanager
    def shared(self) -> Iterator[None]:
        self.enter()
        try:
            yield
        finally:
            self.leave()

    def before_fork(self) -> None:
        with self._cond:
            self._forking = True
            deadline = time.monotonic() + self.WAIT_S
            while self._active and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            if self._active:
                _log.warning(
                    "forking with %d cache index operation(s) in flight after %.0f s; the child "
                    "may find the index locked", self._active, self.WAIT_S,
                )

    def after_fork_parent(self) -> None:
        with self._cond:
            self._forking = False
            self._cond.notify_all()

    def after_fork_child(self) -> None:
        self._reset()  # the child has one thread and no operation in flight


FORK_GATE = ForkGate()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=FORK_GATE.before_fork,
        after_in_parent=FORK_GATE.after_fork_parent,
        after_in_child=FORK_GATE.after_fork_child,
    )


# One lock per cache folder per process, taken around index writes: threads of one
# process then queue on it instead of in SQLite's busy handler, whose sleeps (1 to
# 100 ms) put a put's p99 at ~480 ms with 16 writer threads (benchmarks/peers).
_WRITE_LOCKS: dict[Path, threading.RLock] = {}
_WRITE_LOCKS_GUARD = threading.Lock()


def write_lock(root: Path) -> threading.RLock:
    with _WRITE_LOCKS_GUARD:
        return _WRITE_LOCKS.setdefault(root.resolve(), threading.RLock())


def _reset_write_locks() -> None:
    global _WRITE_LOCKS_GUARD
    _WRITE_LOCKS_GUARD = threading.Lock()
    for root in _WRITE_LOCKS:
        _WRITE_LOCKS[root] = threading.RLock()  # a forked child holds none of its parent's


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_write_locks)


class GatedIndex:
    """The diskcache index: every call, whole transaction, connection open and close
    inside :data:`FORK_GATE`; each thread's connection closed when the thread ends;
    writes under the process's write lock of this cache."""

    def __init__(self, inner: diskcache.Cache) -> None:
        self._inner = inner
        self._thread = threading.local()
        self._root = Path(inner.directory).parent.resolve()
        write_lock(self._root)  # registered, so a forked child gets its own

    def bind_thread(self) -> None:
        # diskcache opens one SQLite connection per thread and keeps it in a reference
        # cycle, so a thread that exits leaves its connection (2 fds and its page
        # cache) until a full gc: the loader reads from a fresh thread pool each epoch,
        # +8 fds and ~1 MB RSS per epoch (tests/reliability/test_soak.py). A closer in
        # our own thread-local dies with the thread and closes that connection.
        if getattr(self._thread, "closer", None) is None:
            with FORK_GATE.shared():  # opening runs PRAGMAs
                con = getattr(self._inner, "_con", None)  # diskcache's per-thread connection
            self._thread.closer = ConnectionCloser(con) if isinstance(con, sqlite3.Connection) else False

    def writing(self) -> threading.RLock:
        """This process's write lock of the cache (a forked child gets a fresh one)."""
        return _WRITE_LOCKS[self._root]

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr
        return _gated_call(self, attr)

    @contextmanager
    def transact(self, retry: bool = False) -> Iterator[None]:
        self.bind_thread()
        with self.writing(), FORK_GATE.shared(), self._inner.transact(retry):
            yield

    def get_many(self, keys: Sequence[str]) -> dict[str, Any]:
        """The values of many str keys that are present, in one query per ``_IN_CHUNK`` keys.

        Reads diskcache's own table and decodes with its own ``Disk.fetch``, as
        ``diskcache.Cache.get`` does for str keys (no expiry, no statistics here).
        """
        self.bind_thread()
        inner, out = self._inner, {}
        with FORK_GATE.shared():
            for i in range(0, len(keys), _IN_CHUNK):
                part = list(keys[i : i + _IN_CHUNK])
                marks = ",".join("?" * len(part))
                rows = inner._sql(f"SELECT key, mode, filename, value FROM Cache WHERE raw = 1 AND key IN ({marks})", part)
                for key, mode, filename, value in rows.fetchall():
                    try:
                        out[key] = inner._disk.fetch(mode, filename, value, False)
                    except OSError:
                        pass  # deleted since the query, as diskcache's get treats it
        return out

    # Batched writes. diskcache's add and set run 3 statements each (look up, write, and a
    # cull of expired keys, which fastload never sets): 6 per published object, 0.07 ms of
    # a cold object's ~0.1 ms cache write (benchmarks/peers/results/profile.md, round 5).
    # These write diskcache's own table with its own Disk encoding in one statement per
    # batch, inside :meth:`transact` (whose transaction makes look-up and write one step).

    def add_many(self, items: Sequence[tuple[str, Any]]) -> set[str]:
        """Add each ``(key, value)`` whose str key is absent (diskcache's ``add``, batched); the keys added."""
        inner = self._inner
        taken = self._present([k for k, _ in items])
        added: set[str] = set()
        rows = []
        now = time.time()
        for key, value in items:
            if key in taken or key in added:
                continue
            size, mode, filename, db_value = inner._disk.store(value, False, key=key)
            rows.append((key, now, now, size, mode, filename, db_value))
            added.add(key)
        if rows:
            inner._con.executemany(_INSERT, rows)
        return added

    def set_many(self, items: Mapping[str, Any]) -> None:
        """Set each str key to its value (diskcache's ``set``, batched), for values stored in the index itself."""
        inner = self._inner
        rows = []
        now = time.time()
        for key, value in items.items():
            size, mode, filename, db_value = inner._disk.store(value, False, key=key)
            if filename is not None:  # a value too large for the index: diskcache's own set files it
                inner._disk.remove(filename)
                inner.set(key, value)
                continue
            rows.append((key, now, now, size, mode, filename, db_value))
        if self._present([r[0] for r in rows], with_file=True):  # an old value in a file: diskcache removes it
            for key, value in items.items():
                inner.set(key, value)
            return
        if rows:
            inner._con.executemany(_UPSERT, rows)

    def _present(self, keys: Sequence[str], with_file: bool = False) -> set[str]:
        """Which of ``keys`` (str) are in the table (only those whose value is a file, with ``with_file``)."""
        out: set[str] = set()
        extra = " AND filename IS NOT NULL" if with_file else ""
        for i in range(0, len(keys), _IN_CHUNK):
            part = list(keys[i : i + _IN_CHUNK])
            marks = ",".join("?" * len(part))
            out.update(k for (k,) in self._inner._sql(f"SELECT key FROM Cache WHERE raw = 1 AND key IN ({marks}){extra}", part))
        return out

    def close(self) -> None:
        with FORK_GATE.shared():  # no bind_thread: it would open a connection to close it
            self._inner.close()

    def iterkeys(self, reverse: bool = False) -> Iterator[Any]:
        # Materialised inside the gate: a generator would read outside it.
        self.bind_thread()
        with FORK_GATE.shared():
            return iter(list(self._inner.iterkeys(reverse)))


_IN_CHUNK = 500  # keys per SELECT ... IN (...): below SQLite's oldest variable limit (999)
_COLUMNS = "key, raw, store_time, expire_time, access_time, access_count, tag, size, mode, filename, value"
_INSERT = f"INSERT INTO Cache({_COLUMNS}) VALUES (?, 1, ?, NULL, ?, 0, NULL, ?, ?, ?, ?)"
_UPSERT = (_INSERT + " ON CONFLICT(key, raw) DO UPDATE SET store_time = excluded.store_time, expire_time = NULL,"
           " access_time = excluded.access_time, tag = NULL, size = excluded.size, mode = excluded.mode,"
           " filename = excluded.filename, value = excluded.value")


def _gated_call(index: GatedIndex, fn: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        index.bind_thread()
        FORK_GATE.enter()
        try:
            return fn(*args, **kwargs)
        finally:
            FORK_GATE.leave()

    return call


def _gated_method(name: str, write: bool) -> Any:
    # The hot calls as plain methods: __getattr__ builds a closure per access.
    def method(self: GatedIndex, *args: Any, **kwargs: Any) -> Any:
        if getattr(self._thread, "closer", None) is None:
            self.bind_thread()
        lock = self.writing() if write else None
        if lock is not None:
            lock.acquire()
        FORK_GATE.enter()
        try:
            return getattr(self._inner, name)(*args, **kwargs)
        finally:
            FORK_GATE.leave()
            if lock is not None:
                lock.release()

    method.__name__ = name
    return method


for _name in ("get", "set", "add", "delete", "pop", "incr"):
    setattr(GatedIndex, _name, _gated_method(_name, write=_name != "get"))


class ConnectionCloser:
    """Closes one thread's SQLite connection when that thread's locals are freed."""

    def __init__(self, con: sqlite3.Connection) -> None:
        self.con = con
        self.pid = os.getpid()

    def __del__(self) -> None:
        if os.getpid() != self.pid:
            # A forked child drops its parent's threads (and their locals) before the
            # at-fork hooks run: the parent's connection is not the child's to close.
            return
        # Closing the last connection checkpoints the WAL: that takes locks too. Never
        # wait here (see try_enter); a connection left open is closed by the gc later.
        if not FORK_GATE.try_enter():
            return
        try:
            self.con.close()
        except sqlite3.Error:
            pass  # freed from another thread (a gc pass): the gc closes it then
        finally:
            FORK_GATE.leave()


class FileLock:
    """An flock with a bounded wait; the kernel releases it if the holder dies."""

    def __init__(self, path: Path, timeout_s: float) -> None:
        self.path, self.timeout_s = path, timeout_s
        self._fd = -1

    def __enter__(self) -> FileLock:
        self._fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self._fd)
                    raise CacheError(f"cache lock {self.path} held for over {self.timeout_s:.0f} s by another process") from None
                time.sleep(0.01)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
