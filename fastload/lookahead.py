"""Index batches announced to the dataset before they are read.

The read-batch path reads ``read_ahead`` batches ahead on ``read_threads``
threads. Over a link with 20 ms to first byte that bounds the requests in
flight by threads x chunk size, not by what the link could carry: 2 threads kept
64 GETs in flight on the 1gbit+20ms link of benchmarks/peers. :class:`Lookahead`
draws index batches further ahead of the readers and hands each to the dataset's
``fetch_ahead(indices)`` (see :meth:`fastload.fetch.Fetcher.ahead`), whose
requests run on fsspec's event loop without a thread each.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterator
from typing import Any

_log = logging.getLogger("fastload")

#: Samples announced ahead of the batches being read (about 4 batches of 64).
LOOKAHEAD_ITEMS = 256


class Lookahead:
    """Yields ``batches`` unchanged, calling ``hint(batch)`` once per batch, ``depth`` batches early.

    A hint is advice: its errors are logged and never end the epoch (the read of
    that batch reports them). Drawing early changes no order and no RNG draw: a
    sampler draws its permutation when iteration starts.
    """

    def __init__(self, batches: Iterator[Any], hint: Callable[[list[int]], Any], depth: int) -> None:
        self._batches = batches
        self._hint = hint
        self._depth = max(0, depth)
        self._drawn: collections.deque[Any] = collections.deque()
        self._done = False

    def __iter__(self) -> Lookahead:
        return self

    def __next__(self) -> Any:
        while not self._done and len(self._drawn) <= self._depth:
            try:
                batch = next(self._batches)
            except StopIteration:
                self._done = True
                break
            self._drawn.append(batch)
            try:
                self._hint(list(batch))
            except Exception as err:  # advice only; the read of this batch reports real errors
                _log.debug("fastload: prefetch hint failed: %s", err)
        if not self._drawn:
            raise StopIteration
        return self._drawn.popleft()


def depth_for(batch_size: int | None) -> int:
    """Batches to announce ahead for ``batch_size`` samples per batch."""
    return max(1, LOOKAHEAD_ITEMS // max(1, batch_size or 1))
