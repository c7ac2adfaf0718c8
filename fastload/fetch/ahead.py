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
guess of the worker costs a wait for the other worker's fetch (the marker of its block,
fastload.cache.flights), never a wrong sample: announcements are advice, and every read
goes through the read path.

How far ahead has one home: :data:`AHEAD_ITEMS` (and :func:`depth_for`, which turns
it into batches); the Fetcher's bound on fetches ahead in flight is derived from it.

The Fetcher's side, :class:`FetcherAhead`: the first blocks of announced items requested at
once (:meth:`FetcherAhead.ahead`), each holding its block's marker (fastload.cache.flights)
until the read that takes it stores it (:meth:`FetcherAhead._take_ahead`), or, while another
process waits for a marker, until it is in (:meth:`FetcherAhead._harvest`).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

from fastload.cache import Cache
from fastload.cache.flights import slot
from fastload.config import Settings
from fastload.errors import ConfigError, StoppedError
from fastload.fetch.base import COMPLETING, FetcherBase, Flight
from fastload.fetch.identity import Identity
from fastload.source import RemoteItem, Source
from fastload.source.sources import Sources
from fastload.transport import curl

_log = logging.getLogger("fastload")

#: Samples announced ahead of the batches being read, per reading process (about 4
#: batches of 64): the loader's process with num_workers=0, else each worker.
AHEAD_ITEMS = 256
# First blocks fetched ahead per Fetcher, at most (memory bound): the announced depth
# (AHEAD_ITEMS), and as many again for the batches drawn while those are still being read.
AHEAD_FLIGHTS = 2 * AHEAD_ITEMS
AHEAD_ITEM_BYTES = 1 << 20  # larger objects are not fetched ahead: their transfer, not latency, dominates
HARVEST_S = 0.02  # finished fetches ahead are stored at a Fetcher's calls at most this often (_harvest)
# Indices announced in this process together (one fetch_ahead call), unless a batch held is about to be
# read: batches of 1 (torch's default) announced one by one cost a fetch-ahead call per sample.
HINT_ITEMS = 64

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
        hint: Announce here, in this process: ``hint(indices)`` for the batches drawn,
            HINT_ITEMS indices at once, or fewer where a batch held is about to be read
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
        self._held: list[Any] = []  # indices drawn, not yet announced (hint=: HINT_ITEMS at once)
        self._held_first = 0  # the draw number of the first batch held
        self._draws = self._yields = 0  # batches drawn and yielded (hint=)

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
        else:
            if self._held and self._held_first <= self._yields:  # a batch held is about to be read
                self._announce()
            self._yields += 1
        if ahead and type(batch) is list:
            return Announced(batch, ahead)
        return batch

    def _announce(self) -> None:
        held, self._held = self._held, []
        _hint(self._hint, held)  # type: ignore[arg-type]

    def _draw(self, batch: Any) -> None:
        if self._hint is not None:
            self._drawn.append((batch, [], 0))
            if not self._held:
                self._held_first = self._draws
            self._draws += 1
            self._held.extend(batch)
            if len(self._held) >= HINT_ITEMS:
                self._announce()
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


class FetcherAhead(FetcherBase):
    """The Fetcher's fetches ahead: started, taken by the reads that reach them, stored on arrival."""

    def __init__(self, settings: Settings, cache: Cache, identity: Identity, sources: Sources) -> None:
        super().__init__(settings, cache, identity, sources)
        self._harvested = 0.0  # when _harvest last looked (time.monotonic)

    @property
    def ahead_bytes(self) -> int:
        """Bytes fetched ahead per object: its first block, at most AHEAD_ITEM_BYTES."""
        return min(self.settings.block_bytes, AHEAD_ITEM_BYTES)

    def ahead(self, items: Sequence[RemoteItem]) -> int:
        """Start fetching the first block of items that will be read soon; returns how many started.

        Advisory: a read that finds its item's fetch under way takes it instead of
        requesting again. Only objects of at most ``AHEAD_ITEM_BYTES`` (or of unknown
        size) are fetched ahead, at most ``AHEAD_FLIGHTS`` at a time, so memory stays bounded.
        An item another process is fetching is not: its read here waits for that fetch.
        """
        limit = self.ahead_bytes
        if self.stop.is_set():
            return 0  # stopping: no request starts (staging's Ctrl-C)
        self._harvest()
        with self._lock:
            table = self._table()
            room = AHEAD_FLIGHTS - sum(1 for f in table.values() if f.ahead)
            # Not one being completed either: that GET brings its first block.
            todo = [i for i in items if (i.url, 0) not in table and (i.url, COMPLETING) not in table
                    and i.size <= limit][: max(0, room)]
        known, key = self.cache.known, self.identity.key
        todo = [i for i in todo if i.size < 0 or key(i, 0) not in known]  # cached here already
        # Cached, though not known here (a DataLoader worker's memo starts empty): looked up
        # before any marker is taken, so a warm read takes none. Two lock calls per item
        # made an item unknown here cost ~50 us against ~15 known (100k staged, num_workers=2).
        sized = [i for i in todo if i.size >= 0]
        if sized:
            stored = {i.url for i, e in zip(sized, self.cache.entries_for([key(i, 0) for i in sized])) if e is not None}
            todo = [i for i in todo if i.url not in stored]
        slots = {i.url: slot(i.url, 0) for i in todo}
        for url, mine in zip(list(slots), self.markers.hold(list(slots.values()))):
            if not mine:
                del slots[url]  # another process is fetching it: its read here waits for that fetch
        todo = [i for i in todo if i.url in slots]
        # Cached by another process (looked up once the markers are held: one stored since is
        # not fetched again): nothing to fetch either. Each was looked up moments ago (a sized one
        # above, a sizeless one by its pin in Dataset.fetch_ahead): again only where another process
        # fetches too (one index query per batch on a cold path of its own: tests/integration/test_fetch.py,
        # test_cold_lookups.py).
        sized = [i for i in self.identity.pinned(todo) if i.size >= 0] if self.contended() else []
        if sized:
            entries = self.cache.entries_for([key(i, 0) for i in sized])
            cached = [i.url for i, e in zip(sized, entries) if e is not None]
            self.markers.release([slots.pop(url) for url in cached])
            todo = [i for i in todo if i.url in slots]
        groups: dict[int, tuple[Source, list[RemoteItem]]] = {}  # one call per Source: one wake-up of its loop
        for item in todo:
            src = self.sources.of(item.url)
            groups.setdefault(id(src), (src, []))[1].append(item)
        started = 0
        try:
            for src, group in groups.values():
                try:
                    futures = src.start_first_many(group, limit)
                except StoppedError:
                    break  # stopped meanwhile
                if futures is None:
                    continue  # this store cannot fetch these ahead: reads fetch as they go
                with self._lock:
                    table = self._table()
                    for item, future in zip(group, futures):
                        flight = Flight(item, future, True)
                        if table.setdefault((item.url, 0), flight) is not flight:
                            future.cancel()  # a read registered its own fetch meanwhile
                        else:
                            flight.slot = slots.pop(item.url)  # held until stored (_harvest, or its read)
                            started += 1
        finally:
            self.markers.release(slots.values())  # those not started
        return started

    def _take_ahead(self, item: RemoteItem) -> Future[Any] | None:
        """The fetch ahead of ``item``'s first block, now the caller's to finish; None if there is none.

        Its marker passes to the caller's completion of ``item`` (Fetcher.complete), held until
        stored; dropped if that holds one already."""
        with self._lock:
            table = self._table()
            flight = table.get((item.url, 0))
            if flight is None or not flight.ahead:
                return None
            del table[(item.url, 0)]
            held, flight.slot = flight.slot, None
            owner = table.get((item.url, COMPLETING))
            if owner is not None and owner.slot is None:
                owner.slot, held = held, None
        if held is not None:
            self.markers.release([held])
        if flight.item != item and not (flight.item.size < 0 and flight.item.url == item.url):
            flight.future.cancel()  # started for another identity of the object
            return None
        return flight.future

    def _harvest(self, force: bool = False) -> None:
        """While another process waits for a marker, store the fetches ahead that are in, and drop their markers.

        A fetch ahead holds its marker until it is stored, and that is when its read takes
        it. The read may come late or never (another worker's batch, another order), and
        two processes each waiting for a block the other fetched ahead would each wait out
        its bound. So while any process waits (Markers.others_wait: one lock lookup), the
        others store their finished fetches ahead at their calls (at most every HARVEST_S,
        and at each look of their own waits); their reads then find them in the cache (a
        hit, after the miss counted here). Nobody waiting, nothing changes: a read takes
        its fetch ahead's bytes from memory. A process that makes no call holds its markers
        until it does: the others wait for them, bounded by the request timeout.
        """
        now = time.monotonic()
        if not force and now - self._harvested < HARVEST_S:
            return
        self._harvested = now
        if not self.markers.others_wait():
            return
        picked: list[tuple[tuple[str, int], Flight]] = []
        with self._lock:
            table = self._table()
            for key, flight in list(table.items()):
                # Not one a completion here has claimed (carried): that caller takes it now.
                if flight.ahead and flight.slot is not None and flight.future.done() and (key[0], COMPLETING) not in table:
                    stand_in = table[key] = Flight(flight.item, Future(), False)  # this process's reads wait for it
                    stand_in.slot, flight.slot = flight.slot, None
                    picked.append((key, flight))
        if not picked:
            return
        t0 = time.perf_counter()
        bb = self.settings.block_bytes
        got: list[tuple[tuple[str, int], RemoteItem, bytes]] = []
        sizeless: list[RemoteItem] = []
        for key, flight in picked:
            src = self.sources.of(flight.item.url)
            try:
                done, data = src.finish_first(flight.item, self.ahead_bytes, flight.future)
                if len(data) != min(bb, done.size):  # larger than fetched ahead: its whole first block
                    done, data = src.fetch_first(done, bb)
            except Exception as err:  # what its read would have met; a read after it fetches again
                self._land([(key, None)], err)
                continue
            got.append((key, done, data))
            if flight.item.size < 0:
                sizeless.append(done)
        if not got:
            return
        self._count_misses(len(got), sum(len(data) for _, _, data in got), t0)
        try:
            self._store([((done, 0), data) for _, done, data in got], False, None,
                        pins=self.identity.pins_of(sizeless) if sizeless else None, looked_up=True)
        except BaseException as err:
            self._land([(key, None) for key, _, _ in got], err)
            raise
        self._land([(key, data) for key, _, data in got], None)

    def _settle(self, futures: list[Future[Any]]) -> None:
        """Wait for a chunk's fetches ahead together: until all are done, the Reader stops,
        or their requests' timeout passes (Source.finish_first then takes each, done or not).

        Waiting on each in turn woke the read thread once per object as its answer came
        in, a thread switch and a GIL handoff each; this wakes it once per chunk.
        """
        curl.settle(futures, self.stop, self.settings.first_wait_s)
