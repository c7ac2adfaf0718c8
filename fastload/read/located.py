"""Where a dataset's samples lie in the cache: one slot per sample, read by its index.

Why: a warm read found each sample's cache entry through two hashed look-ups (its cache key
by URL in :class:`~fastload.fetch.identity.Identity`, then the entry by key in the cache's
memo), and its fetch ahead did both again only to learn that nothing was needed. At a
million samples read at random, each look-up touches objects spread over a gigabyte of
heap: a warm epoch took 36 us per object against 25 at 10k (benchmarks/scale, issue 31). A
slot per index is one read of a list, and the fetch ahead skips the samples it has.

Only small samples have a slot (one cache block: the whole sample is its block 0), and
only where the dataset fits the cache and the cache's memo (:data:`fastload.cache.base.MEMO_MAX`):
the slots hold the entries the memo holds already (no memory but a pointer per sample),
and a dataset that streams through a smaller cache would find them gone each epoch. A slot
gone stale (its entry evicted or rewritten since) fails the read's checks like any memo's
entry (:meth:`fastload.cache.Cache.read_into` rechecks it) and is filled again.

Not pickled: a DataLoader worker fills its own.
"""

from __future__ import annotations

from typing import Any

from fastload.cache import Entry


class Located:
    """The cache entry of each sample's only block, by sample index (None: not known here)."""

    def __init__(self, n: int) -> None:
        self.slots: list[Entry | None] = [None] * n

    def __getstate__(self) -> dict[str, Any]:
        return {"n": len(self.slots)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["n"])  # type: ignore[misc]

    def unknown(self, indices: list[int]) -> list[int]:
        """Those of ``indices`` without a slot filled."""
        slots = self.slots
        return [i for i in indices if slots[i] is None]
