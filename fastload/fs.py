"""``fastload.open`` and the ``fastload::`` fsspec protocol.

A user's own Dataset reads through the cache by changing one line::

    with fsspec.open("fastload::s3://bucket/x.jpg", s3={"anon": True}) as f:
        data = f.read()

or ``fastload.open("s3://bucket/x.jpg")``. Files are read-only and seekable;
reads touch only the cached blocks they need. The protocol is registered
through the ``fsspec.specs`` entry point in pyproject.toml.

Every open in a process shares one :class:`~fastload.read.reader.Reader` (and so one
Cache, one index connection, one Source per protocol) per settings and storage
options (:func:`shared_reader`): a warm open is a pin lookup and a block read, not
a new Reader, Cache and index each time. A forked child starts with none and builds
its own on its first open (the parent's sqlite handles and sockets are not its).
"""

from __future__ import annotations

import io
import os
import threading
from typing import Any

from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs
from fsspec.implementations.chained import ChainedFileSystem

from fastload.cache import keys
from fastload.config import Settings, env_settings
from fastload.errors import ConfigError, EmptyDatasetError
from fastload.read.reader import Reader
from fastload.source import RemoteItem

_SHARED: dict[tuple[Settings, str], Reader] = {}
_SHARED_LOCK = threading.Lock()
CHAIN = "fastload::"  # the prefix of a chained URL that reads through the cache
# URLs found missing, remembered for the process: pyarrow and pandas look for `_metadata` and
# `_common_metadata` beside a Parquet folder on every pass, a HEAD and a GET each (both 404).
MISSING_MAX = 4096
COMPLETE_PART = 256  # sizeless files a listing completes by their first GETs at once (_listing)
READ_BLOCKS = 8  # blocks per step of a large read (BlockFile._fill): what a cold read holds beside its result
_MISSING: dict[str, None] = {}  # insertion-ordered: the oldest is dropped past MISSING_MAX


def _forget_shared() -> None:
    global _SHARED_LOCK
    _SHARED.clear()
    _MISSING.clear()
    _SHARED_LOCK = threading.Lock()  # the parent may have held it mid-fork


os.register_at_fork(after_in_child=_forget_shared)


def shared_reader(settings: Settings | None = None, storage_options: dict[str, Any] | None = None) -> Reader:
    """This process's Reader for ``settings`` (default: from ``FASTLOAD_*``) and ``storage_options``."""
    settings = settings or env_settings()
    key = (settings, repr(sorted((storage_options or {}).items())))
    reader = _SHARED.get(key)
    if reader is None:
        with _SHARED_LOCK:
            reader = _SHARED.get(key)
            if reader is None:
                reader = _SHARED[key] = Reader(settings, storage_options)
    return reader


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

    def readall(self) -> bytes:
        """The rest of the object in one piece (BufferedReader.read() calls it): a whole
        cached block is returned as it is, not copied through 8 KiB reads; more than a
        block is read into the one bytes object returned (:meth:`_fill`), no second copy."""
        start, end = self._pos, self.item.size
        if start >= end:
            return b""
        self._pos = end
        if start == 0 and end <= self.reader.settings.block_bytes:
            return self.reader.read_block(self.item, 0)
        # A BytesIO over a bytes object no one else holds lends that object's memory to fill
        # (getbuffer) and hands it back as it is (getvalue): CPython copies neither time. A
        # join of the blocks held them all and the result at once, 2x the object's size.
        whole = io.BytesIO(bytes(end - start))
        with whole.getbuffer() as view:
            self._fill(view, start, end)
        return whole.getvalue()

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        bb = self.reader.settings.block_bytes
        if len(view) >= bb:  # a read of a block or more: decoded straight into the caller's buffer
            n = max(0, min(len(view), self.item.size - self._pos))
            self._fill(view[:n], self._pos, self._pos + n)
            self._pos += n
            return n
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

    def _fill(self, view: memoryview, start: int, end: int) -> None:
        """Bytes ``[start, end)`` of the object into ``view``, READ_BLOCKS blocks at a time: a
        cold read holds at most that many fetched blocks beside the view."""
        step = self.reader.settings.block_bytes * READ_BLOCKS
        for lo in range(start, end, step):
            hi = min(lo + step, end)
            self.reader.read_into([(self.item, lo, hi, lo - start)], view)


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
        reader: A reader to read through; default: this process's shared one for
            ``settings`` and ``storage_options`` (:func:`shared_reader`).

    Returns:
        A seekable binary file.
    """
    if mode != "rb":
        raise ConfigError(f"fastload.open mode {mode!r} is not supported; the cache is read-only, use 'rb'")
    reader = reader or shared_reader(settings, storage_options)
    item = reader.stat(url)
    # No bigger a buffer than the object: a 1 MiB one per open of a small file was an mmap and munmap each.
    size = min(reader.settings.block_bytes, 1024**2, max(item.size, io.DEFAULT_BUFFER_SIZE))
    return io.BufferedReader(BlockFile(reader, item), buffer_size=size)


class FastloadFileSystem(ChainedFileSystem):
    """fsspec filesystem ``fastload::<url>`` reading any fsspec URL through the cache.

    Files are read through the cache; folders come from fastload's recorded listings
    (manifests, :meth:`Reader.list`), so ``info``, ``ls`` and ``find`` of a folder
    are right for http, s3 and local paths, and a second pass over a listed folder
    sends the remote no request at all. With neither ``target_protocol`` nor ``fs``
    (``fastload.arrow_filesystem``) every path is a full URL and picks its own
    filesystem; paths then come back as URLs (local ones as paths).

    Args:
        target_protocol: The wrapped protocol (set by fsspec for chained URLs).
        target_options: Options of the wrapped filesystem (credentials...); with no
            target, the storage options of every URL.
        fs: An already-built target filesystem, instead of the two above; its own
            options (``S3FileSystem(key=..., secret=...)``) are the ones read with.
        cache_dir: Override ``FASTLOAD_CACHE_DIR``.
        cache_limit: Override ``FASTLOAD_CACHE_LIMIT`` (e.g. ``"200GB"``).
        settings: Cache settings, instead of ``cache_dir``/``cache_limit`` over the environment.
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
        settings: Settings | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if fs is None and target_protocol is not None:
            fs, _ = url_to_fs(f"{target_protocol}://", **(target_options or {}))
        self.target: AbstractFileSystem | None = fs
        if settings is None:
            settings = Settings.from_env(cache_dir=cache_dir, cache_limit_bytes=cache_limit)
        # A built filesystem's own options (its credentials, endpoint) are the ones to read with.
        options = target_options if target_options is not None else getattr(fs, "storage_options", None)
        self.reader = shared_reader(settings, options)

    def _url(self, path: str) -> str:
        for prefix in (CHAIN, f"{self.protocol}://"):
            if path.startswith(prefix) and "://" in path[len(prefix):]:
                path = path[len(prefix):]
        if self.target is None:
            return path if "://" in path else os.path.abspath(path)
        return str(self.target.unstrip_protocol(self.target._strip_protocol(path)))

    def _name(self, url: str) -> str:
        """``url`` as this filesystem names paths."""
        if self.target is not None:
            return str(self.target._strip_protocol(url))
        return url[len("file://"):] if url.startswith("file://") else url

    def glob(self, path: str, maxdepth: int | None = None, **kwargs: Any) -> Any:
        """As fsspec's glob, each remote match named so that it reopens through the cache:
        ``fastload::<url>`` under a target whose paths are whole URLs (HTTP's), and
        ``fastload://<url>`` with no target. Hugging Face ``datasets`` keeps a match that has
        a scheme as it is: a bare ``http://`` match lost fastload, and failed to open."""
        found = super().glob(path, maxdepth=maxdepth, **kwargs)
        prefix = CHAIN if self.target is not None else f"{self.protocol}://"

        def named(name: str) -> str:
            return prefix + name if "://" in name and not name.startswith(("file://", prefix)) else name

        if isinstance(found, dict):
            return {named(k): {**v, "name": named(k)} for k, v in found.items()}
        return [named(n) for n in found]

    def _fs(self, url: str) -> AbstractFileSystem:
        if self.target is not None:
            return self.target
        return url_to_fs(url, **self.reader.storage_options)[0]

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> io.BufferedReader:  # type: ignore[override]
        return open(self._url(path), mode, reader=self.reader)

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        url = self._url(path)
        reader = self.reader
        canon = reader.canonical(url)
        folder = {"name": self._name(canon.rstrip("/")), "size": 0, "type": "directory"}
        if reader.cache.index.get(keys.manifest(canon.rstrip("/"), None)) is not None:
            return folder  # listed before: no request
        if reader.cache.index.get(keys.pin(canon)) is None:
            if url.endswith("/"):
                return folder
            if canon in _MISSING or self._unlisted(canon):
                raise FileNotFoundError(url)
            try:
                found = self._fs(url).info(url)
            except FileNotFoundError:
                _remember_missing(canon)
                raise
            # An HTTP folder answers its URL without "/" with a redirect to the one with it.
            if found.get("type") == "directory" or str(found.get("url", "")).endswith("/"):
                return folder
        item = reader.stat(url)
        return {"name": self._name(item.url), "size": item.size, "type": "file", "version": item.version}

    def _unlisted(self, canon: str) -> bool:
        """Whether ``canon`` is missing from the recorded listing of its folder (then it is not
        there: recorded listings are what this filesystem's folders are, as in find and ls)."""
        parent = canon.rsplit("/", 1)[0]
        if "/" not in canon or not parent:
            return False
        items = self.reader.identity.manifest(parent, None)
        inside = canon + "/"  # a folder: a listing holds its files, not the folder itself
        if items is None or any(i.url == canon or i.url.startswith(inside) for i in items):
            return False
        _remember_missing(canon)
        return True

    def _listing(self, path: str) -> tuple[str, list[Any]]:
        """The folder's canonical URL and its files (a recorded listing, else listed and recorded).

        Files a listing gives no size (an HTTP folder's) are sized by the GET of their first
        block, which is cached for the read that follows, not by a HEAD each: one request per
        file, as FileDataset's first epoch sends."""
        url = self._url(path)
        reader = self.reader
        root = reader.canonical(url).rstrip("/")
        try:
            items = reader.list(url, complete=False)
        except EmptyDatasetError as err:
            raise FileNotFoundError(f"{url}: no files under it ({err})") from err
        if any(i.size < 0 for i in items):
            # In parts: complete() returns the first blocks it fetched, and a folder of a million
            # objects would hold them all at once.
            items = [done for k in range(0, len(items), COMPLETE_PART)
                     for done in reader.fetcher.complete(items[k : k + COMPLETE_PART])[0]]
            reader.identity.save_manifest(reader.manifest_root(url), None, items)
        return root, items

    def find(self, path: str, maxdepth: int | None = None, withdirs: bool = False, detail: bool = False,
             **kwargs: Any) -> Any:
        root, items = self._listing(path)
        out: dict[str, dict[str, Any]] = {}
        for item in items:
            rel = item.url[len(root) + 1:] if item.url.startswith(root + "/") else ""
            parts = rel.split("/") if rel else []
            depth = len(parts) if maxdepth is None else min(len(parts), maxdepth + 1)
            for k in range(1, depth if withdirs else 0):  # the folders above the file, as deep as asked
                name = self._name(root + "/" + "/".join(parts[:k]))
                out.setdefault(name, {"name": name, "size": 0, "type": "directory"})
            if maxdepth is not None and len(parts) > maxdepth:
                continue
            name = self._name(item.url)
            out[name] = {"name": name, "size": item.size, "type": "file", "version": item.version}
        names = sorted(out)
        return {n: out[n] for n in names} if detail else names

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        found = self.find(path, maxdepth=1, withdirs=True, detail=True)
        return list(found.values()) if detail else list(found)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        item = self.reader.stat(self._url(path))
        start = 0 if start is None else (start if start >= 0 else item.size + start)
        end = item.size if end is None else (end if end >= 0 else item.size + end)
        return self.reader.read_range(item, start, end)


def _remember_missing(canon: str) -> None:
    _MISSING[canon] = None
    if len(_MISSING) > MISSING_MAX:
        del _MISSING[next(iter(_MISSING))]


def arrow_filesystem(storage_options: dict[str, Any] | None = None, settings: Settings | None = None) -> Any:
    """A ``pyarrow.fs.FileSystem`` that reads any URL through fastload's cache.

    Paths are full URLs (``https://host/dir/``, ``s3://bucket/prefix``) or local
    paths; ``pyarrow.dataset``, pandas and Ray Data's readers take it as
    ``filesystem=``. Folder listings are recorded (manifests), so a second pass
    makes no request.

    Args:
        storage_options: fsspec options for every URL (credentials, endpoint).
        settings: Cache settings (defaults from ``FASTLOAD_*``).

    Raises:
        ConfigError: pyarrow is not installed.
    """
    try:
        from pyarrow.fs import FSSpecHandler, PyFileSystem
    except ImportError as err:
        raise ConfigError("fastload.arrow_filesystem needs pyarrow; fix: pip install pyarrow") from err
    fs = FastloadFileSystem(target_options=dict(storage_options or {}), settings=settings, skip_instance_cache=True)
    return PyFileSystem(FSSpecHandler(fs))
