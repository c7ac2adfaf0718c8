"""The local cache: its disk's read speed, and what it holds.

**Disk.** A scratch file is written in the cache's own ``tmp/`` folder (named
``<pid>-diagnose.part``, so :meth:`fastload.cache.Cache.check` removes it if we
die), synced, and evicted from the page cache with ``posix_fadvise(DONTNEED)``.
Then it is read three ways: sequentially (1 MiB reads, one thread, page cache
cold), in random sample-sized pieces from several threads (cold again: the
pattern of a warm epoch reading many ~100 KB cache files), and sequentially
with the page cache hot. On a VM the host may still cache the disk, which
makes "cold" optimistic; the verdict uses the random-read rate.

**State.** Entries, bytes, limit, manifests, corrupt entries dropped so far,
and for the diagnosed URL the share of its listed objects already cached
(the hit rate its next epoch would see). The cache keeps no hit/miss counter
across processes; a running loader reports its own in ``loader.stats()``.
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path
from typing import Any

from fastload.config import Settings
from fastload.diagnose._util import ok, skipped

__all__ = ["cache_state", "probe_disk"]

_MIB = 1024**2


def _evict(fd: int) -> bool:
    if not hasattr(os, "posix_fadvise"):
        return False
    os.fsync(fd)  # dirty pages cannot be dropped
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return True


def _seq_read(path: Path) -> tuple[int, float]:
    n = 0
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_MIB):
            n += len(chunk)
    return n, time.perf_counter() - t0


def _random_reads(path: Path, size: int, piece: int, threads: int, budget_s: float) -> tuple[int, float]:
    total = [0]
    lock = threading.Lock()
    errors: list[BaseException] = []
    deadline = time.perf_counter() + budget_s
    slots = max(1, size // piece)
    # Each offset is read once, as a cold epoch reads each cache file once.
    order = random.Random(0).sample(range(slots), slots)
    cursor = [0]

    def work() -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            while time.perf_counter() < deadline:
                with lock:
                    if cursor[0] >= len(order):
                        return
                    slot = order[cursor[0]]
                    cursor[0] += 1
                data = os.pread(fd, piece, slot * piece)
                with lock:
                    total[0] += len(data)
        except BaseException as err:  # re-raised below, in the caller's thread
            errors.append(err)
        finally:
            os.close(fd)

    pool = [threading.Thread(target=work, daemon=True) for _ in range(threads)]
    t0 = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        raise errors[0]
    return total[0], time.perf_counter() - t0


def probe_disk(settings: Settings, *, nbytes: int, piece_bytes: int, threads: int, budget_s: float) -> dict[str, Any]:
    """Read speed of the disk under ``settings.cache_dir`` (see the module docstring)."""
    tmp = settings.cache_dir / "tmp"
    tmp.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = tmp / f"{os.getpid()}-diagnose.part"
    block = os.urandom(_MIB)  # incompressible, so a compressing filesystem cannot cheat
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            t0 = time.perf_counter()
            for _ in range(max(1, nbytes // _MIB)):
                os.write(fd, block)
            evicted = _evict(fd)
            write_s = time.perf_counter() - t0
        finally:
            os.close(fd)
        size = path.stat().st_size
        n, secs = _seq_read(path)
        seq_cold = n / secs
        fd = os.open(path, os.O_RDONLY)
        try:
            _evict(fd)
        finally:
            os.close(fd)
        piece = max(4096, min(piece_bytes, size))
        n, secs = _random_reads(path, size, piece, threads, budget_s)
        random_cold = n / secs if secs > 0 else None
        n, secs = _seq_read(path)
        seq_hot = n / secs
    finally:
        path.unlink(missing_ok=True)
    return ok(
        path=str(settings.cache_dir),
        file_bytes=size,
        write_bps=size / write_s if write_s > 0 else None,
        seq_cold_bps=seq_cold,
        random_cold_bps=random_cold,
        random_piece_bytes=piece,
        random_threads=threads,
        seq_hot_bps=seq_hot,
        page_cache_evicted=evicted,
        note=None if evicted else "posix_fadvise is unavailable: 'cold' reads may come from the page cache",
    )


INDEX_SAMPLE = 20_000  # entries looked up by probe_index, at most
INDEX_BATCH = 256  # keys per look-up, as a loader's batch asks for them


def probe_index(settings: Settings, sample: int = INDEX_SAMPLE) -> dict[str, Any]:
    """Time the cache's index as a warm epoch uses it: look-ups of entries it holds, drawn
    at random, by a process that knows none of them yet (one thread: they are GIL-bound).

    A loader at 9,800 samples/s was limited by index work while diagnose said "disk-bound,
    41,000/s" (issue 31): the disk probe reads a scratch file, not the index."""
    root = settings.cache_dir
    if not (root / "index").exists():
        return skipped(f"the cache at {root} does not exist yet: nothing to look up")
    from fastload.cache import Cache, keys

    cache = Cache(settings)
    try:
        entries = cache.totals()[keys.ENTRIES]
        names = cache.index.sample(keys.ENTRY, sample)
        if len(names) < 100:
            return skipped(f"the cache at {root} holds {entries} entries: too few to time its index", entries=entries)
        wanted = [n[len(keys.ENTRY) :] for n in names]
        t0 = time.perf_counter()
        for i in range(0, len(wanted), INDEX_BATCH):
            cache.entries_for(wanted[i : i + INDEX_BATCH])
        seconds = time.perf_counter() - t0
    finally:
        cache.close()
    return ok(entries=entries, looked_up=len(wanted), batch=INDEX_BATCH, seconds=seconds,
              lookups_per_s=len(wanted) / seconds if seconds > 0 else None)


def cache_state(settings: Settings, url: str | None = None, storage_options: dict[str, Any] | None = None,
                max_items: int = 2000) -> dict[str, Any]:
    """What the cache holds; the cache is not created when it does not exist."""
    root = settings.cache_dir
    if not (root / "index").exists():
        return ok(path=str(root), exists=False, entries=0, stored_bytes=0, limit_bytes=settings.cache_limit_bytes,
                  url_cached_fraction=0.0 if url else None,
                  hit_rate=None, hit_rate_note="the cache keeps no hit counter across processes; "
                  "loader.stats().cache_hit_rate reports a running loader's")
    from fastload.cache import keys
    from fastload.read.reader import Reader

    reader = Reader(settings, storage_options)
    try:
        cache = reader.cache
        entries = cache.totals()[keys.ENTRIES]
        summaries = reader.identity.summaries()
        fraction = None
        url_items = None
        if url:
            try:
                want = reader.manifest_root(url)
            except Exception as err:  # an unusable URL is reported by the storage section
                return skipped(f"cannot name {url} in the cache: {err}")
            items = [i for s in summaries if s["root"] == want for i in reader.identity.manifest(want, s["pattern"]) or []]
            url_items = len(items)
            if items:
                step = max(1, len(items) // max_items)
                picked = items[::step]
                cached = sum(all(cache.contains(reader.identity.key(i, b)) for b in reader.identity.blocks(i)) for i in picked)
                fraction = cached / len(picked)
            else:
                fraction = 0.0
        return ok(
            path=str(root),
            exists=True,
            entries=entries,
            stored_bytes=cache.volume(),
            limit_bytes=settings.cache_limit_bytes,
            manifests=len(summaries),
            corrupt_dropped=cache.corrupt_count(),
            url_listed_items=url_items,
            url_cached_fraction=fraction,
            hit_rate=None,
            hit_rate_note="the cache keeps no hit counter across processes; the URL's cached fraction is the "
            "hit rate its next epoch would see; loader.stats().cache_hit_rate reports a running loader's",
        )
    finally:
        reader.cache.close()
