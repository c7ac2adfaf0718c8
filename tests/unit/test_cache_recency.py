"""Last uses without a write per read (held in memory, one clock per pack, written in
batches), and repair only after a writer crashed (issue 31)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import fastload
from fastload import codec
from fastload.cache import Cache, keys, reads
from fastload.cache.entry import aligned
from fastload.config import Settings


def _settings(tmp_path: Path, **kw: object) -> Settings:
    return Settings(cache_dir=tmp_path / "c", cache_limit_bytes=10**9, **kw)  # type: ignore[arg-type]


def _fill(cache: Cache, n: int, size: int = 4096) -> list[str]:
    names = [f"k{i:05d}" for i in range(n)]
    cache.put_many([(k, os.urandom(size), f"mem://{k}", 0) for k in names])
    return names


def _remote(tmp_path: Path, n: int, size: int) -> Path:
    """A folder of ``n`` random files of ``size`` bytes: a dataset to stage."""
    remote = tmp_path / "remote"
    remote.mkdir()
    for i in range(n):
        (remote / f"f{i:02d}.bin").write_bytes(os.urandom(size))
    return remote


def _changes(cache: Cache) -> int:
    """Rows the index has written since its connection on this thread opened."""
    return cache.index._con().total_changes


def test_a_warm_pass_writes_one_row_per_pack_not_per_read(tmp_path: Path) -> None:
    cache = Cache(_settings(tmp_path))
    names = _fill(cache, 2000)
    reader = Cache(_settings(tmp_path))  # a fresh process's view: nothing known, nothing held
    before = _changes(reader)
    out = np.empty(256 * 4096, np.uint8)
    for i in range(0, len(names), 256):
        assert not reader.read_into([(k, [(0, 4096, j * 4096)]) for j, k in enumerate(names[i : i + 256])], out)
    assert reader.get(names[0]) is not None
    assert _changes(reader) == before  # 2,001 reads, no write yet
    reader.flush_recency()
    packs = {e.clock for e in reader.entries()}
    assert len(packs) == 1 and _changes(reader) - before == 1  # one pack: one clock row
    assert reader.index.get(keys.last_use(packs.pop())) is not None


def test_last_uses_are_written_once_enough_are_held(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = Cache(_settings(tmp_path, pack_max_bytes=0))  # whole files: one clock per entry
    names = _fill(cache, 40)
    monkeypatch.setattr(reads, "RECENCY_FLUSH_KEYS", 16)
    reader = Cache(_settings(tmp_path, pack_max_bytes=0))
    for k in names[:15]:
        assert reader.get(k) is not None
    assert not reader.index.scan(keys.LAST_USE)
    assert reader.get(names[15]) is not None  # the 16th held: all written in one go
    assert len(reader.index.scan(keys.LAST_USE)) == 16 and not reader._held.clocks


def test_last_uses_held_too_long_are_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = Cache(_settings(tmp_path, pack_max_bytes=0))
    names = _fill(cache, 3)
    reader = Cache(_settings(tmp_path, pack_max_bytes=0))
    assert reader.get(names[0]) is not None
    monkeypatch.setattr(reads.time, "time", lambda: reader._held.since + reads.RECENCY_FLUSH_S + 1)
    assert reader.get(names[1]) is not None
    assert {k for k, _ in reader.index.scan(keys.LAST_USE)} == {keys.last_use(names[0]), keys.last_use(names[1])}


def test_close_writes_the_last_uses_held(tmp_path: Path) -> None:
    cache = Cache(_settings(tmp_path, pack_max_bytes=0))
    names = _fill(cache, 3)
    reader = Cache(_settings(tmp_path, pack_max_bytes=0))
    assert reader.get(names[2]) is not None
    reader.close()
    assert [k for k, _ in Cache(_settings(tmp_path)).index.scan(keys.LAST_USE)] == [keys.last_use(names[2])]


def _read_in_child(settings: Settings, name: str) -> None:
    assert Cache(settings).get(name) is not None  # returns without close(): exit must write it


@pytest.mark.parametrize("how", ["multiprocessing", "interpreter"])
def test_a_clean_exit_writes_the_last_uses_held(tmp_path: Path, how: str) -> None:
    s = _settings(tmp_path, pack_max_bytes=0)
    names = _fill(Cache(s), 2)
    if how == "multiprocessing":  # a DataLoader worker ends this way: atexit never runs
        p = multiprocessing.get_context("fork").Process(target=_read_in_child, args=(s, names[1]))
        p.start()
        p.join(60)
        assert p.exitcode == 0
    else:
        code = f"from fastload.cache import Cache; from fastload.config import Settings; " \
               f"assert Cache(Settings(cache_dir={str(s.cache_dir)!r})).get({names[1]!r}) is not None"
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert [k for k, _ in Cache(s).index.scan(keys.LAST_USE)] == [keys.last_use(names[1])]


def test_the_exit_write_does_not_wait_for_an_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each DataLoader worker's end writes what it holds while torch joins it, inside the epoch: its
    # connection commits as the index's own do (synchronous NORMAL: no fsync at commit in WAL mode).
    import sqlite3

    from fastload.cache import held

    s = _settings(tmp_path, pack_max_bytes=0)
    names = _fill(Cache(s), 2)
    assert Cache(s).get(names[0]) is not None
    levels: list[int] = []
    real = sqlite3.connect

    def connect(*args: object, **kw: object) -> sqlite3.Connection:
        con = real(*args, **kw)  # type: ignore[arg-type]
        con.set_trace_callback(lambda sql: sql == "COMMIT" and levels.append(con.execute("PRAGMA synchronous").fetchone()[0]))
        return con

    monkeypatch.setattr(held.sqlite3, "connect", connect)
    held.finish_all()
    assert levels and set(levels) == {1}  # NORMAL (FULL, the default, is 2); other tests' folders may be held too
    assert [k for k, _ in Cache(s).index.scan(keys.LAST_USE)] == [keys.last_use(names[0])]


def test_eviction_keeps_the_pack_read_last(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fastload.cache import packs

    # Payloads below LINE_PAD_MIN get no line padding, so every range in a pack is this size.
    size = codec.LINE_PAD_MIN - codec.LINE
    each = aligned(size + codec.HEADER_BYTES)
    s = _settings(tmp_path).replace(cache_limit_bytes=120 * each)
    monkeypatch.setattr(packs, "ROTATE_BYTES", 40 * each)  # three packs of 40 entries
    cache = Cache(s)
    names = [n for part in range(3) for n in _fill_named(cache, f"p{part}", 40, size)]
    by_pack: dict[str, list[str]] = {}
    for e in cache.entries():
        by_pack.setdefault(e.clock, []).append(e.key)
    assert len(by_pack) == 3
    first = min(by_pack.values(), key=lambda ks: min(ks))  # the oldest pack
    for k in first:
        assert cache.get(k) is not None
    cache.flush_recency()
    cache.evict(cache.volume() - 40 * each)  # one pack's worth must go
    kept = {e.key for e in cache.entries()}
    assert set(first) <= kept  # read last: kept, although written first
    assert len(kept) == 80 and len(names) == 120


def _fill_named(cache: Cache, prefix: str, n: int, size: int) -> list[str]:
    names = [f"{prefix}-{i:03d}" for i in range(n)]
    for k in names:
        cache.put(k, os.urandom(size), url=f"mem://{k}")
    return names


# -- repair only after a crash ------------------------------------------------------


def test_a_clean_writer_leaves_nothing_to_repair(tmp_path: Path) -> None:
    s = _settings(tmp_path)
    code = (f"from fastload.cache import Cache; from fastload.config import Settings; import os; "
            f"Cache(Settings(cache_dir={str(s.cache_dir)!r})).put('a', os.urandom(5000), url='mem://a')")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    cache = Cache(s)
    assert cache.index.scan(keys.WRITER) == [] and cache.get("a") is not None
    assert cache.recover() is None


def test_a_killed_writer_is_repaired_by_the_next_stage(tmp_path: Path) -> None:
    s = _settings(tmp_path, pack_max_bytes=0)
    code = textwrap.dedent(f"""
        import os, sys, time
        from fastload.cache import Cache
        from fastload.config import Settings
        c = Cache(Settings(cache_dir={str(s.cache_dir)!r}, pack_max_bytes=0))
        c.put("a", os.urandom(5000), url="mem://a")
        (c.data_dir / "ab").mkdir(exist_ok=True)
        (c.data_dir / "ab" / "orphan.flp").write_bytes(b"x" * 100)  # a payload a crash left unpublished
        os.utime(c.data_dir / "ab" / "orphan.flp", (time.time() - 3600, time.time() - 3600))
        print("ready", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        cache = Cache(s)
        assert cache.recover() is None  # alive: not a crash
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(30)
    assert [k for k, _ in cache.index.scan(keys.WRITER)] == [keys.writer(proc.pid)]
    found = cache.recover()
    assert found is not None and found["orphans"] == 1
    assert not (cache.data_dir / "ab" / "orphan.flp").exists() and cache.get("a") is not None
    assert cache.index.scan(keys.WRITER) == [] and cache.recover() is None  # repaired once


def test_a_rerun_of_a_staged_dataset_does_not_scan_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    remote = _remote(tmp_path, 20, 3000)
    s = _settings(tmp_path)
    fastload.stage(str(remote), settings=s, progress=False)
    scans: list[str] = []
    monkeypatch.setattr(Cache, "check", lambda self, *a, **k: scans.append("check") or {})
    report = fastload.stage(str(remote), settings=s, progress=False)
    assert report.skipped_blocks == 20 and scans == []
    Cache(s).index.set(keys.writer(2**22 + 12345), time.time())  # a writer that is gone (no such PID)
    fastload.stage(str(remote), settings=s, progress=False)
    assert scans == ["check"]


# -- totals and summaries: `fastload info` without a scan ------------------------------


def test_the_index_keeps_totals_through_publish_drop_and_repair(tmp_path: Path) -> None:
    cache = Cache(_settings(tmp_path))
    assert cache.totals() == {"entries": 0, "stored": 0, "raw": 0, "changes": 0}
    _fill(cache, 10, size=5000)
    assert cache.drop("k00003")
    live = list(cache.entries())
    want = {"entries": 9, "stored": sum(e.stored for e in live), "raw": 45_000, "changes": 11}
    assert cache.totals() == want
    cache.index.set(keys.STORED, 1)  # a count gone wrong: a repair recounts it
    cache.check()
    assert cache.totals() == want
    for name in keys.TOTALS:  # a cache from before totals were kept: counted once, then kept
        cache.index.delete(name)
    assert cache.totals() == want and cache.index.get(keys.ENTRIES) == 9


def test_info_reads_recorded_figures_and_counts_again_after_a_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fastload.cli import dataset_summaries

    remote = _remote(tmp_path, 30, 4096)
    s = _settings(tmp_path)
    fastload.stage(str(remote), settings=s, progress=False)

    def no_scan(self: Cache) -> None:
        raise AssertionError("info scanned every entry")

    counted: list[str] = []
    real = fastload.fetch.identity.Identity.summarise
    monkeypatch.setattr(Cache, "entries", no_scan)
    monkeypatch.setattr(fastload.fetch.identity.Identity, "summarise",
                        lambda self, root, *a: counted.append(root) or real(self, root, *a))
    info = dataset_summaries(s)
    (d,) = info["datasets"]
    assert (info["entries"], d["items"], d["cached_items"], d["remote_bytes"]) == (30, 30, 30, 30 * 4096)
    assert d["stored_bytes"] == info["stored_bytes"] and counted == []  # figures recorded by the stage
    monkeypatch.undo()
    victim = next(iter(Cache(s).entries()))
    assert Cache(s).drop(victim.key)
    monkeypatch.setattr(Cache, "entries", no_scan)
    monkeypatch.setattr(fastload.fetch.identity.Identity, "summarise",
                        lambda self, root, *a: counted.append(root) or real(self, root, *a))
    (d,) = dataset_summaries(s)["datasets"]
    assert d["cached_items"] == 29 and len(counted) == 1  # counted again: something was dropped
    (d,) = dataset_summaries(s)["datasets"]
    assert d["cached_items"] == 29 and len(counted) == 1  # and recorded: not counted a third time


def test_info_reports_the_blocks_the_payloads_hold(tmp_path: Path) -> None:
    from fastload.cli import dataset_summaries

    s = _settings(tmp_path)
    cache = Cache(s)
    _fill(cache, 200)
    for i in range(100):
        assert cache.drop(f"k{i:05d}")  # holes punched in the pack: they take no blocks
    files = [p for p in (s.cache_dir / "data").rglob("*") if p.is_file()]
    info = dataset_summaries(s)
    assert info["disk_bytes"] == sum(p.stat().st_blocks * 512 for p in files)
    assert info["stored_bytes"] == sum(e.stored for e in cache.entries())
    # The pack's length is 200 entries; its blocks hold the live 100, plus at most its two end blocks.
    assert info["stored_bytes"] <= info["disk_bytes"] <= info["stored_bytes"] + 100 * 64 + 2 * 4096
    assert info["index_bytes"] >= (s.cache_dir / "index" / "fastload.db").stat().st_size


def test_stored_sizes_read_in_sql_agree_with_the_records(tmp_path: Path) -> None:
    from fastload.cache.entry import STORED_SQL

    cache = Cache(_settings(tmp_path))
    cache.put_many([(f"p{i}", os.urandom(1000 + i), f"mem://p{i}", 0) for i in range(5)])  # packed
    cache.put("big", os.urandom(3 << 20), url="mem://big")  # a file of its own (a record of the old shape)
    live = list(cache.entries())
    assert {e.offset is None for e in live} == {True, False}
    got = cache.index.select(STORED_SQL, [keys.entry(e.key) for e in live])
    assert got == {keys.entry(e.key): e.stored for e in live}
    assert Cache(_settings(tmp_path)).stored_bytes([e.key for e in live] + ["absent"]) == sum(e.stored for e in live)
    assert Cache(_settings(tmp_path)).present(["p1", "big", "absent"]) == {"p1", "big"}


@pytest.mark.parametrize("memo_max", [0, 3])
def test_look_ups_past_the_memos_bound_still_find_every_entry(tmp_path: Path, memo_max: int) -> None:
    names = _fill(Cache(_settings(tmp_path)), 10)
    reader = Cache(_settings(tmp_path))
    reader.memo_max = memo_max  # 3: cleared in the middle of one batch; 0: staging remembers nothing
    got = reader.entries_for(names)
    assert [e.key if e else None for e in got] == names  # a clear mid-batch once read as misses
    assert len(reader.known) <= memo_max


def test_staging_remembers_no_key_or_pin_per_object(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fastload.read.reader import Reader

    remote = _remote(tmp_path, 40, 2000)
    readers: list[Reader] = []
    real_init = Reader.__init__

    def keep(self: Reader, *a: object, **k: object) -> None:
        real_init(self, *a, **k)  # type: ignore[arg-type]
        readers.append(self)

    monkeypatch.setattr(Reader, "__init__", keep)
    report = fastload.stage(str(remote), settings=_settings(tmp_path), progress=False)
    assert report.fetched_blocks == 40
    (reader,) = readers
    assert len(reader.identity._keys) == 0 and len(reader.identity._pins) == 0
