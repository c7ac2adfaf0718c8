"""Block identity: what a cached block of a remote object is called, and what pins it.

Shared by the fetch layer (:mod:`fastload.fetch`, which stores blocks) and the
:class:`~fastload.read.reader.Reader` (which reads them), so neither asks the other:

* **keys**: an object version's block -> its cache key (:meth:`Identity.key`);
* **blocks and spans**: the blocks an object has and the bytes each covers
  (``Settings.block_bytes``; an object smaller than a block is one block);
* **pins**: an object's recorded size and version (index rows ``u:<url>``), so a
  read needs no request to learn them;
* **manifests**: a recorded listing (index rows ``m:<root>...``): a listed dataset
  reads with its remote unreachable, and ``refresh=True`` re-lists.
"""

from __future__ import annotations

import builtins
import itertools
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastload.cache import Cache, entry_key, keys
from fastload.cache.base import MEMO_EVICT
from fastload.cache.entry import STORED_SQL
from fastload.config import Settings, format_size
from fastload.errors import CacheError
from fastload.source import RemoteItem, glob_to_regex, nothing_matched
from fastload.source.listing import no_collection

_log = logging.getLogger("fastload")

KEYS_MAX = 1 << 20  # cache keys (and pins) remembered per Identity: bounded memory
# Items whose pins or keys are built and looked up at a time: recording or counting a
# listing of 100k held ~600 B per item at once (its pin rows, their look-up, their encoding).
ITEMS_PER_PASS = 10_000


@dataclass
class CachedItems:
    """What the cache holds of a sized dataset (:meth:`Identity.cached_whole`, :meth:`Identity.counted_whole`).

    Attributes:
        whole: Positions of the items whose every block is cached (a range when all are).
        blocks: Those items' blocks.
        nbytes: The remote bytes those blocks cover.
        stored: The bytes their entries take in the cache.
    """

    whole: set[int] | range = field(default_factory=set)
    blocks: int = 0
    nbytes: int = 0
    stored: int = 0

    @property
    def items(self) -> int:
        return len(self.whole)

    def missing(self, n: int) -> builtins.list[int]:
        """The positions among a dataset's ``n`` items of those not cached whole."""
        return [] if isinstance(self.whole, range) else [k for k in range(n) if k not in self.whole]


class Identity:
    """The keys, spans, pins and manifests of one cache under one block size."""

    def __init__(self, settings: Settings, cache: Cache) -> None:
        self.block_bytes = settings.block_bytes
        self.cache = cache
        self._keys: dict[tuple[str, int], tuple[RemoteItem, str]] = {}  # (url, block) -> (item, key)
        # Pins read or written here (url -> size, version): a warm fastload.open asks the
        # index once per URL, as a dataset lists once. Another process's --refresh is seen by new readers.
        self._pins: dict[str, tuple[int, str]] = {}
        # Keys and pins remembered at most (each); 0 remembers none: staging computes a key a
        # few times per object and never reads a pin back, and kept ~300 B per object in them.
        self.keys_max = KEYS_MAX
        self._warned_blocks = False  # _note_block_size, once

    # -- blocks -----------------------------------------------------------------

    def blocks(self, item: RemoteItem) -> range:
        """Block indices of ``item`` (at least one, even for an empty object)."""
        return range(max(1, -(-item.size // self.block_bytes)))

    def span(self, item: RemoteItem, block: int) -> tuple[int, int]:
        """The byte range [start, end) that block ``block`` of ``item`` covers."""
        start = block * self.block_bytes
        return start, min(item.size, start + self.block_bytes)

    def key(self, item: RemoteItem, block: int) -> str:
        """The cache key of block ``block`` of ``item`` (this version of it)."""
        # Remembered: a sha256 per block per read was a tenth of a warm epoch's time.
        # By (url, block), the item kept beside its key: a look-up by (item, block) hashed the
        # item's three fields each time (a URL keeps its hash), and read at random over 100k
        # items it took 1.9 us against 0.7 at 10k (issue 31).
        got = self._keys.get((item.url, block))
        if got is not None and (got[0] is item or got[0] == item):
            return got[1]
        key = entry_key(item.url, item.size, item.version, block, self.block_bytes)
        if self.keys_max > 0:
            if len(self._keys) >= self.keys_max:  # the oldest share goes, as in the cache's memo
                for old in list(itertools.islice(self._keys, max(1, self.keys_max // MEMO_EVICT))):
                    del self._keys[old]
            self._keys[(item.url, block)] = (item, key)
        return key

    # -- pins -------------------------------------------------------------------

    def pin_of(self, url: str) -> RemoteItem | None:
        """``url`` (canonical) as recorded by its pin; None when it has none."""
        pinned = self._pins.get(url)
        if pinned is None:
            pinned = self.cache.index.get(keys.pin(url))
            if pinned is None:
                return None
            self._remember({url: pinned})
        return RemoteItem(url, int(pinned[0]), str(pinned[1]))

    def _remember(self, pins: Mapping[str, tuple[int, str]]) -> None:
        if len(self._pins) + len(pins) > self.keys_max:
            self._pins.clear()  # bounded memory; the index still has every pin
        if len(pins) <= self.keys_max:
            self._pins.update(pins)

    def pins_of(self, items: builtins.list[RemoteItem]) -> dict[str, tuple[int, str]]:
        """The index rows that pin ``items`` (for :meth:`pin`, or a publishing transaction);
        :meth:`pin_of` answers with them from now on."""
        self._remember({item.url: (item.size, item.version) for item in items})
        return {keys.pin(item.url): (item.size, item.version) for item in items}

    def pin(self, items: builtins.list[RemoteItem]) -> None:
        """Record each item's size and version, so a read needs no request to learn them.

        Pins already recorded with these values are not written again: a dataset
        completed by its reads has pinned every item with its first block, and its
        manifest is saved by the read of the last batch, at the end of the cold
        epoch: rewriting its 3,000 pins cost ~40 ms there one by one, ~17 ms
        batched; finding them takes one query per 500, ~8 ms in all
        (tests/unit/test_reader_pins.py).
        """
        index = self.cache.index
        with index.transact():
            for first in range(0, len(items), ITEMS_PER_PASS):
                pins = self.pins_of(items[first : first + ITEMS_PER_PASS])
                recorded = index.get_many(builtins.list(pins))
                index.set_many({name: value for name, value in pins.items() if recorded.get(name) != value})

    def pinned(self, items: builtins.list[RemoteItem]) -> builtins.list[RemoteItem]:
        """``items``, those without a size filled in from their pins where pinned (one index query)."""
        need = [keys.pin(i.url) for i in items if i.size < 0]
        if not need or not self.cache.index.names(keys.PIN, limit=1):  # none pinned yet: a first listing
            return items
        pins = self.cache.index.get_many(need)
        out = []
        for item in items:
            pin = pins.get(keys.pin(item.url)) if item.size < 0 else None
            out.append(item if pin is None else RemoteItem(item.url, int(pin[0]), str(pin[1])))
        return out

    # -- what a dataset has cached ----------------------------------------------

    def cached_whole(self, items: builtins.list[RemoteItem]) -> CachedItems:
        """Which sized ``items`` the cache holds whole under this block size, and their stored
        bytes: one index query per 500 keys, each key computed once, no record decoded (STORED_SQL)."""
        whole: builtins.set[int] = set()
        out = CachedItems(whole)
        for first in range(0, len(items), ITEMS_PER_PASS):
            part = items[first : first + ITEMS_PER_PASS]
            names = [[keys.entry(self.key(item, b)) for b in self.blocks(item)] for item in part]
            stored = self.cache.index.select(STORED_SQL, [n for block_names in names for n in block_names])
            for k, (item, block_names) in enumerate(zip(part, names)):
                if all(n in stored for n in block_names):
                    whole.add(first + k)
                    out.blocks += len(block_names)
                    out.nbytes += item.size
                    out.stored += sum(stored[n] for n in block_names)
        return out

    def counted_whole(self, root: str, pattern: str | None, items: builtins.list[RemoteItem],
                      nbytes: int) -> CachedItems | None:
        """The dataset's summary, where it says its recorded listing ``items`` (of ``nbytes``) is
        cached whole and nothing was published or dropped since it was counted (:meth:`current`):
        a rerun of a staged dataset then computes no key and looks up no entry (1.7 s at 100k);
        None otherwise."""
        summaries = self.summaries()
        mine = next((x for x in summaries if (x["root"], x["pattern"]) == (root, pattern)), None)
        sizes = self.block_sizes(summaries)
        # Counted under this block size alone: its stored bytes are then exactly this reader's entries'.
        if mine is None or sizes != {self.block_bytes} or not self.current(mine, sizes) \
                or mine.get("cached_items") != len(items) or mine.get("items") != len(items):
            return None
        return CachedItems(whole=range(len(items)), blocks=sum(len(self.blocks(i)) for i in items), nbytes=nbytes,
                           stored=mine["stored_bytes"])

    def stored_bytes(self, items: builtins.list[RemoteItem]) -> int:
        """The bytes the sized ``items``' entries take in the cache (keys computed a pass at a time)."""
        return sum(self.cache.stored_bytes([self.key(item, b) for item in items[k : k + ITEMS_PER_PASS]
                                            if item.size >= 0 for b in self.blocks(item)])
                   for k in range(0, len(items), ITEMS_PER_PASS))

    # -- manifests --------------------------------------------------------------

    def save_manifest(self, root: str, pattern: str | None, items: builtins.list[RemoteItem]) -> None:
        """Record a listing, its summary, and pin each item's fingerprint.

        Its rows go in chunks of ITEMS_PER_PASS, one index row each, under a small head row.
        One row of all of them held ~240 B per item at once while it was encoded and bound
        (100k, tracemalloc), and at ten million objects it would pass SQLite's limit on one
        value (SQLITE_MAX_LENGTH, 1e9 bytes) and not be recorded at all.
        """
        index = self.cache.index
        created = time.time()
        chunks = range(0, len(items), ITEMS_PER_PASS)
        with index.transact():
            self._drop_chunks(root, pattern)
            for n, first in enumerate(chunks):
                index.set(keys.manifest_chunk(root, pattern, n),
                          [i.to_json() for i in items[first : first + ITEMS_PER_PASS]])
            index.set(keys.manifest(root, pattern), {"created": created, "chunks": len(chunks), "count": len(items),
                                                     "block_bytes": self.block_bytes})
            index.set(keys.summary(root, pattern), _summary(items, self.block_bytes, created))
            self.pin(items)

    def forget_manifest(self, root: str, pattern: str | None) -> None:
        """Drop a recorded listing: its head, its chunks and its summary."""
        index = self.cache.index
        with index.transact():
            self._drop_chunks(root, pattern)
            index.delete(keys.manifest(root, pattern))
            index.delete(keys.summary(root, pattern))

    def _drop_chunks(self, root: str, pattern: str | None) -> None:
        for name in self.cache.index.names(keys.manifest_chunks(root, pattern)):
            self.cache.index.delete(name)

    def _rows(self, root: str, pattern: str | None, head: dict[str, Any]) -> Iterator[builtins.list[Any]]:
        """The rows of a manifest, chunk by chunk (a manifest recorded before chunks: its own)."""
        if "items" in head:
            yield from head["items"]
            return
        index = self.cache.index
        names = sorted(index.names(keys.manifest_chunks(root, pattern)))
        if len(names) != head.get("chunks"):  # written in one transaction: only a foreign hand gets here
            raise CacheError(f"the recorded listing of {root} ({pattern or 'all'}) has {len(names)} of its "
                             f"{head.get('chunks')} chunks; fix: `fastload cache {root} --refresh` records it again")
        for name in names:
            yield from index.get(name) or []

    def _items(self, root: str, pattern: str | None, head: dict[str, Any]) -> builtins.list[RemoteItem]:
        with no_collection():  # a record per row: see the listing's own (fastload.source.listing)
            return [RemoteItem.from_json(r) for r in self._rows(root, pattern, head)]

    def summaries(self) -> builtins.list[dict[str, Any]]:
        """Every recorded manifest's summary (root, pattern, items, remote_bytes, block_bytes,
        created; cached_items, stored_bytes, changes and sizes once counted), without reading
        the manifests' items: one small row each. A manifest recorded before summaries were
        kept gets one here (its items read once)."""
        index = self.cache.index
        out = {}
        for name, rec in index.scan(keys.SUMMARY):
            out[keys.manifest_parts(name)] = rec
        for name in index.names(keys.MANIFEST):
            root_pattern = keys.manifest_parts(name)
            if root_pattern not in out and (m := index.get(name)) is not None:
                out[root_pattern] = rec = _summary(self._items(*root_pattern, m), m.get("block_bytes"),
                                                   m.get("created", 0.0))
                if self.cache.unwritable is None:
                    index.set(keys.summary(*root_pattern), rec)
        return [{"root": root, "pattern": pattern, **rec} for (root, pattern), rec in out.items()]

    def block_sizes(self, summaries: builtins.list[dict[str, Any]]) -> builtins.set[int]:
        """The block sizes a dataset's cached share is counted under: this reader's and every
        one a listing was recorded with. A dataset staged with --block-size counted as 0/800
        under the default one alone (issue 24; tests/unit/test_block_sizes.py)."""
        return {self.block_bytes} | {s["block_bytes"] for s in summaries if s.get("block_bytes")}

    def current(self, summary: dict[str, Any], sizes: builtins.set[int]) -> bool:
        """Whether ``summary``'s cached figures still stand: counted under ``sizes``, with nothing
        published or dropped since."""
        return summary.get("changes") == self.cache.totals()[keys.CHANGES] and summary.get("sizes") == sorted(sizes)

    def summarise(self, root: str, pattern: str | None, items: builtins.list[RemoteItem] | None,
                  sizes: builtins.set[int]) -> dict[str, Any]:
        """Count how much of a recorded dataset is cached under any of ``sizes`` (block sizes),
        record it in its summary, and return the summary.

        Exact, at a cost that grows with the dataset's items, not the cache's entries (one
        index query per 500 keys). The summary keeps the cache's ``changes`` counter as it
        was before the count: while it still reads the same, nothing was published or
        dropped since, and the figures stand (`fastload info` reads them without counting).

        Args:
            items: The dataset's items when the caller has them; None reads its manifest.
        """
        index = self.cache.index
        changes = self.cache.totals()[keys.CHANGES]  # before the count: a change during it makes it stale
        if items is None:
            m = index.get(keys.manifest(root, pattern))
            items = self._items(root, pattern, m) if m is not None else []
        cached_items = stored_bytes = 0
        for first in range(0, len(items), ITEMS_PER_PASS):
            part = items[first : first + ITEMS_PER_PASS]
            whole = [False] * len(part)
            stored: dict[str, int] = {}  # an entry counted once, whichever block size names it
            for bs in sorted(sizes):
                per_item = [_keys_of(item, bs) for item in part]
                columns = index.select(STORED_SQL, [keys.entry(k) for ks in per_item for k in ks])
                for i, ks in enumerate(per_item):
                    hits = [k for k in ks if keys.entry(k) in columns]
                    whole[i] = whole[i] or len(hits) == len(ks)
                    for k in hits:
                        stored[k] = columns[keys.entry(k)]
            cached_items += sum(whole)
            stored_bytes += sum(stored.values())
        rec = index.get(keys.summary(root, pattern)) or _summary(items, None, time.time())
        rec = {**rec, "cached_items": cached_items, "stored_bytes": stored_bytes, "changes": changes,
               "sizes": sorted(sizes)}
        if self.cache.unwritable is None:
            index.set(keys.summary(root, pattern), rec)
        return {"root": root, "pattern": pattern, **rec}

    def manifest(self, root: str, pattern: str | None) -> builtins.list[RemoteItem] | None:
        """The items of the listing recorded for exactly ``root`` and ``pattern``; None when there is none."""
        manifest = self.cache.index.get(keys.manifest(root, pattern))
        if manifest is None:
            return None
        items = self._items(root, pattern, manifest)
        self._note_block_size(manifest, items)
        return items

    def recorded(self, root: str, pattern: str | None) -> builtins.list[RemoteItem] | None:
        """``root``'s items matching ``pattern`` from a recorded listing (its own, or a whole-folder
        one of it or of a folder above it); None when none is recorded. ``root``: a canonical URL."""
        items = self.manifest(root, pattern)
        return items if items is not None else self._covered(root, pattern)

    def _note_block_size(self, manifest: dict[str, Any], items: builtins.list[RemoteItem]) -> None:
        """Say once when a listing was recorded under another block size: its objects larger
        than a block are cached per block size, so this reader fetches them again."""
        staged, bb = manifest.get("block_bytes"), self.block_bytes
        if self._warned_blocks or staged is None or staged == bb:
            return
        larger = [i for i in items if i.size > min(staged, bb)]
        # Those already cached under this block size too (an earlier run's) are not fetched again.
        found = self.cache.entries_for([self.key(i, 0) for i in larger]) if larger else []
        again = [i for i, e in zip(larger, found) if e is None]
        if again:
            self._warned_blocks = True
            _log.warning(
                "%d of the %d objects listed here (%s) were cached in blocks of %s and are read in blocks of %s: "
                "those larger than a block are fetched again and stored a second time (smaller ones are shared); "
                "fix: read with the block size they were staged with (FASTLOAD_BLOCK_SIZE=%s, Settings(block_bytes=)), "
                "or `fastload clear` the dataset and stage it with --block-size %s",
                len(again), len(items), format_size(sum(i.size for i in again)), format_size(staged),
                format_size(bb), staged, bb,
            )

    def _covered(self, root: str, pattern: str | None) -> builtins.list[RemoteItem] | None:
        """``root``'s items matching ``pattern`` from a recorded whole-folder listing of it or of
        a folder above it; None when no such listing holds anything under ``root``."""
        regex = glob_to_regex(pattern) if pattern else None
        scheme, sep, path = root.partition("://")
        parts = (path if sep else scheme).split("/")
        for depth in range(len(parts), 0, -1):
            above = "/".join(parts[:depth])
            folder = f"{scheme}://{above}" if sep else above
            manifest = self.cache.index.get(keys.manifest(folder, None))
            if manifest is None:
                continue
            rels: dict[str, RemoteItem] = {}
            for row in self._rows(folder, None, manifest):
                item = RemoteItem.from_json(row)
                if item.url == root:  # the root is one object: itself, whatever the pattern (as Source.list)
                    return [item]
                if item.url.startswith(root + "/"):
                    rels[item.url[len(root) + 1 :]] = item
            if not rels:
                continue
            items = [item for rel, item in sorted(rels.items()) if regex is None or regex.match(rel)]
            self._note_block_size(manifest, items)
            if not items:
                folders = len({rel.rpartition("/")[0] for rel in rels} - {""})
                raise nothing_matched(root, pattern, folders, builtins.list(rels))
            return items
        return None

    def manifests(self) -> builtins.list[dict[str, Any]]:
        """Every recorded manifest: root, pattern, created, items (RemoteItems)."""
        out = []
        index = self.cache.index
        for k in index.names(keys.MANIFEST):
            rec = index.get(k)
            if rec is not None:
                root, pattern = keys.manifest_parts(k)
                out.append({"root": root, "pattern": pattern, "created": rec.get("created"),
                            "items": self._items(root, pattern, rec)})
        return out


def _summary(items: builtins.list[RemoteItem], block_bytes: int | None, created: float) -> dict[str, Any]:
    return {"items": len(items), "remote_bytes": sum(i.size for i in items if i.size > 0), "block_bytes": block_bytes,
            "created": created}


def _keys_of(item: RemoteItem, block_bytes: int) -> builtins.list[str]:
    """The cache keys of every block of ``item`` under ``block_bytes``."""
    n = max(1, -(-item.size // block_bytes))
    return [entry_key(item.url, item.size, item.version, b, block_bytes) for b in range(n)]
