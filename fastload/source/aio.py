"""HTTP requests on fsspec's aiohttp session, as coroutines on fsspec's event loop.

Every coroutine request holds a slot of its host's limit (:func:`held`). Ranged GETs of any
store whose answers show their version (HTTP here; S3 and GCS through s3fs and gcsfs,
fastload.source.versioned) go through :func:`get_range`, which names the version expected.

Nothing imports aiohttp ahead of its use: listing pages and GETs go on libcurl
(fastload.transport.curl), and fsspec's HTTP filesystem opens only where a request
goes to aiohttp (Source.fs).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastload.errors import StoppedError
from fastload.source import versioned
from fastload.transport.answers import Page, first_info
from fastload.transport.hostlimit import HostLimit

T = TypeVar("T")

async def http_page(fs: Any, url: str, timeout_s: float) -> Page:
    """GET ``url`` on fsspec's session; the body is read only when it is HTML (a folder page)."""
    import aiohttp

    session = await fs.set_session()
    async with session.get(fs.encode_url(url), timeout=aiohttp.ClientTimeout(total=timeout_s), **fs.kwargs) as r:
        fs._raise_not_found_for_status(r, url)
        final = str(r.url)
        size = int(r.headers["Content-Length"]) if r.headers.get("Content-Length", "").isdigit() else None
        mimetype = r.headers.get("Content-Type", "").partition(";")[0].strip().lower()
        if mimetype == "text/html" or (not mimetype and final.endswith("/")):
            return Page(final, size, await r.text(errors="ignore"))
        r.close()  # a data file: its body is not the listing's business
        return Page(final, size, None)


async def held_page(fs: Any, url: str, timeout_s: float, limit: HostLimit | None) -> Page:
    """:func:`http_page` in a slot of the host's limit (:func:`held`)."""
    return await held(limit, lambda: http_page(fs, url, timeout_s))


def identity_get(fs: Any, headers: dict[str, str] | None = None) -> tuple[dict[str, str], dict[str, Any]]:
    """The headers and other arguments of a GET on fsspec's HTTP session: the filesystem's
    own, plus ``headers``, asking for identity encoding as fsspec's HEAD does (a
    compressed body's length is not the object's size)."""
    kwargs = dict(fs.kwargs)
    return {**(kwargs.pop("headers", None) or {}), **(headers or {}), "Accept-Encoding": "identity"}, kwargs


async def http_get_first(fs: Any, url: str, nbytes: int, timeout_s: float) -> tuple[dict[str, Any], bytes]:
    """One ranged GET on fsspec's own aiohttp session: (HEAD-like info, first ``nbytes`` bytes)."""
    import aiohttp

    session = await fs.set_session()
    headers, kwargs = identity_get(fs, {"Range": f"bytes=0-{max(nbytes, 1) - 1}"})
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



def if_match(version: str) -> str | None:
    """The ``If-Match`` value naming an HTTP object's ``version``, or None where the version may be no ETag.

    A version is the first of an answer's generation, ETag, Content-MD5, Digest and Last-Modified
    (fastload.source.items.version_of), stored without its quotes; only an ETag may be named, as any
    other value would be refused with a 412 by a server that checks. So: none with a space (a date),
    all digits (a generation), an "=" (a digest, a Content-MD5) or a weak ``W/`` (never matches).

    >>> if_match("65a1b2c3-400000"), if_match("Tue, 14 Nov 2023 22:13:20 GMT"), if_match("1700000000000001")
    ('"65a1b2c3-400000"', None, None)
    """
    if not version or version.isdigit() or version.startswith("W/") or any(c in version for c in ' \t",='):
        return None
    return f'"{version}"'


async def http_get_range(fs: Any, url: str, start: int, end: int | None, timeout_s: float,
                         version: str = "") -> tuple[dict[str, Any], bytes]:
    """A GET of ``url[start:end]`` (``end`` None: to the end) on fsspec's session: (HEAD-like
    info of the answer, body). Its size and version (:func:`first_info`) let the caller check
    that the bytes come from the version it listed, which fsspec's ``_cat_file`` does not show.
    An expected ``version`` that is an ETag is named (:func:`if_match`): a server that checks
    answers 412, returned as fastload.source.versioned.refused's info."""
    import aiohttp

    session = await fs.set_session()
    ranged = {} if start == 0 and end is None else {"Range": f"bytes={start}-{'' if end is None else end - 1}"}
    expected = if_match(version)
    headers, kwargs = identity_get(fs, {**ranged, **({"If-Match": expected} if expected else {})})
    async with session.get(fs.encode_url(url), headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s), **kwargs) as r:
        if r.status == 412 and expected:
            return versioned.refused(url, "HTTP 412 to If-Match")
        fs._raise_not_found_for_status(r, url)
        body = await r.read()
        return first_info(url, len(body), r.status, r.headers, body)


class HttpStream:
    """An answer to a GET on fsspec's aiohttp session, read a piece at a time (Source.fetch_whole)."""

    def __init__(self, response: Any) -> None:
        self.response = response
        self.status: int = response.status
        self.headers = response.headers
        length = response.headers.get("Content-Length", "")
        self.length = int(length) if length.isdigit() else None

    @classmethod
    async def open(cls, fs: Any, url: str, timeout_s: float, span: tuple[int, int] | None = None) -> HttpStream:
        """GET ``url``, or only ``span`` (start, end) of it if the server honours Range (a 206)."""
        import aiohttp

        session = await fs.set_session()
        headers, kwargs = identity_get(fs, None if span is None else {"Range": f"bytes={span[0]}-{span[1] - 1}"})
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


async def held(limit: HostLimit | None, request: Callable[[], Awaitable[T]]) -> T:
    """``await request()`` in a slot of ``limit``: every coroutine request passes here."""
    if limit is None:
        return await request()
    async with limit.aslot() as outcome:
        result = await request()
        body = result[1] if isinstance(result, tuple) else result
        outcome.nbytes = len(body) if isinstance(body, (bytes, bytearray)) else 0
        return result


async def get_range(fs: Any, road: str, path: str, start: int, end: int | None, version: str,
                    timeout_s: float) -> tuple[dict[str, Any], bytes]:
    """``path[start:end]`` on ``road`` ("http", "s3", "gcs"), naming the expected ``version`` where the
    store can check it: (info of the answer, with its size and version; body)."""
    if road == "http":
        return await http_get_range(fs, path, start, end, timeout_s, version)
    get = versioned.s3_get_range if road == "s3" else versioned.gcs_get_range
    return await asyncio.wait_for(get(fs, path, start, end, version), timeout_s)


async def gather_ranges(fs: Any, ranges: list[tuple[str, int, int | None]], timeout_s: float,
                         limit_of: Callable[[str], HostLimit | None], stop: threading.Event | None = None,
                         road: str = "", versions: list[str] | None = None) -> list[Any]:
    """Each ``(path, start, end)`` read together, a failure in its place. On a ``road`` whose answers
    show their version ("http", "s3", "gcs": :func:`get_range`), each is an (info, body) for the
    caller to check against the expected one (``versions``, one per range), which each GET names."""
    async def one(k: int, path: str, start: int, end: int | None) -> Any:
        # Bounded like Source.fetch's requests (asyncio's own timeout for stores that take no
        # kwarg); the timeout starts once the request holds its slot.
        limit = limit_of(fs.unstrip_protocol(path))

        def request() -> Awaitable[Any]:
            if stop is not None and stop.is_set():  # stopped while it waited for its slot: no request
                raise StoppedError(f"{fs.unstrip_protocol(path)}: stopped before its request")
            if road:
                return get_range(fs, road, path, start, end, versions[k] if versions else "", timeout_s)
            if start == 0 and end is None:
                return asyncio.wait_for(fs._cat_file(path), timeout_s)
            return asyncio.wait_for(fs._cat_file(path, start=start, end=end), timeout_s)

        return await held(limit, request)

    return await asyncio.gather(*(one(k, *r) for k, r in enumerate(ranges)), return_exceptions=True)


async def gather_first(fs: Any, urls: list[str], nbytes: int, timeout_s: float,
                        limit_of: Callable[[str], HostLimit | None]) -> list[Any]:
    async def one(url: str) -> tuple[dict[str, Any], bytes]:
        return await held(limit_of(url), lambda: http_get_first(fs, url, nbytes, timeout_s))

    return await asyncio.gather(*(one(u) for u in urls), return_exceptions=True)

