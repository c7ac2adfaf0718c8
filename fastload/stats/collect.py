"""The collection: recording what each op did, cheaply, from many threads.

Vocabulary:

* *collector*: a :class:`StatsCollector`; ops record into it with ``add`` (items,
  bytes, busy seconds), ``count`` (an event counter) and ``timer`` (a ``with``
  block timed and added), and :meth:`StatsCollector.snapshot` turns what it holds
  into a :class:`~fastload.stats.report.LoaderStats`.
* *shard*: one thread's counters (:class:`_Shard`). ``add`` touches only the
  calling thread's own shard (a ``threading.local``), so the hot path takes no
  lock; the shards are merged when a snapshot is taken, and a finished thread's
  shard is folded into a *retired* one. The benchmark ``benchmarks/loader/bench.py``
  measures the overhead (stats on vs off).
* *worker processes*: with ``num_workers > 0`` each worker records into its own
  collector and ships what it recorded since its previous batch along with each
  batch (``_take_mine``); the parent's iterator merges it into the loader's
  collector, with each worker's host limits and fetches in flight
  (``set_limits``; :mod:`fastload.loader.worker_stats`).

Which collector code records into is :mod:`fastload.stats.active`'s job.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any

from fastload.stats.report import LoaderStats, OpStats
from fastload.transport import hostlimit

__all__ = ["StatsCollector"]


class _Shard:
    """One thread's counters; only its owner thread writes to it."""

    __slots__ = ("ops", "counters", "batches", "wait", "wall", "thread")

    def __init__(self, thread: threading.Thread | None) -> None:
        # op -> [items, bytes, seconds]; a list so the hot path mutates in place.
        self.ops: dict[str, list[Any]] = {}
        self.counters: dict[str, int] = {}
        self.batches = 0
        self.wait = 0.0
        self.wall = 0.0
        self.thread = thread

    def merge_into(self, other: _Shard) -> None:
        for name, rec in self.ops.items():
            dst = other.ops.setdefault(name, [0, 0, 0.0])
            dst[0] += rec[0]
            dst[1] += rec[1]
            dst[2] += rec[2]
        for name, n in self.counters.items():
            other.counters[name] = other.counters.get(name, 0) + n
        other.batches += self.batches
        other.wait += self.wait
        other.wall += self.wall


class StatsCollector:
    """Thread-safe, cheap per-op counters (per-thread shards merged on read).

    Args:
        enabled: When False every recording method returns at once.

    Example:
        >>> col = StatsCollector()
        >>> col.add("cache_read", items=2, bytes=4096, seconds=0.5)
        >>> col.count("cache_hit", 2)
        >>> s = col.snapshot()
        >>> (s.op("cache_read").bytes, s.counters["cache_hit"])
        (4096, 2)
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._lock = threading.Lock()
        self._local = threading.local()
        self._shards: list[_Shard] = []
        # Shards of finished threads are folded in here so the list stays short
        # when thread pools come and go each epoch.
        self._retired = _Shard(None)
        # Worker processes' host limits and fetches in flight, as each last shipped them
        # ("worker N" -> host -> state; "worker N" -> Fetcher.in_flight()).
        self._limits: dict[str, dict[str, dict[str, Any]]] = {}
        self._fetches: dict[str, dict[str, int]] = {}

    def _shard(self) -> _Shard:
        try:
            return self._local.shard  # type: ignore[no-any-return]
        except AttributeError:
            shard = _Shard(threading.current_thread())
            with self._lock:  # taken once per thread, never on the hot path
                self._shards.append(shard)
            self._local.shard = shard
            return shard

    def add(self, op: str, *, items: int = 0, bytes: int = 0, seconds: float = 0.0) -> None:
        """Record work done by ``op``.

        Args:
            op: Op name, e.g. ``"fetch"``, ``"cache_read"``, ``"decode"`` (see OPS).
            items: Items processed.
            bytes: Bytes produced or moved.
            seconds: Busy seconds spent (wall time of this thread).
        """
        if not self.enabled:
            return
        ops = self._shard().ops
        rec = ops.get(op)
        if rec is None:
            ops[op] = [items, bytes, seconds]
        else:
            rec[0] += items
            rec[1] += bytes
            rec[2] += seconds

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the event counter ``name`` (``cache_hit``, ``cache_miss``...)."""
        if not self.enabled:
            return
        counters = self._shard().counters
        counters[name] = counters.get(name, 0) + n

    @contextmanager
    def timer(self, op: str, *, items: int = 0, bytes: int = 0) -> Iterator[None]:
        """Time the ``with`` body and record it as ``add(op, items, bytes, seconds)``.

        The record is made even when the body raises, so failed work still shows up.
        """
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(op, items=items, bytes=bytes, seconds=time.perf_counter() - t0)

    def record_batches(self, batches: int, wait_seconds: float, wall_seconds: float) -> None:
        """Record batches handed to the consumer (called by the loader only).

        Args:
            batches: Batches handed out since the previous call.
            wait_seconds: Time the consumer spent inside ``next()`` for them.
            wall_seconds: Loop wall time they covered (since the previous call, or the
                start of the epoch's iteration).
        """
        if not self.enabled:
            return
        shard = self._shard()
        shard.batches += batches
        shard.wait += wait_seconds
        shard.wall += wall_seconds

    def set_limits(self, process: str, limits: dict[str, dict[str, Any]], fetches: dict[str, int] | None = None) -> None:
        """Record a DataLoader worker's host limits and fetches in flight (fastload.loader.worker_stats).

        State, not a count: the latest replaces the previous; :meth:`reset` keeps it, as its own.
        """
        if self.enabled:
            with self._lock:
                self._limits[process] = limits
                if fetches is not None:
                    self._fetches[process] = fetches

    def _merged(self, skip: _Shard | None = None) -> _Shard:
        total = _Shard(None)
        with self._lock:
            live = []
            for shard in self._shards:
                if shard.thread is not None and not shard.thread.is_alive():
                    # A dead thread can no longer write: fold it in for good.
                    shard.merge_into(self._retired)
                else:
                    live.append(shard)
            self._shards = live
            self._retired.merge_into(total)
            for shard in live:
                if shard is not skip:
                    shard.merge_into(total)
        return total

    def snapshot(self, read_threads: int = 0, batches_in_flight: int = 0, fetches: dict[str, int] | None = None) -> LoaderStats:
        """Merge every thread's shard into an immutable :class:`LoaderStats`.

        The loader passes what is in flight now in this process (``fetches``: its
        dataset's ``Fetcher.in_flight()``); workers' fetches come from :meth:`set_limits`.
        """
        total = self._merged()
        ops = {n: OpStats(int(r[0]), int(r[1]), float(r[2])) for n, r in total.ops.items()}
        return LoaderStats(
            ops=MappingProxyType(ops),
            counters=MappingProxyType(dict(total.counters)),
            batches=total.batches,
            wait_seconds=total.wait,
            wall_seconds=total.wall,
            # Process-wide, like the limits themselves; a disabled collector reports nothing.
            concurrency=MappingProxyType(self._concurrency() if self.enabled else {}),
            read_threads=read_threads,
            batches_in_flight=batches_in_flight,
            fetches_in_flight=MappingProxyType(self._in_flight(fetches) if self.enabled else {}),
        )

    def _in_flight(self, mine: dict[str, int] | None) -> dict[str, Any]:
        with self._lock:
            procs = ({} if mine is None else {"main": mine}) | self._fetches
        return {"ahead": sum(p["ahead"] for p in procs.values()), "fetching": sum(p["fetching"] for p in procs.values()),
                "processes": procs} if procs else {}

    def _concurrency(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            workers = dict(self._limits)
        return hostlimit.combine_limits({"main": hostlimit.settled(), **workers})

    def _take_mine(self) -> tuple[dict[str, list[Any]], dict[str, int], _Shard]:
        """Detach the calling thread's records: ``({op: [items, bytes, seconds]}, {counter: n})``.

        O(1): only the calling thread writes its own shard, so it is swapped out, not
        copied. DataLoader workers ship these with each batch (fastload.loader.worker_stats).
        The third value is the shard, for :meth:`_others`.
        """
        shard = self._shard()
        ops, counters = shard.ops, shard.counters
        shard.ops, shard.counters = {}, {}
        return ops, counters, shard

    def _others(self, mine: _Shard) -> _Shard | None:
        """Running totals of every thread's records but ``mine``; None when there are none."""
        with self._lock:
            if len(self._shards) < 2 and not (self._retired.ops or self._retired.counters):
                return None
        return self._merged(skip=mine)

    def reset(self) -> None:
        """Forget everything recorded so far."""
        with self._lock:
            # A fresh threading.local makes every thread open a new shard on its next
            # record; an increment racing with the reset lands in an orphaned shard.
            self._local = threading.local()
            self._shards = []
            self._retired = _Shard(None)
