"""The cache's index (one SQLite table) and its concurrency: forks, threads, write queues, the evict lock.

The index is one SQLite table (``idx``: key TEXT PRIMARY KEY, value) in WAL mode,
shared by the threads of one process and by many processes; a table of its own, not
a library's, because a library's public API cost 3 to 5 times as much per object on
the cold path (benchmarks/cache/results/index_cost.md). What makes sharing safe
lives here, and nothing else of the cache's:

* :class:`ForkGate` (:data:`FORK_GATE`): every index call holds it; ``fork()`` waits
  for the calls in flight, so a child never inherits SQLite's lock state mid-write.
* :func:`write_lock`: one lock per cache folder per process around index writes, so
  a process's threads queue in Python, not in SQLite's sleeping busy handler.
* :class:`GatedIndex`: the index, read-write, with both of the above applied to every
  call, and each thread's connection closed when that thread ends
  (:class:`ConnectionCloser`).
* :class:`FileLock`: an ``flock`` with a bounded wait, taken while evicting or
  repairing; the kernel releases it if its holder dies.

**SQLite versions.** The index runs on SQLite :data:`SQLITE_FLOOR` and newer, checked at
open (:func:`require_sqlite`). Its newest feature is UPSERT (3.24); no statement uses
``RETURNING`` (3.35), which Debian bullseye (3.34), Ubuntu 20.04 (3.31) and RHEL 8
(3.26) lack: every cold read failed there (issue 32).
tests/reliability/test_old_sqlite.py runs the index's tests on SQLite 3.28.
"""

from __future__ import annotations

import builtins
import fcntl
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from fastload.cache import keys, migrate
from fastload.errors import CacheError, SQLiteVersionError

_log = logging.getLogger("fastload")


class ForkGate:
    """Index operations hold it (shared, re-entrant per thread); ``fork()`` waits for them.

    SQLite keeps its lock bookkeeping in process memory. A child forked while a
    thread of its parent was inside an index write inherits "this process holds
    the write lock" with no thread left to release it, so every write in the
    child is SQLITE_BUSY until the 60 s busy timeout: a DataLoader worker
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


# The index's one table. Keys are str; a value is stored as itself when it is an int or a
# float (so the byte counter adds up in SQL), as JSON text otherwise (records, pins,
# manifests): nothing in the cache folder is ever unpickled, so a file planted there runs
# no code (tests/reliability/test_secrets.py).
INDEX_FILE = "fastload.db"  # under <cache>/index/
TABLE = "idx"
_IN_CHUNK = 500  # keys per SELECT ... IN (...): below SQLite's oldest variable limit (999)
_SCHEMA = 1  # PRAGMA user_version once the table exists and an old index was migrated
_GET = f"SELECT value FROM {TABLE} WHERE key = ?"
_DELETE = f"DELETE FROM {TABLE} WHERE key = ?"
_INCR = f"INSERT INTO {TABLE}(key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = value + ?"
UPSERT = f"INSERT INTO {TABLE}(key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value"
_ADD = f"INSERT OR IGNORE INTO {TABLE}(key, value) VALUES (?, ?)"


# The oldest SQLite the index runs on: RHEL/Rocky 8's. Python itself needs 3.7.15.
SQLITE_FLOOR = (3, 26, 0)


def require_sqlite(found: tuple[int, int, int] | None = None) -> None:
    """Refuse an SQLite older than :data:`SQLITE_FLOOR` (``found``: the loaded library's version)."""
    found = found or sqlite3.sqlite_version_info
    if found < SQLITE_FLOOR:
        have, need = ".".join(map(str, found)), ".".join(map(str, SQLITE_FLOOR))
        raise SQLiteVersionError(
            f"SQLite {have}, the library this Python's sqlite3 module loads, is older than {need}, the oldest "
            f"fastload's cache index runs on; fix: use a Python linked against SQLite {need} or newer (the "
            "python.org builds and Docker images, conda, or a newer OS), or point LD_LIBRARY_PATH at a newer "
            "libsqlite3.so.0"
        )


def encode(value: Any) -> Any:
    """A value as its column: ints and floats as themselves, anything else as JSON text."""
    if type(value) in (int, float):
        return value
    return json.dumps(value, separators=(",", ":"))


def decode(column: Any) -> Any:
    """A column as its value; a JSON array at the top comes back a tuple, as records and
    pins were written (a pin read back equals the pin it was set to: Identity.pin)."""
    if not isinstance(column, str):
        return column
    value = json.loads(column)
    return tuple(value) if isinstance(value, list) else value


class IndexReads:
    """The look-ups, on a connection per thread (:meth:`_con`) inside :data:`FORK_GATE`."""

    def _con(self) -> sqlite3.Connection:
        raise NotImplementedError

    def get(self, key: str, default: Any = None) -> Any:
        con = self._con()
        FORK_GATE.enter()
        try:
            row = con.execute(_GET, (key,)).fetchone()
        finally:
            FORK_GATE.leave()
        return default if row is None else decode(row[0])

    def get_many(self, keys: Sequence[str]) -> dict[str, Any]:
        """The values of those ``keys`` that are present, in one query per ``_IN_CHUNK`` keys."""
        with FORK_GATE.shared():
            rows = self._select_in("key, value", keys)
        return {k: decode(v) for k, v in rows}

    def present(self, keys: Sequence[str]) -> builtins.set[str]:
        """Those of ``keys`` that are present, in one query per ``_IN_CHUNK`` keys; no value decoded."""
        with FORK_GATE.shared():
            return {k for (k,) in self._select_in("key", keys)}

    def select(self, expression: str, keys: Sequence[str]) -> dict[str, Any]:
        """An SQL ``expression`` of the ``value`` column (e.g. entry.STORED_SQL) for those ``keys``
        that are present, one query per ``_IN_CHUNK`` keys, not decoded (see :func:`decode`)."""
        with FORK_GATE.shared():
            return dict(self._select_in(f"key, {expression}", keys))

    def _select_in(self, columns: str, keys: Sequence[str]) -> list[Any]:
        """``SELECT columns`` of the rows of ``keys`` present, one query per ``_IN_CHUNK`` keys."""
        con, rows = self._con(), []
        for i in range(0, len(keys), _IN_CHUNK):
            part = list(keys[i : i + _IN_CHUNK])
            rows += con.execute(f"SELECT {columns} FROM {TABLE} WHERE key IN ({','.join('?' * len(part))})", part).fetchall()
        return rows

    def scan(self, namespace: str) -> list[tuple[str, Any]]:
        """Every ``(key, value)`` whose key starts with ``namespace`` (keys.py), in one query
        over the key's index: a look-up per key cost 13 s of a rerun at 100k entries (issue 31)."""
        return [(k, decode(v)) for k, v in self._in_namespace("key, value", namespace)]

    def names(self, namespace: str, limit: int = -1) -> list[str]:
        """The keys that start with ``namespace`` (``limit`` at most; -1: all), without the
        values (see :meth:`scan`)."""
        return [k for (k,) in self._in_namespace("key", namespace, limit=limit)]

    def sample(self, namespace: str, n: int) -> list[str]:
        """Up to ``n`` keys of ``namespace`` drawn at random (a scan of the namespace: seconds at millions)."""
        return [k for (k,) in self._in_namespace("key", namespace, "ORDER BY random()", n)]

    def _in_namespace(self, columns: str, namespace: str, order: str = "", limit: int = -1) -> list[Any]:
        """``SELECT columns`` of the rows whose key starts with ``namespace``: a range of the key's index."""
        end = namespace[:-1] + chr(ord(namespace[-1]) + 1)  # the first key past the namespace
        con = self._con()
        with FORK_GATE.shared():
            return con.execute(f"SELECT {columns} FROM {TABLE} WHERE key >= ? AND key < ? {order} LIMIT ?",
                               (namespace, end, limit)).fetchall()

    def iterkeys(self, reverse: bool = False) -> Iterator[str]:
        """Every key, oldest first (newest first with ``reverse``); read whole inside the gate."""
        con = self._con()
        with FORK_GATE.shared():
            rows = con.execute(f"SELECT key FROM {TABLE} ORDER BY rowid {'DESC' if reverse else 'ASC'}").fetchall()
        return iter([k for (k,) in rows])


class GatedIndex(IndexReads):
    """The cache's index, opened read-write: one SQLite table (WAL) under ``directory``.

    Every call, whole transaction, connection open and close runs inside
    :data:`FORK_GATE`; each thread has its own connection, closed when the thread
    ends; writes hold the process's write lock of this cache. An index of the old
    format (before issue 25) is migrated on the first open (:mod:`fastload.cache.migrate`).

    Args:
        directory: The index's folder (``<cache>/index``).
        wal_pages: Checkpoint the write-ahead log at this many pages, and truncate it to them.
    """

    def __init__(self, directory: Path, wal_pages: int = 1000) -> None:
        self.directory = directory
        self.path = directory / INDEX_FILE
        self._wal_pages = wal_pages
        self._thread = threading.local()
        require_sqlite()
        self._root = directory.parent.resolve()
        write_lock(self._root)  # registered, so a forked child gets its own
        directory.mkdir(mode=0o700, exist_ok=True)
        self._prepare()

    def _connect(self) -> sqlite3.Connection:
        # Autocommit (isolation_level None): transact() opens BEGIN IMMEDIATE itself. The
        # busy timeout covers other processes; this process's threads queue on writing().
        con = sqlite3.connect(str(self.path), timeout=60, isolation_level=None, check_same_thread=False)
        try:  # per connection; the file's own settings are made once, in _prepare (they write)
            for pragma in ("synchronous = NORMAL", f"wal_autocheckpoint = {self._wal_pages}",
                           f"journal_size_limit = {self._wal_pages * 4096}"):
                con.execute(f"PRAGMA {pragma}").fetchall()
        except BaseException:
            con.close()
            raise
        return con

    def _con(self) -> sqlite3.Connection:
        # A thread's connection lives in a closer in our thread-local, which dies with the
        # thread and closes it: the loader reads from a fresh thread pool each epoch, and
        # connections left to the gc cost +8 fds and ~1 MB RSS per epoch
        # (tests/reliability/test_soak.py). A forked child opens its own.
        closer = getattr(self._thread, "closer", None)
        if closer is None or closer.pid != os.getpid():
            with FORK_GATE.shared():
                closer = self._thread.closer = ConnectionCloser(self._connect())
        return closer.con

    def _prepare(self) -> None:
        """Create the table, migrating an old index into it once (every process that opens
        the index checks; the first to take the write lock does it)."""
        con = self._con()
        with self.writing(), FORK_GATE.shared():
            if con.execute("PRAGMA user_version").fetchone()[0] < _SCHEMA:
                # Outside a transaction: auto_vacuum (deleted records' pages go back to the
                # disk) takes only before the first table; WAL lets readers run beside a writer.
                con.execute("PRAGMA auto_vacuum = FULL").fetchall()
                con.execute("PRAGMA journal_mode = WAL").fetchall()
                with self._txn():  # another process may have made it meanwhile: look again inside
                    if con.execute("PRAGMA user_version").fetchone()[0] < _SCHEMA:
                        con.execute(f"CREATE TABLE IF NOT EXISTS {TABLE} (key TEXT PRIMARY KEY NOT NULL, value)")
                        rows = migrate.old_rows(self.directory)
                        con.executemany(_ADD, [(k, encode(v)) for k, v in rows])
                        if not rows:  # a new cache starts its totals at 0; a migrated one is counted once (repair.py)
                            con.executemany(_ADD, [(k, 0) for k in keys.TOTALS])
                        con.execute(f"PRAGMA user_version = {_SCHEMA}")
                        if rows:
                            _log.info("cache index %s: %d records migrated from the old index", self.path, len(rows))
            migrate.remove_old(self.directory)

    def writing(self) -> threading.RLock:
        """This process's write lock of the cache (a forked child gets a fresh one)."""
        return _WRITE_LOCKS[self._root]

    def transact(self) -> AbstractContextManager[None]:
        """One write transaction (``BEGIN IMMEDIATE``); nested calls join the outer one."""
        return self._txn()

    @contextmanager
    def _txn(self) -> Iterator[None]:
        con = self._con()
        local = self._thread
        depth = getattr(local, "depth", 0)
        if depth:
            local.depth = depth + 1
            try:
                yield
            finally:
                local.depth = depth
            return
        with self.writing(), FORK_GATE.shared():
            con.execute("BEGIN IMMEDIATE")
            local.depth = 1
            try:
                yield
            except BaseException:
                local.depth = 0
                if con.in_transaction:  # SQLite rolls back by itself after some errors (a full disk)
                    con.execute("ROLLBACK")
                raise
            local.depth = 0
            try:
                con.execute("COMMIT")
            except BaseException:
                if con.in_transaction:
                    con.execute("ROLLBACK")
                raise

    # -- writes: each a statement of its own (SQLite makes one statement atomic), or a
    # step of the caller's transaction --------------------------------------------------

    def _one(self, sql: str, params: Sequence[Any]) -> int:
        """Run one write statement; how many rows it changed."""
        con = self._con()
        if getattr(self._thread, "depth", 0):
            return con.execute(sql, params).rowcount
        with self.writing(), FORK_GATE.shared():
            return con.execute(sql, params).rowcount

    def set(self, key: str, value: Any) -> None:
        self._one(UPSERT, (key, encode(value)))

    def add(self, key: str, value: Any) -> bool:
        """Store ``value`` unless ``key`` is present; whether it was stored."""
        return self._one(_ADD, (key, encode(value))) == 1

    def delete(self, key: str) -> bool:
        return self._one(_DELETE, (key,)) == 1

    # pop and incr read and write in one transaction (the caller's, or their own), not with
    # RETURNING: SQLite has it only since 3.35 (issue 32). The cost, 10k calls on SQLite 3.40:
    # 36.5 us per incr against 39.9 inside the caller's transaction (the hot path: a
    # reservation), 43.0 against 39.6 on its own; one road for every SQLite, then.
    def pop(self, key: str, default: Any = None) -> Any:
        con = self._con()
        with self._txn():
            row = con.execute(_GET, (key,)).fetchone()
            if row is not None:
                con.execute(_DELETE, (key,))
        return default if row is None else decode(row[0])

    def incr(self, key: str, delta: int = 1, default: int = 0) -> int:
        """Add ``delta`` to the int at ``key`` (``default`` when absent); the new value."""
        con = self._con()
        with self._txn():
            con.execute(_INCR, (key, default + delta, delta))
            return int(con.execute(_GET, (key,)).fetchone()[0])

    def set_many(self, items: Mapping[str, Any]) -> None:
        """Set each key to its value, in one statement."""
        with self._txn():
            self._con().executemany(UPSERT, [(k, encode(v)) for k, v in items.items()])

    def add_many(self, items: Sequence[tuple[str, Any]]) -> builtins.set[str]:
        """Add each ``(key, value)`` whose key is absent (first wins within ``items`` too); the keys added."""
        with self._txn():
            taken = {k for (k,) in self._select_in("key", [k for k, _ in items])}
            added: dict[str, Any] = {}
            for key, value in items:
                if key not in taken and key not in added:
                    added[key] = encode(value)
            if added:
                self._con().executemany(_ADD, added.items())
        return builtins.set(added)

    def clear(self) -> int:
        """Delete every record; how many there were."""
        return self._one(f"DELETE FROM {TABLE}", ())

    def checkpoint(self) -> None:
        """Give the write-ahead log back to the disk (checkpoint and truncate it)."""
        con = self._con()
        with self.writing(), FORK_GATE.shared():
            con.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()

    def close(self) -> None:
        """Close this thread's connection (a later call opens a new one)."""
        closer = getattr(self._thread, "closer", None)
        self._thread.closer = None
        if closer is not None and closer.pid == os.getpid():
            with FORK_GATE.shared():
                closer.con.close()


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
