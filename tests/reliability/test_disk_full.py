"""Area 5: the cache disk fills up (a small tmpfs, mounted as root, holds the cache)."""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from faults import FAULTS
from helpers import make_noise_files, payload_files

import fastload
from fastload.cache import Cache, Entry, keys
from fastload.cache.disk import reserve_bytes
from fastload.cache.index import INDEX_FILE, TABLE, decode
from fastload.cli import main as cli_main
from fastload.config import Settings
from fastload.errors import CacheFullError

pytestmark = pytest.mark.integration

N, SIZE = 200, 30_000  # 6 MB of incompressible data
DISK = 3 * 1024**2  # the tmpfs; the cache limit (1 GB) is far above it


def train(url: str, settings: Settings, files: dict[str, bytes], epochs: int) -> int:
    ds = fastload.FileDataset(url, settings=settings)
    root = ds.reader.manifest_root(url) + "/"
    loader = fastload.DataLoader(ds, batch_size=10, shuffle=True, collate_fn=lambda b: b, seed=1)
    n = 0
    for _ in range(epochs):
        for batch in loader:
            for sample in batch:
                assert sample["data"] == files[sample["url"][len(root) :]], sample["url"]
                n += 1
    return n


@pytest.mark.parametrize("variant", [pytest.param("short", id="short"), pytest.param("full", id="full", marks=pytest.mark.slow)])
def test_full_disk_streams_training_and_fails_staging_clearly(
    variant: str, tmp_path: Path, nginx_server: Callable[..., Any], tmpfs: Callable[..., Path],
    record: Callable[..., None], caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    fault = FAULTS["disk-full"]
    trials = fault.trials_full if variant == "full" else fault.trials_short
    files = make_noise_files(tmp_path / "www", N, SIZE)
    server = nginx_server(tmp_path / "www")
    url = server.url + "/"
    cached = []
    for _ in range(trials):
        disk = tmpfs(DISK)
        # No disk reserve: this is the disk filling up for real (test_default_limit_keeps_a_free_margin has the reserve).
        settings = Settings(cache_dir=disk / "cache", block_bytes=64 * 1024, cache_limit_bytes=10**9, disk_reserve_bytes=0)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fastload"):
            assert train(url, settings, files, epochs=2) == 2 * N  # every byte right, twice
        streaming = [r.getMessage() for r in caplog.records if "streaming" in r.getMessage()]
        assert len(streaming) == 1, streaming  # warned once, not per item
        assert "is full" in streaming[0] and "fix:" in streaming[0], streaming[0]

        entries = _entries(settings)  # read-only: the disk is full
        assert 0 < len(entries) < N  # it cached what fit, and streamed the rest
        assert {p.name for p in payload_files(settings.cache_dir)} == {Path(e.path).name for e in entries}  # no orphan
        assert not list(settings.cache_dir.glob("**/*.part"))  # no half-written file
        for e in entries:  # no corrupt entry: a file of its size, or a pack that holds it
            size = (settings.cache_dir / "data" / e.path).stat().st_size
            assert size == e.stored if e.offset is None else size >= e.offset + e.stored
        cached.append(len(entries))

        # A new cache on the full disk opens (read-only where the index cannot even be
        # opened for writing): it serves what it holds, and a new entry is a CacheFullError.
        full = Cache(settings)
        assert full.unwritable in (None, "full")
        assert all(full.get(e.key) is not None for e in entries[:5])
        with pytest.raises(CacheFullError, match=r"disk under .* is full while (indexing|caching) 'x' .*fix:"):
            full.put("k" * 40, os.urandom(1_000_000), url="x")
        full.close()

        # With space again (the tmpfs grown in place), the index opens and every entry is valid.
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        cache = Cache(settings)
        assert all(cache.get(e.key) is not None for e in cache.entries()) and cache.corrupt_count() == 0
        assert cache.check()["bytes"] == sum(e.charged for e in cache.entries())
        cache.close()

        # Staging onto a full disk fails loudly instead of "succeeding" with nothing staged.
        disk2 = tmpfs(DISK)
        capsys.readouterr()
        code = cli_main(["cache", url, "--cache-dir", str(disk2 / "cache"), "--no-progress"])
        err = capsys.readouterr().err
        assert code == 1, err
        # The disk filled (ENOSPC), or the limit in force (capped by the disk's free space less
        # the default reserve) stopped it first: either way exit 1, the disk and the fix named.
        assert "fastload cache: error: " in err and "fix:" in err, err
        assert any(why in err for why in ("is full while", "keeps free) but", "capped by the disk's free space")), err
        assert server.url in err  # names the item
    record(
        "disk-full", trials,
        f"pass: training read {2 * N} samples bit-exact per run with {', '.join(map(str, cached))} of {N} "
        "items cached and one streaming warning; no corrupt, orphan or temp file; a cache reopened on the "
        "full disk serves its entries and refuses new ones with CacheFullError; `fastload cache` ends in "
        "CacheFullError naming the path, the cause and the fix",
        cached=cached,
    )  # fmt: skip


def _entries(settings: Settings) -> list[Entry]:
    """Index records, read with sqlite3 directly (read-only: the disk is full)."""
    import sqlite3

    con = sqlite3.connect(f"file:{settings.cache_dir / 'index' / INDEX_FILE}?mode=ro", uri=True)
    try:
        rows = con.execute(f"SELECT key, value FROM {TABLE} WHERE key LIKE '{keys.ENTRY}%'").fetchall()
    finally:
        con.close()
    return [Entry.from_record(k[len(keys.ENTRY) :], tuple(decode(v))) for k, v in rows]


def _cli(cache_dir: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """A real `fastload` process (a fresh one opens the full disk's index as a user's would)."""
    from helpers import PYTHON, child_env

    return subprocess.run([PYTHON, "-m", "fastload", *argv, "--cache-dir", str(cache_dir)], env=child_env(),
                          capture_output=True, text=True, timeout=120)


def test_info_evict_and_clear_work_on_a_full_disk(
    tmp_path: Path, nginx_server: Callable[..., Any], tmpfs: Callable[..., Path]
) -> None:
    import json

    files = make_noise_files(tmp_path / "www", N, SIZE)
    server = nginx_server(tmp_path / "www")
    disk = tmpfs(DISK)
    settings = Settings(cache_dir=disk / "cache", block_bytes=64 * 1024, cache_limit_bytes=10**9, disk_reserve_bytes=0)
    train(server.url + "/", settings, files, epochs=1)  # fills the disk, then streams

    info = _cli(settings.cache_dir, "info", "--json")
    assert info.returncode == 0, info.stderr
    before = json.loads(info.stdout)
    assert before["entries"] == len(_entries(settings)) > 0

    evicted = _cli(settings.cache_dir, "evict", "--to", "1MB", "--json")
    assert evicted.returncode == 0, evicted.stderr
    assert json.loads(evicted.stdout)["after_bytes"] <= 10**6
    st = os.statvfs(disk)
    assert st.f_bavail * st.f_frsize > 10**6  # the space is back (the index's log given back too)
    cache = Cache(settings)
    assert cache.unwritable is None and cache.corrupt_count() == 0
    assert all(cache.get(e.key) is not None for e in cache.entries())  # what is left is whole
    assert {p.name for p in payload_files(settings.cache_dir)} == {Path(e.path).name for e in cache.entries()}
    cache.close()

    train(server.url + "/", settings, files, epochs=1)  # full again
    cleared = _cli(settings.cache_dir, "clear", "--json")
    assert cleared.returncode == 0, cleared.stderr
    assert not payload_files(settings.cache_dir)
    assert json.loads(_cli(settings.cache_dir, "info", "--json").stdout)["entries"] == 0


def test_default_limit_keeps_a_free_margin(
    tmp_path: Path, nginx_server: Callable[..., Any], tmpfs: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    files = make_noise_files(tmp_path / "www", N, SIZE)
    server = nginx_server(tmp_path / "www")
    disk = tmpfs(DISK)
    settings = Settings(cache_dir=disk / "cache", block_bytes=64 * 1024)  # the default limit (50 GB) and reserve
    with caplog.at_level(logging.WARNING, logger="fastload"):
        assert train(server.url + "/", settings, files, epochs=2) == 2 * N
    # The disk never filled: the limit in force stayed under the free space less the reserve,
    # and LRU eviction (not ENOSPC) kept it there.
    assert not [r for r in caplog.records if "is full" in r.getMessage()], [r.getMessage() for r in caplog.records]
    st = os.statvfs(disk)
    assert st.f_bavail * st.f_frsize > 0
    cache = Cache(settings)
    assert 0 < cache.limit_bytes() < DISK and cache.volume() <= cache.limit_bytes()
    cache.close()


def test_writes_in_flight_to_another_disk_leave_this_ones_room(tmpfs: Callable[..., Path]) -> None:
    # Bytes in flight come off the free space of their own disk only: a process with a cache
    # on each of two disks used to take one disk's writes off the other's room as well.
    mib = 1024**2
    a = Cache(Settings(cache_dir=tmpfs(8 * mib) / "cache", lock_timeout_s=0.5))  # the default reserve: 5%
    b = Cache(Settings(cache_dir=tmpfs(8 * mib) / "cache", lock_timeout_s=0.5))
    held = a._reserve(6 * mib, "a-write")  # a write in flight to disk a: not on the disk yet
    try:
        b._release(b._reserve(6 * mib, "b-write"), 6 * mib)  # disk b's 8 MiB are all its own
        with pytest.raises(CacheFullError):  # disk a still counts its own write in flight
            a._reserve(6 * mib, "a-second")
    finally:
        a._release(held, 6 * mib)
        a.close()
        b.close()


def test_a_write_refused_by_a_full_disk_holds_none_of_its_room_later(tmpfs: Callable[..., Path]) -> None:
    # A write whose reservation could not be committed (the disk full) stayed counted as in
    # flight for the life of the process: every later cache on that disk had that much less
    # room ("room for 0 B" once enough had piled up).
    mib = 1024**2
    disk = tmpfs(16 * mib)
    first = Cache(Settings(cache_dir=disk / "first", disk_reserve_bytes=0))
    _fill(disk)
    filler = disk / "checkpoint.bin"
    with pytest.raises(CacheFullError):
        first.put("a" * 40, os.urandom(6 * mib), url="refused")
    first.close()
    filler.unlink()
    later = Cache(Settings(cache_dir=disk / "later"))  # the default reserve: 5% of the disk
    st = os.statvfs(disk)
    fits = st.f_bavail * st.f_frsize - reserve_bytes(disk, None) - 2 * mib  # 2 MiB for the index
    later.put("b" * 40, os.urandom(fits), url="fits")
    assert later.get("b" * 40) is not None
    later.close()


def test_read_only_cache_serves_reads_and_streams_the_rest_with_one_warning(
    tmp_path: Path, nginx_server: Callable[..., Any], tmpfs: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    import json

    files = make_noise_files(tmp_path / "www" / "staged", 40, SIZE)
    new = make_noise_files(tmp_path / "www" / "new", 20, SIZE)
    server = nginx_server(tmp_path / "www")
    disk = tmpfs(16 * 1024**2)
    settings = Settings(cache_dir=disk / "cache", block_bytes=64 * 1024)
    fastload.stage(server.url + "/staged/", settings=settings, progress=False)
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)  # a shared, pre-staged, read-only cache

    info = _cli(settings.cache_dir, "info", "--json")
    assert info.returncode == 0, info.stderr
    assert (json.loads(info.stdout)["entries"], json.loads(info.stdout)["unwritable_reason"]) == (40, "read-only")
    again = _cli(settings.cache_dir, "cache", server.url + "/staged/", "--block-size", "64KiB", "--json")  # all there: it only checks
    assert again.returncode == 0 and json.loads(again.stdout)["skipped_blocks"] == 40, again.stderr
    new_stage = _cli(settings.cache_dir, "cache", server.url + "/new/")  # staging exists to cache: it fails, and says why
    assert new_stage.returncode == 1 and "is read-only" in new_stage.stderr and "full" not in new_stage.stderr, new_stage.stderr

    with caplog.at_level(logging.WARNING, logger="fastload"):
        assert train(server.url + "/staged/", settings, files, epochs=1) == 40  # served from the cache
        assert not caplog.records
        assert train(server.url + "/new/", settings, new, epochs=2) == 40  # not cached: streamed
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "read-only" in warnings[0], warnings
    assert "full" not in warnings[0] and "free space" not in warnings[0], warnings[0]


_EPOCH = """
import sys, fastload
from fastload.config import Settings
ds = fastload.FileDataset(sys.argv[1], settings=Settings(cache_dir=sys.argv[2]))
root = ds.reader.manifest_root(sys.argv[1]) + "/"
want = {p.name: p.read_bytes() for p in __import__("pathlib").Path(sys.argv[3]).iterdir()}
n = 0
for batch in fastload.DataLoader(ds, batch_size=10, shuffle=True, collate_fn=lambda b: b):
    for s in batch:
        assert s["data"] == want[s["url"][len(root):]], s["url"]
        n += 1
print(n)
"""


def _fill(disk: Path) -> None:
    """Fill ``disk`` to its last block from outside fastload, as a checkpoint writer does."""
    f = open(disk / "checkpoint.bin", "ab")  # noqa: SIM115 - closed below, where a full disk may refuse the flush
    try:
        while True:
            f.write(b"\0" * 65536)
            f.flush()
    except OSError:
        pass
    finally:
        try:
            f.close()  # its buffer may hold what the last write could not place: the disk is full, as meant
        except OSError:
            pass
    assert os.statvfs(disk).f_bavail == 0


def test_a_disk_filled_by_another_program_does_not_lock_the_cache(
    tmp_path: Path, nginx_server: Callable[..., Any], tmpfs: Callable[..., Path]
) -> None:
    # The cache is staged and closed (no fastload process holds its index open), then
    # another program fills the disk. SQLite then cannot create the index's -shm file,
    # and every command failed with "disk I/O error" (issue 24, item 3): the commands
    # that free space must work on a full disk, whoever filled it.
    import json

    from helpers import PYTHON, child_env

    files = make_noise_files(tmp_path / "www", 100, SIZE)  # 3 MB
    server = nginx_server(tmp_path / "www")
    url = server.url + "/"
    disk = tmpfs(8 * 1024**2)
    cache_dir = disk / "cache"
    staged = _cli(cache_dir, "cache", url, "--no-progress")
    assert staged.returncode == 0, staged.stderr
    _fill(disk)
    assert not (cache_dir / "index" / f"{INDEX_FILE}-shm").exists()  # nobody holds the index open

    info = _cli(cache_dir, "info", "--json")
    assert info.returncode == 0, info.stderr
    got = json.loads(info.stdout)
    assert (got["entries"], got["unwritable_reason"], got["datasets"][0]["cached_items"]) == (100, "full", 100)

    again = _cli(cache_dir, "cache", url, "--json")  # all there: it only checks, though the reserve is gone
    assert again.returncode == 0 and json.loads(again.stdout)["skipped_blocks"] == 100, again.stderr

    evicted = _cli(cache_dir, "evict", "--to", "1MB", "--json")
    assert evicted.returncode == 0, evicted.stderr
    assert json.loads(evicted.stdout)["after_bytes"] <= 10**6

    _fill(disk)  # full again, with most of the dataset no longer cached: an epoch streams it
    epoch = subprocess.run([PYTHON, "-c", _EPOCH, url, str(cache_dir), str(tmp_path / "www")], env=child_env(),
                           cwd=Path(__file__).parent, capture_output=True, text=True, timeout=300)
    assert epoch.returncode == 0, epoch.stderr
    assert epoch.stdout.split() == ["100"]  # every sample, bit-exact (asserted in the child)
    warnings = [line for line in epoch.stderr.splitlines() if line.strip()]
    assert len(warnings) == 1 and "streaming" in warnings[0], epoch.stderr
    assert "no more room" in warnings[0] or "is full" in warnings[0], warnings[0]  # the cause, named

    _fill(disk)
    one = _cli(cache_dir, "clear", url, "--json")  # one dataset: its entries go, whoever filled the disk
    assert one.returncode == 0, one.stderr
    assert json.loads(one.stdout)["entries"] > 0
    assert json.loads(_cli(cache_dir, "info", "--json").stdout)["entries"] == 0

    (disk / "checkpoint.bin").unlink()  # the other program's file goes; the dataset is staged again
    staged = _cli(cache_dir, "cache", url, "--no-progress")
    assert staged.returncode == 0, staged.stderr
    _fill(disk)
    cleared = _cli(cache_dir, "clear", "--json")  # everything
    assert cleared.returncode == 0, cleared.stderr
    assert not payload_files(cache_dir)
    assert json.loads(_cli(cache_dir, "info", "--json").stdout)["entries"] == 0
    assert len(files) == 100
