"""Fetch ahead: index batches announced to the dataset before they are read.

The read-batch path reads ``read_ahead`` batches ahead on ``read_threads``
threads. Over a link with 20 ms to first byte that bounds the requests in
flight by threads x chunk size, not by what the link could carry: 2 threads kept
64 GETs in flight on the 1gbit+20ms link of benchmarks/peers. :class:`Announcer`
draws index batches further ahead of the readers and *announces* each one, once,
to the dataset's ``fetch_ahead(indices)`` (see :meth:`fastload.fetch.Fetcher.ahead`),
whose requests run on fsspec's event loop without a thread each.

With DataLoader worker processes the reader of a batch is a worker, and only that
worker's Fetcher (its in-flight table, its event loop) can fetch for it. torch
hands map-style index batches to the workers in turn (batch ``j`` to worker
``j % num_workers``, with ``in_order=True``), so a batch drawn early rides to its
worker on the earliest batch that worker has not yet been handed, as an
:class:`Announced` index batch; the dataset's ``__getitems__`` passes the batches
it carries to ``fetch_ahead`` (:func:`announce`) before it reads its own. A wrong
guess of the worker costs a duplicate fetch, never a wrong sample: announcements
are advice, and every read goes through the read path.

How far ahead has one home: :data:`AHEAD_ITEMS` (and :func:`depth_for`, which turns
it into batches); the Fetcher's bound on fetches ahead in flight is derived from it.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from fastload.errors import ConfigError

_log = logging.getLogger("fastload")

#: Samples announced ahead of the batches being read, per reading process (about 4
#: batches of 64): the loader's process with num_workers=0, else each worker.
AHEAD_ITEMS = 256

Hint = Callable[[list[int]], Any]


class Announced(list):  # type: ignore[type-arg]
    """An index batch (a plain list, as torch's BatchSampler yields) carrying batches its reader reads later.

    It is what the dataset receives (``__getitems__``) and compares equal to the
    list it wraps; it crosses into a worker pickled with what it carries.
    """

    __slots__ = ("ahead",)

    def __init__(self, batch: Iterable[Any], ahead: list[list[int]]) -> None:
        super().__init__(batch)
        self.ahead = ahead

    def __reduce__(self) -> tuple[Any, ...]:
        return (Announced, (list(self), self.ahead))


def _hint(hint: Hint, batch: Any) -> None:
    try:
        hint(list(batch))
    except Exception as err:  # advice only; the read of this batch reports real errors
        _log.debug("fastload: fetch-ahead hint failed: %s", err)


def announce(indices: Any, hint: Hint) -> None:
    """Hand the batches an :class:`Announced` index batch carries to ``hint`` (nothing for a plain one)."""
    for batch in getattr(indices, "ahead", ()):
        _hint(hint, batch)


class Announcer:
    """Yields ``batches`` in order, drawing ``depth`` batches ahead; announces each batch once, when drawn.

    Args:
        batches: The index batches (a batch sampler's iterator).
        depth: Batches drawn beyond the one yielded (:func:`depth_for`).
        hint: Announce here, in this process: ``hint(batch)`` when it is drawn
            (num_workers=0). Its errors are logged and never end the epoch (the read
            of that batch reports them).
        workers: Announce to ``workers`` worker processes instead: a drawn batch
            travels with the earliest batch still to be yielded to the same worker
            (itself when there is none), yielded as an :class:`Announced` batch.
            Only plain lists carry announcements; other batch types are yielded
            unchanged and what they would carry is dropped.

    Drawing early changes no order and no RNG draw of torch's samplers: they draw
    their permutation when iteration starts.
    """

    def __init__(self, batches: Iterator[Any], depth: int, *, hint: Hint | None = None, workers: int = 0) -> None:
        if (hint is None) == (workers < 1):
            raise ConfigError(
                f"Announcer(hint={hint!r}, workers={workers}): announce through hint= (this process) "
                "or to workers= (>= 1 worker processes); pass exactly one"
            )
        self._batches = batches
        self._hint = hint
        self._workers = workers
        self._depth = max(0, depth)
        # Drawn, not yet yielded: (batch, the batches it carries (workers), its worker).
        self._drawn: collections.deque[tuple[Any, list[list[int]], int]] = collections.deque()
        # Per worker, what its drawn batches carry, earliest first (the first one carries the new ones).
        self._pending: list[collections.deque[list[list[int]]]] = [collections.deque() for _ in range(workers)]
        self._position = 0  # batches drawn so far this epoch
        self._done = False

    def __iter__(self) -> Announcer:
        return self

    def __next__(self) -> Any:
        while not self._done and len(self._drawn) <= self._depth:
            try:
                batch = next(self._batches)
            except StopIteration:
                self._done = True
                break
            self._draw(batch)
        if not self._drawn:
            raise StopIteration
        batch, ahead, worker = self._drawn.popleft()
        if self._hint is None:
            self._pending[worker].popleft()
        if ahead and type(batch) is list:
            return Announced(batch, ahead)
        return batch

    def _draw(self, batch: Any) -> None:
        if self._hint is not None:
            self._drawn.append((batch, [], 0))
            _hint(self._hint, batch)
            return
        # torch's cycle over workers restarts at worker 0 each epoch, as does position.
        worker = self._position % self._workers
        self._position += 1
        pending = self._pending[worker]
        ahead: list[list[int]] = []
        (pending[0] if pending else ahead).append(list(batch))
        pending.append(ahead)
        self._drawn.append((batch, ahead, worker))


class AheadSampler:
    """A batch sampler whose iterators draw ahead and announce to workers (torch's multi-process path).

    torch's iterator reads the loader's ``_index_sampler`` once and calls ``iter()``
    on it each epoch; wrapping it here keeps the sampler's own draws (and a resumed
    epoch's skip, inside ``inner``) exactly as they were.
    """

    def __init__(self, inner: Iterable[Any], depth: int, workers: int) -> None:
        self.inner = inner
        self.depth = depth
        self.workers = workers

    def __iter__(self) -> Announcer:
        return Announcer(iter(self.inner), self.depth, workers=self.workers)

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]


def depth_for(batch_size: int | None, workers: int = 0) -> int:
    """Batches to draw ahead for ``batch_size`` samples per batch, read by ``workers`` processes (0: this one).

    Each reading process gets about AHEAD_ITEMS samples announced beyond the
    batch it reads: its own Fetcher and host limit bound what goes out at once.
    """
    return max(1, AHEAD_ITEMS // max(1, batch_size or 1)) * max(1, workers)
