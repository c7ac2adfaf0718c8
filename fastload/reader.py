"""Reading remote objects through the cache: manifests, blocks, misses.

:class:`Reader` is the one place that joins a :class:`~fastload.source.Source`
(the remote) with the :class:`~fastload.cache.Cache` (the local disk). Datasets,
``fastload.open``, the ``fastload::`` fsspec protocol and staging all go
through it, so they share one identity; its misses, fetches ahead and staging's
fetches all go to its :class:`~fastload.fetch.Fetcher`, the one fetch path.

**Manifests.** Listing a dataset (``Reader.list``) records the listing and each
object's fingerprint (size + ETag/mtime) in the cache index. Afterwards, reading
any listed URL uses the recorded fingerprint and makes no remote round trip:
a staged dataset trains with its remote unreachable. The manifest is a
snapshot; ``refresh=True`` (``fastload cache --refresh``) re-lists and picks up
changes. A URL that no manifest covers is re-checked with one ``info`` call per
open, so a changed remote is never served stale.

**Blocks.** Objects are cached in fixed-size blocks of ``Settings.block_bytes``;
an object smaller than that is one block. Random access into a multi-GB tar
shard or .npy file fetches only the blocks it touches.
"""

from __future__ import annotations

import builtins
import hashlib
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from fastload.cache import Cache, entry_key, keys
from fastload.config import Settings, format_size
from fastload.errors import (
    ConfigError,
    EmptyDatasetError,
)
from fastload.fetch import Fetcher
from fastload.source import RemoteItem, Source, glob_to_regex, nothing_matched
from fastload.stats import current_collector

_log = logging.getLogger("fastload")



KEYS_MAX = 1 << 20  # cache keys remembered per Reader


def _checked_urls(urls: Sequence[str]) -> builtins.list[str]:
    """``urls`` as a list of URL strings, or an error naming the first bad entry (never the whole list)."""
    if isinstance(urls, (bytes, bytearray)) or not isinstance(urls, Sequence):
        raise ConfigError(f"a dataset URL must be a string or a sequence of URL strings, not {type(urls).__name__}")
    out = list(urls)
    if not out:
        raise EmptyDatasetError("the URL list is empty; fix: pass at least one URL")
    for k, u in enumerate(out):
        if not isinstance(u, str) or not u:
            shown = repr(u) if len(repr(u)) <= 60 else repr(u)[:57] + "..."
            raise ConfigError(f"URL list entry {k} is {shown} ({type(u).__name__}), not a URL string; "
                              "fix: pass strings such as 's3://bucket/key.jpg'")
    return out


class Reader:
    """Reads objects of one storage location through the cache.

    Args:
        settings: Cache and remote settings (defaults from ``FASTLOAD_*``).
        storage_options: fsspec options for the remote (credentials, endpoint).
        cache: An open cache to share; one is opened from ``settings`` otherwise.
    """

    def __init__(
        self,
        settings: Settings | None = None,
        storage_options: dict[str, Any] | None = None,
        cache: Cache | None = None,
    ) -> None:
        self.settings = settings or (cache.settings if cache else Settings.from_env())
        self.storage_options = dict(storage_options or {})
        self.cache = cache or Cache(self.settings)
        self._sources: dict[str, Source] = {}
        # Set to end this reader's requests: none starts or retries after it, waits for a
        # slot end, requests on fsspec's event loop are cancelled (Source; staging's Ctrl-C).
        # For good: a stopped Reader is dropped.
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._keys: dict[tuple[RemoteItem, int], str] = {}
        # Pins this reader has read or written (url -> size, version): a warm fastload.open asks the
        # index once per URL, as a dataset lists once. Another process's --refresh is seen by new readers.
        self._pins: dict[str, tuple[int, str]] = {}
        self.fetcher = Fetcher(self)  # every miss, fetch ahead and staging fetch goes through it
        self._warned_limit = False
        self._warned_blocks = False  # _note_block_size, once per reader
        self.hits = 0
        self.misses = 0

    def __getstate__(self) -> dict[str, Any]:
        # Workers get settings, not handles: the cache and sockets reopen in the child.
        return {"settings": self.settings, "storage_options": self.storage_options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["settings"], state["storage_options"])  # type: ignore[misc]

    # -- sources and identity -------------------------------------------------

    def source(self, url: str) -> Source:
        """The Source for ``url``'s filesystem (one per protocol, reused)."""
        protocol = url.split("://", 1)[0] if "://" in url else "file"
        with self._lock:
            src = self._sources.get(protocol)
            if src is None:
                src = self._sources[protocol] = Source(url, self.storage_options, self.settings, self.stop)
        return src

    def canonical(self, url: str) -> str:
        """The canonical URL used as identity in the cache."""
        return self.source(url).canonical(url)

    def stat(self, url: str, *, refresh: bool = False) -> RemoteItem:
        """Size and version of ``url``: from a manifest if one covers it, else from the remote."""
        url = self.canonical(url)
        if not refresh:
            pinned = self._pins.get(url)
            if pinned is None:
                pinned = self.cache.index.get(keys.pin(url))
                if pinned is not None:
                    self._remember_pins({url: pinned})
            if pinned is not None:
                return RemoteItem(url, int(pinned[0]), str(pinned[1]))
        return self.source(url).info(url)

    def _remember_pins(self, pins: Mapping[str, tuple[int, str]]) -> None:
        if len(self._pins) + len(pins) > KEYS_MAX:
            self._pins.clear()  # bounded memory; the index still has every pin
        self._pins.update(pins)

    # -- listing (manifests) --------------------------------------------------

    def list(self, url: str | Sequence[str], pattern: str | None = None, *, refresh: bool = False,
             complete: bool = True) -> list[RemoteItem]:
        """List a dataset once and record it; later calls (any process) reuse the record.

        ``url`` is a folder, prefix or object URL, or a sequence of object URLs (no
        listing then: each URL is an item, in order). A recorded listing of the whole
        folder (no pattern), or of a folder above it, serves any pattern under it, so
        a new pattern needs no remote round trip.

        With ``complete=False`` items whose size the listing lacked come back with
        ``size == -1`` and no manifest is saved; the caller completes them and calls
        :meth:`save_manifest` (this is how staging overlaps HEADs with transfers).

        Raises:
            ConfigError: ``pattern`` with a URL list: there is no listing to filter. This is
                the one check (datasets, ``fastload.stage``); a pattern was dropped silently.
        """
        if not isinstance(url, str):
            if pattern is not None:
                raise ConfigError(f"pattern={pattern!r} filters a listing and a URL list has none; fix: filter the "
                                  "list itself, or pass the folder's URL with the pattern")
            return self._list_urls(url, refresh=refresh, complete=complete)
        src = self.source(url)
        root = src.canonical(url).rstrip("/")
        if not refresh:
            recorded = self.recorded(root, pattern)
            if recorded is not None:
                return recorded
        items = Source(url, self.storage_options, self.settings, self.stop).list(pattern, complete=complete)
        if all(i.size >= 0 for i in items):
            self.save_manifest(root, pattern, items)
        return items

    def recorded(self, root: str, pattern: str | None) -> builtins.list[RemoteItem] | None:
        """``root``'s items matching ``pattern`` from a recorded listing (its own, or a whole-folder
        one of it or of a folder above it); None when none is recorded. ``root``: :meth:`manifest_root`."""
        manifest = self.cache.index.get(keys.manifest(root, pattern))
        if manifest is not None:
            items = [RemoteItem.from_json(r) for r in manifest["items"]]
            self._note_block_size(manifest, items)
            return items
        return self._covered(root, pattern)

    def _note_block_size(self, manifest: dict[str, Any], items: builtins.list[RemoteItem]) -> None:
        """Say once when a listing was recorded under another block size: its objects larger
        than a block are cached per block size, so this reader fetches them again."""
        staged, bb = manifest.get("block_bytes"), self.settings.block_bytes
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
            manifest = self.cache.index.get(keys.manifest(f"{scheme}://{above}" if sep else above, None))
            if manifest is None:
                continue
            rels: dict[str, RemoteItem] = {}
            for row in manifest["items"]:
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

    def _list_urls(self, urls: Sequence[str], *, refresh: bool, complete: bool) -> builtins.list[RemoteItem]:
        """The items of a URL list, in its order: sizes from the recorded manifest or pins, else
        ``-1`` (completed by each item's first GET, as a sizeless listing's are)."""
        checked = _checked_urls(urls)
        root = self.manifest_root(checked)
        if not refresh:
            manifest = self.cache.index.get(keys.manifest(root, None))
            if manifest is not None:
                return [RemoteItem.from_json(r) for r in manifest["items"]]
        items = [RemoteItem(self.canonical(u), -1, "") for u in checked]
        if not refresh:
            items = self.pinned(items)
        if complete and any(i.size < 0 for i in items):
            items = [self.source(i.url).complete(i) if i.size < 0 else i for i in items]
        if all(i.size >= 0 for i in items):
            self.save_manifest(root, None, items)
        return items

    def manifest_root(self, url: str | Sequence[str]) -> str:
        """The canonical root URL under which a dataset's manifest is recorded; for a URL
        list, ``urls:<count>:<digest of the URLs>``."""
        if not isinstance(url, str):
            urls = _checked_urls(url)
            digest = hashlib.sha256("\n".join(self.canonical(u) for u in urls).encode()).hexdigest()[:16]
            return f"urls:{len(urls)}:{digest}"
        return self.source(url).canonical(url).rstrip("/")

    def save_manifest(self, root: str, pattern: str | None, items: builtins.list[RemoteItem]) -> None:
        """Record a listing and pin each item's fingerprint."""
        index = self.cache.index
        with index.transact():
            index.set(keys.manifest(root, pattern), {"created": time.time(), "items": [i.to_json() for i in items],
                                                     "block_bytes": self.settings.block_bytes})
            self.pin(items)

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
        pins = self.pins_of(items)
        recorded = index.get_many(builtins.list(pins))
        with index.transact():
            index.set_many({name: value for name, value in pins.items() if recorded.get(name) != value})

    def pins_of(self, items: builtins.list[RemoteItem]) -> dict[str, tuple[int, str]]:
        """The index rows that pin ``items`` (for :meth:`pin`, or a publishing transaction); this
        reader's :meth:`stat` answers with them from now on."""
        self._remember_pins({item.url: (item.size, item.version) for item in items})
        return {keys.pin(item.url): (item.size, item.version) for item in items}

    def manifests(self) -> builtins.list[dict[str, Any]]:
        """Every recorded manifest: root, pattern, created, items."""
        out = []
        for k in list(self.cache.index.iterkeys()):
            if keys.of(keys.MANIFEST, k) is not None:
                rec = self.cache.index.get(k)
                if rec is not None:
                    root, pattern = keys.manifest_parts(k)
                    out.append({"root": root, "pattern": pattern, **rec})
        return out

    def pinned(self, items: builtins.list[RemoteItem]) -> builtins.list[RemoteItem]:
        """``items``, those without a size filled in from their pins where pinned (one index query)."""
        need = [keys.pin(i.url) for i in items if i.size < 0]
        if not need:
            return items
        pins = self.cache.index.get_many(need)
        out = []
        for item in items:
            pin = pins.get(keys.pin(item.url)) if item.size < 0 else None
            out.append(item if pin is None else RemoteItem(item.url, int(pin[0]), str(pin[1])))
        return out

    # -- blocks ---------------------------------------------------------------

    def blocks(self, item: RemoteItem) -> range:
        """Block indices of ``item`` (at least one, even for an empty object)."""
        return range(max(1, -(-item.size // self.settings.block_bytes)))

    def block_span(self, item: RemoteItem, block: int) -> tuple[int, int]:
        """The byte range [start, end) that block ``block`` covers."""
        start = block * self.settings.block_bytes
        return start, min(item.size, start + self.settings.block_bytes)

    def key(self, item: RemoteItem, block: int) -> str:
        # Remembered: a sha256 per block per read was a tenth of a warm epoch's time.
        key = self._keys.get((item, block))
        if key is None:
            if len(self._keys) >= KEYS_MAX:
                self._keys.clear()
            key = self._keys[(item, block)] = entry_key(item.url, item.size, item.version, block, self.settings.block_bytes)
        return key

    def read_block(self, item: RemoteItem, block: int) -> bytes:
        """One block of ``item``: from the cache, or fetched (fastload.fetch), stored and returned."""
        key = self.key(item, block)
        t0 = time.perf_counter()
        data = self.cache.get(key)
        if data is not None:
            self.record("cache_read", 1, len(data), t0)
            return data
        return self.fetcher.fetch([(item, block)])[0]

    def warn_streaming(self, why: str) -> None:
        """Warn once that this reader serves data it cannot cache."""
        if not self._warned_limit:
            self._warned_limit = True
            _log.warning("fastload is streaming: %s", why)

    def warn_if_oversized(self, items: builtins.list[RemoteItem]) -> None:
        """Warn once when a dataset is larger than the cache limit (it will stream)."""
        total = sum(i.size for i in items)
        limit = self.cache.limit_bytes()  # capped by the disk's free space less its reserve
        if total > limit:
            capped = limit < self.settings.cache_limit_bytes
            self.warn_streaming(
                f"dataset is {format_size(total)} but the cache limit {'in force ' if capped else ''}is "
                f"{format_size(limit)}{' (the disk has no more room)' if capped else ''}; items will be evicted and "
                f"refetched each epoch ({'free space on the cache disk' if capped else 'raise --cache-limit / FASTLOAD_CACHE_LIMIT'}"
                " to cache it all)"
            )

    def record(self, stage: str, items: int, nbytes: int, t0: float) -> None:
        """Count ``items`` cache hits (stage ``cache_read``) or misses (``fetch``) since ``t0``."""
        if stage == "fetch":
            self.misses += items
        else:
            self.hits += items
        # Goes to the running loader's collector (fastload.stats), else the process default.
        collector = current_collector()
        collector.add(stage, items=items, bytes=nbytes, seconds=time.perf_counter() - t0)
        collector.count("cache_miss" if stage == "fetch" else "cache_hit", items)

    def read_into(self, requests: Sequence[tuple[RemoteItem, int, int, int]], out: Any,
                  fresh: Mapping[str, bytes] | None = None) -> None:
        """Bytes ``[start, end)`` of each item into ``out`` at byte ``dst``, as one batch.

        The batch-assembly path of the datasets' ``read_batch``: the blocks the
        requests touch are read through :meth:`Cache.read_into` (checked and decoded
        once per call however many ranges they serve, in C when it is built), and
        the blocks that miss are fetched together (:meth:`Fetcher.fetch`).

        Args:
            requests: ``(item, start, end, dst)`` with ``0 <= start <= end <= item.size``.
            out: A writable, C-contiguous buffer (see :func:`fastload.gather.gather`).
            fresh: Blocks just fetched (cache key -> bytes, from :meth:`Fetcher.complete`):
                copied from memory, not read back from disk, and not counted again.
        """
        bb = self.settings.block_bytes
        plan: dict[str, tuple[RemoteItem, int, builtins.list[tuple[int, int, int]]]] = {}
        for item, start, end, dst in requests:
            if not 0 <= start <= end <= item.size:
                raise ConfigError(f"range [{start}, {end}) of {item.url} ({item.size} B) is invalid")
            for block in range(start // bb, -(-end // bb)) if end > start else ():
                base = block * bb
                lo, hi = max(start, base), min(end, base + bb)
                step = plan.get(key := self.key(item, block))
                if step is None:
                    step = plan[key] = (item, block, [])
                step[2].append((lo - base, hi - lo, dst + lo - start))
        view = memoryview(out).cast("B")
        if fresh:
            for key in [k for k in plan if k in fresh]:
                data = memoryview(fresh[key])  # a slice of bytes would be a copy of its own
                for lo, n, dst in plan.pop(key)[2]:
                    view[dst : dst + n] = data[lo : lo + n]
        keys = list(plan)
        t0 = time.perf_counter()
        missed = self.cache.read_into([(k, plan[k][2]) for k in keys], out)
        if len(missed) < len(keys):
            hit = set(keys) - {keys[i] for i in missed}
            spans = [self.block_span(plan[k][0], plan[k][1]) for k in hit]
            self.record("cache_read", len(hit), sum(b - a for a, b in spans), t0)
        if missed:
            steps = [plan[keys[i]] for i in missed]
            for (_, _, copies), got in zip(steps, self.fetcher.fetch([(it, b) for it, b, _ in steps])):
                data = memoryview(got)
                for lo, n, dst in copies:
                    view[dst : dst + n] = data[lo : lo + n]

    # -- whole objects and ranges ---------------------------------------------

    def read(self, url: str | RemoteItem, fresh: Mapping[str, bytes] | None = None) -> bytes:
        """The whole object at ``url``, through the cache (``fresh``: as :meth:`read_into`)."""
        item = url if isinstance(url, RemoteItem) else self.stat(url)
        parts = [fresh[k] if fresh and (k := self.key(item, b)) in fresh else self.read_block(item, b) for b in self.blocks(item)]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def read_range(self, url: str | RemoteItem, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``url``, touching only the blocks that cover them."""
        item = url if isinstance(url, RemoteItem) else self.stat(url)
        if start < 0 or end < start:
            raise ConfigError(f"range [{start}, {end}) of {item.url} is invalid")
        end = min(end, item.size)
        if start >= end:
            return b""
        bb = self.settings.block_bytes
        parts = []
        for block in range(start // bb, (end - 1) // bb + 1):
            data = self.read_block(item, block)
            lo = max(start - block * bb, 0)
            hi = min(end - block * bb, len(data))
            parts.append(data[lo:hi])
        return b"".join(parts)
