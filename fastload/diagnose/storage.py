"""Remote storage probes: list speed, time to first byte, throughput against concurrency.

Everything goes through a :class:`fastload.source.Source`, the object training reads
through, so the probe takes the road training takes: the same CA (``SSL_CERT_FILE``,
``AWS_CA_BUNDLE``, ``client_kwargs``), endpoint, credentials, timeouts and retries, and
the same choice between libcurl's engine (first blocks of HTTP, S3 and GCS objects) and
the fsspec filesystem (aiohttp, s3fs, gcsfs, local files). It once read through an
fsspec filesystem of its own: an https URL whose CA libcurl found failed there while
training ran, and with ``AWS_CA_BUNDLE`` it measured s3fs without saying so (issue 32;
tests/integration/test_diagnose_road.py). The section's ``road`` names the road measured
and why it is that one. The probe reads real objects of the dataset:

* **Listing.** fastload's own listing of the URL (``Source.find``: fsspec's
  ``find``, or fastload's level-at-a-time HTTP listing), timed, with fsspec's
  listing cache invalidated first. Nothing matching is the datasets' error
  (``EmptyDatasetError``'s message), as a skipped section.
* **Sizes.** From the listing; stores whose listings carry no size (plain HTTP)
  get a HEAD (``Source.complete_all``) for a spread sample of objects. The average
  is the sample size the verdict uses.
* **TTFB.** One-byte first-block GETs, one at a time, after a warm-up request that
  opens the connection.
* **Throughput.** For 1, 2, 4, ... concurrent requests, threads pull whole
  objects (ranges of ``chunk_bytes`` for large ones) for a fixed time; the sweep
  stops once two more doublings add under 10%. A level of ``n`` connections runs
  with ``max_requests=n`` (``--max-requests``), the cap of the host's limit that every
  request of a Source holds a slot of. The *saturating* concurrency is the smallest
  that reaches 90% of the best rate.

An object's first range is read as training reads a cold object's first block
(``Source.start_first_many``: libcurl where the Source has a route), its later ranges
as training reads later blocks (``Source.fetch``: the fsspec filesystem).

Bytes are bounded per level (``max_level_bytes``), so a thorough run on a fast
store does not download gigabytes. Requests finish once started, so a level can
overrun its time budget by one request per connection.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastload.config import Settings
from fastload.diagnose._util import median, ok, percentile, skipped

if TYPE_CHECKING:
    from fastload.source import RemoteItem, Source

__all__ = ["StorageBudget", "probe_storage", "road_of", "saturating"]

Unit = tuple["RemoteItem", int, int]  # (the object as listed, start, end): one request's bytes
RETRY_BUDGET_S = 20.0  # how long diagnose retries one failing request (training: Settings.retry_budget_s)
# The fsspec filesystem each protocol's GETs take when libcurl does not carry them.
_FSSPEC_ROADS = {"http": "aiohttp", "https": "aiohttp", "s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}


@dataclass(frozen=True)
class StorageBudget:
    """How much the storage probe may spend (``--quick`` / default / ``--thorough``)."""

    level_s: float = 1.0
    max_level_bytes: int = 256 * 1000**2
    ttfb_requests: int = 10
    objects: int = 32
    head_requests: int = 16
    chunk_bytes: int = 1024**2
    max_connections: int = 64
    list_repeats: int = 1


def saturating(levels: list[dict[str, Any]], share: float = 0.9) -> tuple[int, float]:
    """``(connections, bytes/s)``: the fewest connections reaching ``share`` of the best rate."""
    best = max(lv["bytes_per_s"] for lv in levels)
    for lv in sorted(levels, key=lambda lv: lv["connections"]):
        if lv["bytes_per_s"] >= share * best:
            return int(lv["connections"]), float(best)
    raise AssertionError("unreachable: the best level reaches its own rate")  # pragma: no cover


def road_of(src: Source) -> dict[str, Any]:
    """Which road ``src``'s GETs take, and why: ``{"name", "why"}``, plus ``later_blocks`` where
    libcurl carries only first blocks.

    Read from the Source's own choice (:attr:`Source.route`, and whether libcurl has
    given up on the host, :func:`fastload.transport.curl.broken`), so after the probe it
    names the road the probe's requests took, which is the one training's take.
    """
    from fastload.source import gcs, s3
    from fastload.transport import curl

    protocol = src.url.split("://", 1)[0].lower() if "://" in src.url else "file"
    limit = src.host_limit
    other = _FSSPEC_ROADS.get(protocol, f"fsspec ({protocol})")
    if limit is None:
        return {"name": "fsspec (local files)", "why": "local files take no network road"}
    if src.route is None:
        if protocol in ("s3", "s3a"):
            why = s3.route_for(src.url, src.storage_options, src.settings.http_client)[1]
        elif protocol in ("gs", "gcs"):
            why = gcs.route_for(src.fs, src.storage_options, src.settings.http_client)[1]
        elif protocol in ("http", "https"):
            why = curl.closed_by(src.settings.http_client) or \
                ("a storage option libcurl cannot honour (get_client, an ssl= SSLContext, or client_kwargs beyond "
                 "timeout, headers, auth, trust_env)")
        else:
            why = "libcurl carries HTTP, S3 and GCS only"
        return {"name": other, "why": why}
    if broken := curl.broken(limit):
        return {"name": other, "why": f"libcurl cannot speak to {limit.host} ({broken}); training's GETs move the same way"}
    return {"name": "libcurl", "why": "the Source has a libcurl route for these storage options",
            "later_blocks": other}


def _first(src: Source, item: RemoteItem, nbytes: int) -> bytes:
    """Up to ``nbytes`` from the start of ``item``, as training fetches a cold object's first block."""
    started = src.start_first_many([item], nbytes)
    if started is None:  # a store that cannot start it ahead (local files): training fetches as it goes
        return src.fetch_first(item, nbytes)[1]
    return src.finish_first(item, nbytes, started[0])[1]


def _read(src: Source, unit: Unit) -> bytes:
    item, start, end = unit
    return _first(src, item, end) if start == 0 else src.fetch(item.url, start, end)


class _Level:
    """One concurrency level: ``n`` threads pull work units until the deadline or the byte cap."""

    def __init__(self, src: Source, units: list[Unit], budget: StorageBudget) -> None:
        self.src = src
        self.units = units
        self.budget = budget
        self.lock = threading.Lock()
        self.next = 0
        self.bytes = 0
        self.requests = 0
        self.error: BaseException | None = None
        self.deadline = 0.0

    def _take(self) -> Unit | None:
        with self.lock:
            if self.error is not None or time.perf_counter() >= self.deadline or self.bytes >= self.budget.max_level_bytes:
                return None
            unit = self.units[self.next % len(self.units)]
            self.next += 1
            return unit

    def _worker(self) -> None:
        try:
            while (unit := self._take()) is not None:
                data = _read(self.src, unit)
                with self.lock:
                    self.bytes += len(data)
                    self.requests += 1
        except BaseException as err:  # stored and re-raised by run() in the caller's thread
            with self.lock:
                self.error = err

    def run(self, connections: int) -> dict[str, Any]:
        threads = [threading.Thread(target=self._worker, daemon=True, name=f"fastload-probe-{i}") for i in range(connections)]
        t0 = time.perf_counter()
        self.deadline = t0 + self.budget.level_s
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        if self.error is not None:
            raise self.error
        return {
            "connections": connections,
            "bytes_per_s": self.bytes / elapsed,
            "requests_per_s": self.requests / elapsed,
            "bytes": self.bytes,
            "seconds": round(elapsed, 3),
        }


def _list(src: Source, pattern: str | None, repeats: int) -> tuple[list[RemoteItem], dict[str, Any]]:
    """fastload's own listing of the URL (:meth:`fastload.source.Source.find`), timed.

    Raises:
        EmptyDatasetError: Nothing matches (:func:`fastload.source.matching`'s message).
    """
    from fastload.source import RemoteItem, matching

    times = []
    for _ in range(max(1, repeats)):
        src.fs.invalidate_cache()  # fsspec's listing cache, on the shared filesystem instance
        t0 = time.perf_counter()
        found, folders = src.find(pattern)
        times.append(time.perf_counter() - t0)
    if isinstance(found, RemoteItem):
        return [found], skipped("the URL is a single object; nothing to list")
    secs = median(times)
    listing = ok(items=len(found), matched=0, seconds=round(secs, 4),
                 items_per_s=len(found) / secs if secs > 0 else None, repeats=len(times))
    items = matching(src.url, found, folders, pattern)
    listing["matched"] = len(items)
    return items, listing


def _spread(items: list[Any], n: int) -> list[Any]:
    if len(items) <= n:
        return list(items)
    step = len(items) / n
    return [items[int(i * step)] for i in range(n)]


def _sizes(src: Source, items: list[RemoteItem], budget: StorageBudget) -> tuple[list[tuple[RemoteItem, int]], str]:
    """Each probed object as listed, with its size (from the listing, else a HEAD through the Source).

    The object stays as listed (an HTTP one sizeless), so that its reads take the road a
    cold epoch's do: a sized HTTP object's first block would go to aiohttp, not libcurl.
    """
    if all(i.size >= 0 for i in items):
        return [(i, i.size) for i in items], "listing"
    picked = _spread(items, budget.head_requests)
    done = src.complete_all(picked)  # as the loader sizes a listing (Settings.head_threads HEADs at once)
    return [(i, d.size) for i, d in zip(picked, done)], f"HEAD of {len(picked)} objects"


def _units(objects: list[tuple[RemoteItem, int]], chunk: int) -> list[Unit]:
    units: list[Unit] = []
    for item, size in objects:
        if size <= 0:
            continue
        if size <= chunk:
            units.append((item, 0, size))
        else:
            units.extend((item, start, min(size, start + chunk)) for start in range(0, min(size, 64 * chunk), chunk))
    return units


def _ttfb(src: Source, units: list[Unit], n: int) -> dict[str, Any]:
    _first(src, units[0][0], 1)  # warm-up: DNS, TCP and TLS setup are not per-request costs
    lat = []
    for i in range(n):
        t0 = time.perf_counter()
        _first(src, units[i % len(units)][0], 1)
        lat.append(time.perf_counter() - t0)
    return {"n": n, "median_ms": median(lat) * 1e3, "p90_ms": percentile(lat, 90) * 1e3, "min_ms": min(lat) * 1e3}


def _sweep(src: Source, units: list[Unit], budget: StorageBudget) -> list[dict[str, Any]]:
    levels: list[dict[str, Any]] = []
    conn, best, flat = 1, 0.0, 0
    base = src.settings
    try:
        while conn <= budget.max_connections:
            # The Source's every request holds a slot of its host's limit, whose cap is the Source's
            # max_requests (set on the limit at each request): a level of n threads runs at --max-requests n.
            src.settings = base.replace(max_requests=conn)
            lv = _Level(src, units, budget).run(conn)
            levels.append(lv)
            if lv["bytes_per_s"] >= 1.1 * best:
                flat = 0
            else:
                flat += 1
                if flat >= 2:
                    break  # two doublings without a 10% gain: saturated
            best = max(best, lv["bytes_per_s"])
            conn *= 2
    finally:
        src.settings = base
    return levels


def _settled(src: Source, units: list[Unit], budget: StorageBudget) -> dict[str, Any] | None:
    """Where fastload's own request limit settles for this host (fastload.transport.hostlimit).

    The probe units are fetched through the Source for about ``level_s``, as training
    would fetch them, many in flight from one thread: the controller grows while
    throughput rises and cuts on the server's busy signals. None for local files (no limit).
    """
    limit = src.host_limit
    if limit is None:
        return None
    batch = units * max(1, -(-limit.cap // len(units)))  # enough to fill the cap
    firsts = [item for item, start, _ in batch if start == 0]
    later: list[tuple[str, int, int | None]] = [(item.url, start, end) for item, start, end in batch if start > 0]
    chunk = max(end for _, _, end in batch)
    deadline, moved = time.perf_counter() + budget.level_s, 0
    while time.perf_counter() < deadline and moved < budget.max_level_bytes:
        started = src.start_first_many(firsts, chunk) if firsts else None
        later_got = src.fetch_many(later) if later else []
        moved += sum(len(r) for r in later_got if isinstance(r, bytes))
        if started is not None:
            moved += sum(len(src.finish_first(item, chunk, f)[1]) for item, f in zip(firsts, started))
        elif firsts:
            moved += sum(len(data) for _, data in src.fetch_first_many(firsts, chunk))
    return limit.as_dict()


def probe_storage(url: str | None, storage_options: dict[str, Any] | None = None, *, pattern: str | None = None,
                  budget: StorageBudget | None = None, settings: Settings | None = None) -> dict[str, Any]:
    """The storage section for ``url``; skipped (with the reason) when no URL is given.

    ``settings`` are the loader's (``Settings.from_env()`` when None): its ``http_client``,
    ``max_requests``, timeouts and retries shape the requests as they shape training's.
    """
    if not url:
        return skipped("no URL given; `fastload diagnose URL` measures the storage behind URL")
    budget = budget or StorageBudget()
    from fastload.errors import EmptyDatasetError
    from fastload.source import Source

    # A measurement answers in seconds: a dead store is reported after RETRY_BUDGET_S of retries,
    # not after training's budget of minutes (which rides out an outage mid-epoch).
    settings = settings or Settings.from_env()
    settings = settings.replace(retry_budget_s=min(settings.retry_budget_s, RETRY_BUDGET_S))
    src = Source(url, storage_options, settings)
    try:
        items, listing = _list(src, pattern, budget.list_repeats)
    except EmptyDatasetError as err:
        return skipped(str(err), road=road_of(src))
    sized, sizes_from = _sizes(src, items, budget)
    if not sized:
        return skipped(f"the store reports no object sizes under {url}", listing=listing, road=road_of(src))
    avg = sum(s for _, s in sized) / len(sized)
    exact = sizes_from == "listing"
    dataset_bytes = sum(s for _, s in sized) if exact else avg * len(items)
    probe = _spread(sized, budget.objects)
    units = _units(probe, budget.chunk_bytes)
    if not units:
        return skipped(f"every object under {url} is empty", listing=listing, road=road_of(src))
    ttfb = _ttfb(src, units, budget.ttfb_requests)
    levels = _sweep(src, units, budget)
    settled = _settled(src, units, budget)
    conns, best = saturating(levels)
    one = next(lv for lv in levels if lv["connections"] == 1)
    protocol = src.fs.protocol
    return ok(
        url=url,
        protocol=protocol if isinstance(protocol, str) else protocol[0],
        road=road_of(src),  # after the requests: libcurl may have given up on the host meanwhile
        listing=listing,
        objects=len(items),
        avg_object_bytes=avg,
        dataset_bytes=dataset_bytes,
        dataset_bytes_exact=exact,
        sizes_from=sizes_from,
        probe_objects=len({u[0].url for u in units}),
        chunk_bytes=budget.chunk_bytes,
        ttfb_ms=ttfb,
        levels=levels,
        one_connection_bps=one["bytes_per_s"],
        best_bps=best,
        saturating_connections=conns,
        settled_concurrency=settled,
        samples_per_s_at_best=best / avg,
        _source=src,  # for the compute probes' samples, read through the same road; not reported
        _items=[(i, s) for i, s in probe if s > 0],
    )
