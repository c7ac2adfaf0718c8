"""The cache's disk: how much room it leaves, and what to do when it refuses writes.

**Room.** The limit in force is ``cache_limit_bytes`` capped at the cache's bytes
plus the disk's free space less a reserve (:func:`room`): the default 50 GB limit
filled a smaller disk to 100% (issue 14).

**Refused writes.** A full disk (ENOSPC, SQLite's "database or disk is full") or a
read-only mount (EROFS) is :func:`cannot_write`; callers then serve what is cached
and stream the rest.

**The index opened for reading only.** Opening the index read-write creates its
table (and SQLite its -shm file), so on a full disk (or a ``mount -o ro``)
``fastload info`` and training once failed before reading a byte (issue 14).
:class:`ReadOnlyIndex` reads the same table through SQLite's read-only modes, with
the same look-ups (:class:`~fastload.cache.index.IndexReads`), so every lookup the
read path makes works; every write raises
:class:`IndexUnwritable`, which callers treat as "cannot store" (reads served,
new data streams), as they treat a full disk. A cache staged before issue 25 whose index
cannot be migrated (that writes) is read in place: its old index
(:mod:`fastload.cache.migrate`) through a view of the same name and columns (issue 32).

Vocabulary: *read-only* = the file system refuses writes (``ST_RDONLY``,
``EROFS``); *full* = it has no space (``ENOSPC``). Messages name which.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fastload.cache import migrate
from fastload.cache.index import INDEX_FILE, TABLE, IndexReads, encode, require_sqlite

# The default disk reserve (Settings.disk_reserve_bytes None): this fraction of the
# cache's disk, at most RESERVE_MAX_BYTES, stays free however high the limit.
RESERVE_FRACTION = 0.05
RESERVE_MAX_BYTES = 1000**3
KIND_WORDS = {"read-only": "the file system is read-only", "full": "the disk is full"}
_log = logging.getLogger("fastload")


def reserve_bytes(path: Path, setting: int | None) -> int:
    """The bytes to keep free on ``path``'s disk: ``setting``, or the default share of the disk."""
    if setting is not None:
        return setting
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return _reserve_of(st, setting)


def _reserve_of(st: os.statvfs_result, setting: int | None) -> int:
    if setting is not None:
        return setting
    return min(RESERVE_MAX_BYTES, int(st.f_blocks * st.f_frsize * RESERVE_FRACTION))


def room(path: Path, setting: int | None) -> int | None:
    """Bytes the cache may still add on ``path``'s disk: its free space less the reserve
    (None: no cap, the reserve is 0 or the disk cannot be asked)."""
    if setting == 0:
        return None
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize - _reserve_of(st, setting)  # one statvfs: this runs per cache write


# SQLite's names for a disk with no space: SQLITE_FULL, and the -shm file that cannot grow.
# Nobody holding the index open, SQLite creates its 32 KiB -shm file on open; on a disk
# filled by another program that fails as "disk I/O error" (SQLITE_IOERR_SHMSIZE), and
# `fastload info`, `evict`, `clear` and training all failed on it (issue 24).
_FULL_NAMES = ("SQLITE_FULL", "SQLITE_IOERR_SHMSIZE")


def disk_full(err: BaseException) -> bool:
    """ENOSPC/EDQUOT, or SQLite's names and wording for them."""
    if isinstance(err, OSError):
        return err.errno in (errno.ENOSPC, errno.EDQUOT)
    if not isinstance(err, sqlite3.OperationalError):
        return False
    return getattr(err, "sqlite_errorname", None) in _FULL_NAMES or "full" in str(err)


def cannot_write(err: BaseException) -> bool:
    """The disk refused a write: full (:func:`disk_full`), or read-only (EROFS, SQLite's
    "readonly database", or an index opened read-only). Reads go on; stores stream."""
    if disk_full(err) or isinstance(err, IndexUnwritable):
        return True
    if isinstance(err, OSError):
        return err.errno == errno.EROFS
    return isinstance(err, sqlite3.OperationalError) and "readonly" in str(err)


def unwritable_kind(err: BaseException, root: Path) -> str | None:
    """"read-only", "full", or None when ``err`` is not about the disk refusing writes.

    A read-only mount fails the index's open as "unable to open database file", which
    names neither cause, so the mount flag decides first.
    """
    if read_only_fs(root) or (cannot_write(err) and not disk_full(err)):
        return "read-only"
    if disk_full(err):
        return "full"
    # Any other I/O error of SQLite's on a disk with no space left is the full disk too.
    io_error = isinstance(err, sqlite3.OperationalError) and "I/O error" in str(err)
    return "full" if io_error and no_space(root) else None


def no_space(path: Path) -> bool:
    """Whether the disk holding ``path`` has no room for even SQLite's -shm file (32 KiB)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < 64 * 1024


def file_in_path(path: Path) -> Path | None:
    """``path`` or the nearest folder above it that exists as something other than a
    directory (a file): nothing can be created under it. None when there is none."""
    for p in (path, *path.parents):
        if os.path.lexists(p):
            return None if os.path.isdir(p) else p
    return None


def user_name() -> str:
    """This process's user, by name where the system knows it."""
    try:
        import pwd

        return pwd.getpwuid(os.geteuid()).pw_name
    except (ImportError, KeyError):
        return str(os.geteuid())


class IndexUnwritable(sqlite3.OperationalError):
    """A write to an index opened read-only (the disk is full or mounted read-only)."""


def read_only_fs(path: Path) -> bool:
    """Whether the file system holding ``path`` is mounted read-only."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


class ReadOnlyIndex(IndexReads):
    """The cache's index table, read through SQLite without writing anything.

    Args:
        directory: The index's folder (``<cache>/index``).
        reason: Why it is read-only, for messages ("the file system is read-only", ...).

    Attributes:
        old: Whether it reads an index of the old format in place (:meth:`_view_old`).
    """

    def __init__(self, directory: Path, reason: str) -> None:
        require_sqlite()
        self.directory = directory
        self.reason = reason
        self._local = threading.local()
        self._pid = os.getpid()
        # The new index; else (never migrated: that writes) the old one, read in place.
        self._db = directory / INDEX_FILE
        self.old = False
        uri = self._pick_uri(self._db, f"SELECT 1 FROM {TABLE} LIMIT 1")
        if uri is None and (directory / migrate.OLD_FILE).exists():
            self._db, self.old = directory / migrate.OLD_FILE, True
            self._skips, self._skips_lock = migrate.Skips(self._db), threading.Lock()  # warned once per process
            uri = self._pick_uri(self._db, migrate.SELECT + " LIMIT 1")
        if uri is None:
            raise FileNotFoundError(f"no cache index at {directory / INDEX_FILE} that can be read ({self._error})")
        self._uri = uri
        if self.old:
            _log.info("cache index %s: of the format before issue 25, read in place (%s, so it is not migrated)",
                      self._db, reason)

    def _pick_uri(self, db: Path, probe: str) -> str | None:
        """The URI to open ``db`` read-only by, where ``probe`` runs (None: neither does)."""
        # mode=ro sees writes of other processes (WAL), but needs the -shm file to exist
        # or to be creatable; on a read-only mount neither holds, and nothing can change
        # under us there, so immutable=1 (no locks, no -shm) is exact.
        self._error: BaseException = FileNotFoundError(f"no file {db}")
        if not db.exists():
            return None
        for uri in (f"file:{db}?mode=ro", f"file:{db}?immutable=1"):
            try:
                con = sqlite3.connect(uri, uri=True, check_same_thread=False)
                try:
                    con.execute(probe).fetchall()
                finally:
                    con.close()
                wal = Path(f"{db}-wal")
                if "immutable" in uri and wal.exists() and wal.stat().st_size:
                    _log.info("cache index %s: its write-ahead log was not checkpointed before the file system went "
                              "read-only; the entries written last are not seen (they stream)", db)
                return uri
            except sqlite3.Error as err:
                self._error = err
        return None

    def _con(self) -> sqlite3.Connection:
        if self._pid != os.getpid():  # a forked child opens its own connections
            self._local, self._pid = threading.local(), os.getpid()
        con = getattr(self._local, "con", None)
        if con is None:
            con = sqlite3.connect(self._uri, uri=True, check_same_thread=False)
            if self.old:
                self._view_old(con)
            self._local.con = con
        return con

    def _view_old(self, con: sqlite3.Connection) -> None:
        """Show the old index as the new table: a TEMP view named ``idx`` (found before the
        file's own tables) whose values :func:`migrate.record` reads a row at a time, as the
        migration would have stored them; a record it refuses is absent, as if not migrated."""
        con.text_factory = migrate.decode_text  # a key that is not UTF-8 fails its record, not the query

        def column(*pairs: Any) -> Any:
            # Each column comes as two arguments, (its text as a blob, else None; else the
            # column): Python decodes a function's text arguments strictly, and one that is
            # not UTF-8 would fail the whole query, not its record.
            cols: list[Any] = [o if t is None else migrate.decode_text(t) for t, o in zip(pairs[::2], pairs[1::2])]
            key, mode, filename, value = cols
            try:
                return encode(migrate.record(self.directory, key, mode, filename, value))
            except Exception as err:  # SQLite would fail the whole query on a raise
                with self._skips_lock:
                    self._skips.add(key, err)
                    if self._skips.n == 1:
                        self._skips.report("not read")
                return None

        con.create_function("fastload_old_value", 8, column, deterministic=True)
        value = "fastload_old_value({})".format(", ".join(
            f"CASE WHEN typeof({c}) = 'text' THEN CAST({c} AS BLOB) END, CASE WHEN typeof({c}) != 'text' THEN {c} END"
            for c in ("key", "mode", "filename", "value")))
        con.execute(f"CREATE TEMP VIEW {TABLE}(key, value, rowid) AS SELECT key, {value}, rowid FROM main.{migrate.OLD_TABLE} "
                    f"WHERE raw = 1 AND {value} IS NOT NULL")

    def close(self) -> None:
        con = getattr(self._local, "con", None)
        if con is not None:
            con.close()
            self._local.con = None

    # -- writes: refused ------------------------------------------------------------

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise IndexUnwritable(f"the cache index at {self.directory} is open read-only: {self.reason}")

    set = add = set_many = add_many = delete = pop = incr = clear = checkpoint = _refuse

    @contextmanager
    def transact(self) -> Iterator[None]:
        self._refuse()
        yield  # pragma: no cover - never reached
