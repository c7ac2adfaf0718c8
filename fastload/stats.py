"""Per-stage counters and timers, and the data-stall fraction.

Every stage of the pipeline records what it did into a :class:`StatsCollector`:
items, bytes and busy seconds per *stage*, plus plain event counters such as
``cache_hit``. The :class:`~fastload.loader.DataLoader` owns one collector and
makes it the *active* collector (a ContextVar) of the code that iterates it, from
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

Stage names are free-form; the canonical ones, in table order, are
:data:`STAGES`. The loader itself records ``read`` (time producing samples:
``__getitem__`` or ``read_batch``, which *contains* the sub-stages ``fetch``,
``cache_read`` and ``decode`` that datasets record), ``collate``, ``stage``
(host copy into a staging slot) and ``h2d``.

Cost. ``add`` touches only the calling thread's own shard (a
``threading.local``), so the hot path takes no lock; the shards are merged
when :meth:`StatsCollector.snapshot` is called. The benchmark
``benchmarks/loader/bench.py`` measures the overhead (stats on vs off).

Worker processes. With ``num_workers > 0`` each worker records into its own
collector and ships what it recorded since its previous batch along with each
batch; the parent's iterator merges it into the loader's collector
(:mod:`fastload._worker_stats`).
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

from fastload import hostlimit

__all__ = [
    "STAGES",
    "LoaderStats",
    "StageStats",
    "StatsCollector",
    "combine_limits",
    "current_collector",
    "default_collector",
    "nbytes",
    "use_collector",
]

#: Canonical stage names, in the order the table prints them. Other names are allowed
#: and print after these, sorted.
STAGES: tuple[str, ...] = ("fetch", "cache_read", "decode", "read", "collate", "stage", "h2d")


@dataclass(frozen=True)
class StageStats:
    """What one stage did.

    Attributes:
        items: Items (samples, batches or requests; the stage decides) processed.
        bytes: Bytes produced or moved by the stage.
        seconds: Busy seconds, summed over every thread that ran the stage, so it can
            exceed wall time when the stage runs in parallel.
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


_ZERO = StageStats()


@dataclass(frozen=True)
class LoaderStats:
    """A snapshot of a loader's counters; ``str()`` renders it as a table.

    Attributes:
        stages: Stage name -> :class:`StageStats`.
        counters: Event name -> count (``cache_hit``, ``cache_miss``, ``oversize_batch``...).
        batches: Batches handed to the consumer.
        wait_seconds: Seconds the consumer spent inside ``next()`` waiting for a batch
            (when batches come faster than 100 us apart, timed on a random sample of
            them and scaled: fastload._loader_iter).
        wall_seconds: Seconds from the start of each epoch's iteration to the most recent
            batch, summed over epochs: the training loop's wall time.
        concurrency: Host -> its request limits (:mod:`fastload.hostlimit`), over this
            process and the loader's worker processes, each of which has its own:
            ``limit`` (requests in flight the controllers settled on, summed over the
            processes), ``cap`` (``max_requests``: a cap *per process*), ``peak`` (the most
            in flight at once in one process), ``cuts`` (congestion signals, summed),
            ``last_cut``, and ``processes``: ``{"main" | "worker N": {limit, cap, peak,
            cuts, last_cut}}``, each process's own (:func:`combine_limits`).
    """

    stages: Mapping[str, StageStats] = field(default_factory=dict)
    counters: Mapping[str, int] = field(default_factory=dict)
    batches: int = 0
    wait_seconds: float = 0.0
    wall_seconds: float = 0.0
    concurrency: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def stage(self, name: str) -> StageStats:
        """Return the stats of stage ``name`` (all zero if it never recorded)."""
        return self.stages.get(name, _ZERO)

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

    def as_dict(self) -> dict[str, Any]:
        """Return plain data for JSON output."""
        return {
            "batches": self.batches,
            "wait_seconds": self.wait_seconds,
            "wall_seconds": self.wall_seconds,
            "data_stall_fraction": self.data_stall_fraction,
            "cache_hit_rate": self.cache_hit_rate,
            "counters": dict(self.counters),
            "concurrency": {host: dict(v) for host, v in self.concurrency.items()},
            "stages": {
                name: {
                    "items": s.items,
                    "bytes": s.bytes,
                    "seconds": s.seconds,
                    "items_per_s": s.items_per_s,
                    "bytes_per_s": s.bytes_per_s,
                }
                for name, s in self.stages.items()
            },
        }

    def __str__(self) -> str:
        names = [n for n in STAGES if n in self.stages]
        names += sorted(n for n in self.stages if n not in STAGES)
        rows = [("stage", "items", "MB", "busy s", "items/s", "MB/s")]
        for name in names:
            s = self.stages[name]
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
            lines.append(f"cache hit rate {rate:.1%}")
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
        return "\n".join(lines)


class _Shard:
    """One thread's counters; only its owner thread writes to it."""

    __slots__ = ("stages", "counters", "batches", "wait", "wall", "thread")

    def __init__(self, thread: threading.Thread | None) -> None:
        # stage -> [items, bytes, seconds]; a list so the hot path mutates in place.
        self.stages: dict[str, list[Any]] = {}
        self.counters: dict[str, int] = {}
        self.batches = 0
        self.wait = 0.0
        self.wall = 0.0
        self.thread = thread

    def merge_into(self, other: _Shard) -> None:
        for name, rec in self.stages.items():
            dst = other.stages.setdefault(name, [0, 0, 0.0])
            dst[0] += rec[0]
            dst[1] += rec[1]
            dst[2] += rec[2]
        for name, n in self.counters.items():
            other.counters[name] = other.counters.get(name, 0) + n
        other.batches += self.batches
        other.wait += self.wait
        other.wall += self.wall


class StatsCollector:
    """Thread-safe, cheap per-stage counters (per-thread shards merged on read).

    Args:
        enabled: When False every recording method returns at once.

    Example:
        >>> col = StatsCollector()
        >>> col.add("cache_read", items=2, bytes=4096, seconds=0.5)
        >>> col.count("cache_hit", 2)
        >>> s = col.snapshot()
        >>> (s.stage("cache_read").bytes, s.counters["cache_hit"])
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
        # Worker processes' host limits, as each last shipped them ("worker N" -> host -> state).
        self._limits: dict[str, dict[str, dict[str, Any]]] = {}

    def _shard(self) -> _Shard:
        try:
            return self._local.shard  # type: ignore[no-any-return]
        except AttributeError:
            shard = _Shard(threading.current_thread())
            with self._lock:  # taken once per thread, never on the hot path
                self._shards.append(shard)
            self._local.shard = shard
            return shard

    def add(self, stage: str, *, items: int = 0, bytes: int = 0, seconds: float = 0.0) -> None:
        """Record work done by ``stage``.

        Args:
            stage: Stage name, e.g. ``"fetch"``, ``"cache_read"``, ``"decode"`` (see STAGES).
            items: Items processed.
            bytes: Bytes produced or moved.
            seconds: Busy seconds spent (wall time of this thread).
        """
        if not self.enabled:
            return
        stages = self._shard().stages
        rec = stages.get(stage)
        if rec is None:
            stages[stage] = [items, bytes, seconds]
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
    def timer(self, stage: str, *, items: int = 0, bytes: int = 0) -> Iterator[None]:
        """Time the ``with`` body and record it as ``add(stage, items, bytes, seconds)``.

        The record is made even when the body raises, so failed work still shows up.
        """
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(stage, items=items, bytes=bytes, seconds=time.perf_counter() - t0)

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

    def set_limits(self, process: str, limits: dict[str, dict[str, Any]]) -> None:
        """Record another process's host limits (a DataLoader worker's, fastload._worker_stats).

        State, not a count: the latest replaces the previous, and :meth:`reset` keeps it,
        as it keeps this process's own limits.
        """
        if self.enabled:
            with self._lock:
                self._limits[process] = limits

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

    def snapshot(self) -> LoaderStats:
        """Merge every thread's shard into an immutable :class:`LoaderStats`."""
        total = self._merged()
        stages = {n: StageStats(int(r[0]), int(r[1]), float(r[2])) for n, r in total.stages.items()}
        return LoaderStats(
            stages=MappingProxyType(stages),
            counters=MappingProxyType(dict(total.counters)),
            batches=total.batches,
            wait_seconds=total.wait,
            wall_seconds=total.wall,
            # Process-wide, like the limits themselves; a disabled collector reports nothing.
            concurrency=MappingProxyType(self._concurrency() if self.enabled else {}),
        )

    def _concurrency(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            workers = dict(self._limits)
        return combine_limits({"main": hostlimit.settled(), **workers})

    def _take_mine(self) -> tuple[dict[str, list[Any]], dict[str, int], _Shard]:
        """Detach the calling thread's records: ``({stage: [items, bytes, seconds]}, {counter: n})``.

        O(1): only the calling thread writes its own shard, so it is swapped out, not
        copied. DataLoader workers ship these with each batch (fastload._worker_stats).
        The third value is the shard, for :meth:`_others`.
        """
        shard = self._shard()
        stages, counters = shard.stages, shard.counters
        shard.stages, shard.counters = {}, {}
        return stages, counters, shard

    def _others(self, mine: _Shard) -> _Shard | None:
        """Running totals of every thread's records but ``mine``; None when there are none."""
        with self._lock:
            if len(self._shards) < 2 and not (self._retired.stages or self._retired.counters):
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


def combine_limits(per_process: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Host -> its limits over several processes (``process -> host -> HostLimit.as_dict()``).

    Each process has its own limit and cap for a host (fastload.hostlimit), so the host
    may see the sum of their limits at once: ``limit`` and ``cuts`` are summed, ``peak``
    is the largest of one process, ``cap`` is the (per-process) cap, and ``processes``
    keeps each process's own.

    >>> c = combine_limits({"main": {"h": {"limit": 4, "cap": 8, "peak": 4, "cuts": 0, "last_cut": ""}},
    ...                     "worker 0": {"h": {"limit": 2, "cap": 8, "peak": 6, "cuts": 1, "last_cut": "503"}}})
    >>> {k: c["h"][k] for k in ("limit", "cap", "peak", "cuts", "last_cut")}
    {'limit': 6, 'cap': 8, 'peak': 6, 'cuts': 1, 'last_cut': '503'}
    """
    hosts: dict[str, dict[str, Mapping[str, Any]]] = {}
    for process, limits in per_process.items():
        for host, state in limits.items():
            hosts.setdefault(host, {})[process] = state
    out = {}
    for host, procs in hosts.items():
        states = list(procs.values())
        out[host] = {
            "limit": sum(int(s["limit"]) for s in states),
            "cap": max(int(s["cap"]) for s in states),
            "peak": max(int(s["peak"]) for s in states),
            "cuts": sum(int(s["cuts"]) for s in states),
            "last_cut": next((s["last_cut"] for s in reversed(states) if s.get("last_cut")), ""),
            "processes": {p: dict(s) for p, s in procs.items()},
        }
    return out


def nbytes(obj: Any) -> int:
    """Bytes held by the tensors, arrays, bytes and nested containers in ``obj``.

    Other leaves count 0. Used to fill the ``bytes`` column cheaply (no copies); it
    runs once per batch, so the common containers are walked without generators.
    """
    kind = type(obj)
    if kind is tuple or kind is list:
        total = 0
        for v in obj:
            total += nbytes(v)
        return total
    if kind is dict:
        total = 0
        for v in obj.values():
            total += nbytes(v)
        return total
    if kind is str or obj is None or kind is int or kind is float:
        return 0
    if kind is bytes or kind is bytearray:
        return len(obj)
    n = getattr(obj, "nbytes", None)  # torch.Tensor, numpy.ndarray, memoryview
    if isinstance(n, int):
        return n
    if isinstance(obj, Mapping):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    return 0


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
    """Count ``items`` blocks read from the cache (``hit``, stats stage ``cache_read``) or fetched
    on a miss (stats stage ``fetch``) since ``t0``, in the running loader's collector (else the process default)."""
    collector = current_collector()
    collector.add("cache_read" if hit else "fetch", items=items, bytes=nbytes, seconds=time.perf_counter() - t0)
    collector.count("cache_hit" if hit else "cache_miss", items)
