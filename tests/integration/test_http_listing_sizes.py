"""The sizes an nginx index page shows: read exactly, planned with, and never a HEAD (real nginx).

nginx's autoindex prints each file's exact size (``autoindex_exact_size on``, its default);
planning by bytes (a node's part, a dry run, the cache limit) used to cost a HEAD per
file per rank: 2 nodes x 2 ranks over 10,000 files sent 40,000. Requests are counted in
nginx's access log. Apache's pages are in tests/unit/test_page_links.py (no Apache here).
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from fastload._servers import NginxServer
from fastload.config import Settings
from fastload.source import Source
from fastload.transport.answers import page_links

pytestmark = pytest.mark.integration

ODD = "a b&c \u00e9.jpg"  # nginx writes its href as a%20b%26c%20%C3%A9.jpg
LONG = "n" * 60 + ".jpg"  # nginx cuts the link's text to 50 characters ("..>"), not its href
SIZES = {ODD: 17, LONG: 2, "q<'x>.txt": 1, "empty.bin": 0, "big.bin": 2_345_678, "c0/img_0.jpg": 3000,
         "c0/deep/img_1.jpg": 3001, "c1/img_2.jpg": 9999}
# A location with autoindex_exact_size off: up to 9,999 B the bytes, above "20K", "3M" (approximate).
APPROX = {"approx/small.bin": 512, "approx/edge.bin": 9999, "approx/k.bin": 20_000, "approx/m.bin": 3_000_000}


def _tree(root: Path, sizes: dict[str, int]) -> None:
    for rel, size in sizes.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x" * size)


def _requests(server: NginxServer, method: str) -> list[str]:
    assert server.workdir is not None
    log = (server.workdir / "access.log").read_text()
    return [line for line in log.splitlines() if f'"{method} ' in line]


@pytest.fixture()
def nginx(tmp_path: Path, nginx_server: Callable[..., Any]) -> NginxServer:
    _tree(tmp_path / "www", {**SIZES, **APPROX})
    server: NginxServer = nginx_server(tmp_path / "www", locations="location /approx/ { autoindex on; autoindex_exact_size off; }")
    return server


def test_nginx_index_pages_give_each_file_its_exact_size(nginx: NginxServer) -> None:
    base = nginx.url + "/"
    with urllib.request.urlopen(base) as answer:  # the page as nginx renders it
        page = answer.read().decode()
    files, folders = page_links(base, page)
    top = {rel: size for rel, size in SIZES.items() if "/" not in rel}
    assert files == {base + quote(rel, safe=""): size for rel, size in top.items()}
    assert folders == {base + "c0/", base + "c1/", base + "approx/"}
    with urllib.request.urlopen(base + "approx/") as answer:
        files, _ = page_links(base + "approx/", answer.read().decode())
    # Exact sizes off: bytes up to 9,999 are still exact; "20K" and "3M" are not read.
    assert files == {base + "approx/small.bin": 512, base + "approx/edge.bin": 9999, base + "approx/k.bin": -1,
                     base + "approx/m.bin": -1}


def test_a_listing_plans_with_the_pages_sizes_and_sends_no_head(nginx: NginxServer, tmp_path: Path) -> None:
    src = Source(nginx.url + "/", settings=Settings(cache_dir=tmp_path / "cache", max_requests=4))
    items = src.list(complete=False)
    rel = {item.url[len(nginx.url) + 1:]: item for item in items}
    expected = {quote(r): size for r, size in {**SIZES, **APPROX}.items()}
    assert sorted(rel) == sorted(expected)
    # The item stays sizeless (its version, which names a cache entry, comes with its first answer);
    # the page's size goes along to plan with.
    assert all(item.size == -1 and item.version == "" for item in items)
    sizes, headed = src.plan_sizes(items)
    assert dict(zip(rel, sizes)) == expected
    # Only the two files whose page showed "20K" and "3M" needed a HEAD.
    assert sorted(rel_ for rel_, item in rel.items() if item.index_size < 0) == ["approx/k.bin", "approx/m.bin"]
    assert sorted(h.split()[6] for h in _requests(nginx, "HEAD")) == ["/approx/k.bin", "/approx/m.bin"]
    assert sorted(items[k].url for k in headed) == [nginx.url + "/approx/k.bin", nginx.url + "/approx/m.bin"]
    assert all(done.version for done in headed.values())  # those HEADs completed them: size and ETag

    # A folder whose sizes are all exact plans with none; the GETs were its folder pages only.
    heads, gets = len(_requests(nginx, "HEAD")), _requests(nginx, "GET")
    c0 = Source(nginx.url + "/c0/", settings=Settings(cache_dir=tmp_path / "cache")).list(complete=False)
    assert src.plan_sizes(c0) == ([3001, 3000], {})  # deep/img_1.jpg sorts first
    assert len(_requests(nginx, "HEAD")) == heads
    assert all(line.split()[6].endswith("/") for line in _requests(nginx, "GET")[len(gets):])

    # Completing one for its identity still asks the server: the answer's size is the page's.
    done = src.complete(rel["c1/img_2.jpg"])
    assert (done.size, bool(done.version)) == (9999, True)
