"""Byte ranges of many objects read as one batch, with decoded blocks kept in memory, bounded.

Words, as in this module: a *block* is one cache block of an object
(``Settings.block_bytes``, :mod:`fastload.read.reader`); *kept* means held decoded in a
:class:`KeptBlocks` store in this process; its *limit* is the bytes it may hold.

Why keep blocks: a tar shard's members are small (a 20 KB JPEG) and hundreds share one
8 MiB block, and the cache checks what it stored, a whole block, on every read
(:func:`fastload.cache.gather.gather`: the stored checksum covers the payload, not a
member). Read member by member, a warm read of a 20 KB member cost a read and check of
its 8 MiB block: 2.85 ms for one ``Reader.read_into`` of 20 KB against 5.7 ms for the
whole block, on a loaded 2-core machine (the ``per_member`` row of benchmarks/tar/results/). Kept, a block is read,
checked and decoded once per time it enters the store, and each member read after that
is a copy from memory.

Bounds: the store holds at most ``limit`` bytes of blocks (least recently used go
first), so random reads over a dataset far larger than memory stay correct and cost
at most ``limit`` bytes per process (a batch whose blocks are not kept and are more
than ``limit`` reads its ranges without keeping them); each DataLoader worker process has
its own store (it pickles as its limit). A limit of 0, or one below a block, keeps nothing: every
batch then reads its blocks from the cache once per batch (:func:`read_ranges`).
The default limit has one home, :data:`DEFAULT_KEPT_BYTES`.
"""

from __future__ import annotations

import io
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fastload.cache.gather import split
from fastload.read import gunzip
from fastload.read.reader import Reader
from fastload.source import RemoteItem

__all__ = ["DEFAULT_KEPT_BYTES", "KeptBlocks", "KeptFile", "keep_ahead", "load_blocks", "read_ranges"]

Restore = Callable[[RemoteItem], Any]  # puts a decompressed shard's blocks back (fastload.read.gunzip)

# 256 MiB: 32 blocks of the default 8 MiB, so the blocks a shuffled batch of 64 members
# of one 8-shard dataset touches stay kept from batch to batch
# (benchmarks/tar/bench.py), and a worker process's share stays small beside a training job.
DEFAULT_KEPT_BYTES = 256 * 1024**2


class KeptBlocks:
    """Decoded blocks by cache key, least recently used dropped first past ``limit_bytes``.

    Thread-safe (``fastload.DataLoader``'s read threads share one). A block enters
    only after the cache (or a fetch) checked it, so what is kept is never checked again.

    Args:
        limit_bytes: Most bytes of blocks held at once; 0 keeps nothing.
    """

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = max(0, int(limit_bytes))
        self._blocks: OrderedDict[str, np.ndarray] = OrderedDict()
        # Blocks a thread is reading now: another thread that wants one waits for it rather
        # than reading it too (a DataLoader's read threads start several batches at once, and
        # a cold shuffled batch wants every block of the dataset).
        self._loading: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.evicted = 0

    def __getstate__(self) -> dict[str, Any]:
        # Workers get settings, not contents: a worker fills its own store.
        return {"limit_bytes": self.limit_bytes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["limit_bytes"])  # type: ignore[misc]

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, key: str) -> np.ndarray | None:
        """The kept block ``key`` (marked as just used), or None."""
        with self._lock:
            block = self._blocks.get(key)
            if block is None:
                self.misses += 1
                return None
            self._blocks.move_to_end(key)
            self.hits += 1
            return block

    def put(self, key: str, block: np.ndarray) -> None:
        """Keep ``block`` (read-only from now on), dropping the least recently used past the limit."""
        if block.nbytes > self.limit_bytes:
            return
        block.flags.writeable = False
        with self._lock:
            old = self._blocks.pop(key, None)
            if old is not None:
                self.nbytes -= old.nbytes
            self._blocks[key] = block
            self.nbytes += block.nbytes
            while self.nbytes > self.limit_bytes:
                _, dropped = self._blocks.popitem(last=False)
                self.nbytes -= dropped.nbytes
                self.evicted += 1

    def holds(self, key: str) -> bool:
        """Whether ``key`` is kept, or a thread is reading it now (no use counted, no order changed)."""
        return key in self._blocks or key in self._loading

    def claim(self, keys: Sequence[str]) -> tuple[list[str], list[tuple[str, threading.Event]]]:
        """Of ``keys`` (not kept), those this thread is to read (call :meth:`done` after), and
        those another thread is reading, each with the event set when it is done."""
        mine, theirs = [], []
        with self._lock:
            for key in keys:
                event = self._loading.get(key)
                if event is None:
                    self._loading[key] = threading.Event()
                    mine.append(key)
                else:
                    theirs.append((key, event))
        return mine, theirs

    def done(self, keys: Sequence[str]) -> None:
        """The claimed ``keys`` are read (kept, or failed): wake whoever waits for them."""
        with self._lock:
            for key in keys:
                event = self._loading.pop(key, None)
                if event is not None:
                    event.set()

    def stats(self) -> dict[str, int]:
        """Blocks kept, their bytes, the limit, and hits, misses and evictions so far."""
        return {"blocks": len(self._blocks), "bytes": self.nbytes, "limit_bytes": self.limit_bytes,
                "hits": self.hits, "misses": self.misses, "evicted": self.evicted}


def read_ranges(reader: Reader, ranges: Sequence[tuple[RemoteItem, int, int]],
                kept: KeptBlocks | None = None, restore: Restore | None = None) -> list[bytes]:
    """Bytes ``[start, end)`` of each ``(item, start, end)``, read as one batch.

    With no store (or a limit of 0), one :meth:`Reader.read_into` of the ranges: each
    block they touch is read, checked and decoded once for the batch. With a store,
    ranges in kept blocks are copied from memory; the blocks not kept are read whole with
    one :meth:`Reader.read_into` (misses fetched together), kept, and copied from; when
    those blocks are more than the store's limit, the ranges in them are read as without a
    store (so a batch holds at most ``limit`` bytes of blocks beside its output).
    ``restore`` puts a decompressed shard's blocks back in the cache (its tar items:
    :mod:`fastload.read.gunzip`, never fetched).
    """
    if kept is None or kept.limit_bytes == 0:
        return _read_direct(reader, ranges, restore)
    ident = reader.identity
    bb = reader.settings.block_bytes
    wanted: dict[str, tuple[RemoteItem, int]] = {}
    for item, start, end in ranges:
        for b in range(start // bb, -(-end // bb)) if end > start else ():
            wanted.setdefault(ident.key(item, b), (item, b))
    blocks: dict[str, np.ndarray] = {}
    missing: dict[str, tuple[RemoteItem, int]] = {}
    for key, where in wanted.items():
        got = kept.get(key)
        if got is None:
            missing[key] = where
        else:
            blocks[key] = got
    if sum(ident.span(item, b)[1] - ident.span(item, b)[0] for item, b in missing.values()) > kept.limit_bytes:
        # More blocks than the store holds (a shuffle over far more data than is kept): read
        # whole, they would all be held at once (64 members in 64 blocks: 512 MiB) and few
        # kept, so those ranges are read as they are, one read_into, each block once.
        direct = [k for k, (item, start, end) in enumerate(ranges)
                  if any(ident.key(item, b) in missing for b in range(start // bb, -(-end // bb)))]
        out: list[bytes | None] = [None] * len(ranges)
        for k, data in zip(direct, _read_direct(reader, [ranges[k] for k in direct], restore)):
            out[k] = data
        for k, (item, start, end) in enumerate(ranges):
            if out[k] is None:
                out[k] = _slice(blocks, ident, bb, item, start, end)
        return out  # type: ignore[return-value]
    blocks.update(_load_missing(reader, kept, missing, restore))
    return [_slice(blocks, ident, bb, item, start, end) for item, start, end in ranges]


def _slice(blocks: dict[str, np.ndarray], ident: Any, bb: int, item: RemoteItem, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of ``item`` out of its ``blocks`` (by cache key)."""
    parts = []
    for b in range(start // bb, -(-end // bb)) if end > start else ():
        base = b * bb
        parts.append(blocks[ident.key(item, b)][max(start, base) - base : min(end, base + bb) - base].tobytes())
    return parts[0] if len(parts) == 1 else b"".join(parts)


# How long a thread waits for a block another thread is reading before it reads the block
# itself: past the fetch layer's own request timeouts, so it only guards against a hang.
_WAIT_S = 300.0


def load_blocks(reader: Reader, kept: KeptBlocks, wanted: dict[str, tuple[RemoteItem, int]],
                restore: Restore | None = None) -> dict[str, np.ndarray]:
    """The blocks ``wanted`` (cache key -> (item, block)): kept ones from memory, the rest read
    whole with one :meth:`Reader.read_into` and kept; one another thread is reading is waited for."""
    blocks: dict[str, np.ndarray] = {}
    missing = {}
    for key, where in wanted.items():
        got = kept.get(key)
        if got is None:
            missing[key] = where
        else:
            blocks[key] = got
    blocks.update(_load_missing(reader, kept, missing, restore))
    return blocks


def _load_missing(reader: Reader, kept: KeptBlocks, missing: dict[str, tuple[RemoteItem, int]],
                  restore: Restore | None) -> dict[str, np.ndarray]:
    """The blocks ``missing`` (not kept): read here and kept, or waited for where another
    thread is reading them."""
    blocks: dict[str, np.ndarray] = {}
    mine, theirs = kept.claim(list(missing))
    try:
        blocks.update(_read_blocks(reader, kept, {k: missing[k] for k in mine}, restore))
    finally:
        kept.done(mine)
    rest = {}
    for key, event in theirs:
        got = kept.get(key) if event.wait(_WAIT_S) else None
        if got is None:  # dropped already, over the limit, or that read failed: read it here
            rest[key] = missing[key]
        else:
            blocks[key] = got
    blocks.update(_read_blocks(reader, kept, rest, restore))
    return blocks


def keep_ahead(reader: Reader, kept: KeptBlocks, wanted: dict[str, tuple[RemoteItem, int]]) -> int:
    """Read and keep the blocks ``wanted`` (cache key -> (item, block)) that no thread is reading,
    ahead of the reads that want them (:mod:`fastload.read.ahead`): such a read finds each claimed
    and waits for it. Those another thread is reading are left to it. Returns how many were read."""
    mine, _ = kept.claim([k for k in wanted if not kept.holds(k)])
    try:
        _read_blocks(reader, kept, {k: wanted[k] for k in mine}, None)
    finally:
        kept.done(mine)
    return len(mine)


def _read_blocks(reader: Reader, kept: KeptBlocks, wanted: dict[str, tuple[RemoteItem, int]],
                 restore: Restore | None) -> dict[str, np.ndarray]:
    if not wanted:
        return {}
    spans = [reader.identity.span(item, b) for item, b in wanted.values()]
    sizes = [hi - lo for lo, hi in spans]
    buf = np.empty(sum(sizes), dtype=np.uint8)
    requests, dst = [], 0
    for (item, _), (lo, hi) in zip(wanted.values(), spans):
        requests.append((item, lo, hi, dst))
        dst += hi - lo
    _read_into(reader, requests, buf, restore)
    blocks, dst = {}, 0
    for key, size in zip(wanted, sizes):
        # Its own array per block when several share the buffer: one kept block must not
        # hold its neighbours' memory after they are dropped.
        block = buf if len(sizes) == 1 else buf[dst : dst + size].copy()
        dst += size
        blocks[key] = block
        kept.put(key, block)
    return blocks


class KeptFile(io.RawIOBase):
    """A read-only file over one object's kept blocks (a shard being indexed by tarfile).

    A block not kept is read with the ``ahead - 1`` blocks after it, in one batch (their
    misses fetched together), so a cold shard streams rather than waiting on one block
    at a time; the blocks stay kept for the reads that follow the index.
    """

    def __init__(self, reader: Reader, item: RemoteItem, kept: KeptBlocks, ahead: int = 4,
                 restore: Restore | None = None) -> None:
        super().__init__()
        self.reader, self.item, self.kept, self.ahead = reader, item, kept, max(1, ahead)
        self.restore = restore
        self._pos = 0
        self._block: tuple[int, np.ndarray] | None = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.item.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        bb, n = self.reader.settings.block_bytes, 0
        while n < len(view) and self._pos < self.item.size:
            b, off = divmod(self._pos, bb)
            block = self._get(b)
            take = min(len(view) - n, len(block) - off)
            view[n : n + take] = block.data[off : off + take]
            n += take
            self._pos += take
        return n

    def _get(self, b: int) -> np.ndarray:
        if self._block is not None and self._block[0] == b:
            return self._block[1]
        ident = self.reader.identity
        key = ident.key(self.item, b)
        got = self.kept.get(key)
        if got is None:
            last = min(b + self.ahead, len(ident.blocks(self.item)))
            wanted = {ident.key(self.item, k): (self.item, k) for k in range(b, last)}
            got = load_blocks(self.reader, self.kept, wanted, self.restore)[key]
        self._block = (b, got)
        return got


def _read_into(reader: Reader, requests: Sequence[tuple[RemoteItem, int, int, int]], out: Any,
               restore: Restore | None) -> None:
    """:meth:`Reader.read_into`, with decompressed shards' tar items read from the cache only."""
    if restore is None:
        reader.read_into(requests, out)
        return
    local = [r for r in requests if gunzip.is_tar_item(r[0])]
    if len(local) < len(requests):
        reader.read_into([r for r in requests if not gunzip.is_tar_item(r[0])], out)
    if local:
        gunzip.read_cached(reader, local, out, restore)


def _read_direct(reader: Reader, ranges: Sequence[tuple[RemoteItem, int, int]], restore: Restore | None) -> list[bytes]:
    """:func:`read_ranges` with nothing kept: the ranges into one buffer by one ``read_into``."""
    offsets, dst = [], 0
    for _, start, end in ranges:
        offsets.append(dst)
        dst += end - start
    buf = np.empty(dst, dtype=np.uint8)
    _read_into(reader, [(item, start, end, off) for (item, start, end), off in zip(ranges, offsets)], buf, restore)
    return split(buf, [(off, end - start) for (_, start, end), off in zip(ranges, offsets)])
