"""Listing: folder pages (HTTP) or prefix pages (object stores), many in flight together.

An HTTP server has no listing API, so its folders' index pages are crawled
(:func:`http_find`, :func:`crawl`): every page is read as it **arrives** and the
folders it links to are **started** at once, while the other pages still transfer;
on libcurl where the source routes there (:mod:`fastload.transport.curl`), else on
fsspec's aiohttp session (:mod:`fastload.source.aio`). An object store's prefix is
listed by levels (:func:`store_find`): one page per common prefix (S3's signed
ListObjectsV2, GCS's JSON API objects.list), the whole next level at once, as many
in flight as the host's limit allows; s3fs and gcsfs list one page after another.
Local files and the other stores are listed through fsspec (:meth:`Source.find`).

Words: a page's GET is **started** (:func:`start_pages`: a future, in a slot of the
host's limit) and has **arrived** once it is done (:func:`first_done`); a **record** is
the :class:`RemoteItem` a listed file becomes.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Protocol, TypeVar, runtime_checkable

import fsspec

from fastload.config import Settings
from fastload.errors import StoppedError
from fastload.source import aio
from fastload.source.items import ListPage, RemoteItem, listed
from fastload.transport import curl
from fastload.transport.answers import INDEX_TITLE, Page, page_links
from fastload.transport.curl import CurlRoute
from fastload.transport.hostlimit import SLOT_WAIT_S, STOP_POLL_S, HostLimit

T = TypeVar("T")


# Told how far a listing has got (objects, folders), after the folder pages that arrived
# together are read (HTTP) or each round of pages (S3, GCS); None: nobody asked. A context variable, so
# only the caller that set it (`fastload cache` with its progress bar) hears of it; a
# listing through fsspec's own find reports nothing until it ends.
LISTING_PROGRESS: ContextVar[Callable[[int, int], None] | None] = ContextVar("listing_progress", default=None)


def _progress(files: int, folders: int) -> None:
    note = LISTING_PROGRESS.get()
    if note is not None:
        note(files, folders)


class Source(Protocol):
    """What the crawler uses of a :class:`fastload.source.Source` (passed in: no import back up)."""

    url: str
    settings: Settings
    stop: threading.Event
    _folder_hint: bool

    @property
    def fs(self) -> fsspec.AbstractFileSystem: ...
    @property
    def host_limit(self) -> HostLimit | None: ...
    @property
    def route(self) -> CurlRoute | None: ...
    def info(self, url: str) -> RemoteItem: ...
    def _call(self, fn: Callable[[], T], url: str) -> T: ...
    def _sync(self, func: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any: ...
    def _curl_takes(self, limit: HostLimit) -> bool: ...
    def _stopped(self, url: str) -> None: ...
    def _settle(self, pending: Sequence[Any], timeout_s: float) -> None: ...


@contextmanager
def progress_line(root: str, show: bool) -> Iterator[None]:
    """While listing, one stderr line saying how far it got (objects, folders), at most twice a
    second: a million objects list for tens of seconds, and said nothing (``fastload cache``)."""
    if not show:
        yield
        return
    last = [0.0]  # when the line was last written

    def note(files: int, folders: int) -> None:
        now = time.monotonic()
        if now - last[0] >= 0.5:
            last[0] = now
            sys.stderr.write(f"\rlisting {root}: {files:,} objects in {folders:,} folders")
            sys.stderr.flush()

    token = LISTING_PROGRESS.set(note)
    try:
        yield
    finally:
        LISTING_PROGRESS.reset(token)
        if last[0]:
            sys.stderr.write("\n")


def http_find(src: Source, pattern: str | None) -> tuple[RemoteItem | dict[str, RemoteItem], int]:
    """:meth:`Source.find` over HTTP: folder pages fetched together, each parsed as it arrives.

    fsspec walks an HTTP tree one folder page at a time, and asks for the root
    three times (HEAD, isdir, find), a URL without its trailing slash costing a
    redirect each time: 50 subfolders took 2.5 s with 20 ms to first byte, 0.24 s
    this way (both in one run, ThreadingHTTPServer). Here the root is
    one GET (its redirect, if any, is followed once and its final URL kept), and
    every folder it links to goes out at once, as many at a time as the
    host's limit allows (fastload.transport.hostlimit; tests/integration/test_http_listing.py
    counts them at the server); then :func:`crawl`.

    A folder's index page (Python's "Directory listing for", nginx's "Index of")
    is never an item: an empty folder lists as empty, not as one HTML file.

    Items come sizeless (their size and version come together, from a first GET or a HEAD);
    the exact size an nginx or Apache index page shows goes along as ``index_size``
    (fastload.transport.answers.page_links), so planning by bytes sends no HEAD
    (:meth:`fastload.source.Source.plan_sizes`).
    """
    timeout_s, limit = src.settings.request_timeout_s, src.host_limit

    def get_page(url: str) -> Page:
        # _call holds the request's slot: a second one taken inside it (_held) waited
        # for itself once the limit was cut to 1 (tests/reliability/test_flaky_remote.py hung).
        return src._call(lambda: src._sync(aio.http_page, src.fs, url, timeout_s), url)

    root_url = src.url + "/" if src._folder_hint else src.url
    got = pages(src, [root_url], limit)[0]
    # A failed page is retried alone on aiohttp: backoff, then a named error.
    root = get_page(root_url) if isinstance(got, BaseException) else got
    # A folder: its URL ends in "/" (as asked, or after a redirect), or it is an index
    # page, or an HTML page with links below it where a folder was likely meant.
    folder = root.final.endswith("/")
    if not folder and root.text is not None:
        links = page_links(root.final, root.text)
        likely = src._folder_hint or pattern is not None or root.size is None
        folder = bool(INDEX_TITLE.search(root.text)) or (likely and bool(links[0] or links[1]))
    if not folder:
        return src.info(src.url), 0
    return crawl(src, root, get_page)


def crawl(src: Source, root: Page, get_page: Callable[[str], Page]) -> tuple[dict[str, RemoteItem], int]:
    """The files below ``root``'s folder page by relative path, and the number of folders below it.

    Each page is read the moment it arrives, and the folders it links to go out at
    once, while the other pages still transfer (tests/integration/test_http_listing_arrival.py):
    fetching a whole level before reading it spent 0.27 s waiting and then 0.26 s
    parsing at 100,000 objects (100 pages of 1,000; one cProfile). Each page's records are
    made as it is read, with the collector paused (:func:`no_collection`). With the
    faster page reading (fastload.transport.answers.page_links) ``FileDataset(url)``
    went from 0.68x to 1.28x fsspec's ``find`` at 100,000 objects, 0.86x to 1.39x at
    1,000,000 (benchmarks/scale, nginx, each pair in one run). A failed page is retried
    alone on aiohttp (backoff, then a named error) once none is in flight, as a level's
    were once it had settled.
    """
    base = root.final if root.final.endswith("/") else root.final + "/"
    cut, limit = len(base), src.host_limit
    files: dict[str, RemoteItem] = {}
    seen = {base}
    flying: dict[Any, str] = {}  # a page's GET -> its folder's URL
    failed: list[str] = []
    arrived = [root]
    with no_collection():
        while True:
            todo: list[str] = []
            for page in arrived:
                got_files, got_dirs = page_links(page.final, page.text or "")
                if (page.final if page.final.endswith("/") else page.final + "/").startswith(base):
                    files.update({url[cut:]: listed(url, size) for url, size in got_files.items()})
                else:  # redirected away from the root: by its URL, as fsspec names it
                    files.update({url[cut:] if url.startswith(base) else url: listed(url, size)
                                  for url, size in got_files.items()})
                new = got_dirs - seen
                seen |= new
                todo += new
            _progress(len(files), len(seen) - 1)
            if todo:
                todo.sort()
                flying.update(zip(start_pages(src, todo, limit), todo))
            if not flying:
                if not failed:
                    return files, len(seen) - 1
                arrived, failed = [get_page(url) for url in failed], []
                continue
            arrived = []
            for got in first_done(src, list(flying)):
                url = flying.pop(got)
                try:
                    arrived.append(page_of(got))
                except Exception:  # redone on aiohttp, below
                    got.cancel()
                    failed.append(url)


@contextmanager
def no_collection() -> Iterator[None]:
    """Python's cyclic garbage collector paused (where it ran) while a listing makes its records.

    Each :class:`RemoteItem` is an object the collector tracks, and a full collection
    comes each time those kept since the last one pass a quarter of all tracked: 100,000
    records made two during ``FileDataset(url)`` (0.25-0.5 s of 1.0-1.5 s, timed with
    gc.callbacks, torch imported; none with the pause), and more, each larger, as a listing grows.
    Resumed, the next collections look at them once; the records hold no cycle, and
    other threads' cyclic garbage waits the length of the listing. A pause inside
    another (two listings at once) leaves the collector as the outer one found it.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def pages(src: Source, urls: list[str], limit: HostLimit | None) -> list[Any]:
    """One GET of each folder page, together, a failure in its place (:func:`start_pages`)."""
    started = start_pages(src, urls, limit)
    src._settle(started, 2 * src.settings.request_timeout_s + SLOT_WAIT_S)  # a GET's timeout starts once it runs
    out: list[Any] = []
    for got in started:
        try:
            out.append(page_of(got))
        except Exception as err:  # redone on aiohttp by the caller
            got.cancel()
            out.append(err)
    return out


def start_pages(src: Source, urls: list[str], limit: HostLimit | None) -> list[Any]:
    """One GET of each folder page started, as futures: on libcurl where this source routes there
    (fastload.transport.curl; no wait for aiohttp's import), else on fsspec's session, each
    in a slot of the host's limit (:func:`fastload.source.aio.held_page`)."""
    timeout_s, route = src.settings.request_timeout_s, src.route
    src._stopped(urls[0])
    if route is None or limit is None or not src._curl_takes(limit):
        fs = src.fs
        return [asyncio.run_coroutine_threadsafe(aio.held_page(fs, url, timeout_s, limit), fs.loop) for url in urls]
    return route.start_pages(urls, timeout_s, limit, src.stop)


def page_of(got: Any) -> Page:
    """A finished page GET's :class:`Page`, or the error it ended with."""
    return Page(*got.result(0)) if isinstance(got, curl.Pending) else got.result(0)


def first_done(src: Source, started: list[Any]) -> list[Any]:
    """Those of ``started`` done, once one is; all of them when none is done within a GET's
    timeout and a slot's wait (each then reads as failed). A stop cancels them and raises StoppedError."""
    deadline = time.monotonic() + 2 * src.settings.request_timeout_s + SLOT_WAIT_S
    while not src.stop.is_set() and (left := deadline - time.monotonic()) > 0:
        done = curl.wait_any(started, min(STOP_POLL_S, left))
        if done:
            return done
    if src.stop.is_set():
        curl.end_stopped(src.stop)
        for got in started:
            got.cancel()
        raise StoppedError(f"{src.url}: stopped while listing; its requests were cancelled")
    return started


class StoreRoute(Protocol):
    """An object store's route on libcurl that lists (fastload.source.s3.S3Route, fastload.source.gcs.GcsRoute)."""

    def start_pages(self, urls: Sequence[str], timeout_s: float, limit: HostLimit, stop: threading.Event) -> list[Any]: ...
    def list_url(self, bucket: str, prefix: str, token: str | None) -> str: ...
    def parse_page(self, text: str) -> ListPage: ...
    def item_url(self, bucket: str, key: str) -> str: ...
    def refused(self, url: str, err: curl.HttpStatusError) -> Exception | None: ...


@runtime_checkable
class LearningRoute(Protocol):
    """A store route that learns where a bucket's requests go from an answer (S3's region:
    fastload.source.s3.S3Route.learn)."""

    def learn(self, url: str, err: curl.HttpStatusError) -> bool: ...


def store_find(src: Source, route: StoreRoute, pattern: str | None) -> tuple[dict[str, RemoteItem], int] | None:
    """The objects under an object store source's prefix by relative path, and the common prefixes
    seen; None where its fsspec filesystem must answer: the URL names an object or nothing, or a page
    failed (s3fs or gcsfs then lists it and names the error).

    A page refused for the bucket's region (a 301, 307 or ``AuthorizationHeaderMalformed``) is asked
    again, once, on the route its answer taught (:class:`LearningRoute`), with the next level's pages:
    s3fs, listing page after page, took the whole listing before (tests/integration/test_s3_regions.py).
    """
    limit = src.host_limit
    if limit is None or not src._curl_takes(limit):
        return None
    bucket, _, key = src.url.split("://", 1)[1].partition("/")
    root = key if key == "" or key.endswith("/") else key + "/"
    timeout_s = src.settings.request_timeout_s
    files: dict[str, RemoteItem] = {}
    folders = 0
    todo: list[tuple[str, str | None]] = [(root, None)]
    redone: set[tuple[str, str | None]] = set()  # pages asked again on a learned route
    while todo:
        src._stopped(src.url)
        pending = route.start_pages([route.list_url(bucket, p, t) for p, t in todo], timeout_s, limit, src.stop)
        src._settle(pending, 2 * timeout_s + SLOT_WAIT_S)  # a GET's timeout starts once it runs
        level: list[tuple[str, str | None]] = []
        for (prefix, token), p in zip(todo, pending):
            try:
                page = route.parse_page(p.result(0)[2] or "")
            except curl.HttpStatusError as err:
                if (prefix, token) not in redone and isinstance(route, LearningRoute) and route.learn(src.url, err):
                    redone.add((prefix, token))
                    level.append((prefix, token))
                    continue
                denied = route.refused(src.url, err)
                if denied is not None:  # the store's own code (InvalidToken...): s3fs's HEAD would see only "400"
                    raise denied from None
                p.cancel()
                return None
            except Exception:  # noqa: S110 - the filesystem lists again, with its retries and error names
                p.cancel()
                return None
            for name, size, version in page.objects:
                if not name.endswith("/"):  # a zero-byte "folder" marker is no item
                    files[name[len(root):]] = RemoteItem(route.item_url(bucket, name), size, version)
            folders += len(page.prefixes)
            level += [(sub, None) for sub in page.prefixes]
            if page.token:
                level.append((prefix, page.token))
        _progress(len(files), folders)
        todo = level
    if not files and not folders and root != key:
        return None  # an object's own URL, or nothing: the filesystem's info says which
    return files, folders
