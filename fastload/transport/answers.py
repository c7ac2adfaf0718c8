"""HTTP answers read the same way whichever client received them (aiohttp or libcurl).

One parser per kind of answer: :func:`first_info` reads a first-block GET
(size, version and body in one request), :func:`page_links` a folder's index page.

Words: an index page's **exact** size is a byte count as the server printed it
(nginx's ``autoindex_exact_size on``, Apache's sizes under 973 B, nginx's under
10,000 B with exact sizes off); an **approximate** one has a unit (``4.0K``,
``12M``) and is never read.
"""

from __future__ import annotations

import html
import re
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import repeat
from typing import Any
from urllib.parse import urljoin

from fastload.transport.failures import TruncatedBodyError

INDEX_TITLE = re.compile(r"<title>\s*(?:Directory listing for|Index of)\b", re.IGNORECASE)
# A link that urljoin would append to the page's URL unchanged: no scheme, no leading
# "/", no "." or ".." segment (test_page_links.py checks it against urljoin).
PLAIN_LINK = re.compile(r"(?![./])(?!.*/\.)[^:]*\Z", re.DOTALL)
VERSION_FIELDS = ("ETag", "Content-MD5", "Digest", "Last-Modified")  # an answer's version: what fsspec's HEAD keeps
HREF = re.compile(r"""<a\s[^>]*?href\s*=\s*["']([^"'#]+)["']""", re.IGNORECASE)
# An autoindex row: the link, its text, the date (nginx's and Apache's old "12-Jan-2024 10:00",
# Apache's "2024-01-12 10:00"; cells of Apache's HTMLTable between), then the size: exact in plain
# digits only. A unit after the digits ("4.0K", "12M") or "-" (a folder) fails the lookahead, so
# the row reads as its link alone. One pass per page, as HREF; test_page_links.py reads real rows.
# Each run of padding is crossed once: an optional cell that began with its own "\s*" made the
# engine cross nginx's ~70 spaces a row again (1.1 ms a 1000-row page, now 0.8; HREF alone 0.2).
SIZED_ROW = re.compile(
    HREF.pattern + r"""(?:[^>]*>[^<]*</a>(?:</td>\s*<td[^>]*>)?\s*"""
    r"""(?:\d\d-[a-z]{3}-\d{4}|\d{4}-\d\d-\d\d) \d\d:\d\d"""
    r"""\s*(?:</td>\s*<td[^>]*>\s*)?(\d+)(?=[\s<]))?""",
    re.IGNORECASE,
)
# Whose rows are read for sizes: nginx's autoindex (its "<h1>Index of ...</h1><hr><pre>") and
# Apache's mod_autoindex (a column headed "Size": a SuppressSize page has a description there,
# which may start with digits). Other pages (Python's http.server) give links only.
NGINX_INDEX = re.compile(r"<h1>Index of [^<]*</h1><hr><pre>")
# nginx's own row, as ngx_http_autoindex_module writes it: `<a href="NAME">TEXT</a>`, padding, the
# date, padding, the size (a unit or "-" fails the lookahead, as in SIZED_ROW). Its exact shape
# reads a 1,000-row page in 0.8 ms where SIZED_ROW, for every server's, takes 1.1-1.5 (same
# page, same run); the same rows (test_page_links.py, test_http_listing_sizes.py on a real nginx).
NGINX_ROW = re.compile(r'<a href="([^"]*)">[^<]*</a>(?: +\d\d-[A-Za-z]{3}-\d{4} \d\d:\d\d +(\d+)(?=\s))?')
SIZE_COLUMN = re.compile(r">\s*Size\s*</(?:a|th)>", re.IGNORECASE)
HEAD_CHARS = 4096  # where a page's title and column headings are


@dataclass(frozen=True)
class Page:
    """One HTTP answer while listing: where it ended (after redirects), its size, and its text if HTML."""

    final: str
    size: int | None
    text: str | None



def page_links(page_url: str, text: str) -> tuple[dict[str, int], set[str]]:
    """The files (URL -> exact size in bytes, -1 where the page shows none) and the folders
    (ending in "/") that a folder page links to below itself.

    Sizes come only from an autoindex page of nginx or Apache (:data:`SIZED_ROW`), and only
    exact ones: an approximate "4.0K" is dropped, never rounded into a byte count.

    >>> page_links("http://h/d/", '<h1>Index of /d/</h1><hr><pre><a href="a.jpg">a.jpg</a>  03-Dec-2026 02:58  3000\\n')
    ({'http://h/d/a.jpg': 3000}, set())
    """
    base = page_url if page_url.endswith("/") else page_url + "/"
    files: dict[str, int] = {}
    folders: set[str] = set()
    head = text[:HEAD_CHARS]
    if NGINX_INDEX.search(head):
        rows = NGINX_ROW.findall(text)
    elif INDEX_TITLE.search(head) and SIZE_COLUMN.search(head):
        rows = SIZED_ROW.findall(text)
    else:
        rows = list(zip(HREF.findall(text), repeat("")))
    if all_plain(rows):
        # Every link a plain relative name but the parent's "../" (nginx's and http.server's
        # pages): no test per link. A 1,000-row nginx page took 2.8 ms here, 1.3 of it in these
        # tests and joins (one page of the 1,000,000-object tree, timeit). Sized after sizeless,
        # as below: Apache's IconsAreLinks gives a file a link without its size first.
        files = {base + link: -1 for link, size in rows if not size and link[-1] != "/"}
        files.update({base + link: int(size) for link, size in rows if size and link[-1] != "/"})
        return files, {base + link for link, _ in rows if link[-1] == "/" and link != "../"}
    for link, size in rows:
        if "?" in link:  # sort-order links of autoindex pages
            continue
        if "&" in link:  # Apache writes "&" in a name as "&amp;"; nginx and http.server as %26
            link = html.unescape(link)
        # A plain relative name ("00017.jpg", "cls/") joins by concatenation, below the page:
        # urljoin cost ~25 us a link, 7 ms per page of 300 files, in a listing made before the first byte.
        if PLAIN_LINK.match(link):
            url = base + link
        else:
            url = urljoin(base, link)
            if not url.startswith(base) or url == base:
                continue
        if url[-1] == "/":
            folders.add(url)
        elif size:
            files[url] = int(size)
        else:  # Apache's IconsAreLinks links a file twice, its icon first and without the row
            files.setdefault(url, -1)
    return files, folders


def all_plain(rows: list[tuple[str, str]]) -> bool:
    """Whether every link of ``rows`` but a parent's "../" is one :data:`PLAIN_LINK` takes, with
    neither "?" nor "&" to read: one scan of them all joined, not a match per link. A newline
    inside a link, or two "../" in a row, only make it say False (each link is then read alone)."""
    joined = ("\n" + "\n".join(link for link, _ in rows) + "\n").replace("\n../\n", "\n")
    return not any(c in joined for c in (":", "?", "&", "/.", "\n.", "\n/"))


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
