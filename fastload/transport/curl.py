"""First-block HTTP GETs on libcurl (``fastload._curl``, native/_curl.c), off the GIL.

Why: every cold object of an HTTP listing is fetched by one ranged GET of its
first block (:meth:`fastload.source.Source.fetch_first`). Through fsspec's aiohttp
session that GET costs 0.17 ms of Python on fsspec's event loop thread unshaped,
0.31-0.36 ms on a paced 1 Gbit link, where each answer arrives in many pieces
(benchmarks/peers/results/profile.md, rounds 3 and 5), and that thread trades
the GIL with the read threads. pycurl, which calls Python for every header line
and received piece, gained nothing in the epoch. Here libcurl runs on a C
thread that never takes the GIL: a batch of GETs is handed over in one call,
headers and bodies land in C buffers, and Python collects the answers when it
waits for them.

Scope: the first-block GET of a sizeless HTTP item, fetched ahead
(:meth:`Source.start_first_many`) or on a miss (:meth:`Source.fetch_first_many`),
and the folder pages of an HTTP listing (:meth:`CurlRoute.start_pages`). So a
cold epoch over HTTP sends its first requests without waiting for aiohttp to
import (~0.1 s, about 3% of a 3,000-object epoch at 1 Gbit; the Source imports it
on a thread meanwhile). The later blocks of a listed object go here too, as ranged
GETs that each carry their own Range and If-Match (:meth:`CurlRoute.start_ranges`;
fastload.source.ranged). HEADs and streamed objects stay on fsspec's session. A Source uses curl only where its ``storage_options`` map
onto curl (headers, basic auth, ``trust_env``, ``ssl=False``; the CA bundle of
REQUESTS_CA_BUNDLE or CURL_CA_BUNDLE, :func:`fastload.transport.tls.ca_bundle`; :func:`route_for`), and ``Settings.http_client``
(``FASTLOAD_HTTP_CLIENT``) can turn it off. A host that closes its connection
after each answer (HTTP/1.0, as ``python -m http.server``; ``HostLimit.closing``)
stays here, at most ``CLOSING_MAX`` GETs at once: each waits for a new connection,
which costs less CPU in C than on aiohttp (``benchmarks/ordinary_server``, issue 24:
0.86 of the link here against 0.65-0.71 on aiohttp in the same run, a 2-core
machine under load; staging 200 small files skips aiohttp's import). Any answer this path does not take
as it is (an error status, a failed transfer, a body without a length) is
redone by :meth:`Source.fetch_first` on aiohttp, whose retries, backoff and error
messages are the ones users see.

Requests in flight: each host's :class:`~fastload.transport.hostlimit.HostLimit` stays the
one home of that number. The engine holds slots leased from it
(:meth:`HostLimit.lease`) as permits; a finished GET's permit starts the next
queued one on the C thread. Whenever Python comes by (a batch handed over, a
wait that returns, at least every :data:`PUMP_S` while a reader waits) it feeds
the finished GETs to the host's controller (:meth:`HostLimit.account`), leases
slots for queued work, and gives back idle ones and those above a cut limit.
"""

from __future__ import annotations

import codecs
import concurrent.futures
import importlib
import logging
import os
import re
import ssl
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from fastload.config import pure_python
from fastload.errors import ConfigError
from fastload.transport.hostlimit import SLOW_CONNECT_S, STOP_POLL_S, HostLimit
from fastload.transport.tls import ca_bundle

_log = logging.getLogger("fastload")
PUMP_S = 0.005  # a reader waiting on GETs hands finished ones to the controller at least this often
PAGE_MAX = 64 << 20  # a folder page this long may have been cut: it is read again on aiohttp
_CURL_CODES = {28: TimeoutError, 7: ConnectionRefusedError, 52: ConnectionResetError, 55: ConnectionResetError,
               56: ConnectionResetError}  # libcurl's CURLE_* -> what aiohttp's errors read as (failures.congestion)
# libcurl's codes that say it cannot speak to the host at all, whatever the network does: an
# unsupported protocol or malformed URL (1, 3, 4), TLS set-up, certificates and keys (53, 54,
# 58, 59, 60, 64, 66, 77, 80, 82, 83, 90, 91). Any other failure (a cut body, 18; a reset) is
# one GET's, redone on aiohttp.
_CANNOT_SPEAK = {1, 3, 4, 53, 54, 58, 59, 60, 64, 66, 77, 80, 82, 83, 90, 91}
_PLAIN_URL = re.compile(r"[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]*\Z")  # what libcurl takes as it is


class HttpStatusError(OSError):
    """An HTTP answer this path does not take (status >= 400 but 404, or a 1xx/3xx left over)."""

    def __init__(self, status: int, url: str, body: bytes = b"") -> None:
        super().__init__(f"HTTP {status} for {url}")
        self.status = status  # read by failures.congestion: 429 and 503 cut the limit
        self.body = body[:4096]  # an object store's error document names its code (source.s3.refusal)


class _Host:
    __slots__ = ("broken", "id", "leased", "limit")

    def __init__(self, hid: int, limit: HostLimit) -> None:
        self.id, self.limit, self.leased = hid, limit, 0
        self.broken = ""  # why libcurl cannot talk to this host (a TLS or protocol failure): aiohttp does


def broken(limit: HostLimit) -> str:
    """Why this host's GETs no longer go through libcurl ("" while they do).

    A failure that is not the network's (libcurl could not verify a certificate,
    speak the protocol, or parse the URL: ``_CANNOT_SPEAK``) would fail every GET
    there, each then redone on aiohttp: one such failure sends the host's GETs to
    aiohttp for good. A cut body or a reset does not.
    """
    host = _STATE.hosts.get(id(limit))
    return host.broken if host is not None and host.limit is limit else ""


class _State:
    """This process's engine and its hosts (a forked child starts afresh: the C thread is not there)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pump_lock = threading.Lock()
        self.engine: Any = None
        self.reason = ""  # why there is no engine
        self.hosts: dict[int, _Host] = {}  # id(HostLimit) -> its engine host
        # A stop event (Source.stop) -> the GETs started under it that may still run: a stop
        # ends them at the next pump, as a stopped coroutine sends no request (staging's Ctrl-C).
        self.stoppable: dict[int, tuple[threading.Event, weakref.WeakSet[Pending]]] = {}


_STATE = _State()
_ORPHANS: list[Any] = []  # engines of a parent process, never freed in the child (their mutex may be held)


def _reset_after_fork() -> None:
    global _STATE
    if _STATE.engine is not None:
        _ORPHANS.append(_STATE.engine)
    _STATE = _State()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def engine() -> Any | None:
    """This process's engine, started on first use; None where the extension or libcurl is missing."""
    state = _STATE
    if state.engine is not None or state.reason:
        return state.engine
    with state.lock:
        if state.engine is None and not state.reason:
            if pure_python():
                state.reason = "FASTLOAD_PURE_PYTHON is set"
                return None
            try:
                _curl: Any = importlib.import_module("fastload._curl")
            except ImportError as err:
                state.reason = f"fastload._curl is not built ({err})"
                return None
            paths = ssl.get_default_verify_paths()  # the certificates Python's ssl (so aiohttp) trusts
            try:
                state.engine = _curl.Engine(cainfo=paths.cafile, capath=paths.capath)
            except OSError as err:
                state.reason = str(err)
                return None
            threading.Thread(target=_watch, args=(state,), name="fastload-curl-pump", daemon=True).start()
    return state.engine


def _watch(state: _State) -> None:
    """Pump when no reader does: finished GETs nobody waits for, idle permits, a stop.

    Readers pump as they wait; this thread covers the gaps (a stop while nobody
    waits, the permits of an epoch's last fetches ahead, a reader that waits for a
    slot the engine holds), so leased slots always come back. It wakes only when
    outcomes or idle permits went untaken for ``2 * PUMP_S``, or every STOP_POLL_S
    while a stop event has GETs to end.
    """
    eng = state.engine
    # For the life of the process: a forked child has no copy of this thread (it starts its own
    # engine), and a thread that ended while _STATE was briefly another (a test swapping it) left
    # the engine's leased slots stranded, each aiohttp request then waiting for a slot
    # (tests/integration/test_curl.py::test_the_pump_thread_outlives_a_swapped_state).
    while True:
        due = eng.watch(STOP_POLL_S, 2 * PUMP_S)
        if due or any(stop.is_set() for stop, _ in list(state.stoppable.values())):
            pump()


def unavailable() -> str:
    """Why :func:`engine` is None ("" when it is not, or not tried yet)."""
    return _STATE.reason


def _host(limit: HostLimit) -> _Host:
    state = _STATE
    host = state.hosts.get(id(limit))
    if host is None or host.limit is not limit:
        with state.lock:
            host = state.hosts.get(id(limit))
            if host is None or host.limit is not limit:
                host = state.hosts[id(limit)] = _Host(state.engine.host(), limit)
    return host


def pump() -> None:
    """Finished GETs to their hosts' controllers; permits leased, or given back, to match the work."""
    state = _STATE
    eng = state.engine
    if eng is None or not state.pump_lock.acquire(blocking=False):
        return  # another thread is at it
    try:
        by_host: dict[int, list[tuple[float, int, str, bool]]] = {}
        hosts = {h.id: h for h in state.hosts.values()}
        for hid, code, status, latency, nbytes, connects, connect_s, closes in eng.outcomes():
            host = hosts.get(hid)
            if host is None:
                continue
            why = _congestion(code, status)
            by_host.setdefault(hid, []).append((latency, nbytes, why, code == 0 and 200 <= status < 300))
            if connects and connect_s > SLOW_CONNECT_S:
                host.limit.signal("slow connect")  # a SYN retried by TCP: the server's backlog overflowed
            if closes:
                host.limit.closes_connections()
        for hid, results in by_host.items():
            hosts[hid].limit.account(results)
        for key, (stop, pendings) in list(state.stoppable.items()):
            if stop.is_set():
                _cancel(list(pendings))
                del state.stoppable[key]
            elif not pendings:
                del state.stoppable[key]
        for host in hosts.values():
            _balance(eng, host)
    finally:
        state.pump_lock.release()


def _balance(eng: Any, host: _Host) -> None:
    permits, active, queued = eng.counts(host.id)
    need = active + queued
    if need > host.leased:
        host.leased += host.limit.lease(need - host.leased)
    # Slots beyond a cut limit go back, and one per pump while threads or coroutines wait for
    # one (an aiohttp request of this host: a retry, a listing page), so they are not starved.
    target = max(0, min(need, host.leased) - host.limit.excess() - (1 if host.limit.waiting() else 0))
    held = eng.set_permits(host.id, target)  # max(target, active): running GETs keep theirs
    if held < host.leased:
        host.limit.unlease(host.leased - held)
        host.leased = held


def _congestion(code: int, status: int) -> str:
    if code == 0:
        return f"HTTP {status}" if status in (429, 503) else ""
    kind = _CURL_CODES.get(code)
    return kind.__name__ if kind is not None else ""


class Pending:
    """One GET handed to the engine; finished like a future (``done``, ``cancel``, ``result``).

    ``result()`` gives what :func:`fastload.source.aio.http_get_first` gives: the
    HEAD-like info and the first ``nbytes`` bytes, or raises the error it stands for.
    """

    __slots__ = ("__weakref__", "host", "nbytes", "page", "transfer", "url")

    def __init__(self, transfer: Any, url: str, nbytes: int, host: _Host | None = None, page: tuple[str, ...] = ()) -> None:
        # page: a listing page's content types whose body is the listing (CurlRoute.page_types); (): a first block
        self.transfer, self.url, self.nbytes, self.host, self.page = transfer, url, nbytes, host, page

    def done(self) -> bool:
        return bool(self.transfer.done())

    def started(self) -> bool:
        """Whether it holds a slot yet (running or done); until then it waits in its host's queue."""
        return bool(self.transfer.started())

    def cancel(self) -> bool:
        cancelled = bool(self.transfer.cancel())
        pump()  # its permit may now be idle
        return cancelled

    def result(self, timeout: float | None = None) -> Any:
        """A first block's ``(info, body)`` (:func:`_answer`), or a page's ``(final_url, size, text)``
        (:func:`_page_answer`)."""
        if not wait([self], 1e9 if timeout is None else timeout) == []:
            raise concurrent.futures.TimeoutError(f"{self.url}: no answer within {timeout} s")
        res = self.transfer.result()
        if res[0] in _CANNOT_SPEAK and self.host is not None:
            self.host.broken = self.host.broken or f"libcurl error {res[0]}: {res[10]}"
        return _page_answer(res, self.url, self.page) if self.page else _answer(res, self.url, self.nbytes)


def wait(futures: Sequence[Any], timeout_s: float) -> list[Any]:
    """Wait until all of ``futures`` (Pending or concurrent futures) are done or ``timeout_s`` passed;
    returns those not done. Finished GETs reach their controllers while it waits (:func:`pump`)."""
    deadline = time.monotonic() + max(0.0, timeout_s)
    mine = [f for f in futures if isinstance(f, Pending)]
    others = [f for f in futures if not isinstance(f, Pending)]
    eng = _STATE.engine
    mine = [p for p in mine if not p.done()]
    if mine and eng is not None:
        transfers = [p.transfer for p in mine]
        while True:
            finished = eng.wait(transfers, max(0.0, deadline - time.monotonic()), PUMP_S)
            pump()
            if finished or time.monotonic() >= deadline:
                break
            transfers = [t for t in transfers if not t.done()]
        mine = [p for p in mine if not p.done()]
    if others:
        others = list(concurrent.futures.wait(others, timeout=max(0.0, deadline - time.monotonic())).not_done)
    return [*mine, *others]


def wait_any(futures: Sequence[Any], timeout_s: float) -> list[Any]:
    """Wait until one of ``futures`` (Pending or concurrent) is done or ``timeout_s`` passed; returns
    those done by then (often several: answers that came in while the caller was busy).

    A listing parses each folder page as it arrives, while the others transfer
    (fastload.source.listing.crawl); :func:`wait` returns only once all are done.
    """
    deadline = time.monotonic() + max(0.0, timeout_s)
    eng = _STATE.engine
    while True:
        done = [f for f in futures if f.done()]
        left = deadline - time.monotonic()
        if done or left <= 0:
            return done
        mine = [p.transfer for p in futures if isinstance(p, Pending)]
        others = [f for f in futures if not isinstance(f, Pending)]
        # In short slices: the engine's wait ends early only while finished GETs wait for a pump,
        # and the pump thread (_watch) may take them first; concurrent futures are looked at between.
        slice_s = min(left, 2 * PUMP_S)
        if mine and eng is not None:
            eng.wait(mine, slice_s, PUMP_S)
            pump()
        if others:
            concurrent.futures.wait(others, timeout=0 if mine else slice_s, return_when=concurrent.futures.FIRST_COMPLETED)


def settle(futures: Sequence[Any], stop: threading.Event, timeout_s: float) -> None:
    """Wait for ``futures`` together (Pending or concurrent): until all are done, ``stop`` is
    set, or ``timeout_s`` passes; ``stop`` is looked at every STOP_POLL_S.

    One wait for a chunk wakes its thread once, not once per answer (a switch and a GIL
    handoff each): fetch.Fetcher and Source.fetch_first_many both wait this way.
    """
    pending = [f for f in futures if not f.done()]
    deadline = time.monotonic() + timeout_s
    while pending and not stop.is_set() and (left := deadline - time.monotonic()) > 0:
        pending = wait(pending, min(STOP_POLL_S, left))
    if stop.is_set():
        end_stopped(stop)


def end_stopped(stop: threading.Event) -> None:
    """Cancel every GET started under ``stop``, now, running or queued for a permit.

    The pump ends them too, but only when it next comes by: meanwhile a finished GET's
    permit passed in C to a queued one, which went out after the stop
    (tests/integration/test_fetch.py::test_a_stop_starts_no_fetch_ahead_and_ends_the_wait_for_one).
    """
    entry = _STATE.stoppable.get(id(stop))
    if entry is not None and entry[0] is stop:
        _cancel(list(entry[1]))


def _cancel(pendings: list[Pending]) -> None:
    """Cancel ``pendings``, the queued before the running: a running GET's permit passes in C to
    the next queued one the moment it ends, which would then go out."""
    for p in sorted(pendings, key=lambda p: p.started()):
        p.transfer.cancel()


def _failed(code: int, status: int, message: str, url: str) -> None:
    """Raise what a cancelled or failed transfer, or a 404, stands for (as aiohttp's would read)."""
    if code == -1:
        raise concurrent.futures.CancelledError(f"{url}: cancelled")
    if code:
        kind = _CURL_CODES.get(code, ConnectionError)
        raise kind(f"{url}: {message} (libcurl error {code})")
    if status == 404:
        raise FileNotFoundError(url)  # as fsspec's _raise_not_found_for_status


def _answer(res: tuple[Any, ...], url: str, nbytes: int) -> tuple[dict[str, Any], bytes]:
    """An engine answer as _http_get_first's (info, body), or the error it stands for."""
    from fastload.transport.answers import first_info

    code, status, body, content_range, content_length, etag, modified, md5, digest, _closes, message, _, _, generation = res
    _failed(code, status, message, url)
    if status not in (200, 206, 416):
        raise HttpStatusError(status, url, body)
    if status == 200 and content_length is None and len(body) >= nbytes:
        raise HttpStatusError(status, url)  # no length, and cut at nbytes: its size is unknown here
    headers = _Headers({"content-range": content_range, "content-length": content_length, "etag": etag,
                        "last-modified": modified, "content-md5": md5, "digest": digest, "x-goog-generation": generation})
    return first_info(url, nbytes, status, headers, body)


def _page_answer(res: tuple[Any, ...], url: str, types: tuple[str, ...]) -> tuple[str, int | None, str | None]:
    """A folder page's answer as ``(final_url, size, text)``, as ``fastload.source.aio.http_page`` reads one on
    aiohttp: the text only for a page of one of ``types`` (HTML for a web server's folder), or the error it
    stands for."""
    code, status, body, _, content_length, _, _, _, _, _, message, content_type, final, _ = res
    _failed(code, status, message, url)
    if not 200 <= status < 300:
        raise HttpStatusError(status, url, body)
    final = final or url
    size = int(content_length) if content_length and content_length.isdigit() else None
    mimetype, _, params = (content_type or "").partition(";")
    mimetype = mimetype.strip().lower()
    if not (mimetype in types or (not mimetype and final.endswith("/"))):
        return final, size, None
    if len(body) >= PAGE_MAX:
        raise OSError(f"{url}: folder page of {PAGE_MAX} B or more; read on aiohttp, whole")
    return final, size, body.decode(_charset(params), errors="ignore")


def _charset(params: str) -> str:
    """The charset a Content-Type's parameters name, if Python knows it; else UTF-8 (as aiohttp)."""
    for param in params.split(";"):
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset":
            try:
                return codecs.lookup(value.strip().strip('"')).name
            except LookupError:
                break
    return "utf-8"


class _Headers(dict):  # type: ignore[type-arg]
    """The answer's headers, looked up case-insensitively as aiohttp's are (absent ones are None)."""

    def get(self, name: str, default: Any = None) -> Any:
        value = super().get(name.lower())
        return default if value is None else value

    def __getitem__(self, name: str) -> Any:
        return super().__getitem__(name.lower())


@dataclass(frozen=True)
class CurlRoute:
    """How a Source's first-block GETs go through curl: its session's headers and login (an S3 source's
    signed GETs: :class:`fastload.source.s3.S3Route`)."""

    headers: tuple[str, ...]  # "Name: value" lines
    userpwd: str | None
    trust_env: bool
    encode: Any  # the filesystem's URL encoder (fs.encode_url), for URLs libcurl would not take as they are
    # TLS: the CA bundle file these GETs trust (None: the engine's, Python ssl's default paths), and
    # whether the server's certificate is checked at all (False only where the user turned it off).
    cainfo: str | None = None
    verify: bool = True
    capath: str | None = None  # a folder of CA certificates (c_rehash'd), as REQUESTS_CA_BUNDLE may name one
    # Ask for HTTP/2 over TLS (ALPN; clear-text stays HTTP/1.1); else HTTP/1.1, as aiohttp speaks.
    # A choice to measure (issue 34, item 7), not a negotiation: libcurl's own default would be HTTP/2.
    http2: bool = False

    # A listing page's content types whose body is the listing: a web server's folder index (S3 and GCS
    # routes list in XML and JSON).
    page_types: ClassVar[tuple[str, ...]] = ("text/html",)
    follow: ClassVar[bool] = True  # follow redirects, as aiohttp (an S3 route learns its region from one instead)

    def start(self, urls: Sequence[str], nbytes: int, timeout_s: float, limit: HostLimit,
              stop: threading.Event) -> list[Pending]:
        """Hand one GET of the first ``nbytes`` bytes per URL to the engine; they run in ``limit``'s
        slots, and once ``stop`` is set those not finished are cancelled (:func:`pump`)."""
        return self._submit(urls, nbytes, [f"Range: bytes=0-{max(nbytes, 1) - 1}"], timeout_s, limit, stop, False)

    def start_ranges(self, spans: Sequence[tuple[str, int, int]], timeout_s: float, limit: HostLimit,
                     stop: threading.Event, conditions: Sequence[tuple[str, str]] | None = None) -> list[Pending]:
        """As :meth:`start`, one GET of ``url[start:end]`` per span, each with its own Range and byte count, its
        body written into the bytes its result returns. ``conditions``: per span, a query for its URL and header
        lines ("\\r\\n" between) naming the version expected (fastload.source.ranged). Range and these lines
        are the GET's own, unsigned (S3 asks only for host and x-amz-* headers to be signed)."""
        conditions = conditions or [("", "")] * len(spans)
        own = [f"Range: bytes={start}-{end - 1}" + (f"\r\n{lines}" if lines else "")
               for (_, start, end), (_, lines) in zip(spans, conditions)]
        return self._submit([url for url, _, _ in spans], 0, [], timeout_s, limit, stop, False, own=own,
                            queries=[query for query, _ in conditions], sizes=[end - start for _, start, end in spans])

    def start_pages(self, urls: Sequence[str], timeout_s: float, limit: HostLimit, stop: threading.Event) -> list[Pending]:
        """As :meth:`start`, one GET of each folder page (redirects followed; the body kept if it is
        HTML); each Pending's result is ``(final_url, size, text or None)``."""
        return self._submit(urls, PAGE_MAX, [], timeout_s, limit, stop, True)

    def wire(self, url: str) -> str:
        """The URL libcurl requests for ``url``."""
        return url if _PLAIN_URL.match(url) else str(self.encode(url))

    def sign(self, wire: list[str], headers: list[str]) -> tuple[list[str], list[str] | None]:
        """A batch's signature: header lines for all of its GETs, and one more line per GET (or None)."""
        return [], None

    def refused(self, url: str, err: HttpStatusError) -> Exception | None:
        """The error an answer that refuses the credentials stands for (an object store's: its route
        reads the store's own error), or None: the request is done again on the other road."""
        return None

    def _submit(self, urls: Sequence[str], max_bytes: int, extra: list[str], timeout_s: float, limit: HostLimit,
                stop: threading.Event, page: bool, own: list[str] | None = None, queries: list[str] | None = None,
                sizes: list[int] | None = None) -> list[Pending]:
        """Hand the batch to the engine. ``own``: each GET's own header lines beside its signature; ``queries``:
        appended to each wire URL (signed with it); ``sizes``: each GET's bytes, its body then written in place."""
        eng = engine()
        if eng is None:
            raise ConfigError(f"libcurl's engine is not running here: {unavailable()}")  # route_for checked
        host = _host(limit)
        wire = [self.wire(u) + q for u, q in zip(urls, queries)] if queries else [self.wire(u) for u in urls]
        headers = [*self.headers, *extra, "Accept-Encoding: identity"]
        batch, lines = self.sign(wire, headers)
        if own is not None:
            lines = own if lines is None else [f"{signed}\r\n{mine}" for signed, mine in zip(lines, own)]
        transfers = eng.submit(host.id, wire, max_bytes, [*headers, *batch], timeout_s, self.userpwd, self.trust_env, page,
                               lines, cainfo=self.cainfo, capath=self.capath, verify=self.verify, http2=self.http2,
                               sizes=sizes, exact=sizes is not None, follow=self.follow)
        counts = sizes or [max_bytes] * len(urls)
        pendings = [Pending(t, u, n, host, self.page_types if page else ()) for t, u, n in zip(transfers, urls, counts)]
        state = _STATE
        with state.lock:
            entry = state.stoppable.get(id(stop))
            if entry is None or entry[0] is not stop:
                entry = state.stoppable[id(stop)] = (stop, weakref.WeakSet())
        for p in pendings:
            entry[1].add(p)
        pump()  # lease the permits they need (or cancel them, if stopped meanwhile)
        return pendings


_SESSION_KEYS = {"timeout", "headers", "auth", "trust_env"}  # client_kwargs curl can honour
_REQUEST_KEYS = {"headers", "ssl"}  # per-request options curl can honour (ssl: True or False, _verify_of)
# fsspec HTTPFileSystem's own arguments: they shape the filesystem (its listing cache, its files'
# buffering), not the requests; every other storage option is passed to each request (fs.kwargs).
_FS_KEYS = {"simple_links", "block_size", "same_scheme", "size_policy", "cache_type", "cache_options", "asynchronous",
            "loop", "client_kwargs", "get_client", "encoded", "use_listings_cache", "listings_expiry_time", "max_paths",
            "skip_instance_cache"}


def closed_by(choice: str) -> str:
    """Why no GET may take libcurl's engine under ``choice`` (``Settings.http_client``), or "" when they
    may: every store's route asks here (HTTP below, fastload.source.s3, fastload.source.gcs).

    Raises:
        ConfigError: ``choice`` is "curl" and the engine cannot run here.
    """
    if choice == "aiohttp":
        return "FASTLOAD_HTTP_CLIENT=aiohttp"
    if engine() is None:
        if choice == "curl":
            raise ConfigError(f"http_client='curl' cannot run here: {unavailable()}; fix: install libcurl "
                              "(apt-get install libcurl4) and a C compiler, or FASTLOAD_HTTP_CLIENT=auto")
        return f"libcurl's engine cannot run here ({unavailable()})"
    return ""


def route_for(options: dict[str, Any], choice: str, encode: Callable[[str], Any]) -> CurlRoute | None:
    """A route through curl for an HTTP source's ``storage_options``, or None for aiohttp.

    Read from the options, not from the fsspec filesystem, so that the route (and the
    listing on it) does not wait for aiohttp to import. ``encode`` makes a URL libcurl
    would not take as it is into its wire form (the filesystem's ``encode_url``).
    ``choice`` is ``Settings.http_client``: "aiohttp" never routes; "auto" routes
    where the engine runs and every option maps onto curl; "curl" does the same
    but raises ConfigError where the engine cannot run.
    """
    if closed_by(choice):
        return None
    if "get_client" in options:
        return None  # the user's own session factory: only aiohttp honours it
    client = dict(options.get("client_kwargs") or {})
    request = {k: v for k, v in options.items() if k not in _FS_KEYS}
    if set(client) - _SESSION_KEYS or set(request) - _REQUEST_KEYS:
        return None
    userpwd = None
    auth = client.get("auth")
    if auth is not None:
        login, password = getattr(auth, "login", None), getattr(auth, "password", None)
        if not isinstance(login, str) or not isinstance(password, str):
            return None
        userpwd = f"{login}:{password}"
    headers = {**(client.get("headers") or {}), **(request.get("headers") or {})}
    if not all(isinstance(k, str) and isinstance(v, str) and "\n" not in k + v for k, v in headers.items()):
        return None
    verify = _verify_of(request.get("ssl", True))
    if verify is None:
        return None  # an SSLContext or a fingerprint: what it trusts is aiohttp's to apply
    cainfo, capath = ca_bundle(os.environ) if verify else (None, None)
    if not verify:
        _log.warning("fastload: storage_options ssl=False: HTTPS GETs check neither the certificate nor the host "
                     "name, on libcurl and aiohttp")
    lines = tuple(f"{k}: {v}" for k, v in headers.items() if k.lower() not in ("range", "accept-encoding"))
    return CurlRoute(headers=lines, userpwd=userpwd, trust_env=bool(client.get("trust_env", False)), encode=encode,
                     cainfo=cainfo, capath=capath, verify=verify)


def _verify_of(value: Any) -> bool | None:
    """aiohttp's per-request ``ssl`` (fsspec passes each unknown storage option to every request) as a
    route's ``verify``: True (or None) checks, False does not; anything else (an SSLContext, a Fingerprint)
    is None: only aiohttp can apply it."""
    if value is None or value is True:
        return True
    if value is False:
        return False
    return None
