"""Reading remote objects through the cache: listings, reads, misses.

:class:`Reader` is the one place that joins a :class:`~fastload.source.Source`
(the remote) with the :class:`~fastload.cache.Cache` (the local disk). Datasets,
``fastload.open``, the ``fastload::`` fsspec protocol and staging all go
through it, so they share one identity (:mod:`fastload.fetch.identity`); its misses,
fetches ahead and staging's fetches all go to its :class:`~fastload.fetch.Fetcher`,
the one fetch path, which never calls back into the Reader.

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
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fastload.cache import Cache
from fastload.cache.gather import ROW_RAW
from fastload.config import Settings, format_size
from fastload.errors import ConfigError, EmptyDatasetError
from fastload.fetch import Fetcher
from fastload.fetch.identity import Identity
from fastload.read.located import Located
from fastload.source import RemoteItem
from fastload.source.sources import Sources
from fastload.stats import record_cache


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

    Its parts, each its own layer: ``sources`` (one :class:`~fastload.source.Source`
    per protocol), ``identity`` (keys, spans, pins, manifests:
    :mod:`fastload.fetch.identity`) and ``fetcher`` (the fetch layer: every miss, fetch
    ahead and staging fetch, :mod:`fastload.fetch`).

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
        # Set to end this reader's requests: none starts or retries after it, waits for a
        # slot end, requests on fsspec's event loop are cancelled (Source; staging's Ctrl-C).
        # For good: a stopped Reader is dropped.
        self.stop = threading.Event()
        self.sources = Sources(self.storage_options, self.settings, self.stop)
        self.identity = Identity(self.settings, self.cache)
        self.fetcher = Fetcher(self.settings, self.cache, self.identity, self.sources)
        self.hits = 0

    @property
    def misses(self) -> int:
        """Blocks this reader's Fetcher fetched (each a cache miss)."""
        return self.fetcher.misses

    def __getstate__(self) -> dict[str, Any]:
        # Workers get settings, not handles: the cache and sockets reopen in the child.
        return {"settings": self.settings, "storage_options": self.storage_options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["settings"], state["storage_options"])  # type: ignore[misc]

    # -- identity ---------------------------------------------------------------

    def canonical(self, url: str) -> str:
        """The canonical URL used as identity in the cache."""
        return self.sources.of(url).canonical(url)

    def stat(self, url: str, *, refresh: bool = False) -> RemoteItem:
        """Size and version of ``url``: from its pin if it has one, else from the remote."""
        url = self.canonical(url)
        pinned = None if refresh else self.identity.pin_of(url)
        return pinned if pinned is not None else self.sources.of(url).info(url)

    # -- listing (manifests) --------------------------------------------------

    def list(self, url: str | Sequence[str], pattern: str | None = None, *, refresh: bool = False,
             complete: bool = True) -> list[RemoteItem]:
        """List a dataset once and record it; later calls (any process) reuse the record.

        ``url`` is a folder, prefix or object URL, or a sequence of object URLs (no
        listing then: each URL is an item, in order). A recorded listing of the whole
        folder (no pattern), or of a folder above it, serves any pattern under it, so
        a new pattern needs no remote round trip.

        With ``complete=False`` items whose size the listing lacked come back with
        ``size == -1`` and no manifest is saved; the caller completes them and saves
        the manifest (:meth:`Identity.save_manifest`; this is how staging overlaps HEADs with transfers).

        Raises:
            ConfigError: ``pattern`` with a URL list: there is no listing to filter. This is
                the one check (datasets, ``fastload.stage``); a pattern was dropped silently.
        """
        if not isinstance(url, str):
            if pattern is not None:
                raise ConfigError(f"pattern={pattern!r} filters a listing and a URL list has none; fix: filter the "
                                  "list itself, or pass the folder's URL with the pattern")
            return self._list_urls(url, refresh=refresh, complete=complete)
        root = self.manifest_root(url)
        if not refresh:
            recorded = self.identity.recorded(root, pattern)
            if recorded is not None:
                return recorded
        items = self.sources.lister(url).list(pattern, complete=complete)
        if all(i.size >= 0 for i in items):
            self.identity.save_manifest(root, pattern, items)
        return items

    def _list_urls(self, urls: Sequence[str], *, refresh: bool, complete: bool) -> builtins.list[RemoteItem]:
        """The items of a URL list, in its order: sizes from the recorded manifest or pins, else
        ``-1`` (completed by each item's first GET, as a sizeless listing's are)."""
        checked = _checked_urls(urls)
        root = self.manifest_root(checked)
        if not refresh:
            recorded = self.identity.manifest(root, None)
            if recorded is not None:
                return recorded
        items = [RemoteItem(self.canonical(u), -1, "") for u in checked]
        if not refresh:
            items = self.identity.pinned(items)
        if complete and any(i.size < 0 for i in items):
            items = [self.sources.of(i.url).complete(i) if i.size < 0 else i for i in items]
        if all(i.size >= 0 for i in items):
            self.identity.save_manifest(root, None, items)
        return items

    def manifest_root(self, url: str | Sequence[str]) -> str:
        """The canonical root URL under which a dataset's manifest is recorded; for a URL
        list, ``urls:<count>:<digest of the URLs>``."""
        if not isinstance(url, str):
            urls = _checked_urls(url)
            digest = hashlib.sha256("\n".join(self.canonical(u) for u in urls).encode()).hexdigest()[:16]
            return f"urls:{len(urls)}:{digest}"
        return self.sources.of(url).canonical(url).rstrip("/")

    # -- reads --------------------------------------------------------------------

    def read_block(self, item: RemoteItem, block: int) -> bytes:
        """One block of ``item``: from the cache, or fetched (fastload.fetch), stored and returned."""
        t0 = time.perf_counter()
        data = self.cache.get(self.identity.key(item, block))
        if data is not None:
            self.record_hits(1, len(data), t0)
            return data
        return self.fetcher.fetch([(item, block)])[0]

    def fits(self, items: Sequence[RemoteItem]) -> bool:
        """Whether ``items`` (their sizes known so far) fit the cache limit in force."""
        return sum(i.plan_size for i in items if i.plan_size > 0) <= self.cache.limit_bytes()

    def warn_if_oversized(self, items: builtins.list[RemoteItem]) -> None:
        """Warn once when a dataset is larger than the cache limit (it will stream)."""
        total = sum(i.size for i in items)
        limit = self.cache.limit_bytes()  # capped by the disk's free space less its reserve
        if total > limit:
            capped = limit < self.settings.cache_limit_bytes
            self.fetcher.warn_streaming(
                f"dataset is {format_size(total)} but the cache limit {'in force ' if capped else ''}is "
                f"{format_size(limit)}{' (the disk has no more room)' if capped else ''}; items will be evicted and "
                f"refetched each epoch ({'free space on the cache disk' if capped else 'raise --cache-limit / FASTLOAD_CACHE_LIMIT'}"
                " to cache it all)"
            )

    def record_hits(self, items: int, nbytes: int, t0: float) -> None:
        """Count ``items`` blocks read from the cache since ``t0`` (op ``cache_read``)."""
        self.hits += items
        record_cache(True, items, nbytes, t0)

    def read_into(self, requests: Sequence[tuple[RemoteItem, int, int, int]], out: Any,
                  fresh: Mapping[str, bytes] | None = None) -> None:
        """Bytes ``[start, end)`` of each item into ``out`` at byte ``dst``, as one batch.

        The batch-assembly path of the datasets' ``read_batch``: the blocks the
        requests touch are read through :meth:`Cache.read_into` (checked and decoded
        once per call however many ranges they serve, in C when it is built), and
        the blocks that miss are fetched together (:meth:`Fetcher.fetch`).

        Args:
            requests: ``(item, start, end, dst)`` with ``0 <= start <= end <= item.size``.
            out: A writable, C-contiguous buffer (see :func:`fastload.cache.gather.gather`).
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
                step = plan.get(key := self.identity.key(item, block))
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
            spans = [self.identity.span(plan[k][0], plan[k][1]) for k in hit]
            self.record_hits(len(hit), sum(b - a for a, b in spans), t0)
        if missed:
            steps = [plan[keys[i]] for i in missed]
            for (_, _, copies), got in zip(steps, self.fetcher.fetch([(it, b) for it, b, _ in steps])):
                data = memoryview(got)
                for lo, n, dst in copies:
                    view[dst : dst + n] = data[lo : lo + n]

    def read_samples(self, items: Sequence[RemoteItem], offsets: Sequence[int], out: Any,
                     fresh: Mapping[str, bytes] | None = None, located: Located | None = None,
                     indices: Sequence[int] = ()) -> None:
        """Each of ``items`` whole into ``out`` at its offset: :meth:`read_into` of
        ``(item, 0, item.size, offset)``, with the entries of those that have a slot in
        ``located`` (by ``indices``, the samples' indices) read as they are, looked up by
        no key. The slots of single-block items read are filled, and emptied where they missed."""
        if located is None or fresh:  # a cold batch (fresh blocks) looks its entries up as it stores them
            self.read_into([(item, 0, item.size, off) for item, off in zip(items, offsets)], out, fresh)
            if located is not None:  # so the first warm epoch reads rows, as the later ones do
                self._locate(located, items, indices)
            return
        picks = np.asarray(indices, dtype=np.int64)
        have = located.has(picks)
        rest = np.flatnonzero(~have).tolist()
        if len(rest) < len(picks):
            t0 = time.perf_counter()
            pos = np.flatnonzero(have)
            missed = self.cache.read_rows(located, picks[pos], np.asarray(offsets, dtype=np.uint64)[pos], out)
            if missed:
                rest += pos[missed].tolist()
                pos = np.delete(pos, missed)
            self.record_hits(len(pos), int(located.table[picks[pos], ROW_RAW].sum()), t0)
        if rest:
            self.read_into([(items[k], 0, items[k].size, offsets[k]) for k in rest], out)
            self._locate(located, [items[k] for k in rest], [indices[k] for k in rest])

    def _locate(self, located: Located, items: Sequence[RemoteItem], indices: Sequence[int]) -> None:
        """Fill the slots of those single-block ``items`` (at ``indices``) that a read just looked up
        or stored (the memo holds them), and empty the rest; the memo then forgets them."""
        memo, bb = self.cache.known, self.settings.block_bytes
        small = [k for k in range(len(items)) if 0 <= items[k].size <= bb]
        keys = [self.identity.key(items[k], 0) for k in small]
        located.put([indices[k] for k in small], [memo.get(key) for key in keys])
        self.cache.forget(keys)  # the rows hold them now

    # -- whole objects and ranges ---------------------------------------------

    def read(self, url: str | RemoteItem, fresh: Mapping[str, bytes] | None = None) -> bytes:
        """The whole object at ``url``, through the cache (``fresh``: as :meth:`read_into`)."""
        item = url if isinstance(url, RemoteItem) else self.stat(url)
        parts = [fresh[k] if fresh and (k := self.identity.key(item, b)) in fresh else self.read_block(item, b) for b in self.identity.blocks(item)]
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
