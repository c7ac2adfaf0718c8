"""The Fetcher: the only code on the read path that asks a Source for bytes.

One :class:`Fetcher` per :class:`~fastload.read.reader.Reader`, made with the Reader's
parts (its Sources, Cache and Identity), never the Reader itself. It holds the one table
of fetches in flight (:mod:`fastload.fetch.base`: per process, and across the node through
markers). Its callers are the Reader's misses (datasets, ``fastload.open``, the pipelines'
payloads) and staging. It stores what it fetched with one
:meth:`~fastload.cache.Cache.put_many` per call and returns those bytes, so a cold read
never goes back to disk for them. How many requests are in flight is not decided here:
every request holds a slot of its host's limit (:mod:`fastload.transport.hostlimit`).

Fetches ahead (started before their reads, :mod:`fastload.fetch.ahead`) are taken here by
the reads that reach them.

Sizeless items (an HTTP listing) are completed here too, in one of two ways
(:meth:`Fetcher.complete`): from their pins, else by the GET of their first block
(size, version and bytes in one request); or, to re-check a remote
(``--refresh``), by a HEAD each.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, cast

from fastload.errors import RemoteChangedError
from fastload.fetch.ahead import AHEAD_FLIGHTS, AHEAD_ITEM_BYTES, FetcherAhead
from fastload.fetch.base import COMPLETING, Block, Flight, Gate
from fastload.source import RemoteItem
from fastload.stats import record_cache

__all__ = ["AHEAD_FLIGHTS", "AHEAD_ITEM_BYTES", "COMPLETING", "Fetcher"]

STREAM_BATCH_BYTES = 2 << 20  # blocks of a streamed whole object stored together (memory bound: _fetch_whole)
OVERLAP = 2  # fetch calls of fetch_in_turn at once: one's blocks stored while the next one's GETs run


class Fetcher(FetcherAhead):
    """Fetches blocks from ``sources`` into ``cache``: one table in flight, stores them, returns their bytes."""

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
        self._harvest()
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
        # waited for, not requested again (tests/integration/test_fetch.py counts the GETs), and
        # so is one whose first block another thread fetches (or stores on arrival: _harvest).
        waits: dict[int, Future[Any]] = {}
        firsts: dict[int, Future[Any]] = {}
        carried: list[int] = []  # fetched ahead here: taken, marker and all (_take_ahead)
        with self._lock:
            table = self._table()
            for k in rest:
                flight = table.get((items[k].url, COMPLETING))
                first = table.get((items[k].url, 0))
                if flight is not None:
                    waits[k] = flight.future
                elif first is not None and not first.ahead:
                    firsts[k] = first.future
                else:
                    table[(items[k].url, COMPLETING)] = Flight(items[k], Future(), False)
                    if first is not None:
                        carried.append(k)
        rest = [k for k in rest if k not in waits and k not in firsts]
        fresh: dict[str, bytes] = {}
        landed: set[int] = set()

        def recheck(ks: list[int]) -> list[int]:
            # Completed by another process since the look above: pinned, its first block cached.
            t0, found = time.perf_counter(), []
            for k, item in zip(ks, self.identity.pinned([items[k] for k in ks])):
                key = self.identity.key(item, 0) if item.size >= 0 else ""
                data = self.cache.get(key) if key else None
                if data is not None:
                    out[k], fresh[key] = item, data
                    found.append(k)
            if found:
                record_cache(True, len(found), sum(len(fresh[self.identity.key(out[k], 0)]) for k in found), t0)
            return found

        def here(ks: list[int]) -> None:
            t0 = time.perf_counter()
            got = self._first_blocks([items[k] for k in ks])
            self._count_misses(len(got), sum(len(d) for _, d in got), t0)
            # The pins land in the transaction that publishes the blocks (one transaction, not
            # two: 7% of a cold epoch's CPU), so no cached block is ever left without its pin,
            # which would be cached but not found again (tests/reliability/test_train_kill.py).
            # Sizeless, so unpinned: and a cached first block always has its pin (above). Not cached, then.
            self._store([((item, 0), data) for item, data in got], strict, gate, pins=self.identity.pins_of([i for i, _ in got]),
                        looked_up=True)
            for k, (item, data) in zip(ks, got):
                out[k] = item
                fresh[self.identity.key(item, 0)] = data

        def land(ks: list[int]) -> None:
            self._land([((items[k].url, COMPLETING), (out[k], fresh[self.identity.key(out[k], 0)])) for k in ks], None)
            landed.update(ks)

        try:
            taken = set(carried)  # a list's membership test per item: quadratic in the batch
            marked = [k for k in rest if k not in taken]
            self._once_per_node(marked, [(items[k].url, COMPLETING) for k in marked], recheck, here, land, carried)
        except BaseException as err:
            self._land([((items[k].url, COMPLETING), None) for k in rest if k not in landed], err)
            raise
        for k, future in waits.items():
            item, data = future.result(timeout=self.settings.fetch_wait_s)  # the completing thread's error, if it failed
            out[k] = item
            fresh[self.identity.key(item, 0)] = data
        again = []
        for k, future in firsts.items():
            data = future.result(timeout=self.settings.fetch_wait_s)  # the fetching thread's error, if it failed
            pinned = self.identity.pin_of(items[k].url)  # pinned as it was stored
            if pinned is None or len(data) != min(self.settings.block_bytes, pinned.size):
                again.append(k)  # another identity's block: completed on its own
                continue
            out[k] = pinned
            fresh[self.identity.key(pinned, 0)] = data
        if again:
            done, more = self.complete([items[k] for k in again], heads=heads, strict=strict, gate=gate)
            for k, item in zip(again, done):
                out[k] = item
            fresh.update(more)
        return out, fresh

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
        timeout and retries), and so is one another process is fetching (its marker:
        then it is read from the cache); the rest go out together (one Source.fetch_many
        call, whose requests overlap on fsspec's event loop) and are stored by one
        Cache.put_many. Counts one miss per block fetched here.

        Args:
            strict, gate: As :meth:`complete`.

        Raises:
            RemoteChangedError: The remote's object is gone or changed size since it was listed.
        """
        self._harvest()
        mine: list[int] = []
        ahead: dict[int, Flight] = {}
        waits: dict[int, Future[Any]] = {}
        known = self.cache.known
        with self._lock:
            table = self._table()
            for k, (item, block) in enumerate(blocks):
                flight = table.get((item.url, block))
                if flight is None:
                    table[(item.url, block)] = Flight(item, Future(), False)
                    mine.append(k)
                elif flight.ahead:
                    mine.append(k)  # finished below, by this caller
                    mine_now = table[(item.url, block)] = Flight(item, Future(), False)
                    mine_now.slot, flight.slot = flight.slot, None  # its marker stays held until stored
                    if flight.item == item or (flight.item.size < 0 and flight.item.url == item.url):
                        ahead[k] = flight
                    else:
                        flight.future.cancel()
                else:
                    waits[k] = flight.future
        out: list[bytes | None] = [None] * len(blocks)
        landed: set[int] = set()

        def recheck(ks: list[int]) -> list[int]:
            # Stored by another process since the caller missed: read it, do not fetch again.
            names = [self.identity.key(*blocks[k]) for k in ks]
            t0, found = time.perf_counter(), []
            for k, name, entry in zip(ks, names, self.cache.entries_for(names)):
                if entry is not None and (data := self.cache.get(name)) is not None:
                    out[k] = data
                    found.append(k)
            if found:
                record_cache(True, len(found), sum(len(out[k] or b"") for k in found), t0)
            return found

        def here(ks: list[int]) -> None:
            self._fetch_mine(blocks, ks, {k: ahead[k] for k in ks if k in ahead}, out, strict, gate)

        def land(ks: list[int]) -> None:
            self._land([((blocks[k][0].url, blocks[k][1]), out[k]) for k in ks], None)
            landed.update(ks)

        try:
            # Stored by this process since the caller missed: read it, do not fetch again.
            for k in [k for k in mine if k not in ahead and self.identity.key(*blocks[k]) in known]:
                out[k] = self.cache.get(self.identity.key(*blocks[k]))
            land([k for k in mine if out[k] is not None])
            rest = [k for k in mine if out[k] is None and k not in ahead]
            self._once_per_node(rest, [(blocks[k][0].url, blocks[k][1]) for k in rest], recheck, here, land,
                                carried=list(ahead))
        except BaseException as err:
            self._land([((blocks[k][0].url, blocks[k][1]), out[k]) for k in mine if k not in landed], err)
            raise
        for k, future in waits.items():
            out[k] = future.result(timeout=self.settings.fetch_wait_s)  # the fetching thread's error, if it failed
        return cast("list[bytes]", out)  # every block was this caller's (fetched above) or waited for

    def fetch_in_turn(self, blocks: Sequence[Block], per_call: int, *, strict: bool = False, gate: Gate | None = None,
                      check: Callable[[], None] | None = None) -> Iterator[int]:
        """Staging's :meth:`fetch`: ``blocks`` stored, ``per_call`` a call, each block's byte count yielded;
        OVERLAP calls at once, so one call's blocks are stored while the next one's GETs run. One call after
        another left the link idle while each stored: staging a 2 GB object spent more time storing than
        fetching (benchmarks/large). ``check`` runs before each call (staging's stop).

        Blocks this process stored since the caller listed them (a host that ignores Range streams a whole
        object in its first call) are counted, not read back: that read held two calls' blocks in memory
        (128 MB of a 256 MB object) and read what was just written."""
        calls: collections.deque[Future[list[bytes]]] = collections.deque()
        known = self.cache.known
        with ThreadPoolExecutor(OVERLAP, thread_name_prefix="fastload-fetch-turn") as pool:
            try:
                for k in range(0, len(blocks), per_call):
                    part = []
                    for b in blocks[k : k + per_call]:
                        if self.identity.key(*b) in known:
                            start, end = self.identity.span(*b)
                            yield end - start
                        else:
                            part.append(b)
                    if not part:
                        continue
                    # A host whose Range support is unknown is probed by a call (_fetch_mine) and, if it ignores
                    # Range, sent one GET of the whole object: that call runs alone, never beside its twin
                    # (tests/integration/test_rangeless_stream.py: one GET, bounded memory).
                    alone = any(self.sources.of(item.url).honours_ranges(item.url) is None for item, _ in part)
                    while calls and (alone or len(calls) >= OVERLAP):
                        yield from map(len, calls.popleft().result())
                    if check is not None:
                        check()
                    calls.append(pool.submit(self.fetch, part, strict=strict, gate=gate))
                    if alone:
                        yield from map(len, calls.popleft().result())
                while calls:
                    yield from map(len, calls.popleft().result())
            finally:
                for call in calls:
                    call.cancel()

    def _fetch_mine(self, blocks: Sequence[Block], mine: list[int], ahead: dict[int, Flight],
                    out: list[bytes | None], strict: bool, gate: Gate | None) -> None:
        if not mine:
            return
        t0 = time.perf_counter()
        spans = {k: self.identity.span(*blocks[k]) for k in mine}
        fetched: dict[int, bytes | Exception] = {}
        streamed: set[int] = set()
        self._settle([f.future for f in ahead.values()])
        for k, flight in ahead.items():
            item = blocks[k][0]
            try:
                fetched[k] = self.sources.of(item.url).finish_first(item, self.ahead_bytes, flight.future)[1]
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
        # The caller missed each block it asked for (and recheck looked again where another process may
        # have stored it); a whole object's other blocks were not looked up.
        self._store(stored, strict, gate, looked_up=not seen)

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
                    table[(item.url, b)] = Flight(item, Future(), False)
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

