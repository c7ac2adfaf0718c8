"""Listing by levels: every folder (or common prefix) of a level fetched together.

An HTTP server has no listing API, so its folders' index pages are crawled
(:func:`http_find`), on libcurl where the source routes there
(:mod:`fastload.transport.curl`), else on fsspec's aiohttp session (:mod:`fastload.source.aio`).
An object store's prefix is listed the same way (:func:`store_find`): one page
per common prefix (S3's signed ListObjectsV2, GCS's JSON API objects.list), the
whole next level at once, as many in flight as the host's limit allows; s3fs and
gcsfs list one page after another. Local files and the
other stores are listed through fsspec (:meth:`Source.find`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any, Protocol, TypeVar

import fsspec

from fastload.config import Settings
from fastload.source import aio
from fastload.source.items import ListPage, RemoteItem
from fastload.transport.answers import INDEX_TITLE, Page, page_links
from fastload.transport.curl import CurlRoute
from fastload.transport.hostlimit import SLOT_WAIT_S, HostLimit

T = TypeVar("T")


# Told how far a listing has got (objects, folders), after each level of folder pages
# (HTTP) or each round of pages (S3, GCS); None: nobody asked. A context variable, so
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


def http_find(src: Source, pattern: str | None) -> tuple[RemoteItem | dict[str, RemoteItem], int]:
    """:meth:`Source.find` over HTTP: each level of folders fetched together, one page each.

    fsspec walks an HTTP tree one folder page at a time, and asks for the root
    three times (HEAD, isdir, find), a URL without its trailing slash costing a
    redirect each time: 50 subfolders took 2.5 s with 20 ms to first byte, 0.24 s
    this way (both in one run, ThreadingHTTPServer). Here the root is
    one GET (its redirect, if any, is followed once and its final URL kept), and
    every folder of the next level goes out at once, as many at a time as the
    host's limit allows (fastload.transport.hostlimit; tests/integration/test_http_listing.py
    counts them at the server).

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
    base = root.final if root.final.endswith("/") else root.final + "/"
    files: dict[str, int] = {}  # URL -> the size its page showed, -1 for none
    seen = {base}
    level = [root]
    while level:
        subfolders: set[str] = set()
        for page in level:
            got_files, got_dirs = page_links(page.final, page.text or "")
            files.update(got_files)
            subfolders |= got_dirs - seen
        seen |= subfolders
        _progress(len(files), len(seen) - 1)
        todo = sorted(subfolders)
        answers = pages(src, todo, limit) if todo else []
        level = [get_page(url) if isinstance(got, BaseException) else got for url, got in zip(todo, answers)]
    return {u[len(base) :] if u.startswith(base) else u: RemoteItem(u, -1, "", size) for u, size in files.items()}, \
        len(seen) - 1

def pages(src: Source, urls: list[str], limit: HostLimit | None) -> list[Any]:
    """One GET of each folder page, together, a failure in its place: on libcurl where this
    source routes there (fastload.transport.curl; no wait for aiohttp's import), else on fsspec's session."""
    timeout_s, route = src.settings.request_timeout_s, src.route
    if route is None or limit is None or not src._curl_takes(limit):
        return src._sync(aio.http_pages, src.fs, urls, timeout_s, limit)
    src._stopped(urls[0])
    pending = route.start_pages(urls, timeout_s, limit, src.stop)
    src._settle(pending, 2 * timeout_s + SLOT_WAIT_S)  # a GET's timeout starts once it runs
    out: list[Any] = []
    for p in pending:
        try:
            out.append(Page(*p.result(0)))
        except Exception as err:  # redone on aiohttp by the caller
            p.cancel()
            out.append(err)
    return out


class StoreRoute(Protocol):
    """An object store's route on libcurl that lists (fastload.source.s3.S3Route, fastload.source.gcs.GcsRoute)."""

    def start_pages(self, urls: Sequence[str], timeout_s: float, limit: HostLimit, stop: threading.Event) -> list[Any]: ...
    def list_url(self, bucket: str, prefix: str, token: str | None) -> str: ...
    def parse_page(self, text: str) -> ListPage: ...
    def item_url(self, bucket: str, key: str) -> str: ...


def store_find(src: Source, route: StoreRoute, pattern: str | None) -> tuple[dict[str, RemoteItem], int] | None:
    """The objects under an object store source's prefix by relative path, and the common prefixes
    seen; None where its fsspec filesystem must answer: the URL names an object or nothing, or a page
    failed (s3fs or gcsfs then lists it and names the error)."""
    limit = src.host_limit
    if limit is None or not src._curl_takes(limit):
        return None
    bucket, _, key = src.url.split("://", 1)[1].partition("/")
    root = key if key == "" or key.endswith("/") else key + "/"
    timeout_s = src.settings.request_timeout_s
    files: dict[str, RemoteItem] = {}
    folders = 0
    todo: list[tuple[str, str | None]] = [(root, None)]
    while todo:
        src._stopped(src.url)
        pending = route.start_pages([route.list_url(bucket, p, t) for p, t in todo], timeout_s, limit, src.stop)
        src._settle(pending, 2 * timeout_s + SLOT_WAIT_S)  # a GET's timeout starts once it runs
        level: list[tuple[str, str | None]] = []
        for (prefix, _), p in zip(todo, pending):
            try:
                page = route.parse_page(p.result(0)[2] or "")
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
