"""``fastload.open`` and the ``fastload::`` fsspec protocol.

A user's own Dataset reads through the cache by changing one line::

    with fsspec.open("fastload::s3://bucket/x.jpg", s3={"anon": True}) as f:
        data = f.read()

or ``fastload.open("s3://bucket/x.jpg")``. Files are read-only and seekable;
reads touch only the cached blocks they need. The protocol is registered
through the ``fsspec.specs`` entry point in pyproject.toml.
"""

from __future__ import annotations

import io
from typing import Any

from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs
from fsspec.implementations.chained import ChainedFileSystem

from fastload.config import Settings
from fastload.errors import ConfigError
from fastload.reader import Reader
from fastload.source import RemoteItem


class BlockFile(io.RawIOBase):
    """A read-only, seekable file over one remote object, served from cache blocks."""

    def __init__(self, reader: Reader, item: RemoteItem) -> None:
        self.reader, self.item = reader, item
        self.name = item.url
        self._pos = 0
        self._block = -1
        self._data = b""

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    @property
    def size(self) -> int:
        return self.item.size

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.item.size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        bb = self.reader.settings.block_bytes
        n = 0
        while n < len(view) and self._pos < self.item.size:
            block, off = divmod(self._pos, bb)
            if block != self._block:
                # Keep the last decoded block: sequential small reads decode it once.
                self._data, self._block = self.reader.read_block(self.item, block), block
            take = min(len(view) - n, len(self._data) - off)
            view[n : n + take] = self._data[off : off + take]
            n += take
            self._pos += take
        return n


def open(  # noqa: A001 - mirrors fsspec.open / builtins.open on purpose
    url: str,
    mode: str = "rb",
    *,
    storage_options: dict[str, Any] | None = None,
    settings: Settings | None = None,
    reader: Reader | None = None,
) -> io.BufferedReader:
    """Open a remote object for reading through the fastload cache.

    Args:
        url: Any fsspec URL (``s3://b/k``, ``https://h/p``, a local path...).
        mode: Only ``"rb"``: the cache is read-only.
        storage_options: fsspec options for the remote.
        settings: Cache settings (defaults from ``FASTLOAD_*``).
        reader: Share an existing reader (and its cache handle).

    Returns:
        A seekable binary file.
    """
    if mode != "rb":
        raise ConfigError(f"fastload.open mode {mode!r} is not supported; the cache is read-only, use 'rb'")
    reader = reader or Reader(settings, storage_options)
    item = reader.stat(url)
    return io.BufferedReader(BlockFile(reader, item), buffer_size=min(reader.settings.block_bytes, 1024**2))


class FastloadFileSystem(ChainedFileSystem):
    """fsspec filesystem ``fastload::<url>`` reading any fsspec URL through the cache.

    Args:
        target_protocol: The wrapped protocol (set by fsspec for chained URLs).
        target_options: Options of the wrapped filesystem (credentials...).
        fs: An already-built target filesystem, instead of the two above.
        cache_dir: Override ``FASTLOAD_CACHE_DIR``.
        cache_limit: Override ``FASTLOAD_CACHE_LIMIT`` (e.g. ``"200GB"``).
    """

    protocol = "fastload"

    def __init__(
        self,
        target_protocol: str | None = None,
        target_options: dict[str, Any] | None = None,
        fs: AbstractFileSystem | None = None,
        cache_dir: str | None = None,
        cache_limit: str | int | None = None,
        fo: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if fs is None:
            if target_protocol is None:
                raise ConfigError("fastload:: needs a target, e.g. 'fastload::s3://bucket/key'")
            fs, _ = url_to_fs(f"{target_protocol}://", **(target_options or {}))
        self.target = fs
        settings = Settings.from_env(cache_dir=cache_dir, cache_limit_bytes=cache_limit)
        self.reader = Reader(settings, target_options)

    def _url(self, path: str) -> str:
        return self.target.unstrip_protocol(self.target._strip_protocol(path))

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> io.BufferedReader:  # type: ignore[override]
        return open(self._url(path), mode, reader=self.reader)

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        item = self.reader.stat(self._url(path))
        return {"name": path, "size": item.size, "type": "file", "version": item.version}

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        item = self.reader.stat(self._url(path))
        start = 0 if start is None else (start if start >= 0 else item.size + start)
        end = item.size if end is None else (end if end >= 0 else item.size + end)
        return self.reader.read_range(item, start, end)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        return self.target.ls(path, detail=detail, **kwargs)
