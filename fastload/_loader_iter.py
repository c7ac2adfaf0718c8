"""The iterator that ``iter(fastload.DataLoader)`` returns, and its cheap instrumentation.

It counts the batches handed to the consumer (for ``state_dict``), times the
consumer's waits and the loop's wall time, splits torch's single-process fetch
into reading and collating, and makes the loader's collector the active one
while ``next()`` runs, so datasets and the cache record into it. Sums are kept
in plain attributes and moved into the collector every FLUSH_EVERY batches.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from time import perf_counter
from typing import Any

import torch

from fastload.stats import _ACTIVE, StatsCollector, nbytes

__all__ = ["BYTES_EVERY", "FLUSH_EVERY"]


class _Calls(Iterator[Any]):
    """An iterator over the results of calling ``fn`` (until it raises StopIteration)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn

    def __next__(self) -> Any:
        return self.fn()


class _Progress:
    """Where the most recent epoch stands, for state_dict()."""

    __slots__ = ("yielded", "active", "gen_start")

    def __init__(self, start: int = 0, gen_start: list[torch.Tensor] | None = None) -> None:
        self.yielded = start  # batches of the epoch behind the consumer, resumed ones included
        self.active = True
        self.gen_start = gen_start  # the tracked generators' states when the epoch began


class _TimedCollate:
    """Wraps torch's collate_fn in the single-process fetcher and sums its time.

    It only adds to plain attributes; :class:`_LoaderIter` moves the sums into the
    collector every FLUSH_EVERY batches, which keeps stats cheap on a loop over small
    in-memory tensors (benchmarks/loader/bench.py measures it). Bytes are measured
    on every BYTES_EVERY-th batch and scaled by the item count in between.
    """

    __slots__ = ("fn", "auto", "calls", "per_item", "seconds", "items", "bytes")

    def __init__(self, fn: Callable[[Any], Any], auto: bool) -> None:
        self.fn = fn
        self.auto = auto
        self.calls = 0
        self.per_item = 0.0
        self.seconds = 0.0
        self.items = 0
        self.bytes = 0.0

    def __call__(self, data: Any) -> Any:
        t0 = perf_counter()
        out = self.fn(data)
        self.seconds += perf_counter() - t0
        n = len(data) if self.auto else 1
        if self.calls % BYTES_EVERY == 0 and n:
            self.per_item = nbytes(out) / n
        self.calls += 1
        self.items += n
        self.bytes += n * self.per_item
        return out


class _TimedNext:
    """Wraps the source's ``__next__`` when a prefetcher sits between it and the consumer."""

    __slots__ = ("fn", "seconds")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.seconds = 0.0

    def __call__(self) -> Any:
        t0 = time.perf_counter()
        try:
            return self.fn()
        finally:
            self.seconds += time.perf_counter() - t0


BYTES_EVERY = 8  # batches between exact byte counts of collated batches
FLUSH_EVERY = 64  # batches between moves of the iterator's local sums into the collector


class _LoaderIter(Iterator[Any]):
    """The iterator ``iter(fastload.DataLoader)`` returns; counts batches and time."""

    __slots__ = (
        "_next", "_progress", "_collector", "_collate", "_fetch", "_length", "_keep",
        "_mark", "_last", "_wait", "_batches", "_report", "__weakref__",
    )  # fmt: skip

    def __init__(
        self,
        nxt: Callable[[], Any],
        progress: _Progress,
        collector: StatsCollector | None,
        collate: _TimedCollate | None,
        fetch: _TimedNext | None,
        length: Callable[[], int],
        keep: Any,
        report: Callable[[], None] | None = None,
    ) -> None:
        self._next = nxt
        self._progress = progress
        self._collector = collector
        self._collate = collate  # torch's collate_fn, timed (num_workers=0 torch path)
        self._fetch = fetch  # torch's __next__, timed (only when a prefetcher wraps it)
        self._length = length
        self._keep = keep  # the source iterator: keeps workers / pools alive
        self._mark = self._last = time.perf_counter()
        self._wait = 0.0
        self._batches = 0
        self._report = report  # live stats (log_every / summary_writer), called per batch

    def __iter__(self) -> _LoaderIter:
        return self

    def __len__(self) -> int:
        return self._length()

    def __next__(self) -> Any:
        col = self._collector
        if col is None:
            try:
                batch = self._next()
            except StopIteration:
                self._progress.active = False
                raise
            self._progress.yielded += 1
            return batch
        t0 = perf_counter()
        token = _ACTIVE.set(col)  # the dataset and cache record into this loader
        try:
            batch = self._next()
        except StopIteration:
            self._progress.active = False
            self.flush()
            raise
        finally:
            _ACTIVE.reset(token)
        t1 = self._last = perf_counter()
        self._wait += t1 - t0
        self._progress.yielded += 1
        n = self._batches = self._batches + 1
        if n >= FLUSH_EVERY:
            self.flush()
        if self._report is not None:
            self._report()
        return batch

    def flush(self) -> None:
        """Move the locally summed counters into the collector."""
        col = self._collector
        if col is None:
            return
        if self._batches:
            col.record_batches(self._batches, self._wait, self._last - self._mark)
        collate, fetch = self._collate, self._fetch
        if collate is not None and collate.items:
            inside = fetch.seconds if fetch is not None else self._wait
            size = round(collate.bytes)
            col.add("collate", items=collate.items, bytes=size, seconds=collate.seconds)
            col.add("read", items=collate.items, bytes=size, seconds=inside - collate.seconds)
            collate.seconds, collate.items, collate.bytes = 0.0, 0, 0.0
            if fetch is not None:
                fetch.seconds = 0.0
        self._mark, self._wait, self._batches = self._last, 0.0, 0

    def __del__(self) -> None:
        self.flush()
