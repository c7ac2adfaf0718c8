"""Stats recorded inside DataLoader worker processes, shipped to the parent with each batch.

With ``num_workers > 0`` the dataset's ops (fetch, cache_read, decode) and
collate run in torch's worker processes, where they record into the worker's
process-wide collector (:func:`fastload.stats.default_collector`). While torch
builds its multi-process iterator, the loader gives it a :class:`WorkerCollate`
in place of ``collate_fn``: it runs the user's collate_fn, times it as the
``collate`` op, and returns a :class:`WorkerBatch` holding the batch and what
the worker recorded since its previous batch. In the parent, :class:`Unwrap` sits right after torch's
``__next__``: it adds the delta to the loader's collector and returns the batch
itself, so the device prefetcher and the user get exactly what torch's loader
yields (``tests/unit/test_loader_compat.py``), and torch's pin_memory thread pins
the batch inside (:meth:`WorkerBatch.pin_memory`).

Shipping with the batches needs no extra queue or process, and a delta is a few
small tuples. A worker that fails a batch sends torch's ExceptionWrapper instead;
its records then travel with that worker's next batch.

The same wrapper carries a fastload dataset's payload bytes through reused
shared-memory buffers (:mod:`fastload.device.worker_pack`), with or without stats;
:class:`Unwrap` puts them back before anyone sees the batch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from time import perf_counter
from typing import Any

import torch
from torch.utils.data import default_collate, get_worker_info

from fastload.device.batch_tree import nbytes
from fastload.device.worker_pack import (
    BufferRef,
    SharedBuffers,
    activate,
    by_value,
    pack,
    pickled_bytes,
    unpack,
)
from fastload.loader.snapshot import WorkerStates, worker_changes
from fastload.stats import StatsCollector, default_collector
from fastload.transport import hostlimit

__all__ = ["Delta", "Unwrap", "WorkerBatch", "WorkerCollate", "fetches_of"]

#: ``((op, items, bytes, seconds), ...), ((counter, n), ...), limits``: recorded since
#: the worker's previous batch (None: nothing). ``limits`` is ``(process, {host: state},
#: fetches)``: the worker's host limits (:func:`fastload.transport.hostlimit.settled`) and its
#: dataset's fetches in flight (:func:`fetches_of`) when either changed since the
#: worker's previous batch, else None. Each worker process has its own limits (a host's
#: cap holds per process) and its own Fetcher, so the parent reports them per process.
Limits = tuple[str, dict[str, dict[str, Any]], dict[str, int] | None] | None


def fetches_of(dataset: Any) -> dict[str, int] | None:
    """``dataset``'s fetches in flight (``Fetcher.in_flight()``); None for a dataset without a fastload cache."""
    fetcher = getattr(getattr(dataset, "reader", None), "fetcher", None)
    return None if fetcher is None else fetcher.in_flight()  # type: ignore[no-any-return]
Delta = tuple[tuple[tuple[str, int, int, float], ...], tuple[tuple[str, int], ...], Limits] | None


class WorkerBatch:
    """A collated batch, the stats its worker recorded since its previous batch, its packed bytes."""

    __slots__ = ("batch", "delta", "packed", "pickled", "state")

    def __init__(
        self,
        batch: Any,
        delta: Delta,
        packed: BufferRef | torch.Tensor | None = None,
        pickled: int | None = None,
        state: tuple[int, dict[str, Any] | None] | None = None,
    ) -> None:
        self.batch = batch
        self.delta = delta
        self.packed = packed
        self.pickled = pickled  # bytes of the batch that cross pickled (a worker's first batch only)
        self.state = state  # (worker id, its snapshot or None): fastload.loader.snapshot.worker_changes

    def __reduce__(self) -> tuple[Any, ...]:
        return (WorkerBatch, (self.batch, self.delta, self.packed, self.pickled, self.state))

    def pin_memory(self) -> WorkerBatch:
        """Pin the batch inside (torch's pin_memory thread calls this method when it exists).

        The packed buffer is not pinned: its bytes become ``bytes`` in the parent.
        """
        from torch.utils.data._utils.pin_memory import pin_memory

        return WorkerBatch(pin_memory(self.batch), self.delta, self.packed, self.pickled, self.state)


class WorkerCollate:
    """The collate_fn torch's workers run: the user's, plus the worker's stats delta and packed bytes.

    Args:
        fn: The loader's collate_fn.
        auto: Whether the loader batches (``fn`` then gets a list of samples).
        stats: Ship the worker's stats delta.
        buffers: Move the batch's large ``bytes`` through these shared buffers
            (fastload datasets), or None.
        resume: Ship the worker's id and resume state (:func:`fastload.loader.snapshot.worker_changes`).
    """

    def __init__(
        self,
        fn: Callable[[Any], Any],
        auto: bool,
        *,
        stats: bool = True,
        buffers: SharedBuffers | None = None,
        resume: bool = False,
    ) -> None:
        self.fn = fn
        self.auto = auto
        self.stats = stats
        self.buffers = buffers
        self.resume = resume
        self._measured = False  # per worker process, like _seen
        # Other threads' totals at the previous batch (they may be writing: diffed, not
        # detached). Per worker process: each gets its own copy, by fork or pickle.
        self._seen: tuple[dict[str, list[Any]], dict[str, int]] = ({}, {})
        self._limits: tuple[Any, ...] = ({}, None)  # the host limits and fetches in flight last shipped

    def __call__(self, data: Any) -> WorkerBatch:
        t0 = perf_counter()
        out = self.fn(data)
        dt = perf_counter() - t0
        n = len(data) if self.auto else 1
        delta = self._delta(("collate", n, nbytes(out), dt)) if self.stats else None
        state = worker_changes(sys._getframe(1)) if self.resume else None  # torch's fetcher's frame
        if self.buffers is not None:
            info = get_worker_info()
            worker = 0 if info is None else info.id
            out, packed = pack(out, self.buffers, worker)
            # Measured once per worker: what still crosses pickled (Unwrap warns).
            pickled = None if self._measured else pickled_bytes(out)
            self._measured = True
            activate(self.buffers, worker, self.fn is default_collate)
            return WorkerBatch(out, delta, packed, pickled, state)
        return WorkerBatch(by_value(out), delta, state=state)

    def _delta(self, collate: tuple[str, int, int, float]) -> Delta:
        col = default_collector()  # reset in each forked worker (fastload.stats.active)
        ops, counters, mine = col._take_mine()  # this thread's: the dataset's, mostly
        ds = [collate] + [(name, r[0], r[1], r[2]) for name, r in ops.items()]
        dc = list(counters.items())
        others = col._others(mine)  # e.g. the cache reader's fetch threads
        if others is not None:
            old_ops, old_counters = self._seen
            self._seen = (others.ops, others.counters)
            zero = [0, 0, 0.0]
            for name, r in others.ops.items():
                o = old_ops.get(name, zero)
                if r != o:
                    ds.append((name, r[0] - o[0], r[1] - o[1], r[2] - o[2]))
            for name, k in others.counters.items():
                if k != old_counters.get(name, 0):
                    dc.append((name, k - old_counters.get(name, 0)))
        return tuple(ds), tuple(dc), self._limits_delta()

    def _limits_delta(self) -> Limits:
        """This worker's host limits and fetches in flight, when they changed since its
        previous batch (a few small dicts)."""
        info = get_worker_info()
        limits = hostlimit.settled()  # this process's own: reset in each forked worker
        fetches = fetches_of(None if info is None else info.dataset)
        if (limits, fetches) == self._limits:
            return None
        self._limits = (limits, fetches)
        return f"worker {0 if info is None else info.id}", limits, fetches


class Unwrap:
    """Calls torch's ``__next__``; merges a WorkerBatch's delta into ``collector``, returns its batch.

    A batch that came packed gets its bytes back here (:func:`fastload.device.worker_pack.unpack`).
    """

    __slots__ = ("fn", "collector", "keep", "warn", "states")

    def __init__(
        self,
        fn: Callable[[], Any],
        collector: StatsCollector | None,
        keep: Any = None,
        warn: Callable[[int], None] | None = None,
        states: WorkerStates | None = None,
    ) -> None:
        self.fn = fn
        self.collector = collector
        self.keep = keep  # the WorkerCollate whose buffers this iterator's batches use
        self.warn = warn  # called with a worker's pickled bytes per batch, when measured
        self.states = states  # where each batch's worker state goes (fastload.loader.snapshot)

    def __call__(self) -> Any:
        out = self.fn()
        if type(out) is not WorkerBatch:
            return out
        if out.pickled is not None and self.warn is not None:
            self.warn(out.pickled)
        self._merge(out)
        if out.state is not None and self.states is not None:
            self.states.add(*out.state)
        return out.batch if out.packed is None else unpack(out.batch, out.packed)

    def _merge(self, out: WorkerBatch) -> None:
        if out.delta is not None and self.collector is not None:
            ops, counters, limits = out.delta
            col = self.collector
            for name, items, size, seconds in ops:
                col.add(name, items=items, bytes=size, seconds=seconds)
            for name, n in counters:
                col.count(name, n)
            if limits is not None:
                col.set_limits(*limits)
