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
"""

from __future__ import annotations

import io
import json
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


def old_rows(directory: Path) -> list[tuple[str, Any]]:
    """The records of the old index under ``directory``, oldest first ([] when there is none).

    An old index that SQLite cannot read as one (corrupt) is skipped with a warning: its
    payloads are fetched again. SQLite's other errors (a full disk, a lock) propagate.
    """
    db = directory / OLD_FILE
    if not db.exists():
        return []
    try:
        con = sqlite3.connect(str(db), timeout=60)
        try:
            rows = con.execute(f"SELECT key, mode, filename, value FROM {OLD_TABLE} WHERE raw = 1 ORDER BY rowid").fetchall()
        finally:
            con.close()
    except sqlite3.OperationalError as err:
        if "no such table" not in str(err):
            raise
        rows = []
    except sqlite3.DatabaseError as err:
        _log.warning("cache index %s of the old format is not readable (%s): it is not migrated, and what it held is "
                     "fetched again; re-stage with `fastload cache URL` to fill the cache now", db, err)
        return []
    out = []
    for key, mode, filename, value in rows:
        try:
            plain = _value(directory, mode, filename, value)
            json.dumps(plain)  # the new index holds JSON values; fastload never wrote bytes or objects
            out.append((key, plain))
        except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError) as err:
            _log.info("cache index %s: record %r not migrated (%s); it is fetched again", db, key, err)
    return out


def _value(directory: Path, mode: int, filename: str | None, value: Any) -> Any:
    if mode == _RAW:
        return value
    path = directory / filename if filename else None
    if mode == _BINARY and path is not None:
        return path.read_bytes()
    if mode == _TEXT and path is not None:
        return path.read_text(encoding="utf-8")
    if mode == _PICKLE:
        return _Plain(io.BytesIO(path.read_bytes() if path is not None else value)).load()
    raise ValueError(f"unknown value mode {mode}")


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
