"""The fsspec road: requests through the fsspec filesystem (s3fs, gcsfs, local files, aiohttp).

What the fast roads (libcurl's engine, fastload.transport.curl; S3 signed there,
fastload.source.s3; GCS, fastload.source.gcs) do not carry goes here: local files and the other stores,
HTTP requests other than first blocks, later blocks and listing pages, S3's HEADs,
the blocks the engine did not take (fastload.source.ranged), and every retry of a failed fast request (its errors are the ones users
see). :class:`FsspecRoad` is the part of :class:`~fastload.source.Source` that
speaks to the filesystem; it is a mixin so that Source stays one object to
pickle and to pass around.
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import fsspec
import fsspec.asyn

from fastload.config import Settings
from fastload.errors import RemoteChangedError, StoppedError
from fastload.source import aio, versioned
from fastload.source.errors import changed, unchanged
from fastload.source.items import RemoteItem, version_of
from fastload.transport.answers import VERSION_FIELDS
from fastload.transport.failures import TruncatedBodyError
from fastload.transport.hostlimit import STOP_POLL_S, HostLimit, aiohttp_client

T = TypeVar("T")
_log = logging.getLogger("fastload")
_noted: set[str] = set()
_noted_lock = threading.Lock()
# The other road of each object store: what its requests cost there.
_ROADS = {"s3": "s3fs (a HEAD and a GET per object)", "s3a": "s3fs (a HEAD and a GET per object)",
          "gs": "gcsfs (a metadata request and a GET per object)", "gcs": "gcsfs (a metadata request and a GET per object)"}


def note_fallback(url: str, why: str) -> None:
    """Log that an object store source's GETs stay on this road: at WARNING once per process (default
    logging shows it: it costs a request per object), other causes after it at INFO."""
    with _noted_lock:
        if why in _noted:
            return
        first = not _noted
        _noted.add(why)
    road = _ROADS.get(url.split("://", 1)[0].lower(), "fsspec")
    _log.log(logging.WARNING if first else logging.INFO, "fastload: %s: GETs go through %s, not libcurl: %s",
             url, road, why)


class _Source(Protocol):
    """What the road uses of its Source (fastload.source.core)."""

    url: str
    settings: Settings
    stop: threading.Event
    _http: bool
    _folder_hint: bool
    _root_path: str

    @property
    def fs(self) -> fsspec.AbstractFileSystem: ...
    def limit_of(self, url: str) -> HostLimit | None: ...
    def _call(self, fn: Callable[[], T], url: str) -> T: ...
    def _item(self, info: dict[str, Any]) -> RemoteItem: ...
    def _sync(self, func: Callable[..., Coroutine[Any, Any, T]], *args: Any, timeout_s: float | None = None,
              **kwargs: Any) -> T: ...
    def fetch(self, url: str, start: int = 0, end: int | None = None, *, expect: int | None = None,
              listed: RemoteItem | None = None) -> bytes: ...
    def note_ranges(self, url: str, honoured: bool) -> None: ...
    def _road(self) -> str: ...


def forget_parent_loop(fs: Any) -> None:
    """In a forked child, mark the parent's fsspec event loop as not running here.

    The copied loop object still says it runs (its thread id is the parent's), so
    when an inherited HTTP filesystem is collected, fsspec's ``close_session``
    submits ``session.close`` to a loop no thread runs in this process and waits
    its 0.1 s timeout, on whichever thread the collection happened: in DataLoader
    workers that was fsspec's own loop thread, stalling every request of the
    worker (profile.md, round 4). Not running, it closes the connector directly.
    """
    loop = getattr(fs, "_loop", None)
    if loop is not None and getattr(loop, "_thread_id", None) is not None:
        loop._thread_id = None



def with_timeouts(protocol: str, options: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """``options`` plus per-request timeouts on every call, unless the user set their own.

    Only reads got ``request_timeout_s`` before; a HEAD or a listing page that
    stalled waited for aiohttp's 5-minute default, so a stalled server hung
    listing (tests/reliability/test_flaky_remote.py, "stall" fault).
    """
    opts = dict(options)
    if protocol in ("http", "https"):
        import aiohttp

        client = dict(opts.get("client_kwargs") or {})
        # sock_read bounds each silence, not the whole transfer: a large, slow but
        # steady answer is not a stall.
        client.setdefault("timeout", aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s))
        opts["client_kwargs"] = client
        opts.setdefault("get_client", aiohttp_client)  # reports slow connects and closing servers (hostlimit)
    elif protocol in ("s3", "s3a"):
        config = dict(opts.get("config_kwargs") or {})
        config.setdefault("connect_timeout", timeout_s)
        config.setdefault("read_timeout", timeout_s)
        # One attempt per request: fastload retries (Source._call), with its backoff outside
        # the request's slot, so the host limit sees each SlowDown. botocore retried them
        # inside the slot, sleeping there, and the limit never heard of one
        # (tests/reliability/test_s3_throttle.py). s3fs's own retries: Source._open_fs.
        config.setdefault("retries", {"total_max_attempts": 1})
        opts["config_kwargs"] = config
    return opts



def has_loop(fs: Any) -> bool:
    """Whether ``fs`` runs its requests as coroutines on fsspec's event loop (cancellable on a stop)."""
    return bool(getattr(fs, "async_impl", False)) and getattr(fs, "loop", None) is not None


class FsspecRoad:
    """Listing, reads and coroutines through the fsspec filesystem of a :class:`~fastload.source.Source`."""

    def _sync(self: _Source, func: Callable[..., Coroutine[Any, Any, T]], *args: Any, timeout_s: float | None = None, **kwargs: Any) -> T:
        """``await func(*args, **kwargs)`` on fsspec's event loop, from this thread, within ``timeout_s``.

        As ``fsspec.asyn.sync``, but the wait ends when :attr:`stop` is set (or this
        thread is interrupted): the coroutine is then cancelled, its slot given back,
        and StoppedError raised. Staging's threads once kept retrying held requests
        for tens of seconds after a Ctrl-C (tests/integration/test_stage_interrupt.py).
        """
        coro = func(*args, **kwargs)
        future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout_s) if timeout_s else coro, self.fs.loop)
        try:
            while True:
                try:
                    return future.result(timeout=STOP_POLL_S)
                except concurrent.futures.TimeoutError:
                    if future.done():
                        raise  # the coroutine's own timeout
                    if self.stop.is_set():
                        raise StoppedError(f"{self.url}: stopped; its request was cancelled") from None
        finally:
            future.cancel()  # no-op once done


    def _find(self: _Source, pattern: str | None) -> tuple[RemoteItem | dict[str, RemoteItem], int]:
        """The root as one item, or its files by relative path and its folder count (fsspec find)."""
        fs, root = self.fs, self._root_path
        info = self._call(lambda: fs.info(root), self.url)
        maybe_dir = info.get("size") is None or self._folder_hint or pattern is not None
        is_dir = info.get("type") == "directory" or (maybe_dir and self._call(lambda: fs.isdir(root), self.url))
        if not is_dir:
            return self._item(info), 0
        found = self._call(lambda: fs.find(root, detail=True, withdirs=True), self.url)
        prefix = root.rstrip("/") + "/"
        files, folders = {}, 0
        for path, detail in found.items():
            if detail.get("type") == "directory":
                folders += path.rstrip("/") != root.rstrip("/")
                continue
            size = detail.get("size")
            rel = path[len(prefix) :] if path.startswith(prefix) else path
            files[rel] = RemoteItem(fs.unstrip_protocol(path), -1 if size is None else int(size), version_of(detail))
        return files, folders

    def fetch(self: _Source, url: str, start: int = 0, end: int | None = None, *, expect: int | None = None,
              listed: RemoteItem | None = None) -> bytes:
        """Fetch ``url[start:end]`` with retries, backoff and a per-request timeout.

        Args:
            url: The object.
            start: First byte.
            end: One past the last byte, or None for the end of the object.
            expect: The byte count the caller knows it must get; a short body is
                treated as a cut connection and retried.
            listed: The object as listed: over HTTP the answer's size and version
                must be its (:func:`checked`), never bytes of another version.

        Raises:
            RemoteChangedError: The answer is of another size or version than ``listed``.
        """
        fs = self.fs
        path = fs._strip_protocol(url)
        timeout_s = self.settings.request_timeout_s

        road = self._road()
        version = listed.version if listed is not None else ""

        def once() -> bytes:
            if road:  # the answer's size and version: of the listed object, or RemoteChangedError
                info, data = self._sync(aio.get_range, fs, road, url if self._http else path, start, end, version, timeout_s,
                                        timeout_s=timeout_s)
                data = checked(listed, info, data) if listed is not None else data
            elif has_loop(fs):  # cancellable on a stop
                whole = start == 0 and end is None
                data = self._sync(fs._cat_file, path, timeout_s=timeout_s) if whole else \
                    self._sync(fs._cat_file, path, start=start, end=end, timeout_s=timeout_s)
            elif start == 0 and end is None:
                data = fs.cat_file(path)
            else:
                data = fs.cat_file(path, start=start, end=end)
            if expect is not None and len(data) != expect:
                raise TruncatedBodyError(f"got {len(data)} B of {expect} B")
            return bytes(data)

        return self._call(once, url)

    def _road(self: _Source) -> str:
        """How this source's GETs on the fsspec road show the version that answered (fastload.source.aio.get_range):
        "http", "s3", "gcs", or "" (a store whose answers do not: local files, others)."""
        fs = self.fs
        if not has_loop(fs):
            return ""
        return "http" if self._http else versioned.road_of(fs)

    def fetch_many(self: _Source, ranges: builtins.list[tuple[str, int, int | None]],
                   listed: builtins.list[RemoteItem] | None = None) -> builtins.list[bytes | Exception]:
        """``url[start:end]`` (``end`` None: to the end) of each ``(url, start, end)``, their
        requests overlapping on fsspec's event loop; a failed one's error in its place. As
        with :meth:`fetch`, a body of another length is returned for the caller to judge;
        over HTTP one of another size or version than ``listed`` (one per range) is a
        RemoteChangedError in its place: a refetched block never mixes versions.

        Threads that each wait on one request cost a context switch or more per object
        and contend for the GIL: a cold epoch ran at 615 objects/s with 8 read threads
        and 16 fetch threads, 937/s with 2 read threads (unshaped loopback, 108 KB).
        A range whose request fails is retried alone through :meth:`fetch` (backoff,
        timeout, error translation); what that raises is returned for it.
        """
        fs: Any = self.fs
        results: builtins.list[Any] = [None] * len(ranges)
        if len(ranges) > 1 and getattr(fs, "async_impl", False) and getattr(fs, "loop", None) is not None:
            paths = [(fs._strip_protocol(url), start, end) for url, start, end in ranges]
            road = self._road()
            results = self._sync(aio.gather_ranges, fs, paths, self.settings.request_timeout_s, self.limit_of, self.stop,
                                 road=road, versions=None if listed is None else [i.version for i in listed])
            if road:
                for i, res in enumerate(results):
                    if isinstance(res, tuple):
                        try:
                            results[i] = checked(listed[i], *res) if listed is not None else res[1]
                        except RemoteChangedError as err:
                            results[i] = err

        def again(i: int) -> bytes | Exception:
            url, start, end = ranges[i]
            try:
                return self.fetch(url, start, end, listed=None if listed is None else listed[i])
            except Exception as err:
                return err

        redo = [i for i, res in enumerate(results) if res is None or (isinstance(res, BaseException)
                                                                     and not isinstance(res, RemoteChangedError))]
        if len(redo) > 1 and not getattr(fs, "async_impl", False):
            # A store without an event loop (local files, NFS): its reads overlap on threads.
            with ThreadPoolExecutor(min(len(redo), self.settings.local_threads), thread_name_prefix="fastload-fetch") as pool:
                for i, res in zip(redo, pool.map(again, redo)):
                    results[i] = res
        else:
            for i in redo:
                results[i] = again(i)
        return [res if isinstance(res, Exception) else bytes(res) for res in results]

    def fetch_whole(self: _Source, item: RemoteItem, block_bytes: int, sink: Callable[[RemoteItem, int, bytes], None],
                    block: int | None = None) -> tuple[RemoteItem, bool]:
        """One GET of all of ``item``, handed to ``sink(item, block, bytes)`` a ``block_bytes`` block at a time.

        For hosts that ignore Range (:meth:`ignores_ranges`: Python's http.server): each
        block is read off the answer as it arrives and given to ``sink`` (the fetch layer
        stores it), so memory holds a block, not the object, and the object is fetched
        once. The request, retried from its start on a transient failure (``sink`` may
        then see a block again), holds one slot throughout. A sizeless item is sized
        and versioned by the answer; a sized one must still have its listed size and
        version (the item ``sink`` gets is the answer's).

        Args:
            block: Over HTTP, ask for only this block (a Range header): the way to learn
                whether the host honours Range without a request wasted either way.
                A 206 hands ``sink`` that block alone; a whole answer, every block.

        Returns:
            The item as answered, and whether the whole object came (False: a 206).

        Raises:
            RemoteChangedError: The answer is of another size or version than ``item``'s.
        """
        fs: Any = self.fs
        timeout_s = self.settings.request_timeout_s

        def blocks(size: int) -> builtins.list[int]:
            return [min(block_bytes, size - start) for start in range(0, max(size, 1), block_bytes)]

        def once() -> tuple[RemoteItem, bool]:
            if not self._http:
                with fs.open(fs._strip_protocol(item.url), "rb") as f:
                    for b, n in enumerate(blocks(item.size)):
                        data = f.read(n)
                        if len(data) != n:
                            raise TruncatedBodyError(f"got {len(data)} B of {n} B")
                        sink(item, b, data)
                return item, True
            span = None if block is None else (block * block_bytes, min(item.size, (block + 1) * block_bytes))
            stream = self._sync(aio.HttpStream.open, fs, item.url, timeout_s, span, timeout_s=timeout_s)
            try:
                ranged = stream.status == 206
                total = (stream.headers.get("Content-Range") or "").rpartition("/")[2] if ranged else ""
                info = {"name": item.url, "size": int(total) if total.isdigit() else item.size if ranged else stream.length,
                        **{k: stream.headers[k] for k in VERSION_FIELDS if stream.headers.get(k)}}
                done = self._item(info)
                if item.size >= 0:
                    done = unchanged(item, done)
                if span is not None:
                    self.note_ranges(item.url, ranged)
                if ranged and span is not None and block is not None:
                    sink(done, block, self._sync(stream.read, span[1] - span[0], timeout_s=timeout_s))
                    return done, False
                for b, n in enumerate(blocks(done.size)):
                    sink(done, b, self._sync(stream.read, n, timeout_s=timeout_s))
                return done, True
            finally:
                fsspec.asyn.sync(fs.loop, stream.close, timeout=timeout_s)

        return self._call(once, item.url)


def checked(listed: RemoteItem, info: dict[str, Any], body: bytes) -> bytes:
    """``body``, if the answer it came in (``info``: answers.first_info, fastload.source.versioned) is of
    ``listed``'s size and version, and its store did not refuse the GET's condition (a 412).

    Raises:
        RemoteChangedError: It is not (errors.unchanged): a block of another version.
    """
    if info.get(versioned.CHANGED):
        raise changed(listed, info[versioned.CHANGED])
    if info.get("size") is not None:
        unchanged(listed, RemoteItem(listed.url, int(info["size"]), version_of(info)))
    return body
