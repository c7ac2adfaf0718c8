"""Where a dataset's samples lie in the cache: one slot per sample, read by its index.

Why: a warm read found each sample's cache entry through two hashed look-ups (its cache key
by URL in :class:`~fastload.fetch.identity.Identity`, then the entry by key in the cache's
memo), and its fetch ahead did both again only to learn that nothing was needed. At a
million samples read at random, each look-up touches objects spread over a gigabyte of
heap: a warm epoch took 36 us per object against 25 at 10k (benchmarks/scale, issue 31). A
slot is a row of numbers (:class:`fastload.cache.rows.Rows`, 64 B: no Python object per
sample, read by C), and the fetch ahead skips the samples that have one. The memo forgets
what the slots hold (440 B an entry beside the slot's 64).

Only small samples have a slot (one cache block: the whole sample is its block 0), and
only where the dataset fits the cache: one that streams through a smaller cache would find
them gone each epoch. A slot gone stale (its entry evicted or rewritten since) fails the
read's checks like any entry; :meth:`fastload.cache.Cache.read_rows` empties it, the read
goes the usual way, and the slot is filled again.

Not pickled: a DataLoader worker fills its own. Workers forked anew each epoch (no
``persistent_workers``) start from their parent's slots, so the loader has the parent fill
them from the index before it forks (:func:`fill`): an epoch's workers then look up no
sample their parent found, where each new set of workers looked up every sample again
(17% of such a worker's warm epoch, issue 36). Reading rows writes nothing to their pages,
so the forks share them (a list of entries had each read bump reference counts there).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from fastload.cache.gather import ROW_RAW
from fastload.cache.rows import Rows

if TYPE_CHECKING:
    from fastload.cache import Cache
    from fastload.fetch.identity import Identity
    from fastload.source import RemoteItem

#: Slots asked first: where the index holds none of them, the cache is cold for this
#: dataset and the rest are not asked (a cold first epoch would look up every sample for nothing).
PROBE = 256


class Located(Rows):
    """The cache entry of each sample's only block, as a row by sample index (empty: not known here)."""

    def __getstate__(self) -> dict[str, Any]:
        return {"n": len(self), "prefix": self._prefix}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["n"], state["prefix"])  # type: ignore[misc]

    def complete(self) -> bool:
        """Whether every sample's slot is filled (nothing of the dataset is left to fetch)."""
        return bool(self.has(slice(None)).all())

    def unknown(self, indices: Sequence[int]) -> list[int]:
        """Those of ``indices`` without a slot filled."""
        picks = np.asarray(indices, dtype=np.int64)
        return picks[~self.has(picks)].tolist()  # type: ignore[no-any-return]


    def sizes(self, indices: Sequence[int]) -> list[int]:
        """The size of each of ``indices`` from its slot (its one block is all of it); -1 where it has none."""
        picks = np.asarray(indices, dtype=np.int64)
        raw = self.table[picks, ROW_RAW].astype(np.int64)
        return np.where(self.has(picks), raw, -1).tolist()  # type: ignore[no-any-return]


def fill(located: Located, items: Sequence[RemoteItem], identity: Identity, cache: Cache) -> int:
    """Fill the slots of ``items`` (the dataset's, by index) whose one block the cache's index
    holds: one query per 500 keys not known here, no payload read. Returns the slots filled."""
    todo = [i for i in located.unknown(range(len(items))) if 0 <= items[i].size <= identity.block_bytes]
    filled = 0
    for lo, hi in ((0, PROBE), (PROBE, len(todo))):
        part = todo[lo:hi]
        keys = [identity.key(items[i], 0) for i in part]
        found = cache.entries_for(keys)
        located.put(part, found)
        cache.forget(keys)  # the rows hold them now
        filled += sum(e is not None for e in found)
        if not filled:
            break
    return filled
