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
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from typing import Any

from tqdm import tqdm

from fastload.config import Settings, format_size
from fastload.errors import CacheFullError
from fastload.reader import Reader
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
        CacheFullError: The dataset is larger than the cache limit.
    """
    settings = settings or Settings.from_env()
    reader = Reader(settings, storage_options)
    t0 = time.perf_counter()
    items = reader.list(url, pattern, refresh=refresh)
    report = StageReport(url=reader.canonical(url).rstrip("/"), items=len(items), cache_limit_bytes=settings.cache_limit_bytes)
    report.remote_bytes = sum(i.size for i in items)
    tasks = [(item, b) for item in items for b in reader.blocks(item)]
    report.blocks = len(tasks)
    report.fits = report.remote_bytes <= settings.cache_limit_bytes
    if dry_run:
        report.dry_run = True
        report.stored_bytes = _stored(reader, tasks)
        return report
    if not report.fits:
        raise CacheFullError(
            f"dataset {report.url} is {format_size(report.remote_bytes)} but the cache limit is "
            f"{format_size(settings.cache_limit_bytes)}; fix: raise --cache-limit, stage a subset with --pattern, "
            "or skip staging and let training stream it"
        )
    reader.cache.check()
    todo = [(i, b) for i, b in tasks if not reader.cache.contains(reader.key(i, b))]
    report.skipped_blocks = len(tasks) - len(todo)
    _fetch_all(reader, todo, settings.workers, report, _show(progress), "staging")
    if verify:
        bad = _verify(reader, tasks, settings.workers, _show(progress))
        report.bad_entries = len(bad)
        _fetch_all(reader, bad, settings.workers, report, _show(progress), "refetching")
    report.stored_bytes = _stored(reader, tasks)
    report.seconds = time.perf_counter() - t0
    return report


def _show(progress: bool | None) -> bool:
    return sys.stderr.isatty() if progress is None else progress


def _stored(reader: Reader, tasks: list[tuple[RemoteItem, int]]) -> int:
    total = 0
    for item, block in tasks:
        entry = reader.cache.entry(reader.key(item, block))
        total += entry.stored if entry else 0
    return total


def _fetch_all(reader: Reader, todo: list[tuple[RemoteItem, int]], workers: int, report: StageReport, show: bool, label: str) -> None:
    if not todo:
        return
    total = sum(e - s for s, e in (reader.block_span(i, b) for i, b in todo))
    lock = threading.Lock()
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=label, disable=not show, file=sys.stderr, dynamic_ncols=True)

    def one(task: tuple[RemoteItem, int]) -> None:
        data = reader.fetch_block(*task)
        with lock:
            report.fetched_blocks += 1
            report.fetched_bytes += len(data)
            bar.update(len(data))
            bar.set_postfix(items=f"{report.fetched_blocks}/{len(todo)}", refresh=False)

    with bar, ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(one, t) for t in todo]
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for f in pending:
            f.cancel()
        for f in done:
            f.result()  # re-raise the first failure in its original form


def _verify(reader: Reader, tasks: list[tuple[RemoteItem, int]], workers: int, show: bool) -> list[tuple[RemoteItem, int]]:
    """Read back every entry (size + header + checksum); return the ones that failed or are missing."""
    def ok(task: tuple[RemoteItem, int]) -> bool:
        return reader.cache.get(reader.key(*task)) is not None

    with ThreadPoolExecutor(min(workers, 8)) as pool:
        results = list(tqdm(pool.map(ok, tasks), total=len(tasks), desc="verifying", disable=not show, file=sys.stderr))
    return [t for t, good in zip(tasks, results) if not good]
