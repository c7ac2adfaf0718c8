"""The index of the old format, read once into the new one (issue 25).

Until issue 25 the index was a diskcache (the package) under ``<cache>/index/``:
its ``cache.db`` (table ``Cache``) and value files in subfolders. fastload wrote
str keys only (``raw`` = 1); a value is in the ``value`` column or, when large, in
a file named by ``filename``, per its ``mode``: 1 raw (the column itself), 2 bytes
in a file, 3 UTF-8 text in a file, 4 pickled (in the column, or in a file). This
module reads those rows with sqlite3, so a staged cache stays usable without
re-staging, and removes the old files once the new index holds them.

A pickled value is read by :class:`_Plain`, which builds only plain values (what
fastload wrote: tuples, lists, dicts, str, numbers) and refuses any class or
function a planted pickle names, so the migration runs no code from the cache folder.

A record that cannot be read as a plain value (any error, a value nested deeper than
:data:`MAX_DEPTH` or larger than :data:`MAX_BYTES`) is skipped and counted, with one
warning per index: one odd record once failed the migration, and so every open
(issue 32). When the index cannot be written (a read-only mount, a full disk) the old
index is read in place, a record at a time, through :func:`record`
(:class:`fastload.cache.disk.ReadOnlyIndex`).
"""

from __future__ import annotations

import io
import logging
import pickle
import shutil
import sqlite3
from pathlib import Path
from typing import Any

OLD_FILE, OLD_TABLE = "cache.db", "Cache"
_log = logging.getLogger("fastload")
_RAW, _BINARY, _TEXT, _PICKLE = 1, 2, 3, 4


class _Plain(pickle.Unpickler):
    """An unpickler of plain values only: every global (class, function) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name} is not a plain value; an index record holds none")


# Caps on one record's value: fastload's records nest a few levels deep, and SQLite holds
# no value over 1e9 bytes; a value past either was not written by fastload.
MAX_DEPTH = 32
MAX_BYTES = 10**9


def old_rows(directory: Path) -> list[tuple[str, Any]]:
    """The records of the old index under ``directory``, oldest first ([] when there is none).

    An old index that SQLite cannot read as one (corrupt, or not diskcache's table) is
    skipped with a warning: its payloads are fetched again. A busy, locked or full disk
    propagates (the next open migrates). A bad record is skipped (:class:`Skips`).
    """
    db = directory / OLD_FILE
    if not db.exists():
        return []
    try:
        con = sqlite3.connect(str(db), timeout=60)
        try:
            con.text_factory = decode_text  # a key that is not UTF-8 is one bad record, not a failed SELECT
            rows = con.execute(SELECT).fetchall()
        finally:
            con.close()
    except sqlite3.DatabaseError as err:
        if _transient(err):
            raise
        if "no such table" not in str(err):
            _log.warning("cache index %s of the old format is not readable (%s): it is not migrated, and what it held "
                         "is fetched again; re-stage with `fastload cache URL` to fill the cache now", db, err)
        return []
    out, skips = [], Skips(db)
    for key, mode, filename, value in rows:
        try:
            out.append((key, record(directory, key, mode, filename, value)))
        except Exception as err:  # any bad record (RecursionError, MemoryError included) is skipped: never fails the open
            skips.add(key, err)
    skips.report("not migrated")
    return out


# diskcache's table: str keys have raw = 1; the rowid is the order they were written in.
SELECT = f"SELECT key, mode, filename, value FROM {OLD_TABLE} WHERE raw = 1 ORDER BY rowid"


def decode_text(data: bytes) -> str:
    """SQLite's text as str; bytes that are not UTF-8 as lone surrogates, which :func:`record` refuses."""
    return data.decode("utf-8", "surrogateescape")


def _transient(err: sqlite3.DatabaseError) -> bool:
    """A lock, a busy database, a full disk or an I/O error: the file may be fine next time."""
    text = str(err)
    return any(word in text for word in ("locked", "busy", "full", "I/O error", "unable to open"))


class Skips:
    """Old records skipped: counted, and said in one warning (the first one's key and error)."""

    def __init__(self, db: Path) -> None:
        self.db = db
        self.n = 0
        self.first = ""

    def add(self, key: Any, err: BaseException) -> None:
        self.n += 1
        if self.n == 1:
            self.first = f"{key!r:.200}: {type(err).__name__}: {err!s:.200}"

    def report(self, what: str) -> None:
        if self.n:
            _log.warning("cache index %s of the old format: %d record(s) %s, as they are not plain values fastload "
                         "wrote (first %s); what they held is fetched again", self.db, self.n, what, self.first)


def record(directory: Path, key: Any, mode: int, filename: str | None, value: Any) -> Any:
    """The plain value of one old record; raises (any exception) when it is not one fastload wrote."""
    if not isinstance(key, str):
        raise TypeError(f"key of type {type(key).__name__}; fastload wrote str keys")
    key.encode("utf-8")  # a lone surrogate (bytes that were not UTF-8): SQLite refuses it
    plain, size = _read(directory, mode, filename, value)
    _check(plain, size + 1000)
    return plain


def _read(directory: Path, mode: int, filename: str | None, value: Any) -> tuple[Any, int]:
    """The record's value and its size as stored (bytes)."""
    if mode == _RAW:
        return value, 0
    path = directory / filename if filename else None
    if path is not None:
        # A planted name ("../../x") reads nothing outside the index's folder.
        if not path.resolve().is_relative_to(directory.resolve()):
            raise ValueError(f"value file {filename!r} is outside the index's folder")
        if path.stat().st_size > MAX_BYTES:
            raise ValueError(f"value file {filename!r} is over {MAX_BYTES} bytes")
    if mode == _BINARY and path is not None:
        return path.read_bytes(), 0
    if mode == _TEXT and path is not None:
        return path.read_text(encoding="utf-8"), 0
    if mode == _PICKLE:
        data = path.read_bytes() if path is not None else value
        if len(data) > MAX_BYTES:
            raise ValueError(f"pickled value of {len(data)} bytes is over {MAX_BYTES}")
        return _Plain(io.BytesIO(data)).load(), len(data)
    raise ValueError(f"unknown value mode {mode}")


def _check(value: Any, budget: int) -> None:
    """Raise ValueError unless ``value`` is JSON (the new index's values), at most ``MAX_DEPTH``
    deep, of at most ``budget`` parts. Walked without recursion, so a deep or self-holding
    value fails here, not as a RecursionError in json; the budget (a part costs its pickle a
    byte at least, unless shared) stops a few shared lists that unfold to billions."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        budget -= 1
        if budget < 0:
            raise ValueError("value unfolds to more parts than its pickle has bytes")
        if isinstance(item, (str, int, float)) or item is None:  # bool is an int
            continue
        if not isinstance(item, (list, tuple, dict)):
            raise ValueError(f"a {type(item).__name__} is not a JSON value")
        if depth >= MAX_DEPTH:
            raise ValueError(f"value nested deeper than {MAX_DEPTH} levels")
        if isinstance(item, dict):
            if not all(isinstance(k, str) for k in item):
                raise ValueError("a dict key that is not str")
            stack += [(v, depth + 1) for v in item.values()]
        else:
            stack += [(v, depth + 1) for v in item]


def remove_old(directory: Path) -> None:
    """Delete the old index's files (value folders first, its database last), if it is there."""
    if not (directory / OLD_FILE).exists():
        return
    try:
        for folder in [p for p in directory.iterdir() if p.is_dir()]:  # only the old index had folders here
            shutil.rmtree(folder, ignore_errors=True)
        for name in (f"{OLD_FILE}-shm", f"{OLD_FILE}-wal", OLD_FILE):
            (directory / name).unlink(missing_ok=True)
    except OSError as err:
        _log.info("cache index %s: the old index's files not removed (%s)", directory, err)
