"""An object's later blocks on libcurl's engine: concurrent ranged GETs, each naming the version it expects.

Why: a large object's first block came through the engine (fastload.transport.curl) and every
later block through fsspec's aiohttp session or s3fs, read in Python on fsspec's event loop:
staging a 2 GB file from nginx on loopback ran at 0.10 of ``curl``'s speed (0.21 with every
GET on aiohttp; benchmarks/large/results). Here a batch's blocks are GETs of the engine
(:meth:`CurlRoute.start_ranges`), each with its own Range, each body written by the C thread
into the bytes object the fetch layer stores (no copy in Python).

Versions: each GET names the version the object was listed with where the store checks one
(HTTP and S3: ``If-Match: "<ETag>"``; GCS: ``ifGenerationMatch``), and each answer's size and
version are compared with the listed ones (:func:`fastload.source.fallback.checked`): a 412, or
an answer of another size or version, is a RemoteChangedError for that block (issue 32), as on
the fsspec road. Any other failure (an error status, a reset, a server that ignored Range) is
left to the fsspec road for that block alone, whose retries and messages users see.

Words: a **span** is ``(url, start, end)``, ``end`` exclusive, of a listed (sized) object.
"""

from __future__ import annotations

import builtins
import threading
from collections.abc import Sequence
from typing import Any, Protocol

from fastload.config import Settings
from fastload.errors import RemoteChangedError
from fastload.source import aio, s3, versioned
from fastload.source.fallback import checked
from fastload.source.items import RemoteItem
from fastload.transport import curl
from fastload.transport.curl import CurlRoute, Pending
from fastload.transport.hostlimit import HostLimit

Result = bytes | RemoteChangedError | None  # None: for the fsspec road


class _Source(Protocol):
    """What this module uses of its Source (fastload.source.core)."""

    settings: Settings
    stop: threading.Event
    _store: str

    @property
    def route(self) -> CurlRoute | None: ...
    def limit_of(self, url: str) -> HostLimit | None: ...
    def _curl_takes(self, limit: HostLimit) -> bool: ...
    def _settle(self, pending: Sequence[Any], timeout_s: float) -> None: ...


def condition(store: str, version: str) -> tuple[str, str]:
    """The query and header line of a GET that names ``version`` (the listed one; "" when unknown): GCS's
    ``ifGenerationMatch``, else If-Match where the version is an ETag (:func:`fastload.source.aio.if_match`).

    >>> condition("gcs", "1700000000000001"), condition("", "65a1b2c3-400000"), condition("s3", "")
    (('&ifGenerationMatch=1700000000000001', ''), ('', 'If-Match: "65a1b2c3-400000"'), ('', ''))
    """
    if store == "gcs":
        return (f"&ifGenerationMatch={version}", "") if version.isdigit() else ("", "")
    tag = aio.if_match(version)
    return ("", f"If-Match: {tag}") if tag else ("", "")


def fetch(src: _Source, ranges: Sequence[tuple[str, int, int | None]],
          listed: Sequence[RemoteItem] | None) -> builtins.list[Result]:
    """Each range of a listed object through the engine, where ``src`` has a route to its host: its bytes,
    a RemoteChangedError, or None (not taken, or failed: for the fsspec road).

    Raises:
        StoppedError: ``src.stop`` was set while they ran (they are cancelled).
    """
    out: builtins.list[Result] = [None] * len(ranges)
    route = src.route if listed is not None else None
    if route is None or listed is None:
        return out
    groups: dict[tuple[int, int], tuple[CurlRoute, HostLimit, builtins.list[int]]] = {}
    for k, ((url, start, end), item) in enumerate(zip(ranges, listed)):
        if item.size <= 0 or _end(end, item) <= start:
            continue  # an empty object has no byte to ask for (a 416): the fsspec road's
        limit = src.limit_of(url)
        road = route.of(url.split("://", 1)[1].partition("/")[0]) if isinstance(route, s3.S3Route) else route
        if limit is None or road is None or not src._curl_takes(limit):
            continue  # a bucket whose GETs take s3fs, a host libcurl cannot speak to
        groups.setdefault((id(road), id(limit)), (road, limit, []))[2].append(k)
    pending: dict[int, Pending] = {}
    for road, limit, ks in groups.values():
        spans = [(ranges[k][0], ranges[k][1], _end(ranges[k][2], listed[k])) for k in ks]
        conditions = [condition(src._store, listed[k].version) for k in ks]
        for k, p in zip(ks, road.start_ranges(spans, src.settings.request_timeout_s, limit, src.stop, conditions)):
            pending[k] = p
    if not pending:
        return out
    src._settle(list(pending.values()), src.settings.first_wait_s)
    for k, p in pending.items():
        out[k] = _take(p, listed[k], ranges[k][1], _end(ranges[k][2], listed[k]), src._store)
    return out


def _end(end: int | None, item: RemoteItem) -> int:
    return item.size if end is None else end


def _take(p: Pending, item: RemoteItem, start: int, end: int, store: str) -> Result:
    """One answer's bytes, the RemoteChangedError it stands for, or None (for the fsspec road)."""
    if not p.done():
        p.cancel()  # timed out: the fsspec road tries it again, with its retries
        return None
    try:
        info, body = p.result(0)
    except curl.HttpStatusError as err:
        if err.status != 412 or not any(condition(store, item.version)):
            return None
        info, body = versioned.refused(item.url, "HTTP 412 to " + ("ifGenerationMatch" if store == "gcs" else "If-Match"))
    except Exception:  # noqa: BLE001 - a reset, a cut body, a 404: the fsspec road's, with its retries and messages
        return None
    if not info.get(versioned.CHANGED) and not info.get("honours_ranges") and not (start == 0 and end == item.size):
        return None  # the server ignored Range: these bytes are the object's first, not the span's
    try:
        return checked(item, info, body)
    except RemoteChangedError as err:
        return err
