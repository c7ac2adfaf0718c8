"""Per-op counters and timers, and the data-stall fraction.

Every op of the pipeline (a timed piece of work: fetch, decode, collate...) records
what it did into a :class:`StatsCollector`: items, bytes and busy seconds per *op*,
plus plain event counters such as ``cache_hit``. The
:class:`~fastload.loader.dataloader.DataLoader` owns one collector and makes it the *active* collector (a ContextVar) of the code that iterates it, from
its first ``next()`` until the pass ends, and of its ``read_batch`` threads while
they read, so code deep inside a dataset or the cache reader records without
holding a reference::

    from fastload.stats import current_collector

    col = current_collector()
    col.add("cache_read", items=1, bytes=len(payload), seconds=dt)
    col.count("cache_hit")
    with col.timer("decode", items=1, bytes=len(raw)):
        image = decode(raw)

Outside any loader, :func:`current_collector` returns a process-wide default
collector (:func:`default_collector`), so direct dataset use is counted too.

Op names are free-form; the canonical ones, in table order, are
:data:`OPS`. The loader itself records ``assemble`` (time producing a batch's
samples: ``__getitem__`` or ``read_batch``, which *contains* the ops ``fetch``,
``cache_read`` and ``decode`` that datasets record), ``collate``, ``pin``
(the host copy into a pinned slot of the device prefetcher) and ``h2d``.

Cost. ``add`` touches only the calling thread's own shard (a
``threading.local``), so the hot path takes no lock; the shards are merged
when :meth:`StatsCollector.snapshot` is called. The benchmark
``benchmarks/loader/bench.py`` measures the overhead (stats on vs off).

Worker processes. With ``num_workers > 0`` each worker records into its own
collector and ships what it recorded since its previous batch along with each
batch; the parent's iterator merges it into the loader's collector
(:mod:`fastload.loader.worker_stats`).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from fastload.config import deprecated
from fastload.transport import hostlimit

__all__ = [
    "OPS",
    "WARM_HIT_RATE",
    "LoaderStats",
    "OpStats",
    "StatsCollector",
    "current_collector",
    "default_collector",
    "regime",
    "use_collector",
]

#: Canonical op names, in the order the table prints them. Other names are allowed
#: and print after these, sorted.
OPS: tuple[str, ...] = ("fetch", "cache_read", "decode", "assemble", "collate", "pin", "h2d")
OPS_MEANING = "the timed pieces of work; 'stage' now means pre-staging only"


@dataclass(frozen=True)
class OpStats:
    """What one op did.

    Attributes:
        items: Items (samples, batches or requests; the op decides) processed.
        bytes: Bytes produced or moved by the op.
        seconds: Busy seconds, summed over every thread that ran the op, so it can
            exceed wall time when the op runs in parallel.
    """

    items: int = 0
    bytes: int = 0
    seconds: float = 0.0

    @property
    def items_per_s(self) -> float:
        """Items per busy second (per thread, not aggregate); 0.0 when nothing was timed."""
        return self.items / self.seconds if self.seconds > 0 else 0.0

    @property
    def bytes_per_s(self) -> float:
        """Bytes per busy second (per thread, not aggregate); 0.0 when nothing was timed."""
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


_ZERO = OpStats()

#: A pass (an epoch, say) is warm from this cache hit rate up, else cold (:func:`regime`).
WARM_HIT_RATE = 0.5


def regime(hit_rate: float | None, fresh: bool | None = None) -> str | None:
    """``"cold"`` or ``"warm"``: the one definition (``loader.stats()``, bench, diagnose's verdict).

    A pass is cold when fewer than WARM_HIT_RATE of its reads were cache hits (most of
    its bytes were fetched from the remote), else warm. With no read counted
    (``hit_rate`` None) a pass over a ``fresh`` (empty) cache is cold, any other warm;
    None when that is not known either.

    >>> regime(0.2), regime(0.5), regime(None, fresh=True), regime(None)
    ('cold', 'warm', 'cold', None)
    """
    if hit_rate is None:
        return None if fresh is None else ("cold" if fresh else "warm")
    return "cold" if hit_rate < WARM_HIT_RATE else "warm"


@dataclass(frozen=True)
class LoaderStats:
    """A snapshot of a loader's counters; ``str()`` renders it as a table.

    Attributes:
        ops: Op name -> :class:`OpStats`.
        counters: Event name -> count (``cache_hit``, ``cache_miss``, ``oversize_batch``...).
        batches: Batches handed to the consumer.
        wait_seconds: Seconds the consumer spent inside ``next()`` waiting for a batch
            (when batches come faster than 100 us apart, timed on a random sample of
            them and scaled: fastload.loader.iterator).
        wall_seconds: Seconds from the start of each epoch's iteration to the most recent
            batch, summed over epochs: the training loop's wall time.
        concurrency: Host -> its request limits (:mod:`fastload.transport.hostlimit`), over this
            process and the loader's worker processes, each of which has its own:
            ``limit`` (requests in flight the controllers settled on, summed over the
            processes), ``cap`` (``max_requests``: a cap *per process*), ``peak`` (the most
            in flight at once in one process), ``cuts`` (congestion signals, summed),
            ``last_cut``, and ``processes``: ``{"main" | "worker N": {limit, cap, peak,
            cuts, last_cut}}``, each process's own (:func:`fastload.transport.hostlimit.combine_limits`).
        read_threads: The read_batch pool's threads (0: samples are read in the calling
            thread or in worker processes).
        batches_in_flight: Index batches handed to reading and not yet returned, when
            the snapshot was taken: the read_batch pool's, or those torch sent its workers.
        fetches_in_flight: ``ahead`` (fetches started before their read asked) and
            ``fetching`` (asked for by a read) at that moment, summed over the processes,
            and ``processes``: each one's own (a worker's as of its latest batch);
            empty for a dataset without a fastload cache.
    """

    ops: Mapping[str, OpStats] = field(default_factory=dict)
    counters: Mapping[str, int] = field(default_factory=dict)
    batches: int = 0
    wait_seconds: float = 0.0
    wall_seconds: float = 0.0
    concurrency: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    read_threads: int = 0
    batches_in_flight: int = 0
    fetches_in_flight: Mapping[str, Any] = field(default_factory=dict)

    def op(self, name: str) -> OpStats:
        """Return the stats of op ``name`` (all zero if it never recorded)."""
        return self.ops.get(name, _ZERO)

    @property
    def stages(self) -> Mapping[str, OpStats]:
        """:attr:`ops`' old name (a FutureWarning once)."""
        deprecated("stages", "ops", OPS_MEANING)
        return self.ops

    def stage(self, name: str) -> OpStats:
        """:meth:`op`'s old name (a FutureWarning once)."""
        deprecated("stage()", "op()", OPS_MEANING)
        return self.op(name)

    @property
    def data_stall_fraction(self) -> float:
        """Fraction of the loop's wall time the consumer waited for data (0.0 to 1.0)."""
        if self.wall_seconds <= 0:
            return 0.0
        return min(1.0, self.wait_seconds / self.wall_seconds)

    @property
    def cache_hit_rate(self) -> float | None:
        """``cache_hit / (cache_hit + cache_miss)``, or None when neither was counted."""
        hits = self.counters.get("cache_hit", 0)
        total = hits + self.counters.get("cache_miss", 0)
        return hits / total if total else None

    @property
    def regime(self) -> str | None:
        """``"cold"`` or ``"warm"`` by :attr:`cache_hit_rate` (:func:`regime`); None when nothing was read."""
        return regime(self.cache_hit_rate)

    def as_dict(self) -> dict[str, Any]:
        """Return plain data for JSON output."""
        return {
            "batches": self.batches,
            "wait_seconds": self.wait_seconds,
            "wall_seconds": self.wall_seconds,
            "data_stall_fraction": self.data_stall_fraction,
            "cache_hit_rate": self.cache_hit_rate,
            "regime": self.regime,
            "read_threads": self.read_threads,
            "batches_in_flight": self.batches_in_flight,
            "fetches_in_flight": dict(self.fetches_in_flight),
            "counters": dict(self.counters),
            "concurrency": {host: dict(v) for host, v in self.concurrency.items()},
            "ops": {
                name: {
                    "items": s.items,
                    "bytes": s.bytes,
                    "seconds": s.seconds,
                    "items_per_s": s.items_per_s,
                    "bytes_per_s": s.bytes_per_s,
                }
                for name, s in self.ops.items()
            },
        }

    def __str__(self) -> str:
        names = [n for n in OPS if n in self.ops]
        names += sorted(n for n in self.ops if n not in OPS)
        rows = [("op", "items", "MB", "busy s", "items/s", "MB/s")]
        for name in names:
            s = self.ops[name]
            rows.append(
                (
                    name,
                    str(s.items),
                    f"{s.bytes / 1e6:.1f}",
                    f"{s.seconds:.3f}",
                    f"{s.items_per_s:.0f}",
                    f"{s.bytes_per_s / 1e6:.1f}",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
            )
            for r in rows
        ]
        lines.append(
            f"batches {self.batches}; consumer waited {self.wait_seconds:.3f} s of "
            f"{self.wall_seconds:.3f} s loop wall time: data stall {self.data_stall_fraction:.1%}"
        )
        rate = self.cache_hit_rate
        if rate is not None:
            lines.append(f"cache hit rate {rate:.1%}: {self.regime}")
        for name in sorted(self.counters):
            lines.append(f"{name}: {self.counters[name]}")
        for host, c in sorted(self.concurrency.items()):
            procs = c.get("processes") or {}
            where = ""
            if len(procs) > 1:
                each = ", ".join(f"{name} {p['limit']}" for name, p in procs.items())
                where = f" over {len(procs)} processes ({each})"
            lines.append(f"requests in flight to {host}: settled at {c['limit']}{where} "
                         f"(cap {c['cap']} per process, peak {c['peak']}, cuts {c['cuts']})")
        f = self.fetches_in_flight
        fetches = f"; fetches in flight {f['ahead']} ahead, {f['fetching']} fetching" if f else ""
        lines.append(f"read threads {self.read_threads}; batches in flight {self.batches_in_flight}{fetches}")
        return "\n".join(lines)


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


_DEFAULT = StatsCollector()


class _LoopScope:
    """What a loader's pass makes active: its collector, and what to put back at the end."""

    __slots__ = ("collector", "outer")

    def __init__(self, collector: StatsCollector, outer: StatsCollector | None) -> None:
        self.collector = collector
        self.outer = outer


_ACTIVE: ContextVar[StatsCollector | _LoopScope | None] = ContextVar(
    "fastload_active_collector", default=None
)


def default_collector() -> StatsCollector:
    """Return the process-wide collector used when no loader is active."""
    return _DEFAULT


def current_collector() -> StatsCollector:
    """Return the active collector: the running loader's, else :func:`default_collector`.

    Cheap enough to call per item (one ``ContextVar.get``).
    """
    v = _ACTIVE.get()
    if v is None:
        return _DEFAULT
    return v.collector if type(v) is _LoopScope else v  # type: ignore[union-attr,return-value]


@contextmanager
def use_collector(collector: StatsCollector) -> Iterator[StatsCollector]:
    """Make ``collector`` the active collector of this thread for the ``with`` body."""
    token = _ACTIVE.set(collector)
    _switched()
    try:
        yield collector
    finally:
        _ACTIVE.reset(token)
        _switched()


# A loader's pass enters its scope once and leaves it set between batches, instead of
# setting and resetting the ContextVar around every batch; and it does not even check
# the ContextVar per batch: entering or leaving any scope tells every live pass to
# check before its next batch. Each per-batch step cost ~1% of throughput at batch
# size 1 (benchmarks/loader/bench.py, stats case).
_PASSES: weakref.WeakSet[Any] = weakref.WeakSet()  # objects with a recheck() method
# Adding to a WeakSet while another thread iterates it raises. Re-entrant: a pass's
# finaliser, run by the GC inside one of these sections, leaves its scope (_switched).
_PASSES_LOCK = threading.RLock()


def _watch(loader_pass: Any) -> None:
    with _PASSES_LOCK:
        _PASSES.add(loader_pass)


def _switched() -> None:
    with _PASSES_LOCK:
        passes = list(_PASSES)
    for p in passes:
        p.recheck()


def _enter_loop(collector: StatsCollector) -> _LoopScope:
    cur = _ACTIVE.get()
    # Inside another loader's scope, inherit what it will put back: loader scopes
    # are re-entered on their next batch, so they are never restored.
    scope = _LoopScope(collector, cur.outer if type(cur) is _LoopScope else cur)  # type: ignore[union-attr,arg-type]
    _ACTIVE.set(scope)
    _switched()
    return scope


def _leave_loop(scope: _LoopScope) -> None:
    # A no-op in any other context (a finaliser run by another thread, say).
    if _ACTIVE.get() is scope:
        _ACTIVE.set(scope.outer)
        _switched()


def _reset_after_fork() -> None:
    # A worker forked while another thread held the default collector's lock would
    # deadlock on its first record; and the parent's counts are not the child's.
    global _DEFAULT, _PASSES, _PASSES_LOCK
    _DEFAULT = StatsCollector()
    _ACTIVE.set(None)
    _PASSES, _PASSES_LOCK = weakref.WeakSet(), threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def record_cache(hit: bool, items: int, nbytes: int, t0: float) -> None:
    """Count ``items`` blocks read from the cache (``hit``, op ``cache_read``) or fetched
    on a miss (op ``fetch``) since ``t0``, in the running loader's collector (else the process default)."""
    collector = current_collector()
    collector.add("cache_read" if hit else "fetch", items=items, bytes=nbytes, seconds=time.perf_counter() - t0)
    collector.count("cache_hit" if hit else "cache_miss", items)
