"""Stats recorded inside DataLoader worker processes, shipped to the parent with each batch.

With ``num_workers > 0`` the dataset's stages (fetch, cache_read, decode) and
collate run in torch's worker processes, where they record into the worker's
process-wide collector (:func:`fastload.stats.default_collector`). While torch
builds its multi-process iterator, the loader gives it a :class:`WorkerCollate`
in place of ``collate_fn``: it runs the user's collate_fn, times it as the
``collate`` stage, and returns a :class:`WorkerBatch` holding the batch and what
the worker recorded since its previous batch. In the parent, :class:`Unwrap` sits right after torch's
``__next__``: it adds the delta to the loader's collector and returns the batch
itself, so the device prefetcher and the user get exactly what torch's loader
yields (``tests/unit/test_loader_compat.py``), and torch's pin_memory thread pins
the batch inside (:meth:`WorkerBatch.pin_memory`).

Shipping with the batches needs no extra queue or process, and a delta is a few
small tuples. A worker that fails a batch sends torch's ExceptionWrapper instead;
its records then travel with that worker's next batch.
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter
from typing import Any

from fastload.stats import StatsCollector, default_collector, nbytes

__all__ = ["Delta", "Unwrap", "WorkerBatch", "WorkerCollate"]

#: ``((stage, items, bytes, seconds), ...), ((counter, n), ...)``: recorded since the
#: worker's previous batch (None: nothing).
Delta = tuple[tuple[tuple[str, int, int, float], ...], tuple[tuple[str, int], ...]] | None


class WorkerBatch:
    """A collated batch and the stats its worker recorded since its previous batch."""

    __slots__ = ("batch", "delta")

    def __init__(self, batch: Any, delta: Delta) -> None:
        self.batch = batch
        self.delta = delta

    def __reduce__(self) -> tuple[Any, ...]:
        return (WorkerBatch, (self.batch, self.delta))

    def pin_memory(self) -> WorkerBatch:
        """Pin the batch inside (torch's pin_memory thread calls this method when it exists)."""
        from torch.utils.data._utils.pin_memory import pin_memory

        return WorkerBatch(pin_memory(self.batch), self.delta)


class WorkerCollate:
    """The collate_fn torch's workers run: the user's, plus the worker's stats delta.

    Args:
        fn: The loader's collate_fn.
        auto: Whether the loader batches (``fn`` then gets a list of samples).
    """

    def __init__(self, fn: Callable[[Any], Any], auto: bool) -> None:
        self.fn = fn
        self.auto = auto
        # Other threads' totals at the previous batch (they may be writing: diffed, not
        # detached). Per worker process: each gets its own copy, by fork or pickle.
        self._seen: tuple[dict[str, list[Any]], dict[str, int]] = ({}, {})

    def __call__(self, data: Any) -> WorkerBatch:
        t0 = perf_counter()
        out = self.fn(data)
        dt = perf_counter() - t0
        n = len(data) if self.auto else 1
        return WorkerBatch(out, self._delta(("collate", n, nbytes(out), dt)))

    def _delta(self, collate: tuple[str, int, int, float]) -> Delta:
        col = default_collector()  # reset in each forked worker (fastload.stats)
        stages, counters, mine = col._take_mine()  # this thread's: the dataset's, mostly
        ds = [collate] + [(name, r[0], r[1], r[2]) for name, r in stages.items()]
        dc = list(counters.items())
        others = col._others(mine)  # e.g. the cache reader's fetch threads
        if others is not None:
            old_stages, old_counters = self._seen
            self._seen = (others.stages, others.counters)
            zero = [0, 0, 0.0]
            for name, r in others.stages.items():
                o = old_stages.get(name, zero)
                if r != o:
                    ds.append((name, r[0] - o[0], r[1] - o[1], r[2] - o[2]))
            for name, k in others.counters.items():
                if k != old_counters.get(name, 0):
                    dc.append((name, k - old_counters.get(name, 0)))
        return tuple(ds), tuple(dc)


class Unwrap:
    """Calls torch's ``__next__``; merges a WorkerBatch's delta into ``collector``, returns its batch."""

    __slots__ = ("fn", "collector")

    def __init__(self, fn: Callable[[], Any], collector: StatsCollector) -> None:
        self.fn = fn
        self.collector = collector

    def __call__(self) -> Any:
        out = self.fn()
        if type(out) is not WorkerBatch:
            return out
        if out.delta is not None:
            stages, counters = out.delta
            col = self.collector
            for name, items, size, seconds in stages:
                col.add(name, items=items, bytes=size, seconds=seconds)
            for name, n in counters:
                col.count(name, n)
        return out.batch
