"""A ``.tar.gz`` / ``.tgz`` shard, decompressed once into the cache, then read like a ``.tar``.

Words, as in this module: the *gzip item* is the remote object; its *tar item* is a
stand-in :class:`~fastload.source.RemoteItem` (the gzip item's URL plus :data:`MARK`, the
tar's size, the gzip item's version) whose blocks are never fetched: they are put in the
cache by decompressing the gzip item (:func:`decompress`), and put there again when the
cache has dropped them (:func:`read_cached`'s ``restore``). A GET of the stand-in's URL
would return gzip bytes, so nothing here hands a tar item to the fetch layer.

How: the gzip item is read once, block by block, through the cache (so it is fetched
once, and a later decompression reads the disk), decompressed as a stream, and the tar's
bytes are stored as cache blocks of the tar item. The tar's size is the gzip trailer's
(ISIZE, the size modulo 4 GiB); a tar of 4 GiB or more, or a multi-member gzip, is found
out when the stream ends and decompressed a second time with its true size.
"""

from __future__ import annotations

import io
import struct
import threading
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from fastload.errors import CacheError, DecodeError
from fastload.read.reader import Reader
from fastload.source import RemoteItem

__all__ = ["MARK", "decompress", "is_gzip", "is_tar_item", "read_cached", "tar_item"]

MARK = "#gunzip"  # ends a tar item's URL; "#": no store serves a fragment as a different object
_SUFFIXES = (".tar.gz", ".tgz")
_LOCK = threading.Lock()  # one decompression of a shard at a time in this process


def is_gzip(url: str) -> bool:
    """Whether ``url`` names a gzip-compressed tar shard (``.tar.gz`` or ``.tgz``)."""
    return url.lower().endswith(_SUFFIXES)


def is_tar_item(item: RemoteItem) -> bool:
    """Whether ``item`` is a stand-in for a decompressed shard (its blocks live only in the cache)."""
    return item.url.endswith(MARK)


def tar_item(gz: RemoteItem, size: int) -> RemoteItem:
    """The stand-in for the ``size``-byte tar inside ``gz``."""
    return RemoteItem(gz.url + MARK, size, gz.version)


class _Blocks(io.RawIOBase):
    """The gzip item as a sequential stream of its cached blocks."""

    def __init__(self, reader: Reader, item: RemoteItem) -> None:
        super().__init__()
        self.reader, self.item = reader, item
        self._block, self._data, self._off = 0, b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        if self._off >= len(self._data):
            if self._block * self.reader.settings.block_bytes >= self.item.size:
                return 0
            self._data, self._off = self.reader.read_block(self.item, self._block), 0
            self._block += 1
        view = memoryview(buf).cast("B")
        n = min(len(view), len(self._data) - self._off)
        view[:n] = self._data[self._off : self._off + n]
        self._off += n
        return n


def _isize(reader: Reader, gz: RemoteItem) -> int:
    if gz.size < 18:
        raise DecodeError(f"{gz.url}: {gz.size} B is too short for a gzip file; fix: check or rebuild that shard")
    return int(struct.unpack("<I", reader.read_range(gz, gz.size - 4, gz.size))[0])


def decompress(reader: Reader, gz: RemoteItem) -> RemoteItem:
    """Decompress ``gz`` into the cache as the blocks of its tar item; returns the tar item.

    Raises:
        DecodeError: ``gz`` is not a readable gzip file (naming it).
    """
    with _LOCK:
        size = _isize(reader, gz)
        total = _decompress(reader, gz, size)
        if total != size:  # 4 GiB or more, or several members: the trailer told a part; again, sized
            size = total
            _decompress(reader, gz, size)
        return tar_item(gz, size)


def _decompress(reader: Reader, gz: RemoteItem, size: int) -> int:
    """Put the tar of ``gz`` in the cache as blocks of the ``size``-byte tar item; its true size."""
    tar = tar_item(gz, size)
    bb, ident = reader.settings.block_bytes, reader.identity
    pending, block, total = bytearray(), 0, 0

    def put(data: bytes) -> None:
        nonlocal block
        if block * bb < size or block == 0:  # past the size named a block is never read: not stored
            reader.cache.put(ident.key(tar, block), data, url=tar.url, block=block)
        block += 1

    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)  # gzip framing
    stream = _Blocks(reader, gz)
    try:
        while chunk := stream.read(1 << 20):
            while chunk:
                out = inflate.decompress(chunk)
                pending += out
                total += len(out)
                chunk = b""
                if inflate.eof:  # another gzip member may follow (pigz, concatenated files)
                    chunk = inflate.unused_data
                    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
            while len(pending) >= bb:
                put(bytes(pending[:bb]))
                del pending[:bb]
        tail = inflate.flush()
    except zlib.error as err:
        raise DecodeError(f"{gz.url}: not a readable gzip file ({err}); fix: check or rebuild that shard") from err
    pending += tail
    total += len(tail)
    while len(pending) >= bb:
        put(bytes(pending[:bb]))
        del pending[:bb]
    if pending or block == 0:
        put(bytes(pending))
    return total


def read_cached(reader: Reader, requests: Sequence[tuple[RemoteItem, int, int, int]], out: Any,
                restore: Callable[[RemoteItem], Any]) -> None:
    """:meth:`Reader.read_into` for tar items: from the cache only; blocks it dropped are put
    back by ``restore(tar item)`` (a decompression) and read again, once.

    Raises:
        CacheError: The cache dropped them again (a cache limit below the shard's tar).
    """
    bb, ident = reader.settings.block_bytes, reader.identity
    plan: dict[str, tuple[RemoteItem, list[tuple[int, int, int]]]] = {}
    for item, start, end, dst in requests:
        for b in range(start // bb, -(-end // bb)) if end > start else ():
            base = b * bb
            lo, hi = max(start, base), min(end, base + bb)
            plan.setdefault(ident.key(item, b), (item, []))[1].append((lo - base, hi - lo, dst + lo - start))
    todo = list(plan)
    for attempt in range(2):
        missed = reader.cache.read_into([(k, plan[k][1]) for k in todo], out)
        if not missed:
            return
        todo = [todo[i] for i in missed]
        if attempt == 0:
            for item in {plan[k][0].url: plan[k][0] for k in todo}.values():
                restore(item)
    url = plan[todo[0]][0].url[: -len(MARK)]
    raise CacheError(f"{url}: the cache dropped the decompressed tar of this shard while it was read; fix: raise "
                     "--cache-limit / FASTLOAD_CACHE_LIMIT above the size of a few decompressed shards")
