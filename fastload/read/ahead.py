"""Blocks fetched ahead for datasets whose samples are byte ranges of shards (tar, MDS, LitData).

Words, as in this module: a *block* is one cache block of an item (``Settings.block_bytes``);
*announced* indices are the samples ``fastload.DataLoader`` will read soon (its Announcer,
:mod:`fastload.fetch.ahead`, calls the dataset's ``fetch_ahead``); a *plan* maps them to the
byte ranges they read; *queued* blocks wait for a thread of :class:`BlocksAhead`, *running*
ones are being fetched by it.

Why: a shard dataset's batch reads its blocks when the batch is read (one 8 MiB block
serves hundreds of 20 KB samples), so without this the link idled while each block's
samples were decoded, and a cold pass ran at a fraction of the link
(benchmarks/formats, benchmarks/tar). A file dataset fetches its items' first blocks
ahead (:meth:`fastload.fetch.Fetcher.ahead`); a shard dataset fetches the blocks its
announced samples fall in, here.

How: ``fetch_ahead`` plans on the announcing thread with what is in memory (the announcing
thread never waits on the network), drops blocks that are cached (known here), kept, being
read or queued, and queues the rest; at most ``AHEAD_THREADS`` threads fetch them, a chunk a
call. A sample of a shard whose offset table is not read yet is planned *later*: the block
holding the table is queued like the others, and the thread that fetched it plans the samples
that waited for it (a free thread plans those whose table's block is not queued here). Read
one after another by the planning thread, each shard's table waited for the one before it,
and the link idled while each was stored (benchmarks/formats: MDS in shard order).
Blocks read through a kept store (:class:`~fastload.read.blocks.KeptBlocks`) are claimed and
kept there, so a read that wants one waits for it and copies from memory; the
rest (compressed shards, read whole from the cache) go through ``Fetcher.fetch``, whose
table of fetches in flight makes a read of such a block wait for it. Either way a block is
fetched once. Threads end when nothing is queued, so none outlives its loader's pass for
longer than the fetches it had started. A failed fetch ahead is logged (debug) and counted;
the read of that block then fetches it itself and raises what it meets, as without this.

Bound: queued and running blocks together hold at most :data:`AHEAD_BYTES` per dataset in
each process (blocks beyond it are read when their batch is, as before); its one home.
tests/integration/test_blocks_ahead.py pins the behaviour.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from fastload.read import gunzip
from fastload.read.blocks import KeptBlocks, keep_ahead
from fastload.read.reader import Reader
from fastload.source import RemoteItem

__all__ = ["AHEAD_BYTES", "AHEAD_THREADS", "BlocksAhead", "Plan", "RangesAhead", "TarAhead"]

_log = logging.getLogger("fastload")

#: Bytes of blocks queued or being fetched ahead, per dataset in each process: 8 of the
#: default 8 MiB blocks, a few batches' worth of a shuffled read, well under the kept
#: store's default (256 MiB) so blocks fetched ahead are not dropped before their read.
AHEAD_BYTES = 64 << 20
#: Threads fetching ahead per dataset in each process: two, so one call's blocks are stored
#: while the next call's GETs run (as Fetcher.fetch_in_turn overlaps staging's calls).
AHEAD_THREADS = 2

Range = tuple[RemoteItem, int, int]  # (item, start, end) bytes a sample reads


class Plan(NamedTuple):
    """What announced samples read: ranges through the kept store, ranges read whole from the
    cache (compressed shards), and indices to plan again on a thread (their table is unread),
    each with the range it waits for (the table's bytes, fetched ahead as a kept range)."""

    kept: list[Range]
    cached: list[Range]
    later: list[tuple[int, Range]]


Planner = Callable[[Sequence[int], bool], Plan]  # (indices, may read) -> Plan


class BlocksAhead:
    """Fetches the blocks of announced samples in the background, at most :data:`AHEAD_BYTES` at once.

    Args:
        reader: The dataset's Reader (its Fetcher fetches; its cache says what is stored).
        kept: The dataset's kept store, or None; blocks read through it are kept there
            when it holds twice the bound, else only cached.
        plan: ``plan(indices, load)``: the :class:`Plan` of those samples; ``load=False`` on
            the announcing thread (no read), ``True`` on a thread here (may read tables).
    """

    def __init__(self, reader: Reader, kept: KeptBlocks | None, plan: Planner) -> None:
        self.reader, self.plan = reader, plan
        # A store smaller than that would drop blocks fetched ahead before their reads.
        self.kept = kept if kept is not None and kept.limit_bytes >= 2 * AHEAD_BYTES else None
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._queued: OrderedDict[str, tuple[RemoteItem, int, bool]] = OrderedDict()  # key -> (item, block, keep)
        self._running: set[str] = set()
        self._later: list[int] = []  # indices to plan on a free thread
        self._waiting: dict[str, list[int]] = {}  # a queued or running block's key -> later indices that wait for it
        self._bytes = 0  # of queued and running blocks
        self._threads = 0
        self.fetched = 0  # blocks fetched (or read) here
        self.failed = 0  # fetch calls that raised (their reads fetch again)

    def __reduce__(self) -> tuple[Any, ...]:
        # Threads and locks do not cross processes: a DataLoader worker makes its own.
        return (_none, ())

    def announce(self, indices: Sequence[int], length: int = 0) -> None:
        """Queue the blocks the samples at ``indices`` read; never waits on the network.

        Indices in order (``i, i + 1, ...``: a sequential sampler) bring a block's worth of the
        samples after them (of the ``length`` there are), by their mean size: the samples read
        next. Announced a few batches ahead, small samples span less than a block, so without
        it the next block was asked for only as the reads reached its first batches
        (benchmarks/formats: cold in shard order).
        """
        if self.reader.stop.is_set():
            return
        plan = self.plan(indices, False)
        last = indices[-1] if indices else -1
        if length > last + 1 and list(indices) == list(range(indices[0], last + 1)):
            nbytes = sum(end - start for _, start, end in plan.kept + plan.cached)
            # The mean of the samples planned: counted over all, a batch reaching into a shard whose table
            # is unread reached to the end of the dataset, and its far shards' tables took the threads.
            planned = len(indices) - len(plan.later)
            more = -(-self.reader.settings.block_bytes * planned // nbytes) if nbytes else len(indices)
            # Every 8th of a block's worth: each block of the window is met, at a few samples' cost (the
            # whole window cost as much as reading its batch, warm: 12 us a sample).
            step = max(1, more // 8)
            extra = self.plan(range(last + 1, min(length, last + 1 + more), step), False)
            plan = Plan(plan.kept + extra.kept, plan.cached + extra.cached, plan.later + extra.later)
        self._queue(plan)

    def stats(self) -> dict[str, int]:
        """Blocks queued and running, their bytes, the bound, and blocks fetched and failed calls so far."""
        with self._lock:
            return {"queued": len(self._queued), "running": len(self._running), "bytes": self._bytes,
                    "limit_bytes": AHEAD_BYTES, "threads": self._threads, "fetched": self.fetched,
                    "failed": self.failed}

    def _queue(self, plan: Plan) -> None:
        ident, known, kept = self.reader.identity, self.reader.cache.known, self.kept
        bb = self.reader.settings.block_bytes
        blocks: dict[tuple[str, int], tuple[RemoteItem, int, bool]] = {}  # by (URL, block): a key each, not a range each
        tables = [r for _, r in plan.later]  # after the plan's samples: those are read first
        for ranges, keep in ((plan.kept, kept is not None), (plan.cached, False), (tables, kept is not None)):
            for item, start, end in ranges:
                for b in range(start // bb, -(-end // bb)) if end > start else ():
                    blocks.setdefault((item.url, b), (item, b, keep))
        found: dict[str, tuple[RemoteItem, int, bool]] = {}
        for item, b, keep in blocks.values():
            key = ident.key(item, b)
            if key not in known and (kept is None or not kept.holds(key)):
                found[key] = (item, b, keep)
        with self._lock:
            for key, (item, b, keep) in found.items():
                if key in self._queued or key in self._running:
                    continue
                lo, hi = ident.span(item, b)
                if self._bytes + hi - lo > AHEAD_BYTES:
                    break  # read when its batch is, as without fetching ahead
                self._queued[key] = (item, b, keep)
                self._bytes += hi - lo
            for i, (item, lo, _) in plan.later:
                key = ident.key(item, lo // bb)
                if key in self._queued or key in self._running:
                    self._waiting.setdefault(key, []).append(i)  # planned by the thread that fetches it
                else:  # cached, kept, read by a read, or past the bound: a free thread reads it
                    self._later.append(i)
            start = max(0, min(AHEAD_THREADS - self._threads, len(self._queued) + (1 if self._later else 0)))
            self._threads += start
        for k in range(start):
            try:
                threading.Thread(target=self._run, name="fastload-blocks-ahead", daemon=True).start()
            except RuntimeError:  # no thread to be had now: the reads fetch as they go
                with self._lock:
                    self._threads -= start - k
                raise

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if self.reader.stop.is_set():  # stopping: nothing more starts
                        self._drop()
                    # Blocks first: planning may wait on a read's block, and the link must not wait on it.
                    chunk = self._take()
                    later, self._later = ([], self._later) if chunk else (self._later, [])
                    if not later and not chunk:
                        self._threads -= 1  # under the lock that found no work: an announce now starts a thread
                        return
                if later:
                    self._plan_later(later)
                else:
                    self._fetch(chunk)
        except BaseException:
            with self._lock:
                self._threads -= 1
            raise

    def _drop(self) -> None:
        """Forget what is queued (lock held)."""
        for item, b, _ in self._queued.values():
            lo, hi = self.reader.identity.span(item, b)
            self._bytes -= hi - lo
        self._queued.clear()
        self._later.clear()
        self._waiting.clear()

    def _take(self) -> list[tuple[str, RemoteItem, int, bool]]:
        """Queued blocks for one call, first queued first, about a thread's share of the bound (lock held)."""
        chunk: list[tuple[str, RemoteItem, int, bool]] = []
        nbytes = 0
        while self._queued and (not chunk or nbytes < AHEAD_BYTES // AHEAD_THREADS):
            key, (item, b, keep) = self._queued.popitem(last=False)
            self._running.add(key)
            chunk.append((key, item, b, keep))
            lo, hi = self.reader.identity.span(item, b)
            nbytes += hi - lo
        return chunk

    def _plan_later(self, indices: list[int]) -> None:
        try:
            plan = self.plan(indices, True)
        except Exception as err:  # a table that cannot be read: its batch's read raises it
            with self._lock:
                self.failed += 1
            _log.debug("fastload: planning blocks ahead failed: %s", err)
            return
        self._queue(plan)

    def _fetch(self, chunk: list[tuple[str, RemoteItem, int, bool]]) -> None:
        """Fetch ``chunk``'s blocks, then plan the indices that waited for them."""
        fetched, failed = 0, 0
        waiting: list[int] = []
        try:
            # Stored already (by another process, or a read since it was queued): nothing to fetch.
            entries = self.reader.cache.entries_for([key for key, _, _, _ in chunk])
            todo = [c for c, e in zip(chunk, entries) if e is None]
            kept = {key: (item, b) for key, item, b, keep in todo if keep}
            if kept and self.kept is not None:
                fetched += keep_ahead(self.reader, self.kept, kept)
            rest = [(item, b) for _, item, b, keep in todo if not keep]
            if rest:
                self.reader.fetcher.fetch(rest)
                fetched += len(rest)
        except Exception as err:  # advice only: the read of these blocks fetches them and raises its own error
            failed = 1
            _log.debug("fastload: fetching %d blocks ahead failed: %s", len(chunk), err)
        finally:
            ident = self.reader.identity
            with self._lock:
                self.fetched += fetched
                self.failed += failed
                for key, item, b, _ in chunk:
                    self._running.discard(key)
                    waiting += self._waiting.pop(key, ())
                    lo, hi = ident.span(item, b)
                    self._bytes -= hi - lo
        if waiting:  # their tables are kept (or cached) now: no wait
            self._plan_later(waiting)


def _none() -> None:
    return None


class RangesAhead:
    """Mixin: ``fetch_ahead`` for a dataset with ``reader`` and ``kept`` whose subclass plans (``_ahead_plan``)."""

    reader: Reader
    kept: KeptBlocks

    def fetch_ahead(self, indices: Sequence[int]) -> None:
        """Start fetching the blocks the samples at ``indices`` read (fastload.DataLoader calls it)."""
        ahead = self.__dict__.get("_blocks_ahead")
        if ahead is None or ahead.pid != os.getpid():  # a forked worker's copy: its own threads
            ahead = self.__dict__["_blocks_ahead"] = BlocksAhead(self.reader, self.kept, self._ahead_plan)
        ahead.announce(indices, len(self))  # type: ignore[arg-type]

    def _ahead_plan(self, indices: Sequence[int], load: bool) -> Plan:
        raise NotImplementedError


class TarAhead(RangesAhead):
    """:class:`RangesAhead` for ``fastload.TarDataset``: its ``samples`` and ``_tars`` (every
    member's offset is indexed at construction, so nothing is planned later)."""

    samples: list[tuple[int, str, list[tuple[str, int, int]]]]
    _tars: list[RemoteItem]

    def _ahead_plan(self, indices: Sequence[int], load: bool) -> Plan:
        ranges: list[Range] = []
        for i in indices:
            shard, _, members = self.samples[i]
            # A sample's members lie back to back: one range from its first to its last.
            _, first, _ = members[0]
            _, last, size = members[-1]
            ranges.append((self._tars[shard], first, last + size))
        # A .tar.gz shard's tar is restored from the cache, never fetched.
        local = {tar for tar in {r[0] for r in ranges} if gunzip.is_tar_item(tar)}
        return Plan([r for r in ranges if r[0] not in local] if local else ranges, [], [])
