"""Remote storage through fsspec: listing, fingerprints, ranged reads, retries.

A :class:`Source` is built from an fsspec URL plus ``storage_options``; it never
invents its own storage layer. It pickles its settings, not its filesystem, so a
worker process reopens the connection in the child (fsspec resets its event loop
after fork).

Errors are translated into :mod:`fastload.errors` classes that name the URL, the
cause and the fix. ``storage_options`` values are scrubbed from every message, so
a secret key never reaches a log (tests/integration/test_source_s3.py greps for it).
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import functools
import importlib
import importlib.util
import os
import random
import re
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urljoin, urlsplit

import fsspec
import fsspec.asyn
from fsspec.core import url_to_fs
from fsspec.registry import known_implementations

from fastload import curl
from fastload._loop import submit_all
from fastload.config import Settings
from fastload.curl import CurlRoute, route_for
from fastload.errors import (
    ConfigError,
    CredentialsError,
    EmptyDatasetError,
    FastloadError,
    RemoteChangedError,
    RemoteNotFoundError,
    SourceError,
    StoppedError,
)
from fastload.hostlimit import (
    SLOT_WAIT_S,
    STOP_POLL_S,
    HostLimit,
    aiohttp_client,
    congestion,
    host_of,
    limit_for,
)

T = TypeVar("T")

_INSTALL_HINTS = {
    "s3": "pip install 'fastload[s3]'",
    "s3a": "pip install 'fastload[s3]'",
    "gs": "pip install 'fastload[gcs]'",
    "gcs": "pip install 'fastload[gcs]'",
    "http": "pip install aiohttp",
    "https": "pip install aiohttp",
}
# Exceptions whose class name marks missing or rejected credentials (botocore,
# google-auth); matched by name so that neither package is a hard dependency.
_CREDENTIAL_ERRORS = {
    "NoCredentialsError",
    "PartialCredentialsError",
    "CredentialRetrievalError",
    "DefaultCredentialsError",
    "RefreshError",
}
# Exceptions worth retrying: network failures, timeouts, throttling and 5xx.
_TRANSIENT_NAMES = {
    "ClientPayloadError",
    "ServerDisconnectedError",
    "ClientConnectorError",
    "ClientOSError",
    "ServerTimeoutError",
    "FSTimeoutError",
    "ReadTimeoutError",
    "ConnectTimeoutError",
    "EndpointConnectionError",
    "ConnectionClosedError",
    "IncompleteReadError",
    "ResponseStreamingError",
    "TruncatedBodyError",
}


HEAD_CONCURRENCY = 64  # HEADs in flight while completing a sizeless listing (Source.complete_all)


class TruncatedBodyError(OSError):
    """A read returned fewer bytes than asked for (a cut connection); retried."""


@dataclass(frozen=True)
class RemoteItem:
    """One remote object as listed.

    Attributes:
        url: Canonical URL with its protocol (``s3://b/k``, ``file:///p``, ``http://h/p``).
        size: Size in bytes.
        version: ETag, generation or mtime as a string; "" when the store has none.
    """

    url: str
    size: int
    version: str

    def to_json(self) -> list[Any]:
        return [self.url, self.size, self.version]

    @classmethod
    def from_json(cls, row: list[Any]) -> RemoteItem:
        return cls(str(row[0]), int(row[1]), str(row[2]))


def glob_to_regex(pattern: str) -> re.Pattern[str]:
    """Compile a glob where ``**`` spans folders and ``*`` stays within one.

    >>> bool(glob_to_regex("**/*.jpg").match("a/b/c.jpg")), bool(glob_to_regex("*.jpg").match("a/c.jpg"))
    (True, False)
    """
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def _version_of(info: dict[str, Any]) -> str:
    for key in ("ETag", "etag", "generation", "md5Hash", "LastModified", "Last-Modified", "last_modified", "updated", "mtime", "created"):
        value = info.get(key)
        if value not in (None, ""):
            return str(value).strip('"')
    return ""


def _forget_parent_loop(fs: Any) -> None:
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


class Source:
    """Reads one fsspec location (a prefix, folder or single object).

    Args:
        url: Any fsspec URL or local path.
        storage_options: Passed to the fsspec filesystem (credentials, endpoint...).
        settings: Retry, timeout and parallelism settings.
        stop: Once set, no request or retry starts, waits for a slot end, and requests
            on fsspec's event loop are cancelled: each raises StoppedError (the Reader's
            stop: staging's Ctrl-C).
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, settings: Settings | None = None,
                 stop: threading.Event | None = None) -> None:
        if not isinstance(url, str) or not url:
            # Never the whole value: a list of 100,000 URLs made a 7,900-character message.
            shown = repr(url) if len(repr(url)) <= 60 else f"{repr(url)[:57]}... ({type(url).__name__})"
            raise ConfigError(f"URL {shown} is not a string; pass e.g. 's3://bucket/prefix/' or '/data/train' "
                              "(a list of URLs goes to the datasets or fastload.stage, not to Source)")
        _check_url(url)
        self.storage_options = dict(storage_options or {})
        self.settings = settings or Settings.from_env()
        self.stop = stop or threading.Event()
        self._lock = threading.Lock()
        self._fs: fsspec.AbstractFileSystem | None = None
        self._pid = os.getpid()
        self._root_path = ""
        self.url = url
        self._folder_hint = url.endswith("/")
        # fsspec's HTTP filesystem keeps URLs as they are. It needs aiohttp, whose import
        # (~0.1 s) is most of the time before the first request of a cold epoch: it runs on
        # a thread (import_http_ahead) while the listing and first blocks go through libcurl, and
        # the filesystem opens on first use (fs).
        self._http = url.split("://", 1)[0] in ("http", "https")
        if self._http:
            if importlib.util.find_spec("aiohttp") is None:
                raise ConfigError(f"URL {url!r} needs a package that is missing (aiohttp); fix: {_INSTALL_HINTS['http']}")
            import_http_ahead()
            self._root_path = url
            self.url = url.rstrip("/")
            self._local = False
        else:
            fs = self.fs  # fail early on unknown protocols and missing packages
            self.url = fs.unstrip_protocol(self._root_path).rstrip("/") if self._root_path else url
            # Local files have no host to flood: their reads take no slot.
            self._local = bool({"file", "local", "memory"} & set(fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)))
        # Hosts whose answer to a ranged GET was the whole object (Python's http.server
        # ignores Range): the fetch stage then asks for each object once, whole (fastload.fetch).
        self._rangeless: set[str] = set()

    @functools.cached_property
    def route(self) -> CurlRoute | None:
        """libcurl's route for this HTTP source's listing pages and first-block GETs, or None:
        aiohttp (fastload.curl)."""
        return route_for(self.storage_options, self.settings.http_client, self._encode) if self._http else None

    @staticmethod
    def _curl_takes(limit: HostLimit) -> bool:
        """Whether libcurl carries GETs to ``limit``'s host (where a Source has a route): not to one
        that closes its connections, nor to one libcurl cannot speak to (fastload.curl)."""
        return not limit.closing and not curl.broken(limit)

    def _settle(self, pending: Sequence[Any], timeout_s: float) -> None:
        """Wait for ``pending`` together (curl.settle); on a stop, cancel them and raise StoppedError."""
        curl.settle(pending, self.stop, timeout_s)
        if self.stop.is_set():
            for p in pending:
                p.cancel()
            raise StoppedError(f"{pending[0].url if pending else self.url}: stopped; its requests were cancelled")

    def _encode(self, url: str) -> Any:
        return self.fs.encode_url(url)  # type: ignore[attr-defined]

    def __getstate__(self) -> dict[str, Any]:
        # Settings travel; the filesystem (sockets, event loop) is reopened in the child.
        return {"url": self.url, "storage_options": self.storage_options, "settings": self.settings}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"], state["storage_options"], state["settings"])  # type: ignore[misc]

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """The fsspec filesystem, opened on first use (and again in a forked child)."""
        if self._pid != os.getpid():
            # A forked DataLoader worker inherits the parent's filesystem, whose event
            # loop and sockets stay with the parent: fsspec raises "This class is not
            # fork-safe" on first use. Reopen in the child, with a fresh lock (the old
            # one may have been held by a parent thread at fork time).
            # tests/reliability/test_train_kill.py trains over HTTP with 2 workers.
            self._lock = threading.Lock()
            _forget_parent_loop(self._fs)
            self._fs, self._pid = None, os.getpid()
        if self._fs is None:
            with self._lock:
                if self._fs is None:
                    self._fs, self._root_path = self._open_fs()
        return self._fs

    def _open_fs(self) -> tuple[fsspec.AbstractFileSystem, str]:
        protocol = self.url.split("://", 1)[0] if "://" in self.url else "file"
        try:
            if self._http and _import_failure is not None:
                raise _import_failure  # the import thread's (import_http_ahead), with its traceback
            fs, path = url_to_fs(self.url, **_with_timeouts(protocol, self.storage_options, self.settings.request_timeout_s))
        except ImportError as err:
            hint = _INSTALL_HINTS.get(protocol, f"install the fsspec backend for {protocol!r}")
            raise ConfigError(f"URL {self.url!r} needs a package that is missing ({err}); fix: {hint}") from err
        except ValueError as err:
            raise ConfigError(f"URL {self.url!r} is not usable: {self.scrub(str(err))}; check the protocol and spelling") from err
        except FastloadError:
            raise
        except Exception as err:
            raise self.translate(err, self.url) from err
        if protocol in ("s3", "s3a") and isinstance(getattr(fs, "retries", None), int):
            fs.retries = 1  # s3fs retries SlowDown itself, inside the slot; fastload does (_with_timeouts)
        return fs, path

    @property
    def host_limit(self) -> HostLimit | None:
        """The limit on requests in flight to this source's host (None for local files)."""
        return self.limit_of(self.url)

    def limit_of(self, url: str) -> HostLimit | None:
        """The limit on requests in flight to ``url``'s host (None for local files).

        Looked up per request: a forked child starts with its own limits (fastload.hostlimit).
        """
        return None if self._local else limit_for(host_of(url, self.storage_options), self.settings.workers)

    def ignores_ranges(self, url: str) -> bool:
        """Whether ``url``'s host answered a ranged GET with the whole object."""
        return bool(self._rangeless) and host_of(url, self.storage_options) in self._rangeless

    def note_ignores_ranges(self, url: str) -> None:
        """Record that ``url``'s host answers ranged GETs with the whole object."""
        self._rangeless.add(host_of(url, self.storage_options))

    def _sync(self, func: Callable[..., Coroutine[Any, Any, T]], *args: Any, timeout_s: float | None = None, **kwargs: Any) -> T:
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

    @staticmethod
    def _async(fs: Any) -> bool:
        return bool(getattr(fs, "async_impl", False)) and getattr(fs, "loop", None) is not None

    def _stopped(self, url: str) -> None:
        if self.stop.is_set():
            raise StoppedError(f"{url}: stopped before its request")

    # -- naming -------------------------------------------------------------

    def canonical(self, url: str) -> str:
        """The canonical form of ``url`` on this source's filesystem (stable cache identity)."""
        return self._unstrip(url if self._http else self.fs._strip_protocol(url))

    def _unstrip(self, path: str) -> str:
        """``path`` as a URL of this source's filesystem (fsspec's HTTP paths are URLs already)."""
        return path if self._http else self.fs.unstrip_protocol(path)

    def scrub(self, text: str) -> str:
        """Replace every secret from ``storage_options`` in ``text`` with ``***``."""
        for value in _secrets(self.storage_options):
            text = text.replace(value, "***")
        return text

    def translate(self, err: BaseException, url: str) -> FastloadError:
        """Map a backend exception to a FastloadError naming ``url``, the cause and the fix."""
        cause = self.scrub(f"{type(err).__name__}: {err}")
        name = type(err).__name__
        if name in _CREDENTIAL_ERRORS or isinstance(err, PermissionError):
            return CredentialsError(
                f"{url}: access denied or no credentials ({cause}); fix: pass credentials in "
                "storage_options (e.g. --storage-options '{\"key\": ..., \"secret\": ...}') or the "
                "provider's environment variables"
            )
        if isinstance(err, FileNotFoundError) or "NoSuchBucket" in cause:
            return RemoteNotFoundError(f"{url}: not found ({cause}); fix: check the bucket, path and spelling")
        status = getattr(err, "status", None)  # aiohttp's ClientResponseError
        if self._http and status in (401, 403):
            # nginx without autoindex answers a folder with 403, as it does a missing login.
            folder = status == 403 and url.endswith("/")
            return CredentialsError(
                f"{url}: the server refused the request (HTTP {status}: no login, or a wrong one"
                f"{'; or it does not list folders' if folder else ''}; {cause}); fix: pass the login in "
                "storage_options, e.g. --storage-options '{\"headers\": {\"Authorization\": \"Basic ...\"}}' (or "
                "client_kwargs={'auth': aiohttp.BasicAuth(user, password)} from Python)"
                + ("; or pass the objects' URLs as a list (--url-list; docs/storage.md)" if folder else "")
            )
        if isinstance(err, FastloadError):
            return err
        return SourceError(f"{url}: read failed ({cause}); fix: check the URL, storage_options and that the store is reachable")

    # -- listing --------------------------------------------------------------

    def list(self, pattern: str | None = None, *, complete: bool = True) -> list[RemoteItem]:
        """List every object under the root (or the root itself if it is an object).

        Sizes and versions come from the listing where the store provides them.
        Stores that do not (plain HTTP) need one HEAD per object: with
        ``complete=True`` they are done here in parallel; with ``complete=False``
        such items come back with ``size == -1`` and the caller completes them
        (staging does it in its fetch workers, so the link never sits idle).

        Raises:
            EmptyDatasetError: Nothing matches: an empty folder, or a pattern that
                matches none of the files the listing found (the message counts them).
        """
        found, folders = self.find(pattern)
        if isinstance(found, RemoteItem):
            return [found]
        items = matching(self.url, found, folders, pattern)
        return self.complete_all(items) if complete else items

    def find(self, pattern: str | None = None) -> tuple[RemoteItem | dict[str, RemoteItem], int]:
        """What :meth:`list` filters: the root as one item, or every file under it by its
        path relative to the root, and the number of folders seen.

        ``pattern`` filters nothing here; it only says the root is meant as a folder.
        """
        if self._http:
            return self._http_list(pattern)
        return self._find(pattern)

    def _find(self, pattern: str | None) -> tuple[RemoteItem | dict[str, RemoteItem], int]:
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
            files[rel] = RemoteItem(fs.unstrip_protocol(path), -1 if size is None else int(size), _version_of(detail))
        return files, folders

    def _http_list(self, pattern: str | None) -> tuple[RemoteItem | dict[str, RemoteItem], int]:
        """:meth:`_find` over HTTP: each level of folders fetched together, one page each.

        fsspec walks an HTTP tree one folder page at a time, and asks for the root
        three times (HEAD, isdir, find), a URL without its trailing slash costing a
        redirect each time: 50 subfolders took 2.5 s with 20 ms to first byte, 0.24 s
        this way (both in one run, ThreadingHTTPServer). Here the root is
        one GET (its redirect, if any, is followed once and its final URL kept), and
        every folder of the next level goes out at once, as many at a time as the
        host's limit allows (fastload.hostlimit; tests/integration/test_http_listing.py
        counts them at the server).

        A folder's index page (Python's "Directory listing for", nginx's "Index of")
        is never an item: an empty folder lists as empty, not as one HTML file.
        """
        timeout_s, limit = self.settings.request_timeout_s, self.host_limit

        def get_page(url: str) -> _Page:
            # _call holds the request's slot: a second one taken inside it (_held) waited
            # for itself once the limit was cut to 1 (tests/reliability/test_flaky_remote.py hung).
            return self._call(lambda: self._sync(_http_page, self.fs, url, timeout_s), url)

        root_url = self.url + "/" if self._folder_hint else self.url
        got = self._pages([root_url], limit)[0]
        # A failed page is retried alone on aiohttp: backoff, then a named error.
        root = get_page(root_url) if isinstance(got, BaseException) else got
        # A folder: its URL ends in "/" (as asked, or after a redirect), or it is an index
        # page, or an HTML page with links below it where a folder was likely meant.
        folder = root.final.endswith("/")
        if not folder and root.text is not None:
            links = _page_links(root.final, root.text)
            likely = self._folder_hint or pattern is not None or root.size is None
            folder = bool(_INDEX_TITLE.search(root.text)) or (likely and bool(links[0] or links[1]))
        if not folder:
            return self.info(self.url), 0
        base = root.final if root.final.endswith("/") else root.final + "/"
        files: set[str] = set()
        seen = {base}
        level = [root]
        while level:
            subfolders: set[str] = set()
            for page in level:
                got_files, got_dirs = _page_links(page.final, page.text or "")
                files |= got_files
                subfolders |= got_dirs - seen
            seen |= subfolders
            todo = sorted(subfolders)
            pages = self._pages(todo, limit) if todo else []
            level = [get_page(url) if isinstance(got, BaseException) else got for url, got in zip(todo, pages)]
        return {u[len(base) :] if u.startswith(base) else u: RemoteItem(u, -1, "") for u in files}, len(seen) - 1

    def _pages(self, urls: builtins.list[str], limit: HostLimit | None) -> builtins.list[Any]:
        """One GET of each folder page, together, a failure in its place: on libcurl where this
        source routes there (fastload.curl; no wait for aiohttp's import), else on fsspec's session."""
        timeout_s, route = self.settings.request_timeout_s, self.route
        if route is None or limit is None or not self._curl_takes(limit):
            return self._sync(_http_pages, self.fs, urls, timeout_s, limit)
        self._stopped(urls[0])
        pending = route.start_pages(urls, timeout_s, limit, self.stop)
        self._settle(pending, 2 * timeout_s + SLOT_WAIT_S)  # a GET's timeout starts once it runs
        out: builtins.list[Any] = []
        for p in pending:
            try:
                out.append(_Page(*p.result(0)))
            except Exception as err:  # redone on aiohttp by the caller
                p.cancel()
                out.append(err)
        return out

    def complete(self, item: RemoteItem) -> RemoteItem:
        """``item`` with its size and version filled in (one HEAD if the listing lacked them)."""
        if item.size >= 0 and (item.version or not getattr(self.fs, "async_impl", False)):
            return item
        return self.info(item.url)

    def complete_all(self, items: builtins.list[RemoteItem]) -> builtins.list[RemoteItem]:
        """Complete every item, in parallel where needed."""
        if all(i.size >= 0 and i.version for i in items):
            return items
        # A HEAD moves no data: it is one round trip, so more of them may overlap than
        # transfers. 16 at a time spent ~4 s listing 3,000 objects with 20 ms to first
        # byte, longer than the transfer itself at 1 Gbit (benchmarks/peers).
        threads = min(len(items), max(self.settings.workers, HEAD_CONCURRENCY))
        with ThreadPoolExecutor(max(1, threads)) as pool:
            return list(pool.map(self.complete, items))

    def info(self, url: str) -> RemoteItem:
        """Fetch one object's current size and version (one round trip)."""
        fs: Any = self.fs
        if self._async(fs):  # cancellable on a stop
            return self._item(self._call(lambda: self._sync(fs._info, url), url))
        return self._item(self._call(lambda: fs.info(url), url))

    def read_first(self, item: RemoteItem, nbytes: int) -> tuple[RemoteItem, bytes]:
        """Complete ``item`` and read its first ``nbytes`` bytes, in one request where possible.

        An HTTP listing has no sizes, and a HEAD per object before its GET doubles the
        per-object latency (2 x ~20 ms to first byte on an object store; profiled in
        benchmarks/peers). Over HTTP this is one GET with ``Range: bytes=0-(nbytes-1)``:
        the size comes from its Content-Range (or Content-Length) and the version from
        the same ETag / Last-Modified headers a HEAD reports, so the cache identity is
        the one :meth:`complete` would give. Other stores complete first, then read.
        """
        if item.size >= 0 or not self._http:
            done = self.complete(item)
            return done, self.read(done.url, 0, min(nbytes, done.size), expect=min(nbytes, done.size))
        timeout_s = self.settings.request_timeout_s

        def once() -> tuple[dict[str, Any], bytes]:
            return self._sync(_http_get_first, self.fs, item.url, nbytes, timeout_s)

        info, data = self._call(once, item.url)  # _call holds the slot
        return self._item(info), data

    def read_first_many(self, items: builtins.list[RemoteItem], nbytes: int) -> builtins.list[tuple[RemoteItem, bytes]]:
        """:meth:`read_first` of each item, with their GETs overlapping on fsspec's event loop.

        A staging thread that waits on one request at a time keeps ``workers`` requests in
        flight, too few for 20 ms to first byte; more threads cost CPU and contend for the
        GIL and the cache index. Here one thread keeps a whole batch in flight. An item
        whose GET fails is retried alone through :meth:`read_first` (backoff, translation).
        """
        if len(items) < 2 or not self._http or any(i.size >= 0 for i in items):
            return [self.read_first(i, nbytes) for i in items]
        started = self._curl_first(items, nbytes)
        if started is not None:
            self._settle(started, 2 * self.settings.request_timeout_s)  # as finish_first
            return [self.finish_first(item, nbytes, p) for item, p in zip(items, started)]
        urls = [i.url for i in items]
        results = self._sync(_gather_first, self.fs, urls, nbytes, self.settings.request_timeout_s, self.limit_of)
        return [self.read_first(item, nbytes) if isinstance(res, BaseException) else (self._item(res[0]), res[1])
                for item, res in zip(items, results)]

    def start_first_many(self, items: Sequence[RemoteItem], nbytes: int) -> builtins.list[concurrent.futures.Future[Any]] | None:
        """Start reading each item's first ``nbytes`` on fsspec's event loop, or None where that
        cannot be done (a store without an event loop; sizeless items outside HTTP).

        All are handed to the loop at once (:func:`fastload._loop.submit_all`), so the
        caller pays one wake-up of the loop, not one per item. Each future is finished
        with :meth:`finish_first`; each request holds its host's slot while it runs.
        """
        self._stopped(items[0].url if items else self.url)
        if not items or (not self._http and any(i.size < 0 for i in items)):
            return None
        started = self._curl_first(items, nbytes) if self._http else None
        if started is not None:
            return started
        fs: Any = self.fs
        if not getattr(fs, "async_impl", False) or getattr(fs, "loop", None) is None:
            return None
        timeout_s = self.settings.request_timeout_s

        def maker(item: RemoteItem) -> Callable[[], Coroutine[Any, Any, Any]]:
            if item.size < 0:
                def request() -> Awaitable[tuple[dict[str, Any], bytes]]:
                    self._stopped(item.url)  # a stop while it waited for its slot: no request
                    return _http_get_first(fs, item.url, nbytes, timeout_s)

                return lambda: _held(self.limit_of(item.url), request)
            ranges: builtins.list[tuple[str, int, int | None]] = [(fs._strip_protocol(item.url), 0, min(nbytes, item.size))]
            return lambda: _gather_ranges(fs, ranges, timeout_s, self.limit_of, self.stop)

        return submit_all(fs.loop, [maker(item) for item in items])

    def _curl_first(self, items: Sequence[RemoteItem], nbytes: int) -> builtins.list[Any] | None:
        """The first-block GETs of sizeless ``items`` handed to libcurl (fastload.curl), or None
        where this source's GETs stay on aiohttp (sized items, no route, no host limit)."""
        route = self.route
        if route is None or any(i.size >= 0 for i in items):
            return None
        by_host: dict[int, tuple[HostLimit, builtins.list[int]]] = {}
        for k, item in enumerate(items):
            limit = self.limit_of(item.url)
            if limit is None or not self._curl_takes(limit):
                return None  # e.g. a host that closes its connections stays on aiohttp (fastload.curl)
            by_host.setdefault(id(limit), (limit, []))[1].append(k)
        out: builtins.list[Any] = [None] * len(items)
        for limit, ks in by_host.values():
            for k, pending in zip(ks, route.start([items[k].url for k in ks], nbytes, self.settings.request_timeout_s, limit,
                                                  self.stop)):
                out[k] = pending
        return out

    def finish_first(self, item: RemoteItem, nbytes: int, future: concurrent.futures.Future[Any]) -> tuple[RemoteItem, bytes]:
        """:meth:`read_first`'s result from a :meth:`start_first_many` future; a failed or short read
        is done again by :meth:`read_first` (retries, backoff, error translation)."""
        try:
            res = self._wait(future, self.settings.request_timeout_s * 2, item.url)
            if item.size < 0:
                info, data = res
                done = self._item(info)
            else:
                done, data = item, res[0]
                if isinstance(data, BaseException):
                    raise data
            if len(data) == min(nbytes, done.size):
                return done, bytes(data)
        except StoppedError:
            raise
        except Exception:  # noqa: S110 - redone below, where errors are retried and translated
            future.cancel()
        return self.read_first(item, nbytes)

    def _wait(self, future: concurrent.futures.Future[T], timeout_s: float, url: str) -> T:
        """``future.result(timeout_s)``, but a stop cancels it and raises StoppedError (as :meth:`_sync`).

        A GET still queued for its host's slot on libcurl's thread (fastload.curl) is
        waited for until it runs, as a coroutine's timeout starts once it holds its
        slot (bounded by SLOT_WAIT_S): redoing it on aiohttp would only queue it again
        for the same slots, and each reader doing so kept the engine from leasing any
        (with the limit cut to 1 on a flaky remote, a batch took > 120 s).
        """
        now = time.monotonic()
        deadline, queue_end = now + timeout_s, now + SLOT_WAIT_S
        while True:
            try:
                return future.result(timeout=min(STOP_POLL_S, max(0.0, deadline - time.monotonic())))
            except concurrent.futures.TimeoutError:
                if self.stop.is_set():
                    future.cancel()
                    raise StoppedError(f"{url}: stopped; its request was cancelled") from None
                now = time.monotonic()
                if isinstance(future, curl.Pending) and not future.started() and now < queue_end:
                    deadline = max(deadline, now + timeout_s)
                    continue
                if now >= deadline:
                    raise

    def _item(self, info: dict[str, Any]) -> RemoteItem:
        if info.get("ignores_ranges"):
            self.note_ignores_ranges(info["name"])
        size = info.get("size")
        if size is None:
            raise SourceError(
                f"{info.get('name')}: the store reports no size for it (over HTTP: no Content-Length); fastload "
                "caches sized objects; fix: if it is a folder, end the URL with '/' or pass a pattern; if it is a "
                "file, serve it with a Content-Length (a static file server such as nginx does)"
            )
        return RemoteItem(self._unstrip(info["name"]), int(size), _version_of(info))

    # -- reading --------------------------------------------------------------

    def read(self, url: str, start: int = 0, end: int | None = None, *, expect: int | None = None) -> bytes:
        """Read ``url[start:end]`` with retries, backoff and a per-request timeout.

        Args:
            url: The object.
            start: First byte.
            end: One past the last byte, or None for the end of the object.
            expect: The byte count the caller knows it must get; a short body is
                treated as a cut connection and retried.
        """
        fs = self.fs
        path = fs._strip_protocol(url)
        timeout_s = self.settings.request_timeout_s

        def once() -> bytes:
            if self._async(fs):  # cancellable on a stop
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

    def read_many(self, ranges: builtins.list[tuple[str, int, int | None]]) -> builtins.list[bytes | Exception]:
        """``url[start:end]`` (``end`` None: to the end) of each ``(url, start, end)``, their
        requests overlapping on fsspec's event loop; a failed one's error in its place. As
        with :meth:`read`, a body of another length is returned for the caller to judge.

        Threads that each wait on one request cost a context switch or more per object
        and contend for the GIL: a cold epoch ran at 615 objects/s with 8 read threads
        and 16 fetch threads, 937/s with 2 read threads (unshaped loopback, 108 KB).
        A range whose request fails is retried alone through :meth:`read` (backoff,
        timeout, error translation); what that raises is returned for it.
        """
        fs: Any = self.fs
        results: builtins.list[Any] = [None] * len(ranges)
        if len(ranges) > 1 and getattr(fs, "async_impl", False) and getattr(fs, "loop", None) is not None:
            paths = [(fs._strip_protocol(url), start, end) for url, start, end in ranges]
            results = self._sync(_gather_ranges, fs, paths, self.settings.request_timeout_s, self.limit_of, self.stop)

        def again(i: int) -> bytes | Exception:
            url, start, end = ranges[i]
            try:
                return self.read(url, start, end)
            except Exception as err:
                return err

        redo = [i for i, res in enumerate(results) if res is None or isinstance(res, BaseException)]
        if len(redo) > 1 and not getattr(fs, "async_impl", False):
            # A store without an event loop (local files, NFS): its reads overlap on
            # threads, as many as the cap on requests in flight allows.
            with ThreadPoolExecutor(min(len(redo), self.settings.workers), thread_name_prefix="fastload-read") as pool:
                for i, res in zip(redo, pool.map(again, redo)):
                    results[i] = res
        else:
            for i in redo:
                results[i] = again(i)
        return [res if isinstance(res, Exception) else bytes(res) for res in results]

    def read_whole(self, item: RemoteItem, block_bytes: int, sink: Callable[[int, bytes], None]) -> None:
        """One GET of all of ``item``, handed to ``sink(block, bytes)`` a ``block_bytes`` block at a time.

        For hosts that ignore Range (:meth:`ignores_ranges`: Python's http.server): each
        block is read off the answer as it arrives and given to ``sink`` (the fetch stage
        stores it), so memory holds a block, not the object. The request, retried from
        its start on a transient failure (``sink`` may then see a block again), holds one
        slot throughout.

        Raises:
            RemoteChangedError: The answer's length is not the listed size.
        """
        fs: Any = self.fs
        timeout_s = self.settings.request_timeout_s
        sizes = [min(block_bytes, item.size - start) for start in range(0, max(item.size, 1), block_bytes)]

        def once() -> None:
            if not self._http:
                with fs.open(fs._strip_protocol(item.url), "rb") as f:
                    for block, n in enumerate(sizes):
                        data = f.read(n)
                        if len(data) != n:
                            raise TruncatedBodyError(f"got {len(data)} B of {n} B")
                        sink(block, data)
                return
            stream = self._sync(_HttpStream.open, fs, item.url, timeout_s, timeout_s=timeout_s)
            try:
                if stream.length is not None and stream.length != item.size:
                    raise RemoteChangedError(
                        f"{item.url}: remote now has {stream.length} B, {item.size} B when listed; the object changed; "
                        "fix: `fastload cache --refresh` or refresh=True"
                    )
                for block, n in enumerate(sizes):
                    sink(block, self._sync(stream.read, n, timeout_s=timeout_s))
            finally:
                fsspec.asyn.sync(fs.loop, stream.close, timeout=timeout_s)

        self._call(once, item.url)

    def _call(self, fn: Callable[[], T], url: str) -> T:
        """``fn()`` (one request) in a slot of the host's limit, retried with backoff outside it."""
        settings = self.settings
        limit = self.limit_of(url)
        attempt = 0
        while True:
            self._stopped(url)  # no request or retry starts once stopping
            try:
                if limit is None:
                    return fn()
                with limit.slot(self.stop) as outcome:
                    result = fn()
                    outcome.nbytes = len(result) if isinstance(result, bytes) else 0
                return result
            except Exception as err:
                if not _is_transient(err):
                    raise self.translate(err, url) from err
                last = err
            attempt += 1
            if attempt >= settings.retries:
                break
            # Full jitter keeps many workers from retrying in lockstep.
            delay = min(settings.backoff_max_s, settings.backoff_s * 2 ** (attempt - 1))
            self.stop.wait(random.uniform(0, delay))  # a stop ends the backoff; the next turn raises
        raise SourceError(
            f"{url}: failed after {settings.retries} attempts; last cause: "
            f"{self.scrub(_describe(last, settings.request_timeout_s))}; fix: check the server, or raise "
            "FASTLOAD_RETRIES / FASTLOAD_TIMEOUT_S"
        ) from last


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(/*)")
# Protocols whose URLs name a host or bucket right after "://".
_NEEDS_HOST = {"http": "host", "https": "host", "s3": "bucket", "s3a": "bucket", "gs": "bucket", "gcs": "bucket"}


def _check_url(url: str) -> None:
    """Reject URLs that fsspec would misread rather than refuse.

    "s3:/b/k" became a local path "./s3:/b/k" (then "not found"), "http://" and
    "http://[::1" were reported as "http:: not found", and "s3://" as "Cannot
    traverse all of S3" (tests/reliability/test_hostile_input.py).
    """
    if "::" in url.split("://", 1)[0]:
        return  # a chained URL ("simplecache::s3://..."): fsspec parses the chain
    match = _SCHEME.match(url)
    if match is None or len(match.group(1)) == 1:  # no scheme, or a Windows drive "C:/"
        return
    scheme, slashes = match.group(1).lower(), match.group(2)
    if len(slashes) < 2 and scheme in known_implementations:
        rest = url[match.end() :]
        fixed = f"file:///{rest}" if scheme in ("file", "local") else f"{scheme}://{rest}"
        raise ConfigError(f"URL {url!r} needs two slashes after '{scheme}:'; fix: write '{fixed}'")
    kind = _NEEDS_HOST.get(scheme)
    if kind is None:
        return
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - parsing the port is the check
    except ValueError as err:
        raise ConfigError(f"URL {url!r} is malformed ({err}); fix: check the {kind} and the port") from err
    if not parts.netloc:
        example = "s3://bucket/prefix/" if kind == "bucket" else "https://host/path/"
        raise ConfigError(f"URL {url!r} names no {kind}; fix: write e.g. '{example}'")


def _with_timeouts(protocol: str, options: dict[str, Any], timeout_s: float) -> dict[str, Any]:
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


def _describe(err: BaseException, timeout_s: float) -> str:
    """``Type: message`` of the error worth naming, with the backend error beneath it.

    fsspec's HTTP info() reports a 503 or a reset as ``FileNotFoundError(url)``, and
    s3fs turns S3's ``SlowDown`` into ``OSError(EBUSY)``: the user needs the error
    underneath (tests/reliability/test_flaky_remote.py checks the messages).
    """
    cause = err.__cause__ or err.__context__
    while isinstance(err, FileNotFoundError) and cause is not None and _is_transient(cause):
        err, cause = cause, cause.__cause__ or cause.__context__
    # Timeouts often carry no message; say what expired instead of printing "".
    text = str(err) or (
        f"no answer within request_timeout_s={timeout_s:g} s"
        if isinstance(err, (TimeoutError, asyncio.TimeoutError)) or "Timeout" in type(err).__name__
        else "no message"
    )
    if err.__cause__ is not None and str(err.__cause__) and str(err.__cause__) not in text:
        text += f" (from {type(err.__cause__).__name__}: {err.__cause__})"
    return f"{type(err).__name__}: {text}"


def matching(url: str, files: dict[str, RemoteItem], folders: int, pattern: str | None) -> list[RemoteItem]:
    """The items of ``url``'s listing (by relative path) that ``pattern`` matches, in path order.

    Raises:
        EmptyDatasetError: None does (:func:`nothing_matched`).
    """
    regex = glob_to_regex(pattern) if pattern else None
    items = [item for rel, item in sorted(files.items()) if regex is None or regex.match(rel)]
    if not items:
        raise nothing_matched(url, pattern, folders, list(files))
    return items


def nothing_matched(url: str, pattern: str | None, folders: int, files: Sequence[str]) -> EmptyDatasetError:
    """The error for a listing that yields no item: what was found, and the likely fix."""
    found = f"{folders} folder{'s' * (folders != 1)} and {len(files)} file{'s' * (len(files) != 1)}"
    if not files:
        return EmptyDatasetError(
            f"{url}: no data items: the listing found {found}"
            + (f" (pattern {pattern!r})" if pattern else "")
            + "; fix: check the URL (an empty folder lists as nothing), or put the data there"
        )
    deep = "**/" + pattern.lstrip("/") if pattern and not pattern.startswith("**") else None
    if deep and any(glob_to_regex(deep).match(f) for f in files):
        fix = f"pass --pattern {deep!r} (pattern={deep!r}): '*' stays within one folder, '**/' spans nested folders"
    else:
        examples = ", ".join(repr(f) for f in sorted(files)[:3])
        fix = f"check the pattern against the files' relative paths (e.g. {examples})"
    return EmptyDatasetError(f"{url}: pattern {pattern!r} matches nothing: the listing found {found}, 0 matching; fix: {fix}")


# Titles of a folder's index page: Python's http.server, and nginx / Apache autoindex.
_INDEX_TITLE = re.compile(r"<title>\s*(?:Directory listing for|Index of)\b", re.IGNORECASE)
# A link that urljoin would append to the page's URL unchanged: no scheme, no leading
# "/", no "." or ".." segment (test_page_links.py checks it against urljoin).
_PLAIN_LINK = re.compile(r"(?![./])(?!.*/\.)[^:]*\Z", re.DOTALL)
_HREF = re.compile(r"""<a\s[^>]*?href\s*=\s*["']([^"'#]+)["']""", re.IGNORECASE)


@dataclass(frozen=True)
class _Page:
    """One HTTP answer while listing: where it ended (after redirects), its size, and its text if HTML."""

    final: str
    size: int | None
    text: str | None


async def _http_page(fs: Any, url: str, timeout_s: float) -> _Page:
    """GET ``url`` on fsspec's session; the body is read only when it is HTML (a folder page)."""
    import aiohttp

    session = await fs.set_session()
    async with session.get(fs.encode_url(url), timeout=aiohttp.ClientTimeout(total=timeout_s), **fs.kwargs) as r:
        fs._raise_not_found_for_status(r, url)
        final = str(r.url)
        size = int(r.headers["Content-Length"]) if r.headers.get("Content-Length", "").isdigit() else None
        mimetype = r.headers.get("Content-Type", "").partition(";")[0].strip().lower()
        if mimetype == "text/html" or (not mimetype and final.endswith("/")):
            return _Page(final, size, await r.text(errors="ignore"))
        r.close()  # a data file: its body is not the listing's business
        return _Page(final, size, None)


async def _http_pages(fs: Any, urls: list[str], timeout_s: float, limit: HostLimit | None) -> list[Any]:
    """:func:`_http_page` of each, as many at once as the host's limit allows; a failure in its place."""
    def request(url: str) -> Callable[[], Awaitable[_Page]]:
        return lambda: _http_page(fs, url, timeout_s)

    return await asyncio.gather(*(_held(limit, request(u)) for u in urls), return_exceptions=True)


def _page_links(page_url: str, text: str) -> tuple[set[str], set[str]]:
    """The files and folders (ending in "/") that a folder page links to below itself."""
    base = page_url if page_url.endswith("/") else page_url + "/"
    files: set[str] = set()
    folders: set[str] = set()
    for link in _HREF.findall(text):
        if "?" in link:  # sort-order links of autoindex pages
            continue
        # A plain relative name ("00017.jpg", "cls/") joins by concatenation: urljoin cost
        # ~25 us a link, 7 ms per page of 300 files, in a listing made before the first byte.
        url = base + link if _PLAIN_LINK.match(link) else urljoin(base, link)
        if url.startswith(base) and url != base:
            (folders if url.endswith("/") else files).add(url)
    return files, folders


_IMPORT_LOCK = threading.Lock()
IMPORT_JOIN_S = 60.0  # a fork waits this long at most for the import (it takes ~0.1 s; a hung one must not hang forks)
_importing: threading.Thread | None = None
_import_failure: BaseException | None = None  # what the thread's import raised; Source._open_fs re-raises it


def import_http_ahead() -> None:
    """Import fsspec's HTTP filesystem (and aiohttp) on a thread, once per process, ahead of its use.

    Whoever needs it meanwhile (Source.fs) waits for that import to finish, as
    Python's import lock does; listing pages and first blocks on libcurl do not
    need it. A fork waits for it first: a child must not inherit a module lock
    held by a thread that is not there.
    """
    global _importing
    if _importing is not None or "fsspec.implementations.http" in sys.modules:
        return
    with _IMPORT_LOCK:
        if _importing is None:
            _importing = threading.Thread(target=_import_http, name="fastload-import-http", daemon=True)
            _importing.start()


def _import_http() -> None:
    global _import_failure
    try:
        importlib.import_module("fsspec.implementations.http")
    except Exception as err:  # kept for the Source that opens the filesystem (_open_fs)
        _import_failure = err


def _join_import() -> None:
    if _importing is not None and _importing is not threading.current_thread():
        _importing.join(IMPORT_JOIN_S)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_join_import)


def _identity_get(fs: Any, headers: dict[str, str] | None = None) -> tuple[dict[str, str], dict[str, Any]]:
    """The headers and other arguments of a GET on fsspec's HTTP session: the filesystem's
    own, plus ``headers``, asking for identity encoding as fsspec's HEAD does (a
    compressed body's length is not the object's size)."""
    kwargs = dict(fs.kwargs)
    return {**(kwargs.pop("headers", None) or {}), **(headers or {}), "Accept-Encoding": "identity"}, kwargs


async def _http_get_first(fs: Any, url: str, nbytes: int, timeout_s: float) -> tuple[dict[str, Any], bytes]:
    """One ranged GET on fsspec's own aiohttp session: (HEAD-like info, first ``nbytes`` bytes)."""
    import aiohttp

    session = await fs.set_session()
    headers, kwargs = _identity_get(fs, {"Range": f"bytes=0-{max(nbytes, 1) - 1}"})
    async with session.get(fs.encode_url(url), headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s), **kwargs) as r:
        body = b""
        if r.status != 416:
            fs._raise_not_found_for_status(r, url)
            if r.status != 206 and "Content-Length" in r.headers:  # the server ignored the range: read what we asked for
                size = int(r.headers["Content-Length"])
                body = await r.content.readexactly(min(nbytes, size))
                if len(body) < size:
                    r.close()  # drop the connection rather than drain the rest
            else:
                body = await r.read()
        return first_info(url, nbytes, r.status, r.headers, body)


def first_info(url: str, nbytes: int, status: int, headers: Mapping[str, str], body: bytes) -> tuple[dict[str, Any], bytes]:
    """HEAD-like info of the answer to a first-block GET, and its body (at most ``nbytes``).

    The size comes from the Content-Range of a 206, else the Content-Length of a
    server that ignored the range, else the body; the version from the same
    headers a HEAD reports. Shared by aiohttp's GET and libcurl's (fastload.curl);
    ``headers`` must look names up case-insensitively, as aiohttp's do.
    """
    size: int | None
    ignored = False
    if status == 416:  # an empty object has no byte 0
        body, size = b"", 0
    elif status == 206:
        total = (headers.get("Content-Range") or "").rpartition("/")[2]
        size = int(total) if total.isdigit() else None
    elif (length := headers.get("Content-Length")) is not None:  # the server ignored the range
        size = int(length)
        ignored = size > nbytes
    else:
        size = len(body)
    if size is not None and len(body) != min(nbytes, size):
        raise TruncatedBodyError(f"got {len(body)} B of {min(nbytes, size)} B")
    info: dict[str, Any] = {"name": url, "size": size, "ignores_ranges": ignored}
    for field in ("ETag", "Content-MD5", "Digest", "Last-Modified"):  # what fsspec's HEAD keeps
        if headers.get(field):
            info[field] = headers[field]
    return info, body


class _HttpStream:
    """An answer to a GET on fsspec's aiohttp session, read a piece at a time (Source.read_whole)."""

    def __init__(self, response: Any) -> None:
        self.response = response
        length = response.headers.get("Content-Length", "")
        self.length = int(length) if length.isdigit() else None

    @classmethod
    async def open(cls, fs: Any, url: str, timeout_s: float) -> _HttpStream:
        import aiohttp

        session = await fs.set_session()
        headers, kwargs = _identity_get(fs)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)
        response = await session.get(fs.encode_url(url), headers=headers, timeout=timeout, **kwargs)
        try:
            fs._raise_not_found_for_status(response, url)
        except BaseException:
            response.close()
            raise
        return cls(response)

    async def read(self, n: int) -> bytes:
        return await self.response.content.readexactly(n)  # IncompleteReadError (retried) on a cut answer

    async def close(self) -> None:
        if self.response.content.at_eof():
            self.response.release()  # read to its end: the connection can serve another request
        else:
            self.response.close()  # drop the connection rather than drain the rest


async def _held(limit: HostLimit | None, request: Callable[[], Awaitable[T]]) -> T:
    """``await request()`` in a slot of ``limit``: every coroutine request passes here."""
    if limit is None:
        return await request()
    async with limit.aslot() as outcome:
        result = await request()
        body = result[1] if isinstance(result, tuple) else result
        outcome.nbytes = len(body) if isinstance(body, (bytes, bytearray)) else 0
        return result


async def _gather_ranges(fs: Any, ranges: list[tuple[str, int, int | None]], timeout_s: float,
                         limit_of: Callable[[str], HostLimit | None], stop: threading.Event | None = None) -> list[Any]:
    async def one(path: str, start: int, end: int | None) -> bytes:
        # Bounded like Source.read's requests (asyncio's own timeout for stores that take no
        # kwarg); the timeout starts once the request holds its slot.
        limit = limit_of(fs.unstrip_protocol(path))

        def request() -> Awaitable[bytes]:
            if stop is not None and stop.is_set():  # stopped while it waited for its slot: no request
                raise StoppedError(f"{fs.unstrip_protocol(path)}: stopped before its request")
            if start == 0 and end is None:
                return asyncio.wait_for(fs._cat_file(path), timeout_s)
            return asyncio.wait_for(fs._cat_file(path, start=start, end=end), timeout_s)

        return await _held(limit, request)

    return await asyncio.gather(*(one(*r) for r in ranges), return_exceptions=True)


async def _gather_first(fs: Any, urls: list[str], nbytes: int, timeout_s: float,
                        limit_of: Callable[[str], HostLimit | None]) -> list[Any]:
    async def one(url: str) -> tuple[dict[str, Any], bytes]:
        return await _held(limit_of(url), lambda: _http_get_first(fs, url, nbytes, timeout_s))

    return await asyncio.gather(*(one(u) for u in urls), return_exceptions=True)


def _is_transient(err: BaseException) -> bool:
    # fsspec's HTTP info() reports a refused connection as FileNotFoundError; the
    # network error underneath decides.
    cause = err.__cause__ or err.__context__
    if isinstance(err, FileNotFoundError) and cause is not None and _is_transient(cause):
        return True
    if isinstance(err, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FastloadError)):
        return False
    if type(err).__name__ in _CREDENTIAL_ERRORS:
        return False
    if isinstance(err, (TimeoutError, asyncio.TimeoutError, ConnectionError, TruncatedBodyError)):
        return True
    if congestion(err):  # 429, 503, SlowDown...: worth another try, after backoff
        return True
    if type(err).__name__ in _TRANSIENT_NAMES:
        return True
    status = getattr(err, "status", None) or getattr(err, "code", None)
    if isinstance(status, int):
        return status >= 500  # 429 and 503 were congestion() above
    text = str(err)
    if any(s in text for s in ("500 Internal", "RequestTimeout", "Connection reset")):  # throttles: congestion()
        return True
    # A bare OSError from a network stack is usually transient; a ValueError is not.
    return isinstance(err, OSError) and not isinstance(err, FileExistsError)


_SECRET_KEY = re.compile(r"key|secret|token|pass|session|cred|auth|sig|sas", re.IGNORECASE)


def _secrets(value: Any, secret: bool = False) -> Iterable[str]:
    """String leaves stored under secret-looking keys (key, secret, token, password...)."""
    if isinstance(value, str):
        if secret and len(value) >= 3:
            yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _secrets(v, secret or bool(_SECRET_KEY.search(str(k))))
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _secrets(v, secret)
