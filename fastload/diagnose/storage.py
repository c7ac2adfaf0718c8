"""Remote storage probes: list speed, time to first byte, throughput against concurrency.

Everything goes through fsspec, as fastload itself reads (any protocol, any
``storage_options``). The probe reads real objects of the dataset:

* **Listing.** fastload's own listing of the URL (``Source.find``: fsspec's
  ``find``, or fastload's level-at-a-time HTTP listing), timed, with fsspec's
  listing cache invalidated first. Nothing matching is the datasets' error
  (``EmptyDatasetError``'s message), as a skipped section.
* **Sizes.** From the listing; stores whose listings carry no size (plain HTTP)
  get a HEAD for a spread sample of objects. The average is the sample size the
  verdict uses.
* **TTFB.** One-byte ranged GETs, one at a time, after a warm-up request that
  opens the connection.
* **Throughput.** For 1, 2, 4, ... concurrent requests, threads pull whole
  objects (ranges of ``chunk_bytes`` for large ones) for a fixed time; the sweep
  stops once two more doublings add under 10%. The *saturating* concurrency is
  the smallest that reaches 90% of the best rate.

Bytes are bounded per level (``max_level_bytes``), so a thorough run on a fast
store does not download gigabytes. Requests finish once started, so a level can
overrun its time budget by one request per connection.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastload.config import Settings
from fastload.diagnose._util import median, ok, percentile, skipped

if TYPE_CHECKING:
    from fastload.source import Source

__all__ = ["StorageBudget", "probe_storage", "saturating"]


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


class _Level:
    """One concurrency level: ``n`` threads pull work units until the deadline or the byte cap."""

    def __init__(self, fs: Any, units: list[tuple[str, int, int]], budget: StorageBudget) -> None:
        self.fs = fs
        self.units = units
        self.budget = budget
        self.lock = threading.Lock()
        self.next = 0
        self.bytes = 0
        self.requests = 0
        self.error: BaseException | None = None
        self.deadline = 0.0

    def _take(self) -> tuple[str, int, int] | None:
        with self.lock:
            if self.error is not None or time.perf_counter() >= self.deadline or self.bytes >= self.budget.max_level_bytes:
                return None
            unit = self.units[self.next % len(self.units)]
            self.next += 1
            return unit

    def _worker(self) -> None:
        try:
            while (unit := self._take()) is not None:
                path, start, end = unit
                data = self.fs.cat_file(path, start=start, end=end)
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


def _open(url: str, storage_options: dict[str, Any]) -> tuple[Any, str]:
    from fsspec.core import url_to_fs

    # A private instance: a shared one may hold listings cached by earlier calls.
    return url_to_fs(url, skip_instance_cache=True, **storage_options)  # type: ignore[no-any-return]


def _list(src: Source, fs: Any, pattern: str | None, repeats: int) -> tuple[list[tuple[str, int | None]], dict[str, Any]]:
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
        return [(fs._strip_protocol(found.url), found.size)], skipped("the URL is a single object; nothing to list")
    secs = median(times)
    listing = ok(items=len(found), matched=0, seconds=round(secs, 4),
                 items_per_s=len(found) / secs if secs > 0 else None, repeats=len(times))
    items = matching(src.url, found, folders, pattern)
    listing["matched"] = len(items)
    return [(fs._strip_protocol(i.url), None if i.size < 0 else i.size) for i in items], listing


def _spread(items: list[Any], n: int) -> list[Any]:
    if len(items) <= n:
        return list(items)
    step = len(items) / n
    return [items[int(i * step)] for i in range(n)]


def _sizes(fs: Any, objects: list[tuple[str, int | None]], budget: StorageBudget) -> tuple[list[tuple[str, int]], str]:
    if all(size is not None for _, size in objects):
        return [(p, int(s)) for p, s in objects if s is not None], "listing"
    picked = _spread(objects, budget.head_requests)
    with ThreadPoolExecutor(min(Settings.head_threads, len(picked))) as pool:  # as the loader completes a listing
        infos = list(pool.map(lambda o: fs.info(o[0]), picked))
    sized = [(p, int(i["size"])) for (p, _), i in zip(picked, infos) if i.get("size") is not None]
    return sized, f"HEAD of {len(picked)} objects"


def _units(objects: list[tuple[str, int]], chunk: int) -> list[tuple[str, int, int]]:
    units = []
    for path, size in objects:
        if size <= 0:
            continue
        if size <= chunk:
            units.append((path, 0, size))
        else:
            units.extend((path, start, min(size, start + chunk)) for start in range(0, min(size, 64 * chunk), chunk))
    return units


def _ttfb(fs: Any, units: list[tuple[str, int, int]], n: int) -> dict[str, Any]:
    path = units[0][0]
    fs.cat_file(path, start=0, end=1)  # warm-up: DNS, TCP and TLS setup are not per-request costs
    lat = []
    for i in range(n):
        path = units[i % len(units)][0]
        t0 = time.perf_counter()
        fs.cat_file(path, start=0, end=1)
        lat.append(time.perf_counter() - t0)
    return {"n": n, "median_ms": median(lat) * 1e3, "p90_ms": percentile(lat, 90) * 1e3, "min_ms": min(lat) * 1e3}


def _sweep(fs: Any, units: list[tuple[str, int, int]], budget: StorageBudget) -> list[dict[str, Any]]:
    levels: list[dict[str, Any]] = []
    conn, best, flat = 1, 0.0, 0
    while conn <= budget.max_connections:
        lv = _Level(fs, units, budget).run(conn)
        levels.append(lv)
        if lv["bytes_per_s"] >= 1.1 * best:
            flat = 0
        else:
            flat += 1
            if flat >= 2:
                break  # two doublings without a 10% gain: saturated
        best = max(best, lv["bytes_per_s"])
        conn *= 2
    return levels


def _settled(src: Source, fs: Any, units: list[tuple[str, int, int]], budget: StorageBudget) -> dict[str, Any] | None:
    """Where fastload's own request limit settles for this host (fastload.transport.hostlimit).

    The probe units are fetched through a :class:`fastload.source.Source` for about
    ``level_s``, as training would fetch them: the controller grows while throughput
    rises and cuts on the server's busy signals. None for local files (no limit).
    """
    limit = src.host_limit
    if limit is None:
        return None
    ranges: list[tuple[str, int, int | None]] = [(fs.unstrip_protocol(p), a, b) for p, a, b in units]
    batch = ranges * max(1, -(-limit.cap // len(ranges)))  # enough to fill the cap
    deadline, moved = time.perf_counter() + budget.level_s, 0
    while time.perf_counter() < deadline and moved < budget.max_level_bytes:
        moved += sum(len(r) for r in src.fetch_many(batch) if isinstance(r, bytes))
    return limit.as_dict()


def probe_storage(url: str | None, storage_options: dict[str, Any] | None = None, *, pattern: str | None = None,
                  budget: StorageBudget | None = None) -> dict[str, Any]:
    """The storage section for ``url``; skipped (with the reason) when no URL is given."""
    if not url:
        return skipped("no URL given; `fastload diagnose URL` measures the storage behind URL")
    budget = budget or StorageBudget()
    from fastload.errors import EmptyDatasetError
    from fastload.source import Source

    fs, _ = _open(url, dict(storage_options or {}))
    src = Source(url, storage_options)
    try:
        objects, listing = _list(src, fs, pattern, budget.list_repeats)
    except EmptyDatasetError as err:
        return skipped(str(err))
    sized, sizes_from = _sizes(fs, objects, budget)
    if not sized:
        return skipped(f"the store reports no object sizes under {url}", listing=listing)
    avg = sum(s for _, s in sized) / len(sized)
    exact = sizes_from == "listing"
    dataset_bytes = sum(s for _, s in sized) if exact else avg * len(objects)
    probe = _spread(sized, budget.objects)
    units = _units(probe, budget.chunk_bytes)
    if not units:
        return skipped(f"every object under {url} is empty", listing=listing)
    ttfb = _ttfb(fs, units, budget.ttfb_requests)
    levels = _sweep(fs, units, budget)
    settled = _settled(src, fs, units, budget)
    conns, best = saturating(levels)
    one = next(lv for lv in levels if lv["connections"] == 1)
    return ok(
        url=url,
        protocol=getattr(fs, "protocol", None) if isinstance(getattr(fs, "protocol", None), str) else list(fs.protocol)[0],
        listing=listing,
        objects=len(objects),
        avg_object_bytes=avg,
        dataset_bytes=dataset_bytes,
        dataset_bytes_exact=exact,
        sizes_from=sizes_from,
        probe_objects=len({u[0] for u in units}),
        chunk_bytes=budget.chunk_bytes,
        ttfb_ms=ttfb,
        levels=levels,
        one_connection_bps=one["bytes_per_s"],
        best_bps=best,
        saturating_connections=conns,
        settled_concurrency=settled,
        samples_per_s_at_best=best / avg,
        _paths=[(p, s) for p, s in probe if s > 0],  # for the compute probes; not reported
    )
