"""Cache entries as rows of numbers, by the caller's own index (a dataset's sample index).

Why: a warm read of a small sample by its :class:`~fastload.cache.Entry` touched the entry, its
key, its checksums and its offset (Python objects each), and made a job tuple, a copy tuple and
a path string for :func:`~fastload.cache.gather.gather`. At a million samples read at random those
objects sit in DRAM, not in the CPU's caches, and the young GC visits what the new ones point at:
a warm epoch took 9.7 us per object at 1M against 6.9 at 10k (benchmarks/scale run 6, issue 31).
A row is eight numbers in one array (64 B, a cache line), read by C (:func:`gather.gather_rows`);
the Python objects left per sample are the ones a sample is made of.

A row holds what the index said when it was put; a payload evicted or rewritten since fails the
read's checks, and :meth:`Cache.read_rows` empties its row, so the caller reads it the usual way
(looked up, rechecked, dropped and counted if bad) and puts the entry it finds.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import numpy as np

from fastload.cache import gather
from fastload.cache.entry import Entry


class Rows:
    """One row per index: where its entry's payload lies and what it must decode to (all zeros: none)."""

    def __init__(self, n: int, data_prefix: str) -> None:
        self.table = np.zeros((n, gather.ROW_WIDTH), dtype=np.uint64)
        self.paths: list[bytes] = []  # by path id - 1: a payload file or pack, as the file system names it
        self.clocks: list[str] = []  # by path id - 1: its reads' last use is held under this (Entry.clock)
        self._ids: dict[str, int] = {}
        self._prefix = data_prefix
        self._lock = threading.Lock()  # read threads put rows at once; a path's id is made once

    def __len__(self) -> int:
        return len(self.table)

    def _path_id(self, entry: Entry) -> int:
        pid = self._ids.get(entry.path)
        if pid is None:
            with self._lock:
                pid = self._ids.get(entry.path)
                if pid is None:
                    self.paths.append(os.fsencode(self._prefix + entry.path))
                    self.clocks.append(entry.clock)  # a pack's path for a packed entry, else its key
                    pid = self._ids[entry.path] = len(self.paths)
        return pid

    def _row(self, entry: Entry) -> tuple[int, ...]:  # in gather.ROW_*'s order
        return (self._path_id(entry), gather.ROW_WHOLE_FILE if entry.offset is None else entry.offset, entry.stored,
                entry.raw, entry.codec, entry.checksum, entry.stored_checksum or 0, entry.stored_checksum is not None)

    def put(self, indices: Sequence[int], entries: Sequence[Entry | None]) -> None:
        """The rows of ``indices`` from ``entries`` (None empties a row)."""
        full = [(i, self._row(e)) for i, e in zip(indices, entries) if e is not None]
        empty = [i for i, e in zip(indices, entries) if e is None]
        if full:
            self.table[[i for i, _ in full]] = np.array([r for _, r in full], dtype=np.uint64)
        if empty:
            self.table[empty] = 0

    def has(self, indices: np.ndarray | slice) -> np.ndarray:
        """A bool per index of ``indices`` (a slice: of those rows): whether its row is filled."""
        return self.table[indices, gather.ROW_PATH] != 0

    def location(self, i: int) -> tuple[str, int | None] | None:
        """Row ``i``'s payload as (path under the cache's data folder, offset in its pack), or None."""
        row = self.table[i].tolist()
        if not row[gather.ROW_PATH]:
            return None
        path = os.fsdecode(self.paths[row[gather.ROW_PATH] - 1])[len(self._prefix):]
        return path, None if row[gather.ROW_OFFSET] == gather.ROW_WHOLE_FILE else row[gather.ROW_OFFSET]
