"""What every part of the Fetcher shares: its parts, the one table of fetches in flight and its
markers across the node, and how it stores and counts what it fetched.

The table is keyed by (URL, block): a block is fetched once however many threads (or
fetches ahead) want it, and a sizeless item is completed once (key (URL, COMPLETING))
however many threads complete it at once. It is per process; the processes sharing a
cache folder see each other's fetches through **markers** (:mod:`fastload.cache.flights`):
a fetch holds its block's marker until the block is stored. A process that finds a
marker held by another waits for it (polling, bounded by the request timeout), then looks
the block up again: a hit serves the other's bytes, a miss (the other failed) is fetched
here (:meth:`FetcherBase._once_per_node`). One GET per block per node
(tests/integration/test_one_get_per_node.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from fastload.cache import Cache
from fastload.cache.flights import markers_for, slot
from fastload.config import Settings
from fastload.errors import CacheFullError, CacheLimitError, RemoteChangedError
from fastload.fetch.identity import Identity
from fastload.source import RemoteItem
from fastload.source.sources import Sources
from fastload.stats import record_cache

_log = logging.getLogger("fastload")

COMPLETING = -1  # the in-flight table's "block" of a sizeless item being completed (its first GET)
POLL_FIRST_S, POLL_MAX_S = 0.001, 0.005  # a wait for another process's fetch looks again after 1 ms, then 2, 4, 5, 5...

Block = tuple[RemoteItem, int]
Gate = Callable[[Callable[[], Any]], Any]  # runs a cache write, or refuses it (staging's stop)
Flights = Callable[[list[int]], Any]  # a step of _once_per_node over some of the caller's flights (their indices)


def _now(write: Callable[[], Any]) -> Any:
    return write()


class Flight:
    """One fetch in flight: a block being fetched by a thread, or a first block fetched ahead."""

    __slots__ = ("ahead", "future", "item", "slot")

    def __init__(self, item: RemoteItem, future: Future[Any], ahead: bool) -> None:
        self.item = item
        self.future = future
        self.ahead = ahead  # a Source.start_first_many future (finish it with Source.finish_first)
        self.slot: int | None = None  # the marker this fetch holds (fastload.cache.flights); handed on with it


class FetcherBase:
    """The Fetcher's parts, its table of fetches in flight and their markers; :class:`~fastload.fetch.Fetcher` adds its jobs.

    It holds no reference to its Reader (the Reader owns it), so a dropped Reader is
    freed, its cache's files closed, at once: a cache left open kept
    `mount -o remount,ro` failing (tests/reliability/test_disk_full.py).
    """

    def __init__(self, settings: Settings, cache: Cache, identity: Identity, sources: Sources) -> None:
        self.settings = settings
        self.cache = cache
        self.identity = identity
        self.sources = sources
        self.stop = sources.stop
        self.misses = 0  # blocks fetched here (each a cache miss)
        self._warned_streaming = False
        self._lock = threading.Lock()
        self._flights: dict[tuple[str, int], Flight] = {}
        self._pid = os.getpid()
        self.markers = markers_for(cache.root)  # this process's, shared by its Fetchers of this folder
        flights = self._flights  # not self: the markers it holds are dropped once it is collected
        self.markers.attach(self, lambda: [f.slot for f in list(flights.values()) if f.slot is not None])

    def _table(self) -> dict[tuple[str, int], Flight]:
        if self._pid != os.getpid():  # a forked child: the parent's futures never finish here
            self._flights.clear()  # this process's copy (one dict for life: Markers.attach reads it)
            self._lock, self._pid = threading.Lock(), os.getpid()
        return self._flights

    def _harvest(self, force: bool = False) -> None:
        """Store what this process holds markers for and can store now (the Fetcher's fetches ahead)."""

    def _once_per_node(self, ks: list[int], keys: list[tuple[str, int]], recheck: Flights, here: Flights,
                       land: Flights, carried: Sequence[int] = ()) -> None:
        """Fetch the caller's flights ``ks`` (table keys ``keys``) once per node, not once per process.

        Those whose markers this process gets are looked up again where another process
        fetches too (``recheck``: it may have stored one since the caller's look), the rest fetched (``here``),
        and all landed (``land``: stored, so their markers drop). Then those another process
        holds are waited for: each look takes the markers that came free, looks their blocks
        up and fetches the ones still missing (the other failed, or a collision), until the
        request timeout; what is left then (a holder stuck, or a stop) is fetched here. A
        look stores this process's fetches ahead first (_harvest), so two processes never
        wait on each other (tests/unit/test_flights.py). ``carried``: flights whose fetch
        is under way already (taken from a fetch ahead, marker and all): finished in the
        first round, never waited for.
        """
        held = self._mark(keys)
        ours = [k for k, mine in zip(ks, held) if mine]
        busy = {k: key for k, key, mine in zip(ks, keys, held) if not mine}
        found = set(recheck(ours)) if ours and self.contended() else set()
        go = [k for k in ours if k not in found] + list(carried)
        if go:
            here(go)
        land([k for k in ks if k not in busy] + list(carried))
        if not busy:
            return
        t0 = time.monotonic()
        deadline, pause = t0 + self.settings.request_timeout_s, POLL_FIRST_S
        with self.markers.waiting():
            while busy and not self.stop.is_set() and time.monotonic() < deadline:
                time.sleep(pause)
                pause = min(2 * pause, POLL_MAX_S)
                self._harvest(force=True)
                got = [k for k, mine in zip(list(busy), self._mark(list(busy.values()))) if mine]
                for k in got:
                    del busy[k]
                if got:
                    found = set(recheck(got))
                    if len(found) < len(got):
                        here([k for k in got if k not in found])
                    land(got)
        if busy:
            if not self.stop.is_set():
                _log.info("fastload: another process has been fetching %d blocks (%s, ...) for %.0f s; fetching them here",
                          len(busy), next(iter(busy.values()))[0], time.monotonic() - t0)
            rest = list(busy)
            here(rest)
            land(rest)

    def contended(self) -> bool:
        """Whether another process fetches into this cache (Markers.others_here): then a block whose
        marker was free may have been stored since the caller looked, and is looked up again (one
        index query per call); alone, a process never needs to."""
        return self.markers.others_here()

    def _mark(self, keys: Sequence[tuple[str, int]]) -> list[bool]:
        """Hold the markers of the caller's flights (table keys); False where another process holds one.

        A completion marks block 0: the GET that completes an item brings that block."""
        slots = [slot(url, max(block, 0)) for url, block in keys]
        held = self.markers.hold(slots)
        spare = []
        with self._lock:
            table = self._table()
            for key, s, mine in zip(keys, slots, held):
                if not mine:
                    continue
                flight = table.get(key)
                if flight is None or flight.slot is not None:
                    spare.append(s)  # holds one already (taken from its fetch ahead)
                else:
                    flight.slot = s
        self.markers.release(spare)
        return held

    def _land(self, flights: Sequence[tuple[tuple[str, int], Any]], err: BaseException | None) -> None:
        """Resolve this caller's flights (table key, result or None): the result for the threads
        waiting on them, else ``err``; and drop their markers (their blocks are stored, or failed)."""
        slots = []
        with self._lock:
            table = self._table()
            for key, result in flights:
                flight = table.pop(key, None)
                if flight is None:
                    continue
                if flight.slot is not None:
                    slots.append(flight.slot)
                    flight.slot = None
                if flight.future.done():
                    continue
                if result is not None:
                    flight.future.set_result(result)
                else:
                    url, block = key
                    what = "not completed" if block == COMPLETING else f"block {block} was not fetched"
                    flight.future.set_exception(err or RemoteChangedError(f"{url}: {what}"))
                    flight.future.exception()  # retrieved: a waiter may never come
        self.markers.release(slots)

    def _store(self, fetched: list[tuple[Block, bytes]], strict: bool, gate: Gate | None,
               pins: dict[str, Any] | None = None, looked_up: bool = False) -> None:
        """Cache fetched blocks in one batch; a cache that cannot hold them streams (or, strict, raises).

        ``looked_up``: each block was found missing just before its fetch, under its marker, so the
        cache does not look it up again (Cache.put_many)."""
        batch = [(self.identity.key(item, block), data, item.url, block) for (item, block), data in fetched]
        if not batch:
            return
        try:
            (gate or _now)(lambda: self.cache.put_many(batch, rows=pins, looked_up=looked_up))
        except CacheLimitError:
            raise
        except CacheFullError as err:
            if strict:  # staging exists to cache: a full disk ends it (tests/reliability/test_disk_full.py)
                raise
            what = f"{batch[0][2]} ({err}); serving it" if len(batch) == 1 else f"{batch[0][2]} and {len(batch) - 1} more ({err}); serving them"
            self.warn_streaming(f"cache cannot store {what} without caching")

    def _count_misses(self, items: int, nbytes: int, t0: float) -> None:
        self.misses += items
        record_cache(False, items, nbytes, t0)

    def warn_streaming(self, why: str) -> None:
        """Warn once that this Fetcher serves data its cache cannot hold."""
        if not self._warned_streaming:
            self._warned_streaming = True
            _log.warning("fastload is streaming: %s", why)

    def in_flight(self) -> dict[str, int]:
        """Fetches in flight now: ``ahead`` (first blocks fetched ahead, not yet taken by a read)
        and ``fetching`` (blocks and completions a read is waiting for)."""
        with self._lock:
            flights = list(self._table().values())
        ahead = sum(1 for f in flights if f.ahead)
        return {"ahead": ahead, "fetching": len(flights) - ahead}
