"""The iterator that ``iter(fastload.DataLoader)`` returns, and its cheap instrumentation.

It counts the batches handed to the consumer (for ``state_dict``), times the
consumer's waits and the loop's wall time, splits torch's single-process __next__
into assembling samples and collating them, and makes the loader's collector the active one
from the first ``next()`` until the pass ends, so datasets and the cache record
into it. Sums are kept in plain attributes and moved into
the collector every TICK_S seconds.
"""

from __future__ import annotations

import collections
import itertools
import random
import sys
from collections.abc import Callable, Iterator
from time import perf_counter
from typing import Any

import torch

from fastload.device.batch_tree import nbytes
from fastload.loader.readahead import ReadAhead, finalizing_close
from fastload.loader.torch_surface import surfaced
from fastload.loader.worker_stats import fetches_of
from fastload.stats import LoaderStats, StatsCollector
from fastload.stats.active import _ACTIVE, _enter_loop, _leave_loop, _LoopScope, _watch

__all__ = ["TICK_S"]


class _Calls(Iterator[Any]):
    """An iterator over the results of calling ``fn`` (until it raises StopIteration)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn

    def __next__(self) -> Any:
        return self.fn()


class _Progress:
    """Where the most recent epoch stands, for state_dict()."""

    __slots__ = ("yielded", "active", "gen_start", "sampler_start", "fetcher")

    def __init__(
        self, start: int = 0, gen_start: list[torch.Tensor] | None = None, sampler_start: list[Any] | None = None
    ) -> None:
        self.yielded = start  # batches of the epoch behind the consumer, resumed ones included
        self.active = True
        self.gen_start = gen_start  # the tracked generators' states when the epoch began
        self.sampler_start = sampler_start  # stateful samplers' state_dict() then
        # torch's fetcher of an IterableDataset (num_workers=0): its iterator's state and
        # whether it ended are part of the position, also once the user dropped the pass.
        self.fetcher: Any = None


class _TimedCollate:
    """Splits torch's single-process __next__ into assembling samples and collating them, at almost no cost.

    Item counts are exact. With torch's own BatchSampler every index batch holds
    ``batch_size`` items except the epoch's last, so items are batches times
    ``batch_size``, corrected when the most recent index batch (kept by a C-level tap
    on torch's sampler iterator: ``filterfalse`` with a 1-slot deque's ``append``) is
    short. Other batch samplers, and an IterableDataset (whose last batch can fall
    short of its index batch), get a small wrapper that counts what each collate_fn
    call receives. No Python code runs per batch otherwise, and no per-batch object
    outlives its batch (a list of every index batch made the GC run: ~3%).

    Seconds and bytes are sampled: collate_fn is timed, and its output measured, on
    the first two batches and then on one timed batch in COLLATE_EVERY (:meth:`arm`,
    called by :class:`_LoaderIter`); the items in between are priced at those batches'
    seconds and bytes per item. Timing every batch cost ~3% of throughput at batch
    size 1 (benchmarks/loader/bench.py, stats case). The first call's time is left
    out: torch's first collate is several times slower than the rest.

    Args:
        source: torch's single-process iterator (its dataset fetcher and sampler iterator are
            instrumented in place).
        per_batch: Items per index batch: ``batch_size`` for torch's BatchSampler, 1
            without auto-collation, None to count every collate_fn call.
    """

    __slots__ = (
        "torch_fetcher", "fn", "per_batch", "base", "recent", "short", "counted", "warm",
        "s_items", "s_bytes", "s_timed", "s_seconds", "rate_s", "rate_b",
    )  # fmt: skip

    def __init__(self, source: Any, per_batch: int | None) -> None:
        self.torch_fetcher = source._dataset_fetcher
        self.fn: Callable[[Any], Any] = self.torch_fetcher.collate_fn
        self.per_batch = per_batch
        self.counted = 0  # items, when per_batch is None
        self.warm = False  # whether collate_fn was sampled once already
        self.s_items = 0  # sampled since the last take(): items, bytes, and seconds of
        self.s_bytes = 0  # the s_timed items whose time counts (not the first call's)
        self.s_timed = 0
        self.s_seconds = 0.0
        self.rate_s = 0.0  # collate seconds per item, at the latest samples
        self.rate_b = 0.0  # bytes per item, at the latest samples
        self.recent: collections.deque[Any] = collections.deque(maxlen=1)  # last index batch
        self.short: Any = None  # the short index batch already subtracted
        self.base: Callable[[Any], Any] = self.fn if per_batch is not None else self._counting
        if per_batch is not None and per_batch > 1:
            source._sampler_iter = itertools.filterfalse(self.recent.append, source._sampler_iter)
        self.torch_fetcher.collate_fn = self.base

    def arm(self) -> None:
        """Time the next collate_fn call (then torch's dataset fetcher gets its own function back)."""
        self.torch_fetcher.collate_fn = self._sampled

    def _counting(self, data: Any) -> Any:
        self.counted += len(data)
        return self.fn(data)

    def _sampled(self, data: Any) -> Any:
        self.torch_fetcher.collate_fn = self.base
        n = 1 if self.per_batch == 1 else len(data)
        if self.per_batch is None:
            self.counted += n
        t0 = perf_counter()
        out = self.fn(data)
        if self.warm:  # torch's first collate is several times slower than the rest
            self.s_seconds += perf_counter() - t0
            self.s_timed += n
        self.warm = True
        self.s_items += n
        self.s_bytes += nbytes(out)
        return out

    def take(self, batches: int) -> tuple[int, float, float]:
        """Items of the ``batches`` batches since the previous call, their seconds and bytes."""
        per = self.per_batch
        if per is None:
            items, self.counted = self.counted, 0
        else:
            items = batches * per
            idx = self.recent[0] if self.recent else None
            if idx is not None and len(idx) < per and idx is not self.short and batches:
                self.short = idx
                items -= per - len(idx)
        if self.s_timed:
            self.rate_s = self.s_seconds / self.s_timed
        if self.s_items:
            self.rate_b = self.s_bytes / self.s_items
        self.s_items, self.s_timed, self.s_seconds, self.s_bytes = 0, 0, 0.0, 0
        return items, items * self.rate_s, items * self.rate_b


class _TimedNext:
    """Wraps the source's ``__next__`` when a prefetcher sits between it and the consumer."""

    __slots__ = ("fn", "seconds")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.seconds = 0.0

    def __call__(self) -> Any:
        t0 = perf_counter()
        try:
            return self.fn()
        finally:
            self.seconds += perf_counter() - t0


# Seconds between moves of the iterator's sums into the collector.
TICK_S = 0.05
# Timed batches between timed, measured collate_fn calls (see _TimedCollate).
COLLATE_EVERY = 16
# Batches closer together than this are timed one in SAMPLE_EVERY, at random: two
# clock reads per batch cost ~1.5% of a 20 us batch (benchmarks/loader/bench.py).
FAST_BATCH_S = 100e-6
SAMPLE_EVERY = 16
# Untimed batches after each timed one: a fixed random draw with mean SAMPLE_EVERY - 1,
# of prime length, so the timed batches don't follow a periodic loop (workers taking
# turns) in step.
_GAPS = tuple(random.Random(0).choices(range(2 * SAMPLE_EVERY - 1), k=61))
_EVERY = itertools.repeat(0)  # the gaps when every batch is timed
# Never active: a pass enters its own scope before its first batch.
_NOT_ENTERED = _LoopScope(StatsCollector(enabled=False), None)


class _LoaderIter(Iterator[Any]):
    """The iterator ``iter(fastload.DataLoader)`` returns; counts batches and time.

    Per batch it reads the clock twice (the consumer's wait) and adds to plain
    attributes; the rest happens before a batch once per TICK_S (:meth:`_tick`). When
    batches come faster than FAST_BATCH_S apart, only about one in SAMPLE_EVERY is
    timed, picked at random, and the others are counted and charged the sampled mean
    wait (tests/unit/test_stats.py::test_fast_loop_waits_are_sampled_and_scaled).

    ``iter(loader)`` returns it as a subclass of the torch iterator it wraps, which
    forwards torch's attributes and methods (:func:`new_iter`, :mod:`fastload.loader.torch_surface`).

    The loader's collector becomes the active one at the first ``next()`` and stays so
    until the pass ends or the iterator is closed. It is checked again before the next
    batch when any other scope starts or ends (:meth:`recheck`,
    tests/unit/test_stats.py::test_loader_scope_lasts_the_pass).
    """

    __slots__ = (
        "_next", "_progress", "_collector", "_collate", "_timed_next", "_length", "_keep",
        "_mark", "_last", "_due", "_wait", "_flushed", "_report", "_scope", "_untimed",
        "_gaps", "_timed", "_mean_wait", "_tick_at", "_tick_n", "_arm_in", "_torch", "__weakref__",
    )  # fmt: skip

    def __init__(
        self,
        nxt: Callable[[], Any],
        progress: _Progress,
        collector: StatsCollector | None,
        collate: _TimedCollate | None,
        timed_next: _TimedNext | None,
        length: Callable[[], int],
        keep: Any,
        report: Callable[[], None] | None = None,
        torch_iter: Any = None,
    ) -> None:
        self._torch = torch_iter  # torch's iterator whose surface is forwarded (fastload.loader.torch_surface)
        self._next = nxt
        self._progress = progress
        self._collector = collector
        self._collate = collate  # torch's collate_fn, sampled (num_workers=0 torch path)
        self._timed_next = timed_next  # torch's __next__, timed (only when a prefetcher wraps it)
        self._length = length
        self._keep = keep  # the source iterator: keeps workers / pools alive
        self._mark = self._last = perf_counter()
        self._due = 0.0  # when _tick() runs next: before the first batch
        self._wait = 0.0
        self._flushed = progress.yielded  # batches already recorded in the collector
        self._report = report  # live stats (log_every / summary_writer), called per batch
        self._scope = _NOT_ENTERED  # this pass's collector scope, once entered
        self._untimed = 0  # batches to hand out before the next timed one
        self._arm_in = 1  # timed batches until collate_fn is timed and measured
        self._gaps: Iterator[int] = _EVERY  # values for _untimed
        self._timed = 0  # timed batches since the last flush
        self._mean_wait = 0.0  # per timed batch, at the latest flush with any
        self._tick_at = self._mark  # the previous tick: time and batches then
        self._tick_n = progress.yielded
        if collector is not None:
            _watch(self)  # told by recheck() when some other scope starts or ends

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
        if self._untimed:
            self._untimed -= 1
            try:
                batch = self._next()
            except StopIteration:
                self._progress.active = False
                self.close()
                raise
            self._progress.yielded += 1
            return batch
        t0 = perf_counter()
        if t0 >= self._due:
            t0 = self._tick(col, t0)
        self._arm_in -= 1
        if not self._arm_in:
            self._arm()
        try:
            batch = self._next()
        except StopIteration:
            self._progress.active = False
            self.close()
            raise
        t1 = self._last = perf_counter()
        self._wait += t1 - t0
        self._timed += 1
        self._untimed = next(self._gaps)
        self._progress.yielded += 1
        return batch

    def _tick(self, col: StatsCollector, now: float) -> float:
        # Before a batch: make sure the dataset and cache record into this loader, move
        # the sums so far into the collector, and choose how to time the next TICK_S.
        # Returns the time after all that, so it is not counted as the consumer's wait.
        if _ACTIVE.get() is not self._scope:
            self._scope = _enter_loop(col)
        self._due = now + TICK_S  # after _enter_loop, whose notice resets it
        self.flush()
        n = self._progress.yielded
        if n > self._tick_n:
            fast = (now - self._tick_at) / (n - self._tick_n) < FAST_BATCH_S
            self._gaps = itertools.cycle(_GAPS) if fast else _EVERY
        self._tick_at, self._tick_n = now, n
        return perf_counter()

    def _arm(self) -> None:
        collate = self._collate
        if collate is None:
            self._arm_in = COLLATE_EVERY
            return
        self._arm_in = COLLATE_EVERY if collate.warm else 1
        collate.arm()

    def recheck(self) -> None:
        """Check the active collector before the next batch (a scope was entered or left)."""
        self._untimed = 0
        self._due = 0.0

    def flush(self) -> None:
        """Move the locally summed counters into the collector."""
        col = self._collector
        if col is None:
            return
        yielded = self._progress.yielded
        batches = yielded - self._flushed
        wait = self._wait
        if self._timed:
            self._mean_wait = wait / self._timed
        if self._timed != batches:  # some batches were not timed: charge them the mean
            wait = self._mean_wait * batches
        if batches:
            col.record_batches(batches, wait, self._last - self._mark)
        collate, timed_next = self._collate, self._timed_next
        if collate is not None:
            items, seconds, size = collate.take(batches)
            if items:
                inside = timed_next.seconds if timed_next is not None else wait
                col.add("collate", items=items, bytes=round(size), seconds=seconds)
                col.add("assemble", items=items, bytes=round(size), seconds=max(0.0, inside - seconds))
            if timed_next is not None:
                timed_next.seconds = 0.0
        self._mark, self._wait, self._timed, self._flushed = self._last, 0.0, 0, yielded

    def close(self, timeout: float | None = None) -> None:
        """End this pass early: stop reading ahead and record what was read.

        Reads already running on the read_batch path are waited for (up to ``timeout``
        seconds, default ReadAhead.CLOSE_WAIT_S), so their records do not land in the
        next epoch's stats. Workers are left to torch (persistent ones are reused).
        """
        self._end(ReadAhead.close if timeout is None else lambda reads: reads.close(timeout))

    def _end(self, close_reads: Callable[[ReadAhead], None]) -> None:
        if isinstance(self._keep, ReadAhead):
            close_reads(self._keep)
        _leave_loop(self._scope)
        self._scope = _NOT_ENTERED
        self.flush()

    def __del__(self, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        # At interpreter exit module globals (ReadAhead...) are already None and there
        # is nothing left to record: say nothing. (A default keeps is_finalizing bound.)
        if _finalizing():
            return
        self._end(finalizing_close)  # a finalizer joins no thread (readahead.finalizing_close)


class _LiveLoaderIter(_LoaderIter):
    """A :class:`_LoaderIter` that also calls the live-stats reporter after each batch.

    A subclass, so loops without ``log_every``/``summary_writer`` don't test for it.
    """

    __slots__ = ()

    def __next__(self) -> Any:
        batch = _LoaderIter.__next__(self)
        self._report()  # type: ignore[misc]
        return batch


def loader_stats(collector: StatsCollector, dataset: Any, live: _LoaderIter | None, read_threads: int) -> LoaderStats:
    """A loader's stats now: its records (``live``'s flushed first) and what is in flight.

    Batches in flight are measured, not configured: the read_batch pool's pending
    batches, or the index batches torch sent its workers and has not yet handed out
    (``_send_idx - _rcvd_idx``: those still in a worker and those waiting their turn).
    """
    batches = 0
    if live is not None:
        live.flush()
        keep = live._keep
        if isinstance(keep, ReadAhead):
            batches = keep.in_flight
        elif hasattr(keep, "_send_idx"):  # torch's multi-process iterator
            batches = int(keep._send_idx) - int(keep._rcvd_idx)
    return collector.snapshot(read_threads, batches, fetches_of(dataset))


def new_iter(kind: type[_LoaderIter], torch_iter: object, *args: Any) -> _LoaderIter:
    """A ``kind`` (built with ``args``) that is also an instance of ``type(torch_iter)``, forwarding to it."""
    cls = surfaced(kind, type(torch_iter), frozenset(vars(torch_iter)))  # type: ignore[arg-type]
    it: _LoaderIter = cls(*args, torch_iter=torch_iter)
    return it
