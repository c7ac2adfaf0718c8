"""The cache index: its one-table writes, and an index of the old format migrated on open."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import fastload
from fastload.cache import Cache, keys
from fastload.cache.index import INDEX_FILE
from fastload.cache.migrate import OLD_FILE
from fastload.config import Settings
from fastload.read.reader import Reader


@pytest.fixture()
def settings(tmp_path: Path) -> Settings:
    return Settings(cache_dir=tmp_path / "cache", cache_limit_bytes=10**9, block_bytes=64 * 1024, max_requests=4)


def test_index_writes_keep_their_meaning(settings: Settings) -> None:
    cache = Cache(settings)
    index = cache.index
    assert sorted(index.iterkeys()) == sorted(keys.TOTALS)  # a new cache starts its totals at 0
    assert [index.get(k) for k in keys.TOTALS] == [0, 0, 0]
    index.clear()
    assert index.incr("n") == 1 and index.incr("n", 5) == 6 and index.incr("m", -2, default=10) == 8
    assert index.add("a", (1, "x")) and not index.add("a", (2, "y")) and index.get("a") == (1, "x")
    index.set("a", {"k": [1.5, None]})
    assert index.get("a") == {"k": [1.5, None]} and index.get("missing", 7) == 7
    assert index.pop("a") == {"k": [1.5, None]} and index.pop("a", "gone") == "gone"
    assert index.delete("n") and not index.delete("n")
    with pytest.raises(RuntimeError), index.transact():
        index.set("b", 1)
        with index.transact():  # nested: one transaction, rolled back whole
            index.incr("m", 100)
        raise RuntimeError
    assert index.get("b") is None and index.get("m") == 8
    index.set("c", True)
    assert list(index.iterkeys()) == ["m", "c"] and list(index.iterkeys(reverse=True)) == ["c", "m"]
    assert index.get("c") is True and index.clear() == 2 and not list(index.iterkeys())
    cache.close()


def test_an_old_index_is_migrated_and_serves_the_staged_cache_with_no_fetch(tmp_path: Path, settings: Settings) -> None:
    diskcache = pytest.importorskip("diskcache", reason="building an index of the old format needs the diskcache package")
    remote = tmp_path / "remote"
    remote.mkdir()
    files = {f"f{i}.bin": os.urandom(20_000 + i * 70_000) for i in range(6)}  # small (packed) and multi-block items
    for name, data in files.items():
        (remote / name).write_bytes(data)
    fastload.stage(str(remote), settings=settings, progress=False)
    cache = Cache(settings)
    records = {k: cache.index.get(k) for k in cache.index.iterkeys()}
    volume = cache.volume()
    cache.close()
    assert volume > 0 and any(isinstance(v, dict) for v in records.values())  # a manifest among them

    # The index as fastload wrote it before issue 25: a diskcache with the same records.
    index_dir = settings.cache_dir / "index"
    for p in index_dir.iterdir():
        p.unlink()
    old = diskcache.Cache(str(index_dir), eviction_policy="none", size_limit=2**62)
    for k, v in records.items():
        old.set(k, v)
    old.reset("disk_min_file_size", 0)  # large values live in files: manifests, and the other modes
    for k, v in records.items():
        if isinstance(v, dict):
            old.set(k, v)
    old.set("test:text", "words " * 10)
    old.set("test:bytes", b"\x00\x01" * 10)
    old.close()
    assert (index_dir / OLD_FILE).exists() and not (index_dir / INDEX_FILE).exists()

    for name in files:  # any fetch now fails: what is read comes from the cache
        (remote / name).unlink()
    reader = Reader(settings)
    for name, data in files.items():
        assert reader.read(str(remote / name)) == data
    assert reader.misses == 0 and reader.hits >= len(files)  # every block served from the cache
    index = reader.cache.index
    assert {k: index.get(k) for k in records} == records
    # Text comes across; bytes (which fastload never wrote to its index) do not: the new index holds JSON.
    assert index.get("test:text") == "words " * 10 and index.get("test:bytes") is None
    assert reader.cache.volume() == volume
    assert sorted(p.name for p in index_dir.iterdir() if not p.name.startswith(INDEX_FILE)) == []  # old files gone
    reader.cache.close()


class _Planted:
    """A pickle that, unpickled by plain pickle.loads, would create ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        return (Path.touch, (self.marker,))


def test_a_planted_pickle_in_an_old_index_runs_nothing_and_is_not_migrated(tmp_path: Path, settings: Settings) -> None:
    diskcache = pytest.importorskip("diskcache", reason="building an index of the old format needs the diskcache package")
    marker = tmp_path / "RAN"
    index_dir = settings.cache_dir / "index"
    index_dir.mkdir(parents=True)
    old = diskcache.Cache(str(index_dir), eviction_policy="none", size_limit=2**62)
    old.set("u:https://host/a.jpg", (10, "v1"))
    old.set("u:https://host/evil", _Planted(marker))
    old.close()
    index = Cache(settings).index
    assert index.get("u:https://host/a.jpg") == (10, "v1")  # the plain record came across
    assert index.get("u:https://host/evil") is None and not marker.exists()
    assert (index_dir / INDEX_FILE).exists() and not (index_dir / OLD_FILE).exists()
