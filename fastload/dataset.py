"""Map-style datasets that read through the cache.

Each dataset lists its remote once (the listing is recorded as a manifest in
the cache index, so neither later epochs nor DataLoader workers list again),
pickles its settings rather than its handles, and reads samples through
:class:`~fastload.read.reader.Reader`. Every sample carries its URL so errors and
stats can name it. They work with ``fastload.DataLoader`` and with torch's own.

* :class:`FileDataset` - one file per sample (ImageFolder layouts).
* :class:`ArrayDataset` - rows of one ``.npy`` file, or one ``.npy`` file per sample.
* :class:`TokenDataset` - fixed-length windows over a raw 1-D token file.
* :class:`TarDataset` - WebDataset-style tar shards, members grouped by key.

``read_batch(indices)`` is ``fastload.DataLoader``'s hook to read many samples from threads:
a batch is assembled by :meth:`Reader.read_into` (each cache block it touches read, checked and
decoded once, into one buffer, by ``fastload._native`` without the GIL, or its Python fallback).
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch.utils.data
from torch.utils.data import get_worker_info

from fastload.cache import cannot_write, keys
from fastload.cache.gather import FILL_MIN, filled, split
from fastload.config import Settings, parse_size
from fastload.device.worker_pack import Span, read_buffer, split_read
from fastload.errors import ConfigError, DecodeError, EmptyDatasetError
from fastload.fetch import announce
from fastload.read import ahead, gunzip, located, npy
from fastload.read.blocks import DEFAULT_KEPT_BYTES, KeptBlocks, KeptFile, read_ranges
from fastload.read.reader import Reader
from fastload.read.shards import expand_braces, group_members, list_members
from fastload.source import RemoteItem
from fastload.source.items import Picked

Transform = Callable[[Any], Any]
_ALIGN = 64  # sample offsets in a batch buffer, as .npy aligns its data


def _offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Each sample's offset in a batch buffer of ``sizes`` bytes, and the buffer's size."""
    offsets, pos = [], 0
    for size in sizes:
        offsets.append(pos)
        pos += -(-size // _ALIGN) * _ALIGN
    return offsets, pos


def _batch_buffer(sizes: Sequence[int], shared: bool = False) -> tuple[np.ndarray, list[int], bool]:
    """A batch buffer of ``sizes`` bytes, each sample's offset, and whether it is shared (with ``shared``,
    in a packing worker: worker_pack.read_buffer; its bytes are made by worker_pack.split_read)."""
    offsets, end = _offsets(sizes)
    lease = read_buffer(end, spans=False) if shared and sizes else None
    return (np.empty(end, dtype=np.uint8), offsets, False) if lease is None else (lease, offsets, True)


class _CachedDataset(torch.utils.data.Dataset):
    """Shared plumbing: a reader, a recorded listing, a CPU transform hook."""

    def __init__(self, url: str | Sequence[str], pattern: str | None, *, transform: Transform | None,
                 storage_options: dict[str, Any] | None, settings: Settings | None, refresh: bool,
                 lazy_sizes: bool = False) -> None:
        self.url = url if isinstance(url, str) else list(url)
        self.pattern = pattern
        self.transform = transform
        self.reader = Reader(settings, storage_options)
        # lazy_sizes: a listing without sizes (HTTP) is completed by each item's first
        # GET when it is read (Fetcher.complete), not by a HEAD per item up front.
        # A refresh re-checks every item now, so no pin of the old listing is trusted.
        lazy = lazy_sizes and not refresh
        self.items: list[RemoteItem] = self.reader.list(url, pattern, refresh=refresh, complete=not lazy)
        # Where the manifest is recorded; once: for a URL list it is a digest of every URL.
        self._root = self.reader.manifest_root(self.url)
        if not self.items:  # a listing raises EmptyDatasetError itself; this is a manifest recorded empty
            raise EmptyDatasetError(f"{self._root}: the recorded listing holds no items; fix: refresh=True to list it again")
        self._manifest_due = any(i.size < 0 for i in self.items)
        self.items = self.reader.identity.pinned(self.items)
        self._unsized = sum(1 for i in self.items if i.size < 0)
        self._save_if_sized()
        self.reader.warn_if_oversized([i for i in self.items if i.size >= 0])

    def _sized(self, indices: Sequence[int]) -> tuple[list[RemoteItem], dict[str, bytes]]:
        """The items at ``indices``, each with its size (completed on first read), and the
        first blocks fetched to complete them (cache key -> bytes: read from memory, not disk)."""
        items = [self.items[i] for i in indices]
        fresh: dict[str, bytes] = {}
        if self._unsized and any(i.size < 0 for i in items):
            items, fresh = self.reader.fetcher.complete(items)
            self._adopt(indices, items)
        return items, fresh

    def _pinned(self, indices: Sequence[int]) -> list[RemoteItem]:
        """The items at ``indices``, sizeless ones sized from their recorded pins where pinned.

        A DataLoader worker's copy of the listing learns only the sizes it read; what
        another worker (or an earlier epoch's) cached is found through its pin.
        """
        items = [self.items[i] for i in indices]
        if self._unsized and any(i.size < 0 for i in items):
            items = self.reader.identity.pinned(items)
            self._adopt(indices, items)
        return items

    def _size_from_pins(self) -> None:
        """Size every sample still sizeless here from its recorded pin, where one is (Identity.pinned:
        one query per 500 keys, none while nothing is pinned)."""
        if self._unsized:
            self._pinned([k for k, i in enumerate(self.items) if i.size < 0])

    def _adopt(self, indices: Sequence[int], items: Sequence[RemoteItem]) -> None:
        """Keep the sizes learnt for ``items`` (at ``indices``) in the listing."""
        for i, item in zip(indices, items):
            if item.size >= 0 and self.items[i].size < 0:
                self.items[i] = item
                self._unsized -= 1
        self._save_if_sized()

    def _save_if_sized(self) -> None:
        # Once every size is known here, the listing becomes the recorded manifest, so
        # the next dataset over this URL (any process) starts with sizes.
        if self._unsized == 0 and self._manifest_due:
            self._manifest_due = False
            try:
                self.reader.identity.save_manifest(self._root, self.pattern, self.items)
            except sqlite3.OperationalError as err:
                if not cannot_write(err):  # a full or read-only disk only costs the next dataset a listing
                    raise

    def _apply(self, value: Any, url: str | None = None) -> Any:
        if self.transform is None:
            return value
        try:
            return self.transform(value)
        except Exception as err:
            # The transform's own error, type and traceback kept (a caller may catch
            # it), plus the sample it failed on: a corrupt JPEG deep in an epoch was
            # otherwise anonymous (tests/reliability/test_hostile_input.py).
            url = url or (value.get("__url__") if isinstance(value, dict) else None)
            if url is not None:
                # Blame left open: the file may be bad, or the transform may not handle it.
                err.add_note(
                    f"fastload: the transform raised {type(err).__name__} on {url}; "
                    "the file may be bad, or the transform may not handle it"
                )
            raise

    def read_batch(self, indices: Sequence[int]) -> list[Any]:
        """Samples for ``indices``, in order (called from loader threads)."""
        return [self[i] for i in indices]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        # torch's fetcher (in DataLoader workers, or torch's own loader) asks for a
        # whole batch through this hook: one batched read, misses fetched together.
        # In a fastload.DataLoader worker the batch may carry batches this worker reads
        # later (fastload.fetch.Announced): their fetches start first, on this
        # worker's event loop, so the link stays busy across batches.
        fetch_ahead = getattr(self, "fetch_ahead", None)
        if fetch_ahead is not None:
            announce(indices, fetch_ahead)
        return self.read_batch(indices)

    def _own_getitem(self, cls: type[_CachedDataset]) -> bool:
        # A subclass that reads its samples another way (pipelines.CompressedArrayDataset
        # hands out payloads) keeps the one-by-one read_batch above.
        return type(self).__getitem__ is cls.__getitem__


class FileDataset(_CachedDataset):
    """One remote file per sample.

    Args:
        url: Folder or prefix URL (any fsspec protocol), or a sequence of file URLs
            (a CSV column, a text file of URLs, a server without listings): each is
            a sample, in order, with no listing (sizes come from each file's first
            read, and the list is recorded as a manifest like a listing).
        pattern: Glob relative to ``url``, e.g. ``"**/*.jpg"`` (not with a URL list).
        label: ``"parent"`` for ImageFolder layouts (the class folder name, mapped
            to an index in sorted order like torchvision's ImageFolder), a callable
            ``relative_path -> label`` (the URL itself for a URL list), a sequence
            of labels parallel to the samples, or None for no label.
        transform: Applied on CPU to the raw bytes.
        storage_options: fsspec options for the remote.
        settings: Cache settings.
        refresh: Re-list the remote instead of using the recorded manifest.

    A sample is ``{"data": bytes (or transform(bytes)), "label": int, "url": str}``
    (no ``"label"`` when ``label`` is None); torch's default collate turns a
    batch into lists of bytes/URLs and a label tensor.
    """

    def __init__(self, url: str | Sequence[str], pattern: str | None = None, *,
                 label: str | Callable[[str], Any] | Sequence[Any] | None = None,
                 transform: Transform | None = None, storage_options: dict[str, Any] | None = None,
                 settings: Settings | None = None, refresh: bool = False) -> None:
        super().__init__(url, pattern, transform=transform, storage_options=storage_options, settings=settings,
                         refresh=refresh, lazy_sizes=True)
        root = self._root + "/"
        # Each sample's URL, the items' own strings: a located read names its samples with no item touched
        # (at a million samples an item, its size and its URL are three cache misses; read_batch).
        self.urls = [i.url for i in self.items]
        self.relpaths = [u[len(root):] if u.startswith(root) else u for u in self.urls]
        is_parent = isinstance(label, str) and label == "parent"
        if label is not None and not is_parent and not callable(label):
            if isinstance(label, str) or not hasattr(label, "__len__"):
                raise ConfigError(f"label={label!r} is not understood; use 'parent', a callable, a sequence or None")
            label = list(label)  # a column of a table or array: one label per sample
            if len(label) != len(self.items):
                raise ConfigError(f"label= has {len(label)} entries for {len(self.items)} samples; fix: one label per URL")
        self.label = label
        self.classes: list[str] = []
        self.class_to_idx: dict[str, int] = {}
        if is_parent:
            self.classes = sorted({p.rsplit("/", 2)[-2] if "/" in p else "" for p in self.relpaths})
            self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        # Small samples' cache entries by index, if the dataset fits the cache (read.located says why).
        fits = self.reader.fits(self.items)
        self._located = located.Located(len(self.items), self.reader.cache.data_prefix) if fits else None

    def __len__(self) -> int:
        return len(self.items)

    def item_keys(self) -> list[str]:
        """Each sample's URL: its name in node partitions (fastload.read.partition), the same on every node."""
        return list(self.urls)

    def item_sizes(self) -> list[int]:
        """Each sample's size in bytes, for node partitions: the listing's, an nginx or Apache index
        page's exact ones included (Source.plan_sizes); the rest cost one HEAD per item, once (the
        sizes are recorded with the manifest), so every node splits alike."""
        self._size_from_pins()  # what another process pinned meanwhile (a rank beside this one) needs no HEAD
        if self._unsized:
            todo = [k for k, i in enumerate(self.items) if i.size < 0]
            src = self.reader.sources.of(self.items[todo[0]].url)
            sizes, headed = src.plan_sizes([self.items[k] for k in todo])
            self._adopt([todo[j] for j in headed], list(headed.values()))
            planned = dict(zip(todo, sizes))
            return [planned.get(k, i.size) for k, i in enumerate(self.items)]
        return [i.size for i in self.items]

    def label_of(self, index: int) -> Any:
        rel = self.relpaths[index]
        if isinstance(self.label, list):
            return self.label[index]
        if self.label == "parent":
            return self.class_to_idx[rel.rsplit("/", 2)[-2] if "/" in rel else ""]
        return self.label(rel) if callable(self.label) else None

    def __getitem__(self, index: int) -> dict[str, Any]:
        items, fresh = self._sized([index])
        return self._sample(index, self.reader.read(items[0], fresh))

    def _sample(self, index: int, data: bytes | Span) -> dict[str, Any]:
        url = self.urls[index]
        sample: dict[str, Any] = {"data": self._apply(data, url), "url": url}
        if self.label is not None:
            sample["label"] = self.label_of(index)
        return sample

    def fetch_ahead(self, indices: Sequence[int]) -> None:
        """Start fetching the files at ``indices`` ahead of their read (fastload.DataLoader calls it);
        those located in the cache need nothing."""
        todo = list(indices) if self._located is None else self._located.unknown(list(indices))
        if todo:
            self.reader.fetcher.ahead(self._pinned(todo))

    def locate(self) -> int:
        """Before workers fork: size the samples still sizeless here from their recorded pins, fill their
        cache slots from the index (read.located.fill) and, samples left to fetch, make the first one's
        source's route (Source.prepare), all once for every worker. Returns the slots filled. What a worker
        learns dies with it: a parent whose listing came without sizes (HTTP, a URL list) forked workers
        that pinned every batch again and located none, every epoch (issue 36, workers' warm epoch)."""
        self._size_from_pins()
        filled = located.fill(self._located, self.items, self.reader.identity, self.reader.cache) if self._located else 0
        self.reader.sources.of(self.items[0].url).prepare(lambda: self._located is None or not self._located.complete())
        return filled

    def read_batch(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """``[self[i] for i in indices]``, with the files read as one batch."""
        if not self._own_getitem(FileDataset):
            return super().read_batch(indices)
        if self._unsized or self._located is None:
            items, fresh = self._sized(indices)  # sized here: self.items holds them too (_adopt)
            sizes = [item.size for item in items]
        else:
            # A located sample's size is its slot's, and a sample is named by self.urls: no item is
            # touched (at 1M samples read at random, 0.75 us a sample against 0.09 at 10k).
            fresh, sizes = {}, self._located.sizes(indices)
            for k in [k for k, size in enumerate(sizes) if size < 0]:
                sizes[k] = self.items[indices[k]].size
        if self.transform is None and get_worker_info() is not None:
            # A packing worker, no transform to see the bytes: spans of its shared buffer (worker_pack).
            offsets, end = _offsets(sizes)
            lease = read_buffer(end) if sizes else None
            if lease is not None:
                self.reader.read_samples(Picked(self.items, indices), offsets, lease, fresh, self._located, indices)
                return [self._sample(i, Span(off, size)) for i, size, off in zip(indices, sizes, offsets)]
        # A whole object fetched just now is its sample's bytes as it is (no copy in and out).
        data: list[bytes] = [b""] * len(indices)
        rest = list(range(len(indices)))
        if fresh:
            rest = []
            for k, i in enumerate(indices):
                got = fresh.get(self.reader.identity.key(self.items[i], 0))
                if got is None or len(got) != sizes[k]:
                    rest.append(k)
                else:
                    data[k] = got
        # A large sample is read straight into its own bytes (gather.filled): no batch buffer to split.
        for k in [k for k in rest if sizes[k] >= FILL_MIN]:
            made = filled(sizes[k])
            if made is None:
                break
            self.reader.read_samples(Picked(self.items, [indices[k]]), [0], made[1], fresh, self._located, [indices[k]])
            data[k] = made[0]
            rest.remove(k)
        picked = [indices[k] for k in rest]
        out, offsets, shared = _batch_buffer([sizes[k] for k in rest], shared=True)
        self.reader.read_samples(Picked(self.items, picked), offsets, out, fresh, self._located, picked)
        spans = [(off, sizes[k]) for k, off in zip(rest, offsets)]
        for k, got in zip(rest, split_read(out, spans) if shared else split(out, spans)):
            data[k] = got
        return [self._sample(index, d) for index, d in zip(indices, data)]


class ArrayDataset(_CachedDataset):
    """Rows of one ``.npy`` file (``url`` is the file), or one ``.npy`` per sample (``url`` is a folder).

    Rows are read with ranged reads through cached blocks, so a 50 GB array is
    never downloaded whole for one row. ``url`` may also be a list of ``.npy`` URLs
    (one sample each; ``pattern`` does not apply). A sample is ``{"data": ndarray, "url": str,
    "index": int}``.
    """

    def __init__(self, url: str | Sequence[str], pattern: str | None = "**/*.npy", *, transform: Transform | None = None,
                 storage_options: dict[str, Any] | None = None, settings: Settings | None = None, refresh: bool = False) -> None:
        super().__init__(url, pattern if isinstance(url, str) else None, transform=transform, storage_options=storage_options, settings=settings, refresh=refresh)
        self.single = len(self.items) == 1 and self.items[0].url.rstrip("/") == self._root
        self.dtype: np.dtype | None = None
        self.shape: tuple[int, ...] = ()
        if self.single:
            item = self.items[0]
            head = self.reader.read_range(item, 0, min(item.size, npy.HEADER_MAX))
            self.dtype, self.shape, fortran, self.offset = npy.parse_header(head, item.url)
            self.row_dtype: np.dtype = self.dtype
            if fortran or not self.shape:
                raise DecodeError(
                    f"{item.url}: need a C-ordered array with at least one dimension; "
                    "fix: numpy.save(path, numpy.ascontiguousarray(a))"
                )
            # Python ints: np.prod(dtype=int64) wrapped around on a hostile shape such as
            # (2, 2**62, 4), passed the size check and failed later in reshape.
            self.row_bytes = math.prod(self.shape[1:]) * self.dtype.itemsize
            if self.offset + self.shape[0] * self.row_bytes > item.size:
                raise DecodeError(
                    f"{item.url}: header says {self.shape} {self.dtype} but the file is only {item.size} B; "
                    "fix: rewrite it with numpy.save (the header disagrees with the data)"
                )

    def __len__(self) -> int:
        return self.shape[0] if self.single else len(self.items)

    def _row(self, index: int) -> int:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} rows")
        return index % len(self)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self.single:
            index = self._row(index)
            item = self.items[0]
            start = self.offset + index * self.row_bytes
            raw = self.reader.read_range(item, start, start + self.row_bytes)
            arr = np.frombuffer(raw, dtype=self.row_dtype).reshape(self.shape[1:])
        else:
            item = self.items[index]
            raw = self.reader.read(item)
            arr = npy.array_at(memoryview(raw), 0, len(raw), item.url)
        return {"data": self._apply(arr), "url": item.url, "index": index}

    def read_batch(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """``[self[i] for i in indices]``, read as one batch; rows are views of one array."""
        if not self._own_getitem(ArrayDataset):
            return super().read_batch(indices)
        if self.single:
            rows, item, n = [self._row(i) for i in indices], self.items[0], self.row_bytes
            out = np.empty((len(rows), *self.shape[1:]), dtype=self.row_dtype)
            starts = [self.offset + r * n for r in rows]
            self.reader.read_into([(item, a, a + n, k * n) for k, a in enumerate(starts)], out)
            return [{"data": self._apply(out[k]), "url": item.url, "index": r} for k, r in enumerate(rows)]
        items = [self.items[i] for i in indices]
        buf, offsets, _ = _batch_buffer([item.size for item in items])  # not shared: its arrays are views of it
        self.reader.read_into([(item, 0, item.size, off) for item, off in zip(items, offsets)], buf)
        return [
            {"data": self._apply(npy.array_at(buf.data, off, item.size, item.url)), "url": item.url, "index": index}
            for index, item, off in zip(indices, items, offsets)
        ]


class TokenDataset(_CachedDataset):
    """Fixed-length windows over a raw 1-D token file (a common LM pattern).

    Sample ``i`` is ``tokens[i*stride : i*stride + seq_len]`` as an ndarray of
    ``dtype``; only the cached blocks a window touches are fetched.

    Args:
        url: The token file (raw little-endian integers, no header).
        seq_len: Tokens per sample (use ``context + 1`` for input/target pairs).
        dtype: Token dtype, e.g. ``"uint16"`` or ``"int32"``.
        stride: Tokens between window starts (default ``seq_len``: no overlap).
    """

    def __init__(self, url: str, seq_len: int, *, dtype: str = "int32", stride: int | None = None,
                 transform: Transform | None = None, storage_options: dict[str, Any] | None = None,
                 settings: Settings | None = None, refresh: bool = False) -> None:
        super().__init__(url, None, transform=transform, storage_options=storage_options, settings=settings, refresh=refresh)
        if len(self.items) != 1:
            raise ConfigError(f"TokenDataset needs one token file; {url} lists {len(self.items)} objects")
        self.dtype = np.dtype(dtype)
        self.seq_len, self.stride = int(seq_len), int(stride or seq_len)
        if self.seq_len < 1 or self.stride < 1:
            raise ConfigError(f"seq_len={seq_len} and stride={stride} must be positive")
        item = self.items[0]
        if item.size % self.dtype.itemsize:
            raise DecodeError(f"{item.url}: {item.size} B is not a whole number of {self.dtype} tokens; check dtype=")
        self.n_tokens = item.size // self.dtype.itemsize
        if self.n_tokens < self.seq_len:  # no window fits: length 0 trained on nothing, silently
            raise EmptyDatasetError(
                f"{item.url}: {self.n_tokens} {self.dtype} tokens ({item.size} B), fewer than one window of "
                f"seq_len={self.seq_len}; fix: a seq_len of at most {self.n_tokens}, or a larger token file"
            )
        self._len = (self.n_tokens - self.seq_len) // self.stride + 1

    def __len__(self) -> int:
        return self._len

    def _window(self, index: int) -> int:
        if not -self._len <= index < self._len:
            raise IndexError(f"window {index} out of range for {self._len} windows")
        return index % self._len

    def __getitem__(self, index: int) -> dict[str, Any]:
        index = self._window(index)
        item, size = self.items[0], self.dtype.itemsize
        start = index * self.stride * size
        raw = self.reader.read_range(item, start, start + self.seq_len * size)
        return {"data": self._apply(np.frombuffer(raw, dtype=self.dtype)), "url": item.url, "index": index}

    def read_batch(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """``[self[i] for i in indices]``, read as one batch; windows are rows of one array."""
        if not self._own_getitem(TokenDataset):
            return super().read_batch(indices)
        windows, item = [self._window(i) for i in indices], self.items[0]
        out = np.empty((len(windows), self.seq_len), dtype=self.dtype)
        n, step = self.seq_len * self.dtype.itemsize, self.stride * self.dtype.itemsize
        self.reader.read_into([(item, w * step, w * step + n, k * n) for k, w in enumerate(windows)], out)
        return [{"data": self._apply(out[k]), "url": item.url, "index": w} for k, w in enumerate(windows)]


class TarDataset(ahead.TarAhead, _CachedDataset):
    """WebDataset tar shards: consecutive members sharing a key are one sample.

    Shards are indexed once (the index is stored in the cache index beside the
    manifest) and members are read with ranged reads through cached blocks.
    Keys and suffixes follow webdataset's own rule (:mod:`fastload.read.shards`): the key
    is the member's path up to the first dot of its file name, the suffix (lowercased)
    all after it; members with no suffix and webdataset's ``__meta__`` members are
    skipped, as webdataset skips them. Member names are never trusted as paths: they are
    only strings used to group members; nothing is ever extracted to disk, and non-file
    members (links, devices) are skipped. A sample is ``{"__key__": key, "__url__":
    shard_url, "<suffix>": bytes, ...}``, the keys a ``webdataset.WebDataset`` pipeline yields.

    Reads: ``read_batch`` (what ``fastload.DataLoader`` calls) reads a batch's members
    together, each cache block they touch read, checked and decoded once, and keeps
    decoded blocks in memory (``kept_bytes``, least recently used dropped first), so the
    next members of a kept block are copies from memory (:mod:`fastload.read.blocks`).

    Args:
        url: A folder or prefix URL (with ``pattern``), a brace pattern as webdataset
            writes it (``"https://h/shard-{000000..000007}.tar"``, ``"{a,b}"`` lists;
            expanded to a list of shard URLs, in order), or a sequence of shard URLs
            (no listing; ``pattern`` does not apply).
        pattern: Glob relative to a folder ``url``.
        transform: Applied on CPU to each sample dict.
        storage_options: fsspec options for the remote.
        settings: Cache settings.
        refresh: Re-list the remote instead of using the recorded manifest.
        kept_bytes: Bytes of decoded blocks kept in memory per process (each DataLoader
            worker has its own); ``"256MB"`` style sizes work; 0 keeps none. Default
            :data:`fastload.read.blocks.DEFAULT_KEPT_BYTES` (256 MiB).
    """

    def __init__(self, url: str | Sequence[str], pattern: str | None = "**/*.tar", *, transform: Transform | None = None,
                 storage_options: dict[str, Any] | None = None, settings: Settings | None = None, refresh: bool = False,
                 kept_bytes: int | str | None = None) -> None:
        if isinstance(url, str) and "{" in url:
            url = expand_braces(url)  # webdataset's shard notation: a URL list, no listing
        super().__init__(url, pattern if isinstance(url, str) else None, transform=transform, storage_options=storage_options, settings=settings, refresh=refresh)
        self.kept = KeptBlocks(DEFAULT_KEPT_BYTES if kept_bytes is None else parse_size(kept_bytes))
        # (shard index, key, [(suffix, offset, size), ...]) per sample, in shard order.
        self.samples: list[tuple[int, str, list[tuple[str, int, int]]]] = []
        # The members each shard's samples have between them: a sample lacking one is named
        # when read, not left to end in a bare KeyError from torch's collate.
        self._exts: list[frozenset[str]] = []
        self._gzips: dict[str, RemoteItem] = {}  # a .tar.gz shard by its tar item's URL (fastload.read.gunzip)
        # Shards indexed side by side: one shard's tar headers are parsed while another's
        # blocks are fetched and stored (benchmarks/tar/results/: cold epochs).
        with ThreadPoolExecutor(min(_INDEX_THREADS, len(self.items)), thread_name_prefix="fastload-tar-index") as pool:
            indexed = list(pool.map(self._index, self.items))
        # What each shard's members are read from: the shard, or a .tar.gz shard's tar item.
        self._tars = [tar for tar, _ in indexed]
        for shard, (_, index) in enumerate(indexed):
            self._exts.append(frozenset(ext for _, members in index for ext, _, _ in members))
            for key, members in index:
                self.samples.append((shard, key, members))

    def _index(self, item: RemoteItem) -> tuple[RemoteItem, list[tuple[str, list[tuple[str, int, int]]]]]:
        """The item a shard's members are read from, and its samples: recorded, or indexed now."""
        cache_key = keys.tar_index(item.url, item.size, item.version)
        cached = self.reader.cache.index.get(cache_key)
        # Recorded as {"rule": ..., "samples": ...}: an index of an older grouping rule (a bare
        # list, members merged by key wherever they stood) is rebuilt, not trusted.
        if isinstance(cached, dict) and cached.get("rule") == _TAR_RULE:
            tar = item
            if "tar_size" in cached:
                tar = gunzip.tar_item(item, cached["tar_size"])
                self._gzips[tar.url] = item
            return tar, [(key, [tuple(m) for m in members]) for key, members in cached["samples"]]  # type: ignore[misc]
        tar = item
        if gunzip.is_gzip(item.url):
            tar = gunzip.decompress(self.reader, item)
            self._gzips[tar.url] = item
        found = list_members(lambda: self._shard_file(tar), item.url, tar.size)
        index = group_members(found, item.url)
        record: dict[str, Any] = {"rule": _TAR_RULE, "samples": index}
        if tar is not item:
            record["tar_size"] = tar.size
        self.reader.cache.index.set(cache_key, record)
        return tar, index

    def _shard_file(self, tar: RemoteItem) -> KeptFile:
        """A file over a shard to index, through kept blocks: fetched ahead where blocks are
        kept (and kept for the reads after), one at a time where none are."""
        ahead = _INDEX_AHEAD if self.kept.limit_bytes >= _INDEX_AHEAD * self.reader.settings.block_bytes else 1
        return KeptFile(self.reader, tar, self.kept, ahead, self._restore)

    def _restore(self, tar: RemoteItem) -> None:
        """Put the blocks of a .tar.gz shard's tar item back in the cache (it dropped them)."""
        gunzip.decompress(self.reader, self._gzips[tar.url])

    def __len__(self) -> int:
        return len(self.samples)

    def _checked(self, index: int) -> tuple[RemoteItem, RemoteItem, str, list[tuple[str, int, int]]]:
        shard, key, members = self.samples[index]
        item = self.items[shard]
        missing = sorted(self._exts[shard] - {ext for ext, _, _ in members})
        if missing:
            raise DecodeError(
                f"{item.url}: sample {key!r} has no {', '.join(repr(m) for m in missing)} member (other samples of "
                "this shard have it); fix: rebuild that shard, or drop the sample with a sampler"
            )
        return item, self._tars[shard], key, members

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self._read([index])[0]

    def read_batch(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """``[self[i] for i in indices]``, the members read as one batch (:func:`fastload.read.blocks.read_ranges`)."""
        if not self._own_getitem(TarDataset):
            return super().read_batch(indices)
        return self._read(indices)

    def _read(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        picked = [self._checked(i) for i in indices]
        ranges = [(tar, offset, offset + size) for _, tar, _, members in picked for _, offset, size in members]
        data = iter(read_ranges(self.reader, ranges, self.kept, self._restore))
        out = []
        for item, _, key, members in picked:
            sample: dict[str, Any] = {"__key__": key, "__url__": item.url}
            for ext, _, _ in members:
                sample[ext] = next(data)
            out.append(self._apply(sample))
        return out


# Blocks of a shard read together while indexing it (one read_into: their GETs overlap), and shards
# indexed at once. On loopback with 2 busy cores, 4 ahead took a cold index of 8 x 11 MB shards from a
# median of 1.76 s to 1.35 s; 4 threads changed nothing there (CPU-bound), kept for round trips.
_INDEX_AHEAD = 4
_INDEX_THREADS = 4
_TAR_RULE = "webdataset-1"  # the grouping rule of recorded tar indexes (fastload.read.shards)
