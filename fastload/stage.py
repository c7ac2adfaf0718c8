"""Pre-staging: copy a remote dataset into the cache before training (``fastload cache``).

Staging lists the dataset once (recording the manifest), then fetches every
block that is not already cached and valid with ``workers`` parallel requests.
Because cached entries are skipped, rerunning after an interruption (even a
SIGKILL) resumes where it stopped; entries are published atomically, so an
interrupted write is never mistaken for a valid one
(tests/integration/test_stage_kill.py).
"""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from typing import Any

from tqdm import tqdm

from fastload.config import Settings, format_size
from fastload.errors import CacheFullError
from fastload.reader import Reader, manifest_key
from fastload.source import RemoteItem


@dataclass
class StageReport:
    """What a staging run did.

    Attributes:
        url: The dataset root.
        items: Objects in the dataset.
        blocks: Cache entries the dataset needs.
        remote_bytes: Total size of the dataset on the remote.
        stored_bytes: Bytes the dataset occupies in the cache (after LZ4).
        fetched_blocks: Blocks fetched in this run.
        fetched_bytes: Remote bytes moved in this run.
        skipped_blocks: Blocks already cached and valid.
        bad_entries: Entries that failed verification (dropped and refetched).
        seconds: Wall time of the run.
        cache_limit_bytes: The limit in force.
        fits: Whether the dataset fits the limit (raw size, conservative).
        dry_run: Nothing was fetched.
        concurrency: The remote host's request limit after the run: ``limit`` (what the
            controller settled on), ``cap`` (``workers``), ``peak`` in flight, ``cuts``
            (fastload.hostlimit); empty for local files.
    """

    url: str
    items: int = 0
    blocks: int = 0
    remote_bytes: int = 0
    stored_bytes: int = 0
    fetched_blocks: int = 0
    fetched_bytes: int = 0
    skipped_blocks: int = 0
    bad_entries: int = 0
    seconds: float = 0.0
    cache_limit_bytes: int = 0
    fits: bool = True
    dry_run: bool = False
    concurrency: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """Remote bytes per stored byte (>1 means LZ4 saved space)."""
        return self.remote_bytes / self.stored_bytes if self.stored_bytes else 0.0

    @property
    def mb_per_s(self) -> float:
        """Remote bytes fetched per second in this run, in MB/s."""
        return self.fetched_bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"ratio": round(self.ratio, 4), "mb_per_s": round(self.mb_per_s, 3)}

    def __str__(self) -> str:
        if self.dry_run:
            verdict = "fits" if self.fits else "does NOT fit"
            return (
                f"{self.url}: {self.items} items, {format_size(self.remote_bytes)} on the remote; "
                f"{verdict} the cache limit {format_size(self.cache_limit_bytes)}"
            )
        lines = [
            f"staged      {self.url}",
            f"items       {self.items} ({self.blocks} cache entries)",
            f"fetched     {self.fetched_blocks} entries, {format_size(self.fetched_bytes)} "
            f"(skipped {self.skipped_blocks} already cached)",
            f"remote      {format_size(self.remote_bytes)}",
            f"on disk     {format_size(self.stored_bytes)} (ratio {self.ratio:.2f}x)",
            f"time        {self.seconds:.2f} s, {self.mb_per_s:.1f} MB/s",
        ]
        if self.concurrency:
            c = self.concurrency
            lines.append(f"requests    settled at {c['limit']} in flight (cap {c['cap']}, peak {c['peak']}, cuts {c['cuts']})")
        if self.bad_entries:
            lines.append(f"verify      {self.bad_entries} bad entries found, dropped and refetched")
        return "\n".join(lines)


def stage(
    url: str,
    *,
    pattern: str | None = None,
    storage_options: dict[str, Any] | None = None,
    settings: Settings | None = None,
    refresh: bool = False,
    dry_run: bool = False,
    verify: bool = False,
    progress: bool | None = None,
) -> StageReport:
    """Copy the dataset at ``url`` into the cache; see the module docstring.

    Args:
        url: Any fsspec URL of a folder/prefix or a single object.
        pattern: Glob relative to ``url`` (``**/*.jpg``); None takes everything.
        storage_options: fsspec options (credentials, endpoint).
        settings: Cache dir, limit, workers, LZ4 level...
        refresh: Re-list the remote instead of trusting the recorded manifest.
        dry_run: Only list and report the size against the cache limit.
        verify: After staging, re-read every entry and check its checksum.
        progress: Show a progress bar (default: when stderr is a terminal).

    Raises:
        CacheFullError: The dataset is larger than the cache limit, or the disk filled up.
    """
    settings = settings or Settings.from_env()
    reader = Reader(settings, storage_options)
    t0 = time.perf_counter()
    # Dry runs need every size now; real runs complete sizeless (HTTP) items
    # inside the fetch workers, so HEADs overlap with transfers.
    items = reader.list(url, pattern, refresh=refresh, complete=dry_run)
    root = reader.manifest_root(url)
    report = StageReport(url=root, items=len(items), cache_limit_bytes=settings.cache_limit_bytes)
    known = [i for i in items if i.size >= 0]
    report.remote_bytes = sum(i.size for i in known)
    report.fits = report.remote_bytes <= settings.cache_limit_bytes
    if dry_run:
        report.dry_run = True
        report.blocks = sum(len(reader.blocks(i)) for i in items)
        report.stored_bytes = _stored(reader, items)
        report.seconds = time.perf_counter() - t0
        return report
    if not report.fits:
        raise CacheFullError(_too_big(report, settings))
    reader.cache.check()
    # An interrupted stage leaves this marker behind. Its rerun (and a refresh) completes
    # sizeless items with a HEAD each, so blocks already cached are skipped; a fresh
    # stage has nothing cached to skip and fetches them with one GET each (_fetch_all).
    marker = "p:" + manifest_key(root, pattern)
    fresh = not refresh and reader.cache.index.get(marker) is None
    reader.cache.index.set(marker, time.time())
    items = _fetch_all(reader, items, report, _show(progress), "staging", heads="pinned" if fresh else "all")
    reader.save_manifest(root, pattern, items)
    reader.cache.index.delete(marker)
    report.remote_bytes = sum(i.size for i in items)
    report.blocks = sum(len(reader.blocks(i)) for i in items)
    if report.remote_bytes > settings.cache_limit_bytes:
        raise CacheFullError(_too_big(report, settings))
    if verify:
        bad = _verify(reader, items, settings.workers, _show(progress))
        report.bad_entries = len(bad)
        _fetch_blocks(reader, bad, report, _show(progress), "refetching")
    report.stored_bytes = _stored(reader, items)
    report.seconds = time.perf_counter() - t0
    limit = reader.source(url).host_limit
    report.concurrency = limit.as_dict() if limit is not None else {}
    return report


def _too_big(report: StageReport, settings: Settings) -> str:
    return (
        f"dataset {report.url} is {format_size(report.remote_bytes)} but the cache limit is "
        f"{format_size(settings.cache_limit_bytes)}; fix: raise --cache-limit, stage a subset with --pattern, "
        "or skip staging and let training stream it"
    )


def _show(progress: bool | None) -> bool:
    return sys.stderr.isatty() if progress is None else progress


def _stored(reader: Reader, items: list[RemoteItem]) -> int:
    total = 0
    for item in items:
        if item.size < 0:
            continue
        for block in reader.blocks(item):
            entry = reader.cache.entry(reader.key(item, block))
            total += entry.stored if entry else 0
    return total


class _Progress:
    """Thread-safe counters plus the tqdm bar (items, bytes, MB/s, ETA)."""

    def __init__(self, report: StageReport, total_bytes: int, items: int, show: bool, label: str) -> None:
        self.report, self.items, self.done = report, items, 0
        self.lock = threading.Lock()
        self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc=label, disable=not show, file=sys.stderr, dynamic_ncols=True)

    def fetched(self, nbytes: int) -> None:
        with self.lock:
            self.report.fetched_blocks += 1
            self.report.fetched_bytes += nbytes
            self.bar.update(nbytes)

    def skipped(self, nbytes: int) -> None:
        with self.lock:
            self.report.skipped_blocks += 1
            self.bar.update(nbytes)

    def item_done(self) -> None:
        with self.lock:
            self.done += 1
            self.bar.set_postfix(items=f"{self.done}/{self.items}", refresh=False)


CHUNK = 32  # items one staging task completes and fetches together: their requests overlap
CHUNK_THREADS = 4  # tasks at once; the requests in flight are bounded by the host limit, not here
BATCH_BYTES = 64 * 1024**2  # blocks one fetch call holds in memory, at most


def _fetch_all(reader: Reader, items: list[RemoteItem], report: StageReport, show: bool, label: str,
               heads: str) -> list[RemoteItem]:
    """Complete, skip-or-fetch every block of every item through the fetch stage; returns completed items.

    CHUNK items per task: their sizeless ones are completed together (a GET each that
    brings the first block, or a HEAD each as ``heads`` says: Fetcher.complete), then
    the blocks not cached yet are fetched together. Staging exists to cache, so a
    cache that cannot hold a block ends it (``strict``; tests/reliability/test_disk_full.py).
    """
    if not items:
        return []
    fetcher = reader.fetcher
    progress = _Progress(report, sum(i.size for i in items if i.size >= 0), len(items), show, label)
    completed: list[RemoteItem | None] = [None] * len(items)

    def do_chunk(indices: list[int]) -> None:
        done, fresh = fetcher.complete([items[i] for i in indices], heads=heads, strict=True)
        todo: list[tuple[RemoteItem, int]] = []
        for i, item in zip(indices, done):
            if item.size != items[i].size:
                with progress.lock:
                    progress.bar.total += item.size
            completed[i] = item
            todo += [(item, b) for b in reader.blocks(item)]
        entries = reader.cache.entries_for([reader.key(item, b) for item, b in todo])
        missing = []
        for (item, block), entry in zip(todo, entries):
            key = reader.key(item, block)
            if key in fresh:
                progress.fetched(len(fresh[key]))
            elif entry is not None:
                start, end = reader.block_span(item, block)
                progress.skipped(end - start)
            else:
                missing.append((item, block))
        per_call = max(1, BATCH_BYTES // reader.settings.block_bytes)
        for k in range(0, len(missing), per_call):
            for data in fetcher.fetch(missing[k : k + per_call], strict=True):
                progress.fetched(len(data))
        for _ in indices:
            progress.item_done()

    chunks = [list(range(k, min(k + CHUNK, len(items)))) for k in range(0, len(items), CHUNK)]
    with progress.bar, ThreadPoolExecutor(CHUNK_THREADS) as pool:
        futures: set[Future[None]] = {pool.submit(do_chunk, c) for c in chunks}
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for f in done:
            if f.exception() is not None:
                for g in futures:
                    g.cancel()
                raise f.exception()  # type: ignore[misc]
        wait(futures)
    return [c for c in completed if c is not None]


def _fetch_blocks(reader: Reader, todo: list[tuple[RemoteItem, int]], report: StageReport, show: bool, label: str) -> None:
    progress = _Progress(report, sum(e - s for s, e in (reader.block_span(i, b) for i, b in todo)), len(todo), show, label)
    per_call = max(1, BATCH_BYTES // reader.settings.block_bytes)
    with progress.bar:
        for k in range(0, len(todo), per_call):
            for data in reader.fetcher.fetch(todo[k : k + per_call], strict=True):
                progress.fetched(len(data))


def _verify(reader: Reader, items: list[RemoteItem], workers: int, show: bool) -> list[tuple[RemoteItem, int]]:
    """Read back every entry (size + header + checksum); return the ones that failed or are missing."""
    tasks = [(item, b) for item in items for b in reader.blocks(item)]

    def ok(task: tuple[RemoteItem, int]) -> bool:
        return reader.cache.get(reader.key(*task)) is not None

    with ThreadPoolExecutor(min(workers, 8)) as pool:
        results = list(tqdm(pool.map(ok, tasks), total=len(tasks), desc="verifying", disable=not show, file=sys.stderr))
    return [t for t, good in zip(tasks, results) if not good]
