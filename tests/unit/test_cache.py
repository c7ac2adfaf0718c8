"""The cache contract on a local-filesystem remote: identity, checks, bounds, atomicity."""

from __future__ import annotations

import os
import pickle
import stat
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload.cache import Cache, keys
from fastload.config import Settings
from fastload.errors import CacheLimitError, ConfigError, RemoteChangedError
from fastload.read.reader import Reader


def make_files(root: Path, n: int = 8, size: int = 50_000) -> dict[str, bytes]:
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for i in range(n):
        data = (f"sample {i} ".encode() * (size // 10))[:size] + os.urandom(64)
        (root / f"f{i:03d}.bin").write_bytes(data)
        out[f"f{i:03d}.bin"] = data
    return out


@pytest.fixture()
def settings(tmp_path: Path) -> Settings:
    return Settings(cache_dir=tmp_path / "cache", cache_limit_bytes=10**9, block_bytes=64 * 1024, chunk_bytes=16 * 1024, max_requests=4, retries=2, backoff_s=0.01)


def test_staging_runs_stage_threads_tasks_at_once(tmp_path: Path, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    import concurrent.futures
    import importlib

    stage_mod = importlib.import_module("fastload.stage")  # the module; fastload.stage is the function

    sizes: list[int | None] = []

    class Recorded(concurrent.futures.ThreadPoolExecutor):
        def __init__(self, max_workers: int | None = None, *args: Any, **kwargs: Any) -> None:
            sizes.append(max_workers)
            super().__init__(max_workers, *args, **kwargs)

    monkeypatch.setattr(stage_mod, "ThreadPoolExecutor", Recorded)
    make_files(tmp_path / "remote")
    fastload.stage(str(tmp_path / "remote"), settings=settings.replace(stage_threads=3), progress=False)
    assert sizes[0] == 3  # the staging pool: its size is a Settings field, not a constant
    with pytest.raises(ConfigError, match="stage_threads=0"):
        settings.replace(stage_threads=0)


def test_staged_reads_survive_the_remote_disappearing(tmp_path: Path, settings: Settings) -> None:
    files = make_files(tmp_path / "remote")
    fastload.stage(str(tmp_path / "remote"), settings=settings, progress=False)
    for name in files:
        (tmp_path / "remote" / name).unlink()
    reader = Reader(settings)
    for name, data in files.items():
        assert reader.read(str(tmp_path / "remote" / name)) == data
    assert reader.misses == 0 and reader.hits == len(files)


def test_corrupt_truncated_and_missing_payloads_are_dropped_refetched_and_counted(tmp_path: Path, settings: Settings) -> None:
    settings = settings.replace(pack_max_bytes=0)  # a file per payload; packs: tests/unit/test_cache_packs.py
    files = make_files(tmp_path / "remote", n=6)
    fastload.stage(str(tmp_path / "remote"), settings=settings, progress=False)
    cache = Cache(settings)
    entries = sorted(cache.entries(), key=lambda e: e.url)
    flipped, truncated, deleted = entries[0], entries[1], entries[2]
    raw = bytearray((cache.data_dir / flipped.path).read_bytes())
    raw[len(raw) // 2] ^= 0x5A
    (cache.data_dir / flipped.path).write_bytes(bytes(raw))
    with open(cache.data_dir / truncated.path, "r+b") as f:
        f.truncate(truncated.stored // 2)
    (cache.data_dir / deleted.path).unlink()

    reader = Reader(settings)
    for name, data in files.items():
        assert reader.read(str(tmp_path / "remote" / name)) == data
    assert reader.cache.corrupt_count() == 3
    assert reader.misses == 3  # exactly the three bad entries were refetched
    assert all(Reader(settings).cache.get(e.key) is not None for e in Cache(settings).entries())


def test_eviction_keeps_volume_under_the_limit_and_prefers_recent(tmp_path: Path) -> None:
    s = Settings(cache_dir=tmp_path / "c", cache_limit_bytes=200_000, block_bytes=64 * 1024, pack_max_bytes=0)
    cache = Cache(s)
    blobs = {f"k{i}": os.urandom(30_000) for i in range(20)}
    for i, (k, v) in enumerate(blobs.items()):
        cache.put(k, v, url=f"mem://{k}")
        if i >= 1:
            cache.index.set(keys.last_use("k0"), 1e18)  # k0 is always the most recently used
        assert cache.volume() <= s.cache_limit_bytes
        disk = sum(p.stat().st_size for p in cache.data_dir.glob("*/*.flp"))
        assert disk == cache.volume()
    assert cache.get("k0") == blobs["k0"]
    assert cache.get("k1") is None  # an early, untouched entry was evicted
    assert cache.get("k19") == blobs["k19"]


def test_limit_below_one_item_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "remote").mkdir()
    (tmp_path / "remote" / "big.bin").write_bytes(os.urandom(100_000))
    s = Settings(cache_dir=tmp_path / "c", cache_limit_bytes=50_000, block_bytes=1024**2)
    with pytest.raises(CacheLimitError, match=r"smaller than item .*big\.bin.*raise --cache-limit"):
        Reader(s).read(str(tmp_path / "remote" / "big.bin"))


@pytest.mark.parametrize("pack_max", [0, 1 << 20], ids=["files", "packs"])
def test_remote_names_never_become_local_paths(tmp_path: Path, settings: Settings, pack_max: int) -> None:
    cache = Cache(settings.replace(pack_max_bytes=pack_max))
    for url in ["../../etc/passwd", "/abs/path", "a\x00b", "x" * 5000, "s3://b/../../../root"]:
        cache.put(Reader(settings).identity.key(fastload.RemoteItem(url, 3, ""), 0), b"abc", url=url)
    for path in cache.root.rglob("*"):
        assert path.resolve().is_relative_to(cache.root.resolve())
    names = [p.name for p in cache.data_dir.glob("*/*.flp")] if not pack_max else [e.path for e in cache.entries()]
    assert len(names) == 5 and all(len(n) < 80 and n.replace("-", "").replace(".flp", "").replace(".pack", "").replace("packs/", "").isalnum() for n in names)


def test_changed_remote_is_not_served_stale(tmp_path: Path, settings: Settings) -> None:
    path = tmp_path / "obj.bin"
    path.write_bytes(b"version one")
    reader = Reader(settings)
    assert reader.read(str(path)) == b"version one"
    path.write_bytes(b"version two, longer")
    assert Reader(settings).read(str(path)) == b"version two, longer"
    # Same size, new mtime: still a new identity.
    path.write_bytes(b"version 2, LONGER!!")
    os.utime(path, (1, 1))
    assert Reader(settings).read(str(path)) == b"version 2, LONGER!!"


def test_staged_snapshot_detects_a_changed_remote_on_refetch(tmp_path: Path, settings: Settings) -> None:
    files = make_files(tmp_path / "remote", n=2)
    fastload.stage(str(tmp_path / "remote"), settings=settings, progress=False)
    reader = Reader(settings)
    for e in list(reader.cache.entries()):
        reader.cache.drop(e.key)
    (tmp_path / "remote" / "f000.bin").write_bytes(b"short now")
    with pytest.raises(RemoteChangedError, match=r"f000\.bin.*--refresh"):
        reader.read(str(tmp_path / "remote" / "f000.bin"))
    report = fastload.stage(str(tmp_path / "remote"), settings=settings, refresh=True, progress=False)
    assert report.remote_bytes == len(b"short now") + len(files["f001.bin"])
    assert Reader(settings).read(str(tmp_path / "remote" / "f000.bin")) == b"short now"


def test_large_objects_are_cached_in_blocks_and_ranges_fetch_only_their_blocks(tmp_path: Path, settings: Settings) -> None:
    big = os.urandom(10 * 64 * 1024 + 123)
    (tmp_path / "big.bin").write_bytes(big)
    reader = Reader(settings)
    item = reader.stat(str(tmp_path / "big.bin"))
    assert reader.read_range(item, 3 * 65536 + 5, 3 * 65536 + 500) == big[3 * 65536 + 5 : 3 * 65536 + 500]
    assert reader.misses == 1
    assert reader.read_range(item, 65530, 65540) == big[65530:65540]  # spans blocks 0 and 1
    assert reader.misses == 3
    with fastload.open(str(tmp_path / "big.bin"), settings=settings) as f:
        f.seek(-100, os.SEEK_END)
        assert f.read() == big[-100:]
        f.seek(0)
        assert f.read() == big


def test_cache_dir_is_private(settings: Settings) -> None:
    old = os.umask(0o022)
    try:
        cache = Cache(settings)
    finally:
        os.umask(old)
    assert stat.S_IMODE(cache.root.stat().st_mode) == 0o700


def test_check_removes_stale_temp_and_orphan_files(settings: Settings) -> None:
    cache = Cache(settings)
    cache.put("k", b"data" * 100, url="mem://k")
    stale = cache.tmp_dir / "999999999-deadbeef.part"  # a writer that died (no such pid)
    stale.write_bytes(b"half")
    orphan = cache.data_dir / "ab" / "ab-orphan.flp"
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(b"x")
    os.utime(orphan, (1, 1))
    torn = cache.data_dir / "ab" / "999999999-cafe.part"  # a payload write that died beside its folder's payloads
    torn.write_bytes(b"half")
    result = cache.check()
    assert result["stale_tmp"] == 2 and result["orphans"] == 1
    assert not stale.exists() and not orphan.exists() and not torn.exists()
    assert cache.get("k") == b"data" * 100


def test_threads_fetch_each_block_once_and_agree(tmp_path: Path, settings: Settings) -> None:
    files = make_files(tmp_path / "remote", n=4)
    reader = Reader(settings)
    urls = [str(tmp_path / "remote" / n) for n in files] * 8
    results: list[bytes] = [b""] * len(urls)

    def work(i: int) -> None:
        results[i] = reader.read(urls[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(urls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == [files[Path(u).name] for u in urls]
    assert reader.misses == len(files)


def test_reader_and_cache_pickle_settings_not_handles(settings: Settings, tmp_path: Path) -> None:
    files = make_files(tmp_path / "remote", n=1)
    reader = Reader(settings)
    clone = pickle.loads(pickle.dumps(reader))
    assert clone.cache is not reader.cache and clone.settings == settings
    assert clone.read(str(tmp_path / "remote" / "f000.bin")) == files["f000.bin"]


def test_limit_below_the_working_set_streams_and_warns_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    files = make_files(tmp_path / "remote", n=10, size=40_000)
    s = Settings(cache_dir=tmp_path / "c", cache_limit_bytes=120_000, block_bytes=64 * 1024, min_saving=1.0)
    ds_items = Reader(s).list(str(tmp_path / "remote"))
    reader = Reader(s)
    with caplog.at_level("WARNING", logger="fastload"):
        reader.warn_if_oversized(ds_items)
        for _epoch in range(2):
            for item in ds_items:
                assert reader.read(item) == files[item.url.rsplit("/", 1)[1]]
        reader.warn_if_oversized(ds_items)
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "streaming" in caplog.records[0].message and "cache limit" in caplog.records[0].message
    assert reader.cache.volume() <= s.cache_limit_bytes
    assert reader.misses > len(files)  # the second epoch refetched evicted items


def test_memory_protocol_stages_and_reads(tmp_path: Path, settings: Settings) -> None:
    import fsspec

    mem = fsspec.filesystem("memory")
    mem.pipe({"/fl-test/a.bin": b"alpha" * 1000, "/fl-test/sub/b.bin": b"beta" * 1000})
    report = fastload.stage("memory://fl-test/", settings=settings, progress=False)
    assert report.items == 2 and report.fetched_blocks == 2
    mem.rm("/fl-test", recursive=True)
    assert Reader(settings).read("memory://fl-test/sub/b.bin") == b"beta" * 1000


def test_a_zombie_writer_is_dead(tmp_path: Path) -> None:
    """A killed writer that no one reaped (PID 1 in a container) holds no reservation."""
    pid = os.fork()
    if pid == 0:  # the child exits at once; the parent does not reap it yet
        os._exit(0)
    try:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z":
            assert time.monotonic() < deadline, "the child never became a zombie"
            time.sleep(0.01)
        cache = Cache(Settings(cache_dir=tmp_path / "c"))
        with cache.index.transact():
            cache.index.set(keys.reservation(pid, "deadbeef"), 1234)
            cache.index.incr("bytes", 1234)
        assert cache.check()["bytes"] == 0
        assert not [k for k in cache.index.iterkeys() if keys.of(keys.RESERVATION, k) is not None]
        cache.close()
    finally:
        os.waitpid(pid, 0)
