"""HTTP answers read the same way whichever client received them (aiohttp or libcurl).

One parser per kind of answer: :func:`first_info` reads a first-block GET
(size, version and body in one request), :func:`page_links` a folder's index page.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin

from fastload.transport.failures import TruncatedBodyError

INDEX_TITLE = re.compile(r"<title>\s*(?:Directory listing for|Index of)\b", re.IGNORECASE)
# A link that urljoin would append to the page's URL unchanged: no scheme, no leading
# "/", no "." or ".." segment (test_page_links.py checks it against urljoin).
PLAIN_LINK = re.compile(r"(?![./])(?!.*/\.)[^:]*\Z", re.DOTALL)
VERSION_FIELDS = ("ETag", "Content-MD5", "Digest", "Last-Modified")  # an answer's version: what fsspec's HEAD keeps
HREF = re.compile(r"""<a\s[^>]*?href\s*=\s*["']([^"'#]+)["']""", re.IGNORECASE)


@dataclass(frozen=True)
class Page:
    """One HTTP answer while listing: where it ended (after redirects), its size, and its text if HTML."""

    final: str
    size: int | None
    text: str | None



def page_links(page_url: str, text: str) -> tuple[set[str], set[str]]:
    """The files and folders (ending in "/") that a folder page links to below itself."""
    base = page_url if page_url.endswith("/") else page_url + "/"
    files: set[str] = set()
    folders: set[str] = set()
    for link in HREF.findall(text):
        if "?" in link:  # sort-order links of autoindex pages
            continue
        # A plain relative name ("00017.jpg", "cls/") joins by concatenation: urljoin cost
        # ~25 us a link, 7 ms per page of 300 files, in a listing made before the first byte.
        url = base + link if PLAIN_LINK.match(link) else urljoin(base, link)
        if url.startswith(base) and url != base:
            (folders if url.endswith("/") else files).add(url)
    return files, folders



def first_info(url: str, nbytes: int, status: int, headers: Mapping[str, str], body: bytes) -> tuple[dict[str, Any], bytes]:
    """HEAD-like info of the answer to a first-block GET, and its body (at most ``nbytes``).

    The size comes from the Content-Range of a 206, else the Content-Length of a
    server that ignored the range, else the body; the version from the same
    headers a HEAD reports. Shared by aiohttp's GET (fastload.source.aio) and libcurl's (fastload.transport.curl);
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
    info: dict[str, Any] = {"name": url, "size": size, "ignores_ranges": ignored, "honours_ranges": status == 206}
    for field in VERSION_FIELDS:
        if headers.get(field):
            info[field] = headers[field]
    if headers.get("x-goog-generation"):  # GCS: the version its listing gives (fastload.source.gcs)
        info["generation"] = headers["x-goog-generation"]
    return info, body
