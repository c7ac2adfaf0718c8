"""Parallel, bounded read-ahead of index batches in the loader's own process.

This is the ``num_workers=0`` fast path of :class:`fastload.DataLoader` for
datasets that expose ``read_batch(indices) -> list`` (fastload's datasets do), or
for any map-style dataset when the user opts in with ``read_ahead=N``.

The consumer thread pulls index batches from the sampler (so sampler RNG draws
stay in the consumer thread), splits each into up to ``threads`` chunks, and
submits ``read_fn(chunk)`` to a thread pool, keeping ``ahead`` batches beyond
the one being returned in flight. Batches smaller than :data:`GROUP_SAMPLES`
(``batch_size=1``, torch's default) are read together, one ``read_fn`` call for
the samples of consecutive batches, at least GROUP_SAMPLES of them in flight: a
read per sample cost a cache transaction per sample, 2.6-3.7 ms of CPU per cold
object where batches of 64 cost 0.5.
``next()`` waits for the oldest batch's chunks (in bounded slices), joins them
in index order and collates them in the consumer thread.

Errors: a chunk's exception is re-raised by ``next()`` for that batch, in its
original form and traceback (``Future.result`` re-raises the same object); later
batches are unaffected, as with torch's single-process iterator. A group whose read
failed is read again batch by batch as its batches are reached, so each raises its own.
"""

from __future__ import annotations

import collections
import itertools
import math
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from fastload.device.batch_tree import nbytes
from fastload.errors import LoaderError
from fastload.stats import StatsCollector
from fastload.stats.active import _ACTIVE

__all__ = ["ReadAhead"]

#: Seconds between liveness reports while a read is outstanding and no timeout is set.
STALL_WARN_S = 60.0
#: Seconds close() waits for reads already running before it lets them finish unwatched.
CLOSE_WAIT_S = 10.0
#: Batches smaller than this are read together, as one read of this many samples at least.
GROUP_SAMPLES = 32

_POOL_IDS = itertools.count()


class ReadAhead(Iterator[Any]):
    """Iterate collated batches, reading ``ahead`` batches ahead on ``threads`` threads.

    Args:
        indices: Iterator of index lists (``auto_collation``) or single indices.
        read_fn: ``read_fn(list_of_indices) -> list_of_samples`` (same length, same order);
            called concurrently from pool threads.
        collate_fn: Applied in the consumer thread to the list of samples (auto-collation)
            or to the single sample.
        auto_collation: Whether ``indices`` yields lists (batch mode).
        threads: Pool size (>= 1); also the most chunks a batch is split into.
        ahead: Batches read beyond the one ``next()`` returns (>= 0; 0 reads each
            batch, in parallel chunks, inside its own ``next()``).
        timeout: Seconds a batch may take before LoaderError; 0 waits indefinitely but
            warns every STALL_WARN_S seconds.
        collector: Records ``read`` (in pool threads, which are made to see it as the
            active collector) and ``collate``.
        post: Applied to each collated batch (pin memory), or None.
        name: Used in error messages (the dataset's type name).
        group_samples: Batches smaller than this are read together, this many samples at least
            (:data:`GROUP_SAMPLES`); 1 reads each batch on its own.
    """

    def __init__(
        self,
        indices: Iterator[Any],
        read_fn: Callable[[list[Any]], Sequence[Any]],
        collate_fn: Callable[[Any], Any],
        *,
        auto_collation: bool,
        threads: int,
        ahead: int,
        timeout: float = 0.0,
        collector: StatsCollector | None = None,
        post: Callable[[Any], Any] | None = None,
        name: str = "dataset",
        group_samples: int = GROUP_SAMPLES,
    ) -> None:
        self._indices = indices
        self._read_fn = read_fn
        self._collate = collate_fn
        self._auto = auto_collation
        self._threads = max(1, threads)
        self._ahead = max(0, ahead)
        self._timeout = timeout
        self._collector = collector
        self._post = post
        self._name = name
        self._group = max(1, group_samples) if self._ahead > 0 else 1  # ahead=0: each batch inside its next()
        # A prefix of its own, so close() can tell its own threads (and other code can
        # tell this loader's threads from another's).
        self._thread_prefix = f"fastload-read-{next(_POOL_IDS)}"
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            max_workers=self._threads, thread_name_prefix=self._thread_prefix
        )
        self._pending: collections.deque[_Batch] = collections.deque()
        self._exhausted = False

    def __iter__(self) -> ReadAhead:
        return self

    @property
    def threads(self) -> int:
        """The pool's size: the most chunks read at once."""
        return self._threads

    @property
    def in_flight(self) -> int:
        """Index batches submitted to the pool and not yet returned by ``next()`` (loader.stats())."""
        return len(self._pending)

    def _task(self, chunk: list[Any]) -> Sequence[Any]:
        col = self._collector
        if col is None:
            out = self._read_fn(chunk)
        else:
            # Datasets record into the loader's collector. A plain set and reset: a
            # pool thread's scope is no loader pass's concern (no use_collector notice).
            token = _ACTIVE.set(col)
            t0 = time.perf_counter()
            try:
                out = self._read_fn(chunk)
            finally:
                _ACTIVE.reset(token)
            dt = time.perf_counter() - t0
            col.add("assemble", items=len(chunk), bytes=nbytes(out), seconds=dt)
        if len(out) != len(chunk):
            raise LoaderError(
                f"{self._name}.read_batch returned {len(out)} samples for {len(chunk)} indices; "
                "it must return exactly one sample per index, in order"
            )
        return out

    def _fill(self) -> None:
        pool = self._pool
        while pool is not None and not self._exhausted and (
                len(self._pending) <= self._ahead or (self._group > 1 and self._queued() <= self._group)):
            batches = self._draw()
            if not batches:
                return
            if len(batches) == 1:
                batch = batches[0]
                step = max(1, math.ceil(len(batch) / self._threads))
                chunks = [batch[i : i + step] for i in range(0, len(batch), step)] or [[]]
                self._pending.append(_Batch([pool.submit(self._task, c) for c in chunks], batch))
                continue
            group = pool.submit(self._task, [i for batch in batches for i in batch])
            lo = 0
            for batch in batches:
                self._pending.append(_Batch([group], batch, (lo, lo + len(batch))))
                lo += len(batch)

    def _draw(self) -> list[list[Any]]:
        """The next index batch, or the next small ones up to ``group_samples`` samples together."""
        batches: list[list[Any]] = []
        n = 0
        while n < self._group:
            try:
                idx = next(self._indices)
            except StopIteration:
                self._exhausted = True
                break
            batches.append(list(idx) if self._auto else [idx])  # a large one after small ones joins them
            n += len(batches[-1])
        return batches

    def _queued(self) -> int:
        """Samples of the batches pending."""
        return sum(len(entry.indices) for entry in self._pending)

    def _wait(self, fut: Future[Sequence[Any]], started: float) -> Sequence[Any]:
        warned_at = started
        while True:
            now = time.monotonic()
            if self._timeout > 0:
                left = started + self._timeout - now
                if left <= 0:
                    self.close(timeout=0)  # the storage is stalled: don't wait for it again
                    raise LoaderError(
                        f"{self._name}.read_batch did not return within timeout="
                        f"{self._timeout} s; the storage may be stalled. Raise timeout= "
                        "or check the source's connectivity"
                    )
                slice_s = min(left, 1.0)
            else:
                slice_s = 1.0
                if now - warned_at >= STALL_WARN_S:
                    warned_at = now
                    warnings.warn(
                        f"{self._name}.read_batch has not returned for {now - started:.0f} s "
                        "(still waiting; set timeout= on the DataLoader to fail instead)",
                        RuntimeWarning,
                        stacklevel=4,
                    )
            try:
                return fut.result(timeout=slice_s)
            except FutureTimeout:
                continue

    def __next__(self) -> Any:
        self._fill()
        if not self._pending:
            self.close()
            raise StopIteration
        # `ahead` batches stay in flight while this one is finished and consumed.
        entry = self._pending.popleft()
        started = time.monotonic()
        samples: list[Any] = []
        if entry.span is None:
            for fut in entry.futures:
                samples.extend(self._wait(fut, started))
        else:
            fut = entry.futures[0]
            try:
                got = self._wait(fut, started)
            except BaseException:
                if not fut.done() or fut.cancelled() or fut.exception() is None:
                    raise  # a timeout or a close, not the read's own error
                got = None
            # A group's read failed: each of its batches is read on its own, and raises its own error.
            samples = list(self._task(entry.indices) if got is None else got[entry.span[0] : entry.span[1]])
        col = self._collector
        t0 = time.perf_counter()
        batch = self._collate(samples if self._auto else samples[0])
        if col is not None:
            col.add(
                "collate",
                items=len(samples),
                bytes=nbytes(batch),
                seconds=time.perf_counter() - t0,
            )
        if self._post is not None:
            batch = self._post(batch)
        return batch

    def close(self, timeout: float = CLOSE_WAIT_S, *, join: bool = True) -> None:
        """Cancel queued reads and wait up to ``timeout`` s for the running ones.

        Waiting keeps an epoch stopped early from leaking its last reads' records into
        the next epoch's stats (tests/unit/test_readahead.py). When they all finish in
        time the pool's threads are joined too (unless ``join`` is false); otherwise
        they end on their own.
        """
        pool, self._pool = self._pool, None
        running = list({id(fut): fut for entry in self._pending for fut in entry.futures if not fut.cancel()}.values())
        self._pending.clear()
        self._exhausted = True
        if pool is None:
            return
        pool.shutdown(wait=False, cancel_futures=True)
        if timeout <= 0 or threading.current_thread().name.startswith(self._thread_prefix + "_"):
            return  # told not to wait, or dropped by one of the pool's own threads
        if not wait(running, timeout=timeout).not_done:
            if join:
                pool.shutdown(wait=True)  # the reads are done: this only joins idle threads
        else:
            warnings.warn(
                f"{self._name}: reads still running {timeout} s after the loader stopped; "
                "their stats may be counted in the next epoch",
                RuntimeWarning,
                stacklevel=2,
            )

    def __del__(self, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        # At interpreter exit module globals are None already; the threads die with it.
        if not _finalizing() and getattr(self, "_pool", None) is not None:
            finalizing_close(self)


class _Batch:
    """One index batch in flight: the futures of its chunks, or of the group it is read with (``span``:
    its samples' slice of the group's)."""

    __slots__ = ("futures", "indices", "span")

    def __init__(self, futures: list[Future[Sequence[Any]]], indices: list[Any],
                 span: tuple[int, int] | None = None) -> None:
        self.futures, self.indices, self.span = futures, indices, span


def finalizing_close(reads: ReadAhead) -> None:
    """``reads.close()`` from a finalizer: wait for running reads, join no thread.

    A finalizer runs wherever a collection happens to start, for instance inside
    threading's own bookkeeping while a new thread starts, which holds a lock that
    ending a thread takes again: joining the pool's threads there hung the test
    suite for good (tests/unit/test_readahead.py). The threads, told to stop, end
    on their own.
    """
    reads.close(join=False)
