"""Requests in flight to one host: a hard cap, and an adaptive limit under it.

Every request :class:`~fastload.source.Source` sends (a GET, a ranged GET, a
HEAD) holds a slot of its host's :class:`HostLimit` while it runs; nothing else
in fastload bounds requests, so this is the one home of that number.

* **Cap.** ``Settings.max_requests`` (``--max-requests``, ``FASTLOAD_MAX_REQUESTS``): the most
  requests one process ever has in flight to one host, for staging and training
  alike (tests/integration/test_hostlimit_server.py counts connections at the server).
* **Limit.** Under the cap, an AIMD controller chooses how many may run. It
  starts at :data:`START`, grows while the host's throughput rises and its
  requests' latency does not (slow start: one more per answer that did not
  queue while requests wait, so doubling each round trip, until a window's
  throughput stops rising; then by one per window while each step pays, taking
  back a step that made throughput fall, and trying one more now and then),
  and halves on a congestion
  signal (:func:`fastload.transport.failures.congestion`): a connect timeout, a reset or refused connection,
  HTTP 429 or 503, S3 ``SlowDown``, a TCP connect slower than :data:`SLOW_CONNECT_S` (a server
  whose listen backlog overflows drops SYNs, which TCP retries only after a
  second). Throughput alone never cuts: on a shared machine it dips for reasons
  of its own (an unshaped loopback cut itself three times an epoch). A server that closes each connection
  after its answer stays at :data:`CLOSING_MAX`.

The limit a host settled on is reported by :func:`settled` (``loader.stats()``,
``fastload cache --json``, ``fastload diagnose``).

Slots are handed over first-come first-served, to threads (:meth:`HostLimit.slot`)
and to coroutines on fsspec's event loop (:meth:`HostLimit.aslot`) alike.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

from fastload.errors import SourceError, StoppedError
from fastload.transport.failures import congestion
from fastload.transport.tls import ssl_context

START = 4  # requests allowed at first: a small server is never met with a burst
RISE = 1.05  # a step "pays" when throughput rises by at least this factor
QUEUED = 2.0  # mean latency above this many times its lowest: requests are queueing, not adding throughput
FALL = 0.9  # a step "hurts" when throughput falls below this factor: take it back
# A server that closes the connection after each answer (HTTP/1.0, as http.server)
# takes every request through its listen queue: 5 deep in Python's socketserver. In
# a namespace running `python -m http.server`, 9 requests in flight overflowed it 3
# times in 3 stagings (TcpExtListenOverflows), 4 never did; each overflow costs a
# SYN retried after 1 s.
CLOSING_MAX = 4
SLOT_WAIT_S = 900.0  # a wait for a slot longer than this is a fault, not a queue: it raises
STOP_POLL_S = 0.05  # how often a thread waiting on a slot or a request looks at its Reader's stop
SLOW_CONNECT_S = 0.5  # a TCP connect this slow was retried: the server's listen backlog overflowed
WINDOW_MIN_S = 0.05  # a window shorter than this is too noisy to judge
WINDOW_MIN_REQUESTS = 8
PROBE_EVERY = 8  # windows held before trying one more again (conditions change)


class HostLimit:
    """The cap and the adaptive limit of one host (see the module docstring).

    Args:
        host: What the limit is named by in stats (``http://127.0.0.1:8080``).
        cap: The hard cap (``Settings.max_requests``).
    """

    def __init__(self, host: str, cap: int) -> None:
        self.host = host
        self.cap = max(1, cap)
        self.limit = float(min(self.cap, START))
        self.in_flight = 0
        self.peak = 0  # most requests ever in flight at once
        self.cuts = 0  # congestion signals that cut the limit
        self.last_cut = ""  # what the last one was (congestion(): "SlowDown", "HTTP 503", an error's type), or "slow connect"
        self.closing = False  # the host closes each connection after its answer (CLOSING_MAX)
        self._lock = threading.Lock()
        self._waiters: collections.deque[Callable[[], bool]] = collections.deque()
        self._slow_start = True
        self._done = 0  # requests completed (ok or not)
        self._cut_guard = 0  # no second cut before _done reaches this (one cut per window)
        self._best = 0.0
        self._prev = 0.0
        self._base = 0.0  # the lowest mean request latency of a window: latency without queueing
        self._fastest = 0.0  # the lowest latency of one request (slow start's yardstick)
        self._grew = False  # the last window's verdict was "one more"
        self._held = 0  # windows judged without a change
        self._wanting = False  # a holder of leased slots (lease) asked for more than it got
        self._new_window(time.monotonic())

    def set_cap(self, cap: int) -> None:
        """Apply a new cap (the latest ``Settings.max_requests`` of a Source for this host)."""
        with self._lock:
            self.cap = max(1, cap)
            self.limit = min(self.limit, float(self.cap))
            wake = self._hand_over()
        for fn in wake:
            fn()

    # -- slots -------------------------------------------------------------------

    @contextmanager
    def slot(self, stop: threading.Event | None = None) -> Iterator[_Outcome]:
        """Hold a slot in this thread for the ``with`` body (one request).

        Raises:
            StoppedError: ``stop`` was set while waiting for the slot (staging's Ctrl-C).
        """
        with self._lock:
            if self._free():
                self._take()
                event = None
            else:
                event = threading.Event()

                def wake() -> bool:
                    event.set()
                    return True

                self._waiters.append(wake)
        if event is not None and not _waited(event, stop):  # handed a slot by _release
            with self._lock:
                handed = wake not in self._waiters
                if not handed:
                    self._waiters.remove(wake)
            if handed:  # handed over just now: pass it on
                self._give_back()
            if stop is not None and stop.is_set():
                raise StoppedError(f"{self.host}: stopped while waiting for a request slot")
            raise self._starved()
        with self._holding() as outcome:
            yield outcome

    def aslot(self) -> _AsyncSlot:
        """A slot for a coroutine on an event loop, held for the ``async with`` body."""
        return _AsyncSlot(self)

    async def _acquire(self) -> None:
        """Wait on the running loop until this coroutine holds a slot (FIFO with threads)."""
        with self._lock:
            if self._free():
                self._take()
                return
            loop = asyncio.get_running_loop()
            future = loop.create_future()
            self._waiters.append(_async_waker(loop, future, self._give_back))
        # One timer, not asyncio.wait_for (a wrapper future and callbacks per waiter): slots
        # cost ~30 us per request that way, on fsspec's loop thread (benchmarks/peers/results/profile.md).
        timer = loop.call_later(SLOT_WAIT_S, _expire, future)
        try:  # cancelled while waiting: the slot, once handed over, is given back (_async_waker)
            await future
        except _SlotExpired as err:
            raise self._starved() from err
        finally:
            timer.cancel()

    @contextmanager
    def _holding(self) -> Iterator[_Outcome]:
        """The body of a slot already taken: its outcome (error or not) goes to the controller."""
        outcome = _Outcome()
        try:
            yield outcome
        except BaseException as err:
            outcome.error = err
            raise
        finally:
            self._release(outcome)

    def _starved(self) -> SourceError:
        return SourceError(
            f"{self.host}: no request slot came free in {SLOT_WAIT_S:g} s ({self.in_flight} requests in flight, "
            f"limit {int(self.limit)} of --max-requests {self.cap}); fix: check that the server answers, or raise FASTLOAD_TIMEOUT_S"
        )

    def _free(self) -> bool:
        return self.in_flight < int(self.limit) and not self._waiters

    def _take(self) -> None:
        self.in_flight += 1
        if self.in_flight > self.peak:
            self.peak = self.in_flight
        if self.in_flight >= int(self.limit):
            self._full = True

    def _hand_over(self) -> list[Callable[[], bool]]:
        """Slots for waiters while the limit allows (under the lock); returns who to wake."""
        wake = []
        while self._waiters and self.in_flight < int(self.limit):
            self._take()
            wake.append(self._waiters.popleft())
        return wake

    def _give_back(self) -> None:
        # A waiter that went away after being handed a slot: pass the slot on.
        with self._lock:
            self.in_flight -= 1
            wake = self._hand_over()
        for fn in wake:
            fn()

    def _release(self, outcome: _Outcome) -> None:
        now = time.monotonic()
        why = congestion(outcome.error) if outcome.error is not None else ""
        with self._lock:
            self.in_flight -= 1
            self._record(now, now - outcome.t0, outcome.nbytes, why, outcome.error is None)
            wake = self._hand_over()
        for fn in wake:
            fn()

    # -- slots held in bulk (fastload.transport.curl: a transfer thread that runs without the GIL) --

    def lease(self, n: int) -> int:
        """Take up to ``n`` slots now, without waiting; returns how many were taken.

        The holder runs one request per slot, many after each other, and reports
        them with :meth:`account`; :meth:`unlease` gives slots back. None are taken
        while threads or coroutines wait (first come, first served).
        """
        with self._lock:
            free = 0 if self._waiters else max(0, int(self.limit) - self.in_flight)
            taken = min(max(0, n), free)
            self._wanting = taken < n  # requests wait for slots: slow start may grow
            for _ in range(taken):
                self._take()
        return taken

    def unlease(self, n: int) -> None:
        """Give back ``n`` slots taken by :meth:`lease`."""
        with self._lock:
            self.in_flight -= n
            wake = self._hand_over()
        for fn in wake:
            fn()

    def waiting(self) -> bool:
        """Whether threads or coroutines wait for a slot."""
        return bool(self._waiters)

    def excess(self) -> int:
        """Slots in use beyond the limit (after a cut): a holder of leased slots gives these back."""
        return max(0, self.in_flight - int(self.limit))

    def account(self, results: list[tuple[float, int, str, bool]]) -> None:
        """Requests run in leased slots: (latency_s, nbytes, congestion or "", ok) each, to the controller."""
        now = time.monotonic()
        with self._lock:
            for latency, nbytes, why, ok in results:
                self._record(now, latency, nbytes, why, ok)

    def _record(self, now: float, latency: float, nbytes: int, why: str, ok: bool) -> None:
        """One finished request, to the controller (under the lock)."""
        self._done += 1
        if why:
            self._cut(now, why)
        elif ok:
            self._window_bytes += nbytes
            self._window_done += 1
            self._window_latency += latency
            self._fastest = min(self._fastest or latency, latency)
            if self._slow_start and (self._waiters or self._wanting) and latency <= self._fastest * QUEUED:
                # One more per answer that did not queue while others wait: the limit
                # doubles each round trip, as TCP's slow start does. Doubling once per
                # window (>= 50 ms) took ~0.25 s to reach 32 with 20 ms to first byte,
                # ~8% of a 3 s cold epoch at 1 Gbit (benchmarks/peers).
                self._step(1.0)
            self._judge(now)

    # -- the controller (under the lock) --------------------------------------------

    def closes_connections(self) -> None:
        """The host closed a connection after its answer: hold the limit to CLOSING_MAX."""
        if not self.closing:
            with self._lock:
                self.closing = True
                self.limit = min(self.limit, float(CLOSING_MAX))

    def signal(self, why: str) -> None:
        """A congestion signal seen outside a request's result (a connect retried by TCP)."""
        with self._lock:
            self._cut(time.monotonic(), why)

    def _new_window(self, now: float) -> None:
        self._window_start = now
        self._window_bytes = 0
        self._window_done = 0
        self._window_latency = 0.0
        self._full = self.in_flight >= int(self.limit)

    def _cut(self, now: float, why: str) -> None:
        if self._done < self._cut_guard:
            return  # the requests in flight at the last cut are still reporting it
        self.limit = max(1.0, self.limit / 2)
        self.cuts += 1
        self.last_cut = why
        self._slow_start = False
        self._cut_guard = self._done + self.in_flight + 1
        self._best = self._prev = 0.0
        self._new_window(now)

    def _judge(self, now: float) -> None:
        elapsed = now - self._window_start
        if self._window_done < max(WINDOW_MIN_REQUESTS, int(self.limit)) or elapsed < WINDOW_MIN_S:
            return
        rate = (self._window_bytes or self._window_done) / elapsed
        if self._full:  # only a window that used the whole limit says anything about its size
            # Latency says whether requests now queue somewhere (the link, the server's
            # threads or its accept queue): only a step that adds throughput, not queueing, pays.
            latency = self._window_latency / self._window_done
            self._base = min(self._base or latency, latency)
            queued = latency > self._base * QUEUED
            paid = (not self._prev or rate >= self._prev * RISE) and not queued
            # In slow start the limit grows per answer (_release): 20 ms to first byte needs
            # ~30 in flight at 1 Gbit. A window whose growth did not pay ends it: one at a time from here.
            self._slow_start = self._slow_start and paid
            if not self._slow_start:
                self._adjust(rate, paid)
        self._best = max(self._best, rate)
        self._prev = rate
        self._new_window(now)

    def _adjust(self, rate: float, paid: bool) -> None:
        """After slow start: one step per full window, up where it paid, down where it hurt."""
        if self._grew and rate < self._prev * FALL:
            self._step(-1.0)  # one more made it worse
        elif paid or self._held >= PROBE_EVERY:
            self._step(1.0)
        else:
            self._held += 1
            self._grew = False

    def _step(self, by: float) -> None:
        ceiling = min(self.cap, CLOSING_MAX) if self.closing else self.cap
        self.limit = min(float(ceiling), max(1.0, self.limit + by))
        self._grew = by > 0
        self._held = 0

    def as_dict(self) -> dict[str, Any]:
        """The limit now, the cap, the peak in flight, the cuts and the last cut's cause (stats, JSON)."""
        return {"limit": int(self.limit), "cap": self.cap, "peak": self.peak, "cuts": self.cuts, "last_cut": self.last_cut}


def _waited(event: threading.Event, stop: threading.Event | None) -> bool:
    """Whether ``event`` (a slot handed over) came before SLOT_WAIT_S passed or ``stop`` was set."""
    if stop is None:
        return event.wait(SLOT_WAIT_S)
    deadline = time.monotonic() + SLOT_WAIT_S
    while not event.wait(STOP_POLL_S):
        if stop.is_set() or time.monotonic() > deadline:
            return False
    return True


class _AsyncSlot:
    """``async with limit.aslot() as outcome``: a class, not a generator (this runs once per request)."""

    __slots__ = ("_limit", "_outcome")

    def __init__(self, limit: HostLimit) -> None:
        self._limit = limit

    async def __aenter__(self) -> _Outcome:
        await self._limit._acquire()
        self._outcome = _Outcome()
        return self._outcome

    async def __aexit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: Any) -> None:
        if err is not None:
            self._outcome.error = err
        self._limit._release(self._outcome)


class _SlotExpired(Exception):
    """No slot came free within SLOT_WAIT_S (set on a waiting coroutine's future)."""


def _expire(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_exception(_SlotExpired())


class _Outcome:
    """What a request holding a slot reports: its bytes, or the error it raised."""

    __slots__ = ("error", "nbytes", "t0")

    def __init__(self) -> None:
        self.t0 = time.monotonic()  # when the slot was granted
        self.nbytes = 0
        self.error: BaseException | None = None


def _async_waker(loop: asyncio.AbstractEventLoop, future: asyncio.Future[None], give_back: Callable[[], None]) -> Callable[[], bool]:
    def resolve() -> None:
        if future.done():  # cancelled while it waited: pass the slot on
            give_back()
        else:
            future.set_result(None)

    def wake() -> bool:
        try:
            if asyncio.get_running_loop() is loop:  # released on the loop itself: no self-pipe write
                resolve()
                return True
        except RuntimeError:  # released by a thread without a running loop
            pass
        try:
            loop.call_soon_threadsafe(resolve)
        except RuntimeError:  # the loop is closed: nobody will take the slot
            give_back()
        return True

    return wake




_LIMITS: dict[str, HostLimit] = {}
_LIMITS_LOCK = threading.Lock()


def host_of(url: str, storage_options: dict[str, Any] | None = None) -> str:
    """The host a URL's requests go to: scheme and netloc (an S3 endpoint_url where one is set)."""
    endpoint = (storage_options or {}).get("endpoint_url") or ((storage_options or {}).get("client_kwargs") or {}).get("endpoint_url")
    if endpoint:
        parts = urlsplit(str(endpoint))
        return f"{parts.scheme}://{parts.netloc}"
    if "://" not in url:
        return "file://"
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def limit_for(host: str, cap: int) -> HostLimit:
    """This process's limit for ``host``, its cap set to ``cap``."""
    with _LIMITS_LOCK:
        limit = _LIMITS.get(host)
        if limit is None:
            limit = _LIMITS[host] = HostLimit(host, cap)
            return limit
    if limit.cap != cap:
        limit.set_cap(cap)
    return limit


async def aiohttp_client(**kwargs: Any) -> Any:
    """fsspec's ``get_client`` for HTTP: an aiohttp session that reports slow TCP connects,
    and servers that close each connection, to their host's limit.

    A server whose listen backlog is full drops the SYN; TCP sends it again after
    a second, then two, and the request just looks slow. Only the connect's own
    duration tells (tests/integration/test_hostlimit_server.py). Both are seen in
    the session's connector and response classes, not through an aiohttp
    ``TraceConfig``: a trace sends five signals per request, ~25 us of the ~200 us
    each GET costs on fsspec's loop (benchmarks/peers/results/profile.md). A
    ``connector`` or ``response_class`` of the user's own is kept, without that report.
    """
    import aiohttp

    response_class, connector_class = _aiohttp_classes()
    kwargs.setdefault("response_class", response_class)
    if kwargs.get("connector") is None:
        # On fsspec's loop, as set_session calls this; trusting the CA of REQUESTS_CA_BUNDLE or
        # CURL_CA_BUNDLE where one is named, as the first-block GETs on libcurl do (transport/tls.py).
        context = ssl_context(os.environ)
        kwargs["connector"] = connector_class() if context is None else connector_class(ssl=context)
    return aiohttp.ClientSession(**kwargs)


@functools.cache
def _aiohttp_classes() -> tuple[type[Any], type[Any]]:
    import aiohttp

    class _Response(aiohttp.ClientResponse):
        async def start(self, connection: Any) -> Any:
            started = await super().start(connection)
            old = self.version is not None and self.version < (1, 1)
            if old or self.headers.get("Connection", "").lower() == "close":
                limit = _LIMITS.get(host_of(str(self.url)))
                if limit is not None:
                    limit.closes_connections()
            return started

    class _Connector(aiohttp.TCPConnector):
        async def _create_connection(self, req: Any, traces: Any, timeout: Any) -> Any:
            t0 = time.monotonic()
            proto = await super()._create_connection(req, traces, timeout)
            if time.monotonic() - t0 > SLOW_CONNECT_S:
                limit = _LIMITS.get(host_of(str(req.url)))
                if limit is not None:
                    limit.signal("slow connect")
            return proto

    return _Response, _Connector


def settled() -> dict[str, dict[str, Any]]:
    """Host -> the limit it settled on (``limit``), its ``cap``, ``peak`` in flight and ``cuts``."""
    with _LIMITS_LOCK:
        limits = list(_LIMITS.values())
    return {lim.host: lim.as_dict() for lim in limits if lim.host != "file://"}


def combine_limits(per_process: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Host -> its limits over several processes (``process -> host -> HostLimit.as_dict()``).

    Each process has its own limit and cap for a host (fastload.transport.hostlimit), so the host
    may see the sum of their limits at once: ``limit`` and ``cuts`` are summed, ``peak``
    is the largest of one process, ``cap`` is the (per-process) cap, and ``processes``
    keeps each process's own.

    >>> c = combine_limits({"main": {"h": {"limit": 4, "cap": 8, "peak": 4, "cuts": 0, "last_cut": ""}},
    ...                     "worker 0": {"h": {"limit": 2, "cap": 8, "peak": 6, "cuts": 1, "last_cut": "503"}}})
    >>> {k: c["h"][k] for k in ("limit", "cap", "peak", "cuts", "last_cut")}
    {'limit': 6, 'cap': 8, 'peak': 6, 'cuts': 1, 'last_cut': '503'}
    """
    hosts: dict[str, dict[str, Mapping[str, Any]]] = {}
    for process, limits in per_process.items():
        for host, state in limits.items():
            hosts.setdefault(host, {})[process] = state
    out = {}
    for host, procs in hosts.items():
        states = list(procs.values())
        out[host] = {
            "limit": sum(int(s["limit"]) for s in states),
            "cap": max(int(s["cap"]) for s in states),
            "peak": max(int(s["peak"]) for s in states),
            "cuts": sum(int(s["cuts"]) for s in states),
            "last_cut": next((s["last_cut"] for s in reversed(states) if s.get("last_cut")), ""),
            "processes": {p: dict(s) for p, s in procs.items()},
        }
    return out


def _reset_after_fork() -> None:
    # A child's requests are its own: a parent's waiters and in-flight counts are not.
    global _LIMITS, _LIMITS_LOCK
    _LIMITS, _LIMITS_LOCK = {}, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)
