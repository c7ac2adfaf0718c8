"""Pre-staging: copy a remote dataset into the cache before training (``fastload cache``).

Staging lists the dataset once (recording the manifest), then fetches every
block that is not already cached and valid with up to ``max_requests`` parallel requests.
Because cached entries are skipped, rerunning after an interruption (even a
SIGKILL) resumes where it stopped; entries are published atomically, so an
interrupted write is never mistaken for a valid one
(tests/reliability/test_stage_kill.py).

With ``nodes=``/``node_rank=`` it stages one node's part: exactly the items
``partition="node"`` reads on that node (:mod:`fastload.read.partition`), split from the
whole listing, whose manifest it records whole.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from tqdm import tqdm

from fastload.cache import keys
from fastload.config import Settings, format_size
from fastload.errors import (
    CacheFullError,
    ConfigError,
    EmptyDatasetError,
    FastloadError,
    StoppedError,
)
from fastload.fetch.identity import CachedItems
from fastload.read.reader import Reader
from fastload.source import RemoteItem
from fastload.source.listing import progress_line

T = TypeVar("T")
_log = logging.getLogger("fastload")


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
        verified_entries: Entries read back and checked by ``verify`` (0: not asked).
        bad_entries: Entries that failed verification (dropped and refetched).
        seconds: Wall time of the run.
        cache_limit_bytes: The limit in force.
        fits: Whether the dataset fits the limit (raw size, conservative).
        dry_run: Nothing was fetched.
        concurrency: The remote host's request limit after the run: ``limit`` (what the
            controller settled on), ``cap`` (``max_requests``), ``peak`` in flight, ``cuts``
            (fastload.transport.hostlimit); empty for local files.
        node: ``"<node_rank>/<nodes>"`` when one node's part was staged, else empty;
            ``items`` and the byte counts are then that part's.
        remote_changed: Staged from a recorded listing: its objects whose size or version
            the remote's listing now shows changed (0 where the listing has neither: HTTP).
        remote_new: Objects the remote lists now that the recorded listing lacks.
        remote_gone: Objects of the recorded listing the remote lists no more.
    """

    url: str
    items: int = 0
    blocks: int = 0
    remote_bytes: int = 0
    stored_bytes: int = 0
    fetched_blocks: int = 0
    fetched_bytes: int = 0
    skipped_blocks: int = 0
    verified_entries: int = 0
    bad_entries: int = 0
    seconds: float = 0.0
    cache_limit_bytes: int = 0
    fits: bool = True
    dry_run: bool = False
    concurrency: dict[str, Any] = field(default_factory=dict)
    node: str = ""
    remote_changed: int = 0
    remote_new: int = 0
    remote_gone: int = 0

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
            f"staged      {self.url}" + (f" (node {self.node})" if self.node else ""),
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
        if self.verified_entries:  # silence when all was well read as "not checked"
            lines.append(f"verify      {self.verified_entries} entries checked, {self.bad_entries} bad"
                         + (", dropped and refetched" if self.bad_entries else ""))
        return "\n".join(lines)


def stage(
    url: str | Sequence[str],
    *,
    pattern: str | None = None,
    storage_options: dict[str, Any] | None = None,
    settings: Settings | None = None,
    refresh: bool = False,
    dry_run: bool = False,
    verify: bool = False,
    progress: bool | None = None,
    nodes: int | None = None,
    node_rank: int | None = None,
) -> StageReport:
    """Copy the dataset at ``url`` into the cache; see the module docstring.

    Args:
        url: Any fsspec URL of a folder/prefix or a single object, or a sequence of
            object URLs (staged without a listing; the report names it ``urls:<n>:<digest>``).
        pattern: Glob relative to ``url`` (``**/*.jpg``); None takes everything.
        storage_options: fsspec options (credentials, endpoint).
        settings: Cache dir, limit, max_requests, LZ4 level...
        refresh: Re-list the remote instead of trusting the recorded manifest.
        dry_run: Only list and report the size against the cache limit.
        verify: After staging, re-read every entry and check its checksum.
        progress: Show a progress bar (default: when stderr is a terminal).
        nodes, node_rank: Stage only what ``partition="node"`` reads on node ``node_rank``
            of ``nodes``; one given, the other comes from torchrun's or Slurm's
            environment (:func:`fastload.read.partition.node_env`). Neither: the whole dataset.

    Raises:
        CacheFullError: The dataset is larger than the cache limit, or the disk filled up.
        ConfigError: One of ``nodes``/``node_rank`` given and the other not found.
    """
    settings = settings or Settings.from_env()
    reader = Reader(settings, storage_options)
    # No key memo (~0.3 KB per object at 100k), an entry memo of the latest writes only (~390 B per object
    # each): the Fetcher sees blocks stored meanwhile in it (a Range-less server's object stores all at once).
    reader.identity.keys_max = 0
    reader.cache.memo_max = STAGING_MEMO
    t0 = time.perf_counter()
    # Dry runs need every size now; real runs complete sizeless (HTTP) items
    # inside the fetch workers, so HEADs overlap with transfers.
    part = nodes is not None or node_rank is not None
    root = reader.manifest_root(url)
    # The remote is listed again to compare with a recorded listing (_compare_with_remote) on a thread of its
    # own, from the start, while this one reads the record and checks the cache (a rerun: about one listing).
    listed = url if isinstance(url, str) and not refresh else None  # a URL whose listing may be recorded
    again = _list_later(reader, listed, pattern) \
        if listed is not None and not part and reader.cache.index.present([keys.manifest(root, pattern)]) else None
    snapshot = reader.identity.recorded(root, pattern) if listed is not None else None
    if snapshot is not None and part and any(i.size < 0 for i in snapshot):
        snapshot = None  # a node's part is split by bytes: the listing is completed below
    # A node's part is split by bytes, so it needs every size first (as the sampler does): the
    # listing's, an nginx or Apache index page's exact ones included; the rest cost a HEAD each.
    if snapshot is not None:
        items = list(snapshot)  # completed in place below (_fetch_all); the snapshot stays as recorded
    else:
        with progress_line(root, _show(progress)):
            items = reader.list(url, pattern, refresh=refresh, complete=False)
    plan = [i.plan_size for i in items]
    if (dry_run or part) and items and min(plan) < 0:
        plan, headed = reader.sources.of(items[0].url).plan_sizes(items)
        items = [headed.get(k, i) for k, i in enumerate(items)]
    node = ""
    if part:
        from fastload.read import (
            partition,  # numpy: only for a node's part, not at every import of fastload
        )

        env_nodes, env_rank = partition.node_env()
        nodes = env_nodes if nodes is None else nodes
        node_rank = env_rank if node_rank is None else node_rank
        if nodes is None or node_rank is None or not 0 <= node_rank < nodes:
            raise ConfigError(
                f"staging one node's part needs nodes= and node_rank= in [0, nodes) (got {nodes}, {node_rank}), "
                "and torchrun's or Slurm's environment does not give them; fix: pass both (--nodes, --node-rank)"
            )
        owner = partition.assign([i.url for i in items], plan, nodes)
        kept = partition.node_items(owner, node_rank)
        items, plan = [items[k] for k in kept], [plan[k] for k in kept]
        node = f"{node_rank}/{nodes}"
    # The limit in force: --cache-limit, capped so the disk keeps its reserve free (fastload/cache/writes.py).
    limit = reader.cache.limit_bytes()
    report = StageReport(url=root, items=len(items), cache_limit_bytes=limit, node=node)
    if snapshot is not None and listed is not None and again is None:
        again = _list_later(reader, listed, pattern)
    known = sum(1 for size in plan if size >= 0)
    report.remote_bytes = sum(size for size in plan if size >= 0)
    del plan  # a pointer per object, not needed past here (staging's memory: issue 31)
    report.fits = report.remote_bytes <= limit
    if dry_run:
        report.dry_run = True
        report.blocks = sum(max(1, -(-i.plan_size // settings.block_bytes)) for i in items)
        report.stored_bytes = reader.identity.stored_bytes(items)
        _compare_with_remote(report, snapshot, again)
        report.seconds = time.perf_counter() - t0
        return report
    sizeless = known < len(items)
    # Every size known (a recorded listing, S3, GCS): the entries cached already are found in one pass over the
    # index, with their stored bytes; only the rest go to the fetch threads (2.3 s of a 100k rerun, before).
    cached = CachedItems()
    if all(i.size >= 0 for i in items):  # sizes an index page showed name no entry (RemoteItem.index_size)
        recorded = reader.identity.counted_whole(root, pattern, items, report.remote_bytes) if snapshot is not None and not part else None
        cached = recorded or reader.identity.cached_whole(items)
    # Before any request for an object: the sizes known say so already. A dataset cached
    # whole only needs checking, though another program took the room since.
    if not report.fits and (sizeless or cached.items < len(items)):
        raise CacheFullError(_too_big(report, settings, sized=known if sizeless else None))
    writable = reader.cache.unwritable is None  # a read-only cache may still hold it all: then it only checks
    reader.cache.recover()  # repairs only after a crash (cache/repair.py)
    # An interrupted stage leaves this marker behind. Its rerun (and a refresh) completes sizeless items with a
    # HEAD each, so blocks cached are skipped; a fresh stage has none to skip: one GET each (_fetch_all).
    marker = keys.staging(root, pattern)
    fresh = not refresh and reader.cache.index.get(marker) is None
    if writable:
        reader.cache.index.set(marker, time.time())
    items = _fetch_all(reader, items, report, _show(progress), "staging", heads="pinned" if fresh else "all",
                       limit=limit if sizeless else None, cached=cached)
    if writable:
        # A part's listing was recorded whole when it was listed; a snapshot staged as it was
        # recorded is not written again (1.5 s of a 100k rerun, and it reset the summary).
        if not part and items != snapshot:
            reader.identity.save_manifest(root, pattern, items)
        reader.cache.index.delete(marker)
    rest = [items[k] for k in cached.missing(len(items))]
    report.remote_bytes = cached.nbytes + sum(i.size for i in rest)
    report.blocks = cached.blocks + sum(len(reader.identity.blocks(i)) for i in rest)
    if verify:
        bad = _verify(reader, items, settings.verify_threads, _show(progress))
        report.verified_entries, report.bad_entries = report.blocks, len(bad)
        # A bad entry was counted as skipped (valid by size) above; refetched, it counts as
        # fetched instead, so the two still add up to the dataset's entries.
        report.skipped_blocks -= min(len(bad), report.skipped_blocks)
        _fetch_blocks(reader, bad, report, _show(progress), "refetching")
    mine = None
    if writable and not part and isinstance(url, str):  # `fastload info` then reads its figures without counting
        summaries = reader.identity.summaries()
        sizes = reader.identity.block_sizes(summaries)
        mine = next((s for s in summaries if (s["root"], s["pattern"]) == (root, pattern)), None)
        if mine is None or not reader.identity.current(mine, sizes):
            mine = reader.identity.summarise(root, pattern, items, sizes)
    # Counted under this block size alone, the summary's stored bytes are the dataset's.
    if mine is not None and mine.get("sizes") == [settings.block_bytes] and mine.get("cached_items") == len(items):
        report.stored_bytes = mine["stored_bytes"]
    else:
        report.stored_bytes = cached.stored + reader.identity.stored_bytes(rest)
    # The index's log folded into its file: a staged cache then reads whole from a
    # read-only mount too (docs/cache.md, "Full and read-only disks").
    reader.cache.compact()
    _compare_with_remote(report, snapshot, again)
    report.seconds = time.perf_counter() - t0
    host = reader.sources.of(items[0].url if items else root).host_limit
    report.concurrency = host.as_dict() if host is not None else {}
    return report


def _list_later(reader: Reader, url: str, pattern: str | None) -> Future[list[RemoteItem] | None]:
    """:func:`_list_again` on a thread of its own (its error, if any, comes at ``result()``)."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="fastload-stage")
    future = pool.submit(_list_again, reader, url, pattern)
    pool.shutdown(wait=False)
    return future


def _list_again(reader: Reader, url: str, pattern: str | None) -> list[RemoteItem] | None:
    """The remote's listing now (the listing only, no object); None when it cannot be listed."""
    try:
        return reader.sources.lister(url).list(pattern, complete=False)
    except EmptyDatasetError:
        return []  # everything recorded is gone
    except FastloadError as err:  # unreachable: the snapshot is all there is to stage
        _log.info("staging %s from its recorded listing; the remote could not be listed to compare (%s)", url, err)
        return None


def _compare_with_remote(report: StageReport, snapshot: list[RemoteItem] | None,
                         again: Future[list[RemoteItem] | None] | None) -> None:
    """Staging from a recorded listing stages that snapshot (docs/cache.md); the remote was
    listed once more (:func:`_list_again`): say how many objects changed since, and the fix.

    A rerun on a changed remote said "skipped 14 already cached" and nothing else (issue 24).
    An HTTP listing has no sizes or versions: there only new and gone objects show.
    """
    now = again.result() if again is not None else None
    if snapshot is None or now is None:
        return
    was = {i.url: i for i in snapshot}
    is_ = {i.url: i for i in now}
    report.remote_changed = sum(
        1 for u, i in is_.items()
        if u in was and i.size >= 0 and (i.size != was[u].size or bool(i.version) and i.version != was[u].version)
    )
    report.remote_new = len(is_.keys() - was.keys())
    report.remote_gone = len(was.keys() - is_.keys())
    if report.remote_changed or report.remote_new or report.remote_gone:
        _log.warning(
            "%s: the remote differs from its recorded listing: %d changed, %d new, %d gone "
            "object(s); this run stages the recorded snapshot, as training reads it; fix: `fastload cache --refresh` "
            "(refresh=True) to stage the remote as it is now",
            report.url, report.remote_changed, report.remote_new, report.remote_gone,
        )


def _too_big(report: StageReport, settings: Settings, sized: int | None = None) -> str:
    """The error for a dataset larger than the limit; ``sized``: only that many of its objects'
    sizes are known yet (their sum is ``report.remote_bytes``), so it is at least that large."""
    capped = report.cache_limit_bytes < settings.cache_limit_bytes
    why = (f"the cache limit in force is {format_size(report.cache_limit_bytes)} (--cache-limit "
           f"{format_size(settings.cache_limit_bytes)}, capped by the disk's free space less its reserve)"
           if capped else f"the cache limit is {format_size(report.cache_limit_bytes)}")
    fix = "free space on the cache's disk, move FASTLOAD_CACHE_DIR" if capped else "raise --cache-limit"
    size = format_size(report.remote_bytes)
    if sized is not None:
        size = (f"at least {size} (the size of {sized} of its {report.items} objects; staging stopped before "
                "fetching the rest)")
    return (
        f"dataset {report.url} is {size} but {why}; fix: {fix}, stage a subset with "
        "--pattern, or skip staging and let training stream it"
    )


def _show(progress: bool | None) -> bool:
    return sys.stderr.isatty() if progress is None else progress


class _Progress:
    """Thread-safe counters plus the tqdm bar.

    With every size known (S3, local, a recorded listing) the bar counts bytes
    against the dataset's size. An HTTP listing has no sizes: they arrive with each
    item's first GET, and a byte total that grows with them sat at 100% all run
    (issue 14). Then the bar counts items against their known number, and bytes
    are shown as a count, without a percentage.
    """

    def __init__(self, report: StageReport, total_bytes: int | None, items: int, show: bool, label: str) -> None:
        self.report, self.items, self.done, self.nbytes = report, items, 0, 0
        self.sized_items = self.sized_bytes = 0  # objects whose size staging has learned, and their sum
        self.pending = 0  # items being completed under a limit (admitted)
        self.by_bytes = total_bytes is not None
        self.lock = threading.Lock()
        self.room = threading.Condition(self.lock)
        if self.by_bytes:
            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc=label, disable=not show, file=sys.stderr,
                            dynamic_ncols=True)
        else:
            self.bar = tqdm(total=items, unit="item", desc=label, disable=not show, file=sys.stderr, dynamic_ncols=True)

    def admitted(self, indices: list[int], limit: int | None, block: int) -> Iterator[list[int]]:
        """``indices``, or under ``limit`` parts that fit the room left at the mean size learned (before one:
        ``block``, what a completion fetches), less other tasks' parts, at least one. 32 at once: 130 GETs
        for 1 MB over 120 x 100 KB; one at once under 50 GB: lone GETs on aiohttp (0.5 s import)."""
        if limit is None:
            yield indices
            return
        k = 0
        while (rest := len(indices) - k) > 0:
            with self.room:
                while True:
                    per = self.sized_bytes / self.sized_items if self.sized_items else block  # the mean, once known
                    want = rest if per == 0 else int((limit - self.sized_bytes) // per) - self.pending
                    if want > 0 or not self.pending:  # none pending: one more item, whose size then decides
                        break
                    self.room.wait(1.0)
                n = max(1, min(want, rest))
                self.pending += n
            try:
                yield indices[k : k + n]
            finally:
                with self.room:
                    self.pending -= n
                    self.room.notify_all()
            k += n

    def fetched(self, nbytes: int) -> None:
        with self.lock:
            self.report.fetched_blocks += 1
            self.report.fetched_bytes += nbytes
            self._bytes(nbytes)

    def skipped(self, nbytes: int) -> None:
        with self.lock:
            self.report.skipped_blocks += 1
            self._bytes(nbytes)

    def skipped_whole(self, cached: CachedItems) -> None:
        """Count items found cached whole before any task ran, in one update of the bar."""
        with self.lock:
            self.report.skipped_blocks += cached.blocks
            self.done += cached.items
            self._bytes(cached.nbytes)
            if not self.by_bytes:
                self.bar.update(cached.items)

    def _bytes(self, nbytes: int) -> None:
        self.nbytes += nbytes
        if self.by_bytes:
            self.bar.update(nbytes)
        else:
            self.bar.set_postfix_str(format_size(self.nbytes), refresh=False)

    def item_done(self) -> None:
        with self.lock:
            self.done += 1
            if self.by_bytes:
                self.bar.set_postfix(items=f"{self.done}/{self.items}", refresh=False)
            else:
                self.bar.update(1)


class _Stop:
    """Ctrl-C for staging: no request, retry or cache write starts once it is set.

    Waiting for every queued task took 23 s on a slow server (issue 14), and from
    Python (``fastload.stage`` in a notebook) the staging threads went on retrying
    held requests one by one after the KeyboardInterrupt. The stop is the Reader's
    (``Reader.stop``): its Sources start no request or retry after it, end their waits
    for a slot, and cancel their requests on fsspec's event loop. So the interrupted
    run waits only for writes in progress (milliseconds) and for its threads to see
    the stop, never for the remote; nothing is left half-written
    (tests/integration/test_stage_interrupt.py).
    """

    WRITES_WAIT_S = 5.0
    THREADS_WAIT_S = 5.0  # a thread in a request that cannot be cancelled (a sync-only store) is left to end alone

    def __init__(self, event: threading.Event) -> None:
        self._cond = threading.Condition()
        self._event = event
        self._writing = 0

    def check(self) -> None:
        if self._event.is_set():
            raise StoppedError("staging is stopping")

    def write(self, fn: Callable[[], T]) -> T:
        """``fn()`` (a cache write) unless stopped; a stop waits for it to end."""
        with self._cond:
            self.check()
            self._writing += 1
        try:
            return fn()
        finally:
            with self._cond:
                self._writing -= 1
                self._cond.notify_all()

    def set(self) -> None:
        with self._cond:
            self._event.set()
            self._cond.wait_for(lambda: self._writing == 0, self.WRITES_WAIT_S)


STAGING_MEMO = 16_384  # cache entries a staging run remembers (its latest writes; Cache.known)
CHUNK = 32  # items one staging task completes and fetches together: their requests overlap
BATCH_BYTES = 64 * 1024**2  # blocks one fetch call holds in memory, at most


def _fetch_all(reader: Reader, items: list[RemoteItem], report: StageReport, show: bool, label: str,
               heads: str, limit: int | None = None, cached: CachedItems | None = None) -> list[RemoteItem]:
    """Complete, skip-or-fetch every block of every item through the fetch layer; returns ``items``,
    completed in place (each listed item gives way to its completed one as it is done: both held
    to the end cost ~70 B per object of staging's memory, issue 31).

    CHUNK items per task: their sizeless ones are completed together (a GET each that
    brings the first block, or a HEAD each as ``heads`` says: Fetcher.complete), then
    the blocks not cached yet are fetched together. Staging exists to cache, so a
    cache that cannot hold a block ends it (``strict``; tests/reliability/test_disk_full.py).
    Every cache write passes the stop (Ctrl-C), so none begins after it.

    ``limit``: where the listing had no sizes (HTTP), sizes are learned as objects are completed,
    as many at once as fit (_Progress.admitted); once they pass the limit, staging stops (CacheFullError).

    ``cached``: the items found cached whole beforehand (Identity.cached_whole): counted as skipped
    at once, never passed to a task.
    """
    if not items:
        return []
    fetcher = reader.fetcher
    sized = all(i.size >= 0 for i in items)
    cached = cached or CachedItems()
    progress = _Progress(report, sum(i.size for i in items) if sized else None, len(items), show, label)
    progress.skipped_whole(cached)
    rest = cached.missing(len(items))
    if not rest:  # all of it cached: nothing to fetch
        progress.bar.close()
        return items
    stop = _Stop(reader.stop)
    per_call = max(1, BATCH_BYTES // reader.settings.block_bytes)

    def do_chunk(chunk: list[int]) -> None:
        for part in progress.admitted(chunk, limit, reader.settings.block_bytes):
            do_part(part)

    def do_part(indices: list[int]) -> None:
        stop.check()
        done, fresh = fetcher.complete([items[i] for i in indices], heads=heads, strict=True, gate=stop.write)
        if limit is not None:
            with progress.lock:
                progress.sized_items += len(done)
                progress.sized_bytes += sum(i.size for i in done)
                if progress.sized_bytes > limit:
                    report.remote_bytes = progress.sized_bytes
                    raise CacheFullError(_too_big(report, reader.settings, sized=progress.sized_items))
        todo: list[tuple[RemoteItem, int]] = []
        for i, item in zip(indices, done):
            items[i] = item
            todo += [(item, b) for b in reader.identity.blocks(item)]
        cached = reader.cache.present([reader.identity.key(item, b) for item, b in todo])
        missing = []
        for item, block in todo:
            key = reader.identity.key(item, block)
            if key in fresh:
                progress.fetched(len(fresh[key]))
            elif key in cached:
                start, end = reader.identity.span(item, block)
                progress.skipped(end - start)
            else:
                missing.append((item, block))
        for nbytes in fetcher.fetch_in_turn(missing, per_call, strict=True, gate=stop.write, check=stop.check):
            progress.fetched(nbytes)
        for _ in indices:
            progress.item_done()

    pool = ThreadPoolExecutor(reader.settings.stage_threads)
    tasks: list[Future[None]] = []
    try:
        with progress.bar:
            tasks += [pool.submit(do_chunk, rest[k : k + CHUNK]) for k in range(0, len(rest), CHUNK)]
            futures = set(tasks)
            while futures:
                done, futures = wait(futures, return_when=FIRST_EXCEPTION)
                for f in done:
                    if f.exception() is not None:
                        raise f.exception()  # type: ignore[misc]
    except BaseException:
        # Ctrl-C or a failed task: stop the rest. Their requests are cancelled (_Stop), so the
        # threads end at once and none fetches on behind the caller's back.
        stop.set()
        pool.shutdown(wait=False, cancel_futures=True)
        wait(tasks, timeout=_Stop.THREADS_WAIT_S)
        raise
    pool.shutdown()
    return items


def _fetch_blocks(reader: Reader, todo: list[tuple[RemoteItem, int]], report: StageReport, show: bool, label: str) -> None:
    progress = _Progress(report, sum(e - s for s, e in (reader.identity.span(i, b) for i, b in todo)), len(todo), show, label)
    with progress.bar:
        # Bad entries were dropped (and forgotten) when verify read them, so none counts as known here.
        for nbytes in reader.fetcher.fetch_in_turn(todo, max(1, BATCH_BYTES // reader.settings.block_bytes), strict=True):
            progress.fetched(nbytes)


def _verify(reader: Reader, items: list[RemoteItem], threads: int, show: bool) -> list[tuple[RemoteItem, int]]:
    """Read back every entry (size + header + checksum); return the ones that failed or are missing."""
    tasks = [(item, b) for item in items for b in reader.identity.blocks(item)]

    def ok(task: tuple[RemoteItem, int]) -> bool:
        return reader.cache.get(reader.identity.key(*task)) is not None

    with ThreadPoolExecutor(threads) as pool:
        results = list(tqdm(pool.map(ok, tasks), total=len(tasks), desc="verifying", disable=not show, file=sys.stderr))
    return [t for t, good in zip(tasks, results) if not good]
