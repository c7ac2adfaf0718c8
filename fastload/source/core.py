"""The Source core: one fsspec location's identity, fingerprints, and the dispatch of its requests.

A :class:`Source` is built from an fsspec URL plus ``storage_options``; it never
invents its own storage layer. It pickles its settings, not its filesystem, so a
worker process reopens the connection in the child (fsspec resets its event loop
after fork).

Each request goes one of three ways, chosen per source: libcurl's engine
(:mod:`fastload.transport.curl`; HTTP first blocks and listing pages, S3 first blocks
signed there, :mod:`fastload.source.s3`, and GCS first blocks, :mod:`fastload.source.gcs`; the later
blocks of all three, :mod:`fastload.source.ranged`), coroutines on fsspec's aiohttp session
(:mod:`fastload.source.aio`), or fsspec's filesystem (s3fs, gcsfs, local files: the
fallback for the rest). Listing is :mod:`fastload.source.listing`.

Errors are translated into :mod:`fastload.errors` classes that name the URL, the
cause and the fix. ``storage_options`` values are scrubbed from every message, so
a secret key never reaches a log (tests/reliability/test_secrets.py greps for it).
"""

from __future__ import annotations

import builtins
import concurrent.futures
import functools
import importlib.util
import os
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import fsspec
import fsspec.asyn
from fsspec.core import url_to_fs

from fastload.config import Settings
from fastload.errors import (
    CertificateError,
    ConfigError,
    FastloadError,
    RemoteChangedError,
    RemoteNotFoundError,
    SourceError,
    StoppedError,
)
from fastload.source import aio, errors, fallback, gcs, listing, ranged, s3
from fastload.source.fallback import FsspecRoad
from fastload.source.items import RemoteItem, matching, version_of
from fastload.transport import curl
from fastload.transport.curl import CurlRoute, route_for
from fastload.transport.failures import describe, secrets, transient, untrusted
from fastload.transport.hostlimit import (
    SLOT_WAIT_S,
    STOP_POLL_S,
    HostLimit,
    host_of,
    limit_for,
)
from fastload.transport.loop import submit_all
from fastload.transport.retry import Retries, note_retry

T = TypeVar("T")


_STORES = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


class Source(FsspecRoad):
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
        errors.check_url(url)
        self.storage_options = dict(storage_options or {})
        self.settings = settings or Settings.from_env()
        self.stop = stop or threading.Event()
        self._lock = threading.Lock()
        self._fs: fsspec.AbstractFileSystem | None = None
        self._pid = os.getpid()
        self._root_path = ""
        self.url = url
        self._folder_hint = url.endswith("/")
        # fsspec's HTTP filesystem keeps URLs as they are. It needs aiohttp, whose import costs
        # 0.1-0.2 s of CPU: listing pages and GETs go on libcurl, so the filesystem opens (and
        # aiohttp imports) only where a request goes to aiohttp (fs); a cold epoch over nginx
        # imports neither (tests/integration/test_curl.py).
        self._http = url.split("://", 1)[0] in ("http", "https")
        # An object store whose first blocks libcurl can carry (fastload.source.s3, fastload.source.gcs).
        self._store = _STORES.get(url.split("://", 1)[0].lower(), "")
        if self._http:
            if importlib.util.find_spec("aiohttp") is None:
                raise ConfigError(f"URL {url!r} needs a package that is missing (aiohttp); fix: {errors.INSTALL_HINTS['http']}")
            self._root_path = url
            self.url = url.rstrip("/")
            self._local = False
        elif self._store == "s3":
            # s3fs, with aiobotocore and aiohttp, costs ~0.2 s of CPU to import: a key list's first blocks go on
            # libcurl without it (issue 34, item 6), so the filesystem opens on first use (fs), as HTTP's.
            if importlib.util.find_spec("s3fs") is None:
                raise ConfigError(f"URL {url!r} needs a package that is missing (s3fs); fix: {errors.INSTALL_HINTS['s3']}")
            self._root_path = s3.strip(url)
            self.url = s3.unstrip(self._root_path).rstrip("/") if self._root_path else url
            self._local = False
        else:
            fs = self.fs  # fail early on unknown protocols and missing packages
            self.url = fs.unstrip_protocol(self._root_path).rstrip("/") if self._root_path else url
            # Local files have no host to flood: their reads take no slot.
            self._local = bool({"file", "local", "memory"} & set(fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)))
        # Per host, whether its answer to a ranged GET was a 206 (True) or the whole object
        # (False: Python's http.server ignores Range); the fetch layer then asks for each
        # object once, whole, and until it knows, asks with one GET that serves either way
        # (fastload.fetch).
        self._ranges: dict[str, bool] = {}

    @functools.cached_property
    def route(self) -> CurlRoute | None:
        """libcurl's route for this source's first-block GETs (and an HTTP source's listing pages), or
        None: aiohttp for HTTP (fastload.transport.curl), s3fs for S3 (fastload.source.s3), fsspec for the rest."""
        if self._http:
            return route_for(self.storage_options, self.settings.http_client, self._encode)
        if not self._store:
            return None
        store_route: CurlRoute | None
        if self._store == "s3":
            store_route, why = s3.route_for(self.url, self.storage_options, self.settings.http_client)
        else:
            store_route, why = gcs.route_for(self.fs, self.storage_options, self.settings.http_client)
        if store_route is None:
            fallback.note_fallback(self.url, why)
        return store_route

    def prepare(self, needed: Callable[[], bool]) -> None:
        """Make this source's route now where making it costs and ``needed()`` says requests are to come: an
        S3 route is botocore's resolution of the configuration, 0.1-0.3 s of CPU once (botocore's import and
        S3's model). Called before a DataLoader forks workers, so that they inherit it instead of each making
        its own at its first GET, every pass (fastload.dataset.FileDataset.locate); ``needed`` is asked only
        while the route is not made. Not GCS: its route needs gcsfs's filesystem, whose credentials may be
        asked of the metadata server; HTTP's costs nothing."""
        if self._store == "s3" and "route" not in self.__dict__ and needed():  # __dict__: cached_property's
            _ = self.route

    def _curl_takes(self, limit: HostLimit) -> bool:
        """Whether libcurl carries GETs to ``limit``'s host (where a Source has a route): not to one
        libcurl cannot speak to (fastload.transport.curl). A host that closes its connections stays too: a
        connect per GET costs less CPU in C (benchmarks/ordinary_server: 0.86 of the link against
        0.65-0.71 on aiohttp, same run)."""
        return not curl.broken(limit)

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
            fallback.forget_parent_loop(self._fs)
            self._fs, self._pid = None, os.getpid()
        if self._fs is None:
            with self._lock:
                if self._fs is None:
                    self._fs, self._root_path = self._open_fs()
        return self._fs

    def _open_fs(self) -> tuple[fsspec.AbstractFileSystem, str]:
        protocol = self.url.split("://", 1)[0] if "://" in self.url else "file"
        try:
            fs, path = url_to_fs(self.url, **fallback.with_timeouts(protocol, self.storage_options, self.settings.request_timeout_s))
        except ImportError as err:
            hint = errors.INSTALL_HINTS.get(protocol, f"install the fsspec backend for {protocol!r}")
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

        Looked up per request: a forked child starts with its own limits (fastload.transport.hostlimit).
        """
        return None if self._local else limit_for(host_of(url, self.storage_options), self.settings.max_requests)

    def ignores_ranges(self, url: str) -> bool:
        """Whether ``url``'s host answered a ranged GET with the whole object."""
        return self.honours_ranges(url) is False

    def honours_ranges(self, url: str) -> bool | None:
        """Whether ``url``'s host answers ranged GETs with the range; None: not known yet (HTTP only)."""
        if not self._http:
            return True
        return self._ranges.get(host_of(url, self.storage_options)) if self._ranges else None

    def note_ranges(self, url: str, honoured: bool) -> None:
        """Record whether ``url``'s host answers ranged GETs with the range (True) or the whole object."""
        self._ranges[host_of(url, self.storage_options)] = honoured

    def _stopped(self, url: str) -> None:
        if self.stop.is_set():
            raise StoppedError(f"{url}: stopped before its request")

    # -- naming -------------------------------------------------------------

    def canonical(self, url: str) -> str:
        """The canonical form of ``url`` on this source's filesystem (stable cache identity)."""
        if self._store == "s3" and self._fs is None:
            return s3.unstrip(s3.strip(url))  # as s3fs names it, without importing it
        return self._unstrip(url if self._http else self.fs._strip_protocol(url))

    def _unstrip(self, path: str) -> str:
        """``path`` as a URL of this source's filesystem (fsspec's HTTP paths are URLs already)."""
        if self._store == "s3" and self._fs is None:
            return s3.unstrip(path)
        return path if self._http else self.fs.unstrip_protocol(path)

    def scrub(self, text: str) -> str:
        """Replace every secret from ``storage_options`` in ``text`` with ``***``."""
        for value in secrets(self.storage_options):
            text = text.replace(value, "***")
        return text

    def translate(self, err: BaseException, url: str) -> FastloadError:
        """Map a backend exception to a FastloadError naming ``url``, the cause and the fix (errors.translate)."""
        if untrusted(err):  # never retried (failures.transient): the fix is a CA, not patience
            return CertificateError(errors.untrusted_text(url, self.scrub(f"{type(err).__name__}: {err}")))
        return errors.translate(err, url, self.scrub, self._http)


    def list(self, pattern: str | None = None, *, complete: bool = True) -> list[RemoteItem]:
        """List every object under the root (or the root itself if it is an object).

        Sizes and versions come from the listing where the store provides them.
        Stores that do not (plain HTTP) need one HEAD per object: with
        ``complete=True`` they are done here in parallel; with ``complete=False``
        such items come back with ``size == -1`` and the caller completes them
        (staging does it in its fetch workers, so the link never sits idle). An nginx or
        Apache index page's exact sizes come along as ``index_size``: they plan
        (:meth:`plan_sizes`), but a cache key needs the version too, which only an answer gives.

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
            return listing.http_find(self, pattern)
        route = self.route
        if isinstance(route, (s3.S3Route, gcs.GcsRoute)):
            found = listing.store_find(self, route, pattern)
            if found is not None:
                return found
        return self._find(pattern)

    def complete(self, item: RemoteItem) -> RemoteItem:
        """``item`` with its size and version filled in (one HEAD if the listing lacked them)."""
        # (HTTP's filesystem is async: asked without opening it, which imports aiohttp.)
        if item.size >= 0 and (item.version or not (self._http or getattr(self.fs, "async_impl", False))):
            return item
        return self.info(item.url)

    def complete_all(self, items: builtins.list[RemoteItem]) -> builtins.list[RemoteItem]:
        """Complete every item, in parallel where needed."""
        if all(i.size >= 0 and i.version for i in items):
            return items
        # A HEAD moves no data: it is one round trip, so more of them may overlap than
        # transfers. 16 at a time spent ~4 s listing 3,000 objects with 20 ms to first
        # byte, longer than the transfer itself at 1 Gbit (benchmarks/peers).
        threads = min(len(items), self.settings.head_threads)
        with ThreadPoolExecutor(max(1, threads)) as pool:
            return list(pool.map(self.complete, items))

    def plan_sizes(self, items: builtins.list[RemoteItem]) -> tuple[builtins.list[int], dict[int, RemoteItem]]:
        """Each item's size to plan with (node parts, dry runs, the cache limit), and the items
        a HEAD completed for it, by index.

        Sizes come from the listing where it gave them, an nginx or Apache index page's
        exact ones included (:attr:`RemoteItem.plan_size`); only the rest cost a HEAD each
        (:meth:`complete_all`): 2 nodes x 2 ranks planning over 10,000 files of an nginx
        folder sent 40,000 HEADs, now none (tests/integration/test_http_listing_sizes.py).
        """
        sizes = [i.plan_size for i in items]
        todo = [k for k, size in enumerate(sizes) if size < 0]
        done = dict(zip(todo, self.complete_all([items[k] for k in todo]))) if todo else {}
        for k, item in done.items():
            sizes[k] = item.size
        return sizes, done

    def info(self, url: str) -> RemoteItem:
        """Fetch one object's current size and version (one round trip)."""
        fs: Any = self.fs
        if fallback.has_loop(fs):  # cancellable on a stop
            return self._item(self._call(lambda: self._sync(fs._info, url), url))
        return self._item(self._call(lambda: fs.info(url), url))

    def fetch_first(self, item: RemoteItem, nbytes: int) -> tuple[RemoteItem, bytes]:
        """Complete ``item`` and fetch its first ``nbytes`` bytes, in one request where possible.

        An HTTP listing has no sizes, and a HEAD per object before its GET doubles the
        per-object latency (2 x ~20 ms to first byte on an object store; profiled in
        benchmarks/peers). Over HTTP this is one GET with ``Range: bytes=0-(nbytes-1)``:
        the size comes from its Content-Range (or Content-Length) and the version from
        the same ETag / Last-Modified headers a HEAD reports, so the cache identity is
        the one :meth:`complete` would give. S3 and GCS do the same on libcurl
        (fastload.source.s3, fastload.source.gcs), for sized items too. Other stores complete
        first, then read.
        """
        started = self._curl_first([item], nbytes) if self._store else None
        if started is not None:
            self._settle(started, self.settings.first_wait_s)
            return self.finish_first(item, nbytes, started[0])
        return self._fetch_first(item, nbytes)

    def _fetch_first(self, item: RemoteItem, nbytes: int) -> tuple[RemoteItem, bytes]:
        """:meth:`fetch_first` through fsspec's session or filesystem: retried, errors translated."""
        if item.size >= 0 or not self._http:
            done = self.complete(item)
            return done, self.fetch(done.url, 0, min(nbytes, done.size), expect=min(nbytes, done.size), listed=done)
        timeout_s = self.settings.request_timeout_s

        def once() -> tuple[dict[str, Any], bytes]:
            return self._sync(aio.http_get_first, self.fs, item.url, nbytes, timeout_s)

        info, data = self._call(once, item.url)  # _call holds the slot
        return self._item(info), data

    def fetch_first_many(self, items: builtins.list[RemoteItem], nbytes: int) -> builtins.list[tuple[RemoteItem, bytes]]:
        """:meth:`fetch_first` of each item, with their GETs overlapping on fsspec's event loop.

        A staging thread that waits on one request at a time keeps ``max_requests`` requests in
        flight, too few for 20 ms to first byte; more threads cost CPU and contend for the
        GIL and the cache index. Here one thread keeps a whole batch in flight. An item
        whose GET fails is retried alone through :meth:`fetch_first` (backoff, translation).
        """
        started = self._curl_first(items, nbytes) if len(items) >= 2 or self._store else None
        if started is not None:
            self._settle(started, self.settings.first_wait_s)
            return [self.finish_first(item, nbytes, p) for item, p in zip(items, started)]
        if len(items) < 2 or not self._http or any(i.size >= 0 for i in items):
            return [self.fetch_first(i, nbytes) for i in items]
        urls = [i.url for i in items]
        results = self._sync(aio.gather_first, self.fs, urls, nbytes, self.settings.request_timeout_s, self.limit_of)
        return [self.fetch_first(item, nbytes) if isinstance(res, BaseException) else (self._item(res[0]), res[1])
                for item, res in zip(items, results)]

    def start_first_many(self, items: Sequence[RemoteItem], nbytes: int) -> builtins.list[concurrent.futures.Future[Any]] | None:
        """Start reading each item's first ``nbytes`` on fsspec's event loop, or None where that
        cannot be done (a store without an event loop; sizeless items outside HTTP).

        All are handed to the loop at once (:func:`fastload.transport.loop.submit_all`), so the
        caller pays one wake-up of the loop, not one per item. Each future is finished
        with :meth:`finish_first`; each request holds its host's slot while it runs.
        """
        self._stopped(items[0].url if items else self.url)
        started = self._curl_first(items, nbytes) if items and (self._http or self._store) else None
        if started is not None:
            return started
        if not items or (not self._http and any(i.size < 0 for i in items)):
            return None
        fs: Any = self.fs
        if not getattr(fs, "async_impl", False) or getattr(fs, "loop", None) is None:
            return None
        timeout_s = self.settings.request_timeout_s
        road = self._road()  # each answer checked against its listed version (finish_first)

        def maker(item: RemoteItem) -> Callable[[], Coroutine[Any, Any, Any]]:
            if item.size < 0:
                def request() -> Awaitable[tuple[dict[str, Any], bytes]]:
                    self._stopped(item.url)  # a stop while it waited for its slot: no request
                    return aio.http_get_first(fs, item.url, nbytes, timeout_s)

                return lambda: aio.held(self.limit_of(item.url), request)
            ranges: builtins.list[tuple[str, int, int | None]] = [(fs._strip_protocol(item.url), 0, min(nbytes, item.size))]
            return lambda: aio.gather_ranges(fs, ranges, timeout_s, self.limit_of, self.stop, road=road, versions=[item.version])

        return submit_all(fs.loop, [maker(item) for item in items])

    def _curl_first(self, items: Sequence[RemoteItem], nbytes: int) -> builtins.list[Any] | None:
        """The first-block GETs of ``items`` handed to libcurl (fastload.transport.curl), or None where this
        source's GETs stay on aiohttp or s3fs (no route, no host limit; sized HTTP items)."""
        route = self.route
        if route is None or (not self._store and any(i.size >= 0 for i in items)):
            return None
        if isinstance(route, s3.S3Route) and not all(route.takes(i.url) for i in items):
            return None  # a bucket whose GETs take s3fs (an S3 Express one...), decided once for it (s3.Buckets)
        by_host: dict[int, tuple[HostLimit, builtins.list[int]]] = {}
        for k, item in enumerate(items):
            limit = self.limit_of(item.url)
            if limit is None or not self._curl_takes(limit):
                return None  # e.g. a host that closes its connections stays on aiohttp (fastload.transport.curl)
            by_host.setdefault(id(limit), (limit, []))[1].append(k)
        out: builtins.list[Any] = [None] * len(items)
        for limit, ks in by_host.values():
            for k, pending in zip(ks, route.start([items[k].url for k in ks], nbytes, self.settings.request_timeout_s, limit,
                                                  self.stop)):
                out[k] = pending
        return out

    def finish_first(self, item: RemoteItem, nbytes: int, future: concurrent.futures.Future[Any], *,
                     redone: bool = False) -> tuple[RemoteItem, bytes]:
        """:meth:`fetch_first`'s result from a :meth:`start_first_many` future; a failed or short read
        is done again by :meth:`fetch_first` (retries, backoff, error translation). ``redone``: the
        future is a GET redone once on its bucket's learned route (S3Route.learn)."""
        try:
            res = self._wait(future, self.settings.first_wait_s, item.url)
            if item.size < 0 or isinstance(future, curl.Pending):  # (info, body): sized by the answer
                info, data = res
                done = self._item(info)
                if item.size >= 0:
                    done = errors.unchanged(item, done)
            else:
                done, data = item, res[0]
                if isinstance(data, BaseException):
                    raise data
                if isinstance(data, tuple):  # an answer with its version: of the listed one, or RemoteChangedError
                    data = fallback.checked(item, *data)
            if len(data) == min(nbytes, done.size):
                return done, bytes(data)
        except (StoppedError, RemoteChangedError):
            raise
        except FileNotFoundError as err:
            if self._store and isinstance(future, curl.Pending):  # an object store's 404: no such key or bucket
                raise RemoteNotFoundError(f"{item.url}: not found (HTTP 404); fix: check the bucket, key and spelling") \
                    from err
            future.cancel()
        except curl.HttpStatusError as err:
            route = self.route
            if isinstance(route, s3.S3Route) and not redone and route.learn(item.url, err):
                future.cancel()  # the bucket's region, learned: this GET is redone there once (test_s3_regions.py)
                again = self._curl_first([item], nbytes)
                return self._fetch_first(item, nbytes) if again is None else self.finish_first(item, nbytes, again[0],
                                                                                               redone=True)
            denied = route.refused(item.url, err) if self._store and route is not None else None
            if denied is not None:  # retrying cannot help; the other road's message would say less
                raise denied from None
            future.cancel()
        except Exception:  # noqa: S110 - redone below, where errors are retried and translated
            future.cancel()
        return self._fetch_first(item, nbytes)

    def fetch_many(self, ranges: builtins.list[tuple[str, int, int | None]],
                   listed: builtins.list[RemoteItem] | None = None) -> builtins.list[bytes | Exception]:
        """As :meth:`FsspecRoad.fetch_many`, but the ranges of listed objects go through libcurl's engine where
        this source has a route (fastload.source.ranged: a large object's blocks as concurrent ranged GETs);
        those it does not take, or that fail there, go the fsspec road."""
        got: builtins.list[Any] = ranged.fetch(self, ranges, listed)
        todo = [k for k, res in enumerate(got) if res is None]
        if todo:
            rest = super().fetch_many([ranges[k] for k in todo], None if listed is None else [listed[k] for k in todo])
            for k, res in zip(todo, rest):
                got[k] = res
        return got

    def _wait(self, future: concurrent.futures.Future[T], timeout_s: float, url: str) -> T:
        """``future.result(timeout_s)``, but a stop cancels it and raises StoppedError (as :meth:`_sync`).

        A GET still queued for its host's slot on libcurl's thread (fastload.transport.curl) is
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
        if info.get("ignores_ranges") or info.get("honours_ranges"):
            self.note_ranges(info["name"], not info.get("ignores_ranges"))
        size = info.get("size")
        if size is None:
            raise SourceError(
                f"{info.get('name')}: the store reports no size for it (over HTTP: no Content-Length); fastload "
                "caches sized objects; fix: if it is a folder, end the URL with '/' or pass a pattern; if it is a "
                "file, serve it with a Content-Length (a static file server such as nginx does)"
            )
        return RemoteItem(self._unstrip(info["name"]), int(size), version_of(info))

    # -- reading --------------------------------------------------------------

    def _call(self, fn: Callable[[], T], url: str) -> T:
        """``fn()`` (one request) in a slot of the host's limit, retried outside it while the retry
        budget lasts (fastload.transport.retry: backoff, Retry-After, one warning per outage)."""
        settings = self.settings
        limit = self.limit_of(url)
        retries = Retries.of(settings)
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
                if not transient(err):
                    raise self.translate(err, url) from err
                last = err
            sleep = retries.sleep_after(last)
            if sleep is None:
                break
            # Every retry marks its host as failing; one line per outage, not per request.
            note_retry(host_of(url, self.storage_options), self.scrub(describe(last, settings.request_timeout_s)), settings)
            self.stop.wait(sleep)  # a stop ends the backoff; the next turn raises
        raise SourceError(self._exhausted(url, retries, last)) from last

    def _exhausted(self, url: str, retries: Retries, last: BaseException) -> str:
        """What a request that ran out of retries says: the URL, how long it tried, the last cause, and which
        setting gives more (named both ways: Settings arguments win over FASTLOAD_* variables)."""
        settings = self.settings
        cause = self.scrub(describe(last, settings.request_timeout_s))
        if retries.capped:
            more = (f"retries={settings.retries} caps the attempts: drop it (Settings(retries=None), or unset "
                    f"FASTLOAD_RETRIES) to retry for up to retry_budget_s={settings.retry_budget_s:g} s")
        else:
            more = (f"a longer wait: Settings(retry_budget_s=...) or FASTLOAD_RETRY_BUDGET_S "
                    f"(now {settings.retry_budget_s:g} s)")
        return (f"{url}: failed after {retries.attempts} attempts in {retries.elapsed_s:.1f} s; last cause: {cause}; "
                f"fix: check that the store is up and reachable; {more}; a slow store: Settings(request_timeout_s=...) "
                "or FASTLOAD_TIMEOUT_S (an argument to Settings(...) wins over the variable)")
