"""An index of the old format (a diskcache, before issue 25) with bad records, the SQLite
floor, and an old index read in place when it cannot be migrated (issue 32)."""

from __future__ import annotations

import io
import json
import logging
import pickle
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from fastload.cache import Cache, migrate
from fastload.cache.disk import IndexUnwritable, ReadOnlyIndex
from fastload.cache.entry import STORED_SQL
from fastload.cache.index import INDEX_FILE, SQLITE_FLOOR, require_sqlite
from fastload.config import Settings
from fastload.errors import SQLiteVersionError

GOOD = {
    "u:https://host/a.jpg": (10, "v1"),
    "e:0123": ("ab/0123", 7, 9, "lz4", 5),  # an entry record: (path, stored, raw, ...)
    "m:https://host/": {"files": [["a.jpg", 10]], "n": 1},
    "bytes": 11,
    "note": "words " * 10,
}
DEEP = 100_000


def _deep() -> bytes:
    """A list nested DEEP levels: EMPTY_LIST DEEP times, then APPEND DEEP-1 times (pickle builds
    it without recursing; json.dumps of it raises RecursionError)."""
    return b"\x80\x02" + b"]" * DEEP + b"a" * (DEEP - 1) + b"."


def _laughs() -> bytes:
    """40 levels, each a list holding the level below twice: 2**40 parts from ~200 bytes."""
    out = b"\x80\x02]q\x00"  # level 0, memo 0
    for i in range(1, 41):
        out += b"]h" + bytes([i - 1]) + b"h" + bytes([i - 1]) + b"e" + b"q" + bytes([i])
    return out + b"."


BAD_PICKLES = {
    "bad:build-on-list": b"\x80\x02]}X\x01\x00\x00\x00aK\x01sb.",  # BUILD on a list: AttributeError
    "bad:deep": _deep(),  # RecursionError in json, before issue 32
    "bad:self": b"\x80\x02]q\x00h\x00a.",  # a list that holds itself
    "bad:laughs": _laughs(),
    "bad:garbage": b"\x80\x02\xff\xfe",
    "bad:global": pickle.dumps(Path("/x")),  # a class: refused by the unpickler
    "bad:set": pickle.dumps({1, 2}),  # not a JSON value
}


def _old_index(index_dir: Path, bad: bool = True) -> None:
    """An old index with the GOOD records and, with ``bad``, one odd record of each kind."""
    diskcache = pytest.importorskip("diskcache", reason="building an index of the old format needs the diskcache package")
    index_dir.mkdir(parents=True, exist_ok=True)
    old = diskcache.Cache(str(index_dir), eviction_policy="none", size_limit=2**62)
    for k, v in GOOD.items():
        old.set(k, v)
    old.close()
    if not bad:
        return
    (index_dir.parent / "outside.txt").write_text("a secret")
    con = sqlite3.connect(str(index_dir / migrate.OLD_FILE))
    rows: list[tuple[Any, ...]] = [(k, 4, None, v) for k, v in BAD_PICKLES.items()]
    rows += [("bad:escape", 3, "../../outside.txt", None), ("bad:mode", 99, None, b"x"), ("bad:bytes", 1, None, b"\x00"),
             (5, 1, None, 1)]
    con.executemany("INSERT INTO Cache(key, raw, mode, filename, value, store_time) VALUES (?, 1, ?, ?, ?, 0)", rows)
    con.execute("INSERT INTO Cache(key, raw, mode, value, store_time) VALUES (CAST(x'ff61' AS TEXT), 1, 1, 1, 0)")
    con.commit()
    con.close()


N_BAD = len(BAD_PICKLES) + 5


def test_the_bad_records_fail_as_issue_32_says() -> None:
    # What escaped the migration's except before: pin the causes, so the test below covers them.
    with pytest.raises(AttributeError):
        migrate._Plain(io.BytesIO(BAD_PICKLES["bad:build-on-list"])).load()
    deep = migrate._Plain(io.BytesIO(BAD_PICKLES["bad:deep"])).load()
    with pytest.raises(RecursionError):
        json.dumps(deep)


def test_bad_records_are_skipped_counted_and_warned_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    settings = Settings(cache_dir=tmp_path / "cache")
    index_dir = settings.cache_dir / "index"
    _old_index(index_dir)
    with caplog.at_level(logging.WARNING, logger="fastload"):
        cache = Cache(settings)
    assert {k: cache.index.get(k) for k in GOOD} == GOOD
    assert not [k for k in cache.index.iterkeys() if k.startswith("bad:")]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and f"{N_BAD} record(s) not migrated" in warnings[0], warnings
    assert "a secret" not in str(cache.index.get("bad:escape"))
    cache.close()
    assert (index_dir / INDEX_FILE).exists() and not (index_dir / migrate.OLD_FILE).exists()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fastload"):
        again = Cache(settings)  # later opens work, and say nothing more
    assert again.index.get("note") == GOOD["note"] and not caplog.records
    again.close()


def test_an_old_index_that_is_not_diskcaches_is_skipped_not_fatal(tmp_path: Path) -> None:
    settings = Settings(cache_dir=tmp_path / "cache")
    index_dir = settings.cache_dir / "index"
    index_dir.mkdir(parents=True)
    con = sqlite3.connect(str(index_dir / migrate.OLD_FILE))
    con.execute("CREATE TABLE Cache (key TEXT)")  # no raw, mode...: "no such column", which failed every open
    con.close()
    cache = Cache(settings)
    assert cache.index.get("entries") == 0 and cache.unwritable is None
    cache.close()


def test_an_old_index_is_read_in_place_when_it_cannot_be_migrated(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    index_dir = tmp_path / "cache" / "index"
    _old_index(index_dir)
    before = sorted(p.name for p in index_dir.iterdir())
    with caplog.at_level(logging.WARNING, logger="fastload"):
        index = ReadOnlyIndex(index_dir, "the file system is read-only")
        assert index.old
        assert {k: index.get(k) for k in GOOD} == GOOD and index.get("bad:deep", "gone") == "gone"
        assert index.get_many(list(GOOD) + list(BAD_PICKLES)) == GOOD
        assert index.present(["u:https://host/a.jpg", "bad:self", "missing"]) == {"u:https://host/a.jpg"}
        assert index.scan("u:") == [("u:https://host/a.jpg", (10, "v1"))]
        assert index.names("bad:") == [] and index.sample("e:", 5) == ["e:0123"]
        assert index.select(STORED_SQL, ["e:0123", "bad:set"]) == {"e:0123": 7}  # SQL over the values, as migrated
        assert list(index.iterkeys()) == list(GOOD) and list(index.iterkeys(reverse=True)) == list(GOOD)[::-1]
        with pytest.raises(IndexUnwritable):
            index.set("x", 1)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "not read" in warnings[0], warnings  # once, however many bad records it met
    index.close()
    # Not migrated: no new index, the old one as it was (SQLite's mode=ro adds its -wal and -shm files here).
    assert sorted(p.name for p in index_dir.iterdir() if not p.name.endswith(("-wal", "-shm"))) == before


def test_a_new_index_is_preferred_to_an_old_one_beside_it(tmp_path: Path) -> None:
    settings = Settings(cache_dir=tmp_path / "cache")
    Cache(settings).close()
    _old_index(settings.cache_dir / "index", bad=False)
    index = ReadOnlyIndex(settings.cache_dir / "index", "the disk is full")
    assert not index.old and index.get("note") is None and index.get("entries") == 0
    index.close()


def test_an_sqlite_below_the_floor_is_refused_at_open_naming_both_versions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_sqlite()  # this machine's SQLite is above the floor
    monkeypatch.setattr(sqlite3, "sqlite_version_info", (3, 22, 0))
    with pytest.raises(SQLiteVersionError) as err:
        Cache(Settings(cache_dir=tmp_path / "cache"))
    text = str(err.value)
    floor = ".".join(map(str, SQLITE_FLOOR))
    assert "SQLite 3.22.0" in text and f"older than {floor}" in text and "fix:" in text, text
    assert not isinstance(err.value, OSError)  # not taken for a disk that refuses writes
    with pytest.raises(SQLiteVersionError):
        ReadOnlyIndex(tmp_path / "cache" / "index", "the disk is full")
