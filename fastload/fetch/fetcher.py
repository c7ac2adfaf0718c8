"""The Fetcher: the only code on the read path that asks a Source for bytes.

One :class:`Fetcher` per :class:`~fastload.read.reader.Reader`, made with the Reader's
parts (its Sources, Cache and Identity), never the Reader itself. It holds the one table
of fetches in flight, keyed by (URL, block): a block is fetched once however many
threads (or fetches ahead) want it, and a sizeless item is completed once (key
(URL, COMPLETING)) however many threads complete it at once. Its callers are the
Reader's misses (datasets, ``fastload.open``, the pipelines' payloads) and staging. It stores what it fetched
with one :meth:`~fastload.cache.Cache.put_many` per call and returns those bytes,
so a cold read never goes back to disk for them. How many requests are in flight
is not decided here: every request holds a slot of its host's limit
(:mod:`fastload.transport.hostlimit`).

Sizeless items (an HTTP listing) are completed here too, in one of two ways
(:meth:`Fetcher.complete`): from their pins, else by the GET of their first block
(size, version and bytes in one request); or, to re-check a remote
(``--refresh``), by a HEAD each.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, cast

from fastload.cache import Cache
from fastload.config import Settings
from fastload.errors import CacheFullError, CacheLimitError, RemoteChangedError, StoppedError
from fastload.fetch.ahead import AHEAD_ITEMS
from fastload.fetch.identity import Identity
from fastload.source import RemoteItem, Source
from fastload.source.sources import Sources
from fastload.stats import record_cache
from fastload.transport import curl

_log = logging.getLogger("fastload")

# First blocks fetched ahead per Fetcher, at most (memory bound): the announced depth
# (AHEAD_ITEMS), and as many again for the batches drawn while those are still being read.
AHEAD_FLIGHTS = 2 * AHEAD_ITEMS
AHEAD_ITEM_BYTES = 1 << 20  # larger objects are not fetched ahead: their transfer, not latency, dominates
STREAM_BATCH_BYTES = 2 << 20  # blocks of a streamed whole object stored together (memory bound: _fetch_whole)

COMPLETING = -1  # the in-flight table's "block" of a sizeless item being completed (its first GET)

Block = tuple[RemoteItem, int]
Gate = Callable[[Callable[[], Any]], Any]  # runs a cache write, or refuses it (staging's stop)


def _now(write: Callable[[], Any]) -> Any:
    return write()


class _Flight:
    """One fetch in flight: a block being fetched by a thread, or a first block fetched ahead."""

    __slots__ = ("ahead", "future", "item")

    def __init__(self, item: RemoteItem, future: Future[Any], ahead: bool) -> None:
        self.item = item
        self.future = future
        self.ahead = ahead  # a Source.start_first_many future (finish it with Source.finish_first)


class Fetcher:
    """Fetches blocks from ``sources`` into ``cache``: one table in flight, stores them, returns their bytes.

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
        self._flights: dict[tuple[str, int], _Flight] = {}
        self._pid = os.getpid()

    def _table(self) -> dict[tuple[str, int], _Flight]:
        if self._pid != os.getpid():  # a forked child: the parent's futures never finish here
            self._lock, self._flights, self._pid = threading.Lock(), {}, os.getpid()
        return self._flights

    @property
    def ahead_bytes(self) -> int:
        """Bytes fetched ahead per object: its first block, at most AHEAD_ITEM_BYTES."""
        return min(self.settings.block_bytes, AHEAD_ITEM_BYTES)

    # -- ahead ----------------------------------------------------------------------

    def ahead(self, items: Sequence[RemoteItem]) -> int:
        """Start fetching the first block of items that will be read soon; returns how many started.

        Advisory: a read that finds its item's fetch under way takes it instead of
        requesting again. Only objects of at most ``AHEAD_ITEM_BYTES`` (or of unknown
        size) are fetched ahead, at most ``AHEAD_FLIGHTS`` at a time, so memory stays bounded.
        """
        limit = self.ahead_bytes
        if self.stop.is_set():
            return 0  # stopping: no request starts (staging's Ctrl-C)
        with self._lock:
            table = self._table()
            room = AHEAD_FLIGHTS - sum(1 for f in table.values() if f.ahead)
            # Not one being completed either: that GET brings its first block.
            todo = [i for i in items if (i.url, 0) not in table and (i.url, COMPLETING) not in table
                    and i.size <= limit][: max(0, room)]
        known, key = self.cache.known, self.identity.key
        todo = [i for i in todo if i.size < 0 or key(i, 0) not in known]  # cached here already
        sized = [i for i in todo if i.size >= 0]
        if sized:  # cached by another process: nothing to fetch either
            entries = self.cache.entries_for([key(i, 0) for i in sized])
            cached = {i.url for i, e in zip(sized, entries) if e is not None}
            todo = [i for i in todo if i.url not in cached]
        groups: dict[int, tuple[Source, list[RemoteItem]]] = {}  # one call per Source: one wake-up of its loop
        for item in todo:
            src = self.sources.of(item.url)
            groups.setdefault(id(src), (src, []))[1].append(item)
        started = 0
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
                    if table.setdefault((item.url, 0), _Flight(item, future, True)).future is not future:
                        future.cancel()  # a read registered its own fetch meanwhile
                    else:
                        started += 1
        return started

    def _take_ahead(self, item: RemoteItem) -> Future[Any] | None:
        """The fetch ahead of ``item``'s first block, now the caller's to finish; None if there is none."""
        with self._lock:
            flight = self._table().get((item.url, 0))
            if flight is None or not flight.ahead:
                return None
            del self._flights[(item.url, 0)]
        if flight.item != item and not (flight.item.size < 0 and flight.item.url == item.url):
            flight.future.cancel()  # started for another identity of the object
            return None
        return flight.future

    # -- sizeless items -------------------------------------------------------------

    def complete(self, items: Sequence[RemoteItem], *, heads: str = "none", strict: bool = False,
                 gate: Gate | None = None) -> tuple[list[RemoteItem], dict[str, bytes]]:
        """``items`` with sizes, and the first blocks fetched on the way (cache key -> bytes).

        A sizeless item is completed by the GET of its first block (an HTTP listing
        has no sizes; a HEAD before each GET cost a round trip and ~0.5 ms of CPU per
        object, benchmarks/peers); those GETs overlap, and their blocks are pinned
        and stored. An item with a recorded pin needs no request, unless ``heads``
        asks for one.

        Args:
            heads: ``"none"``: trust pins (training). ``"pinned"``: check pinned items
                by a HEAD each, so their cached blocks can be skipped (staging).
                ``"all"``: a HEAD for every sizeless item (an interrupted stage's
                rerun, ``--refresh``).
            strict: Raise CacheFullError when the cache cannot hold a block
                (staging), instead of serving it uncached (training streams).
            gate: Runs each cache write (staging's Ctrl-C stop refuses new ones).
        """
        todo = [k for k, item in enumerate(items) if item.size < 0]
        out = list(items)
        if not todo:
            return out, {}
        checks = todo if heads == "all" else []
        if heads != "all":
            # A sizeless item fetched ahead had no pin when its fetch started (Dataset.fetch_ahead
            # looked, moments ago): its GET brings size and version, so no second look-up.
            with self._lock:
                table = self._table()
                flying = {k for k in todo if (f := table.get((items[k].url, 0))) is not None and f.ahead and f.item.size < 0}
            looked = [k for k in todo if k not in flying]
            for k, item in zip(looked, self.identity.pinned([items[k] for k in looked])):
                if item.size >= 0 and heads == "pinned":
                    checks.append(k)
                else:
                    out[k] = item
        if checks:
            for k, item in zip(checks, self.sources.of(items[checks[0]].url).complete_all([items[k] for k in checks])):
                out[k] = item
        rest = [k for k in todo if out[k].size < 0]
        if not rest:
            return out, {}
        # The one table covers completions too: an item another thread is completing is
        # waited for, not requested again (tests/integration/test_fetch.py counts the GETs).
        waits: dict[int, Future[Any]] = {}
        with self._lock:
            table = self._table()
            for k in rest:
                flight = table.get((items[k].url, COMPLETING))
                if flight is None:
                    table[(items[k].url, COMPLETING)] = _Flight(items[k], Future(), False)
                else:
                    waits[k] = flight.future
        rest = [k for k in rest if k not in waits]
        t0 = time.perf_counter()
        try:
            got = self._first_blocks([items[k] for k in rest])
        except BaseException as err:
            self._land([((items[k].url, COMPLETING), None) for k in rest], err)
            raise
        self._land([((items[k].url, COMPLETING), pair) for k, pair in zip(rest, got)], None)
        self._count_misses(len(got), sum(len(d) for _, d in got), t0)
        # The pins land in the transaction that publishes the blocks (one transaction, not
        # two: 7% of a cold epoch's CPU), so no cached block is ever left without its pin,
        # which would be cached but not found again (tests/reliability/test_train_kill.py).
        self._store([((item, 0), data) for item, data in got], strict, gate, pins=self.identity.pins_of([i for i, _ in got]))
        fresh = {}
        for k, (item, data) in zip(rest, got):
            out[k] = item
            fresh[self.identity.key(item, 0)] = data
        for k, future in waits.items():
            item, data = future.result(timeout=self.settings.fetch_wait_s)  # the completing thread's error, if it failed
            out[k] = item
            fresh[self.identity.key(item, 0)] = data
        return out, fresh

    def _settle(self, futures: list[Future[Any]]) -> None:
        """Wait for a chunk's fetches ahead together: until all are done, the Reader stops,
        or their requests' timeout passes (Source.finish_first then takes each, done or not).

        Waiting on each in turn woke the read thread once per object as its answer came
        in, a thread switch and a GIL handoff each; this wakes it once per chunk.
        """
        curl.settle(futures, self.stop, self.settings.first_wait_s)

    def _first_blocks(self, items: list[RemoteItem]) -> list[tuple[RemoteItem, bytes]]:
        """Source.fetch_first of each, from fetches started ahead where there are some."""
        bb = self.settings.block_bytes
        out: list[tuple[RemoteItem, bytes] | None] = [None] * len(items)
        rest = []
        taken: dict[int, Future[Any]] = {}
        for k, item in enumerate(items):
            future = self._take_ahead(item)
            if future is None:
                rest.append(k)
            else:
                taken[k] = future
        self._settle(list(taken.values()))
        for k, future in taken.items():
            item = items[k]
            src = self.sources.of(item.url)
            done, data = src.finish_first(item, self.ahead_bytes, future)
            if len(data) != min(bb, done.size):  # larger than fetched ahead: its whole first block
                done, data = src.fetch_first(done, bb)
            out[k] = (done, data)
        if rest:
            got = self.sources.of(items[rest[0]].url).fetch_first_many([items[k] for k in rest], bb)
            for k, pair in zip(rest, got):
                out[k] = pair
        return [pair for pair in out if pair is not None]

    # -- blocks ---------------------------------------------------------------------

    def fetch(self, blocks: Sequence[Block], *, strict: bool = False, gate: Gate | None = None) -> list[bytes]:
        """The bytes of each (sized) block, fetched once whoever asks, stored, and returned.

        A block another thread is fetching is waited for (bounded by the request
        timeout and retries); the rest go out together (one Source.fetch_many call,
        whose requests overlap on fsspec's event loop) and are stored by one
        Cache.put_many. Counts one miss per block fetched here.

        Args:
            strict, gate: As :meth:`complete`.

        Raises:
            RemoteChangedError: The remote's object is gone or changed size since it was listed.
        """
        mine: list[int] = []
        ahead: dict[int, Future[Any]] = {}
        waits: dict[int, Future[Any]] = {}
        known = self.cache.known
        with self._lock:
            table = self._table()
            for k, (item, block) in enumerate(blocks):
                flight = table.get((item.url, block))
                if flight is None:
                    table[(item.url, block)] = _Flight(item, Future(), False)
                    mine.append(k)
                elif flight.ahead:
                    mine.append(k)  # finished below, by this caller
                    table[(item.url, block)] = _Flight(item, Future(), False)
                    if flight.item == item or (flight.item.size < 0 and flight.item.url == item.url):
                        ahead[k] = flight.future
                    else:
                        flight.future.cancel()
                else:
                    waits[k] = flight.future
        out: list[bytes | None] = [None] * len(blocks)
        try:
            # Stored by this process since the caller missed: read it, do not fetch again.
            for k in [k for k in mine if k not in ahead and self.identity.key(*blocks[k]) in known]:
                out[k] = self.cache.get(self.identity.key(*blocks[k]))
            self._fetch_mine(blocks, [k for k in mine if out[k] is None], ahead, out, strict, gate)
        except BaseException as err:
            self._land([((blocks[k][0].url, blocks[k][1]), out[k]) for k in mine], err)
            raise
        self._land([((blocks[k][0].url, blocks[k][1]), out[k]) for k in mine], None)
        for k, future in waits.items():
            out[k] = future.result(timeout=self.settings.fetch_wait_s)  # the fetching thread's error, if it failed
        return cast("list[bytes]", out)  # every block was this caller's (fetched above) or waited for

    def _land(self, flights: Sequence[tuple[tuple[str, int], Any]], err: BaseException | None) -> None:
        """Resolve this caller's flights (table key, result or None): the result for the threads
        waiting on them, else ``err``."""
        with self._lock:
            table = self._table()
            for key, result in flights:
                flight = table.pop(key, None)
                if flight is None or flight.future.done():
                    continue
                if result is not None:
                    flight.future.set_result(result)
                else:
                    url, block = key
                    what = "not completed" if block == COMPLETING else f"block {block} was not fetched"
                    flight.future.set_exception(err or RemoteChangedError(f"{url}: {what}"))
                    flight.future.exception()  # retrieved: a waiter may never come

    def _fetch_mine(self, blocks: Sequence[Block], mine: list[int], ahead: dict[int, Future[Any]],
                    out: list[bytes | None], strict: bool, gate: Gate | None) -> None:
        if not mine:
            return
        t0 = time.perf_counter()
        spans = {k: self.identity.span(*blocks[k]) for k in mine}
        fetched: dict[int, bytes | Exception] = {}
        streamed: set[int] = set()
        self._settle(list(ahead.values()))
        for k, future in ahead.items():
            item = blocks[k][0]
            try:
                fetched[k] = self.sources.of(item.url).finish_first(item, self.ahead_bytes, future)[1]
            except Exception as err:
                fetched[k] = err
        rest = [k for k in mine if k not in fetched]
        if rest:
            src = self.sources.of(blocks[rest[0]][0].url)
            by_item: dict[RemoteItem, list[int]] = {}
            for k in rest:
                by_item.setdefault(blocks[k][0], []).append(k)
            ranges: dict[tuple[str, int, int | None], list[int]] = {}
            for item, ks in by_item.items():
                partial = [k for k in ks if spans[k][1] - spans[k][0] != item.size]
                # A host not known to honour Range is asked for one block by a GET that serves
                # either way: a 206 is that block; the whole object is streamed into its blocks
                # (64 ranged GETs each answered whole took 4.5 GB for a 64 MB object).
                probe = bool(partial) and src.honours_ranges(item.url) is None
                if partial and (probe or src.ignores_ranges(item.url)):
                    try:
                        got = self._fetch_whole(item, {blocks[k][1] for k in ks}, strict, gate,
                                                probe=blocks[partial[0]][1] if probe else None)
                    except Exception as err:
                        got = {}
                        for k in ks:
                            fetched[k] = err
                    for k in ks:
                        if blocks[k][1] in got:
                            fetched[k] = got[blocks[k][1]]
                            streamed.add(k)
                    ks = [k for k in ks if k not in fetched]  # a 206: the rest by ranged GETs
                for k in ks:
                    start, end = spans[k]
                    ranges.setdefault((item.url, 0, None) if start == 0 and end == item.size else (item.url, start, end), []).append(k)
            if ranges:
                # Each answer is checked against the item's listed size and version: a refetched
                # block of a rewritten object is a RemoteChangedError, never a torn object.
                listed = [blocks[ks[0]][0] for ks in ranges.values()]
                for ks, data in zip(ranges.values(), src.fetch_many(list(ranges), listed)):
                    for k in ks:
                        fetched[k] = data
        stored: list[tuple[Block, bytes]] = []
        seen: set[Block] = set()  # blocks already taken from a whole object
        for k in mine:
            (item, block), (start, end), data = blocks[k], spans[k], fetched[k]
            if isinstance(data, FileNotFoundError):
                raise RemoteChangedError(
                    f"{item.url}: listed (or staged) but now missing on the remote ({data}); fix: re-list with "
                    "refresh=True / `fastload cache --refresh`"
                ) from data
            if isinstance(data, Exception):
                raise data
            if k in streamed:  # stored as it arrived (_fetch_whole)
                out[k] = data
                continue
            if len(data) == item.size != end - start:
                # The whole object, for one block: the server ignores Range headers (Python's
                # http.server does), found out by this request. Every block is kept, so the
                # object is fetched once (tests/integration/test_hostlimit_server.py); from
                # now on this host's objects are streamed (_fetch_whole).
                whole, out[k] = data, data[start:end]
                self.sources.of(item.url).note_ranges(item.url, False)
                if (item, block) not in seen:
                    stored += [((item, b), whole[x:y]) for b in self.identity.blocks(item) for x, y in [self.identity.span(item, b)]]
                    seen.update((item, b) for b in self.identity.blocks(item))
                continue
            elif len(data) != end - start:
                raise RemoteChangedError(
                    f"{item.url}: remote now returns {len(data)} B for block {block}, expected {end - start} B from its "
                    "recorded size; the object changed since it was listed; fix: `fastload cache --refresh` or refresh=True"
                )
            out[k] = data
            stored.append(((item, block), data))
        self._count_misses(len(mine), sum(len(out[k] or b"") for k in mine), t0)
        self._store(stored, strict, gate)

    def _fetch_whole(self, item: RemoteItem, wanted: set[int], strict: bool, gate: Gate | None,
                     probe: int | None = None) -> dict[int, bytes]:
        """The ``wanted`` blocks of ``item``, from one GET of all of it (a host that ignores Range).

        Every block is stored as it arrives, a few blocks per put_many (STREAM_BATCH_BYTES),
        so memory holds those and the wanted ones, not the object; the object is fetched
        once (tests/integration/test_fetch.py measures the memory and counts the GETs).
        Blocks already cached (an interrupted stage's, another process's) are not stored
        again. Blocks nobody else is fetching are entered in the table for this GET, and
        their waiters get each as soon as it is stored.

        ``probe``: the host's Range support is not known yet; the GET asks for that block
        alone (Source.fetch_whole), so a 206 returns just it.
        """
        claimed: set[int] = set()
        if probe is None:  # a probe may bring one block only: it claims none
            with self._lock:
                table = self._table()
                claimed = {b for b in self.identity.blocks(item) if b not in wanted and (item.url, b) not in table}
                for b in claimed:
                    table[(item.url, b)] = _Flight(item, Future(), False)
        got: dict[int, bytes] = {}
        seen: set[int] = set()
        batch: list[tuple[Block, bytes]] = []
        held = [0]  # bytes in batch
        landed: set[int] = set()  # claimed blocks whose waiters have their bytes
        known = self.cache.known
        todo = list(self.identity.blocks(item))  # a rerun after Ctrl-C stores only the blocks it lacks
        cached = {b for b, e in zip(todo, self.cache.entries_for([self.identity.key(item, b) for b in todo])) if e is not None}

        def land(pairs: list[tuple[int, bytes]]) -> None:
            pairs = [(b, data) for b, data in pairs if b in claimed]
            self._land([((item.url, b), data) for b, data in pairs], None)
            landed.update(b for b, _ in pairs)

        def flush() -> None:
            self._store(batch, strict, gate)
            land([(b, data) for (_, b), data in batch])
            batch.clear()
            held[0] = 0

        def sink(_: RemoteItem, block: int, data: bytes) -> None:  # the item as answered: item (sized)
            if block in seen:  # the request was retried from its start
                return
            seen.add(block)
            if block in wanted:
                got[block] = data
            if block in cached or self.identity.key(item, block) in known:
                land([(block, data)])
                return
            batch.append(((item, block), data))
            held[0] += len(data)
            if held[0] >= STREAM_BATCH_BYTES:
                flush()

        try:
            self.sources.of(item.url).fetch_whole(item, self.settings.block_bytes, sink, probe)
            flush()
        except BaseException as err:
            self._land([((item.url, b), None) for b in claimed - landed], err)
            raise
        return got

    def _store(self, fetched: list[tuple[Block, bytes]], strict: bool, gate: Gate | None,
               pins: dict[str, Any] | None = None) -> None:
        """Cache fetched blocks in one batch; a cache that cannot hold them streams (or, strict, raises)."""
        batch = [(self.identity.key(item, block), data, item.url, block) for (item, block), data in fetched]
        if not batch:
            return
        try:
            (gate or _now)(lambda: self.cache.put_many(batch, rows=pins))
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
