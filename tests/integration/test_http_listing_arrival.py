"""An HTTP listing reads each folder page as it arrives (fastload.source.listing.crawl): a fast
page's files are counted, and its subfolders requested, while a slow page of the same level is
still being served. Until issue 31 a level's pages were all fetched, then all read."""

from __future__ import annotations

import functools
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fastload.config import Settings
from fastload.read.reader import Reader
from fastload.source.listing import LISTING_PROGRESS

pytestmark = pytest.mark.integration

HOLD_S = 20.0  # the slow page's longest wait: past it the listing still ends, and the test fails


class _Handler(http.server.SimpleHTTPRequestHandler):
    """``/slow/`` is answered once ``/fast/deep/`` has been asked for (or after HOLD_S)."""

    deep_asked: threading.Event
    released: list[bool]

    def do_GET(self) -> None:
        if self.path == "/fast/deep/":
            self.deep_asked.set()
        if self.path == "/slow/":
            self.released.append(self.deep_asked.wait(HOLD_S))
        super().do_GET()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture()
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "www"
    for rel in ("fast/f0.bin", "fast/f1.bin", "fast/deep/d0.bin", "slow/s0.bin", "slow/s1.bin", "slow/s2.bin"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x" * 10)
    return root


@pytest.fixture()
def server(tree: Path) -> Iterator[tuple[str, _Handler]]:
    handler: Any = type("H", (_Handler,), {"deep_asked": threading.Event(), "released": []})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(tree)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", handler
    handler.deep_asked.set()
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=10)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("client", ["auto", "aiohttp"])  # libcurl's pages, and aiohttp's
def test_a_page_is_read_as_it_arrives_while_a_slow_one_is_served(
    tmp_path: Path, server: tuple[str, Any], client: str
) -> None:
    base, handler = server
    settings = Settings(cache_dir=tmp_path / "cache", max_requests=4, request_timeout_s=60, http_client=client)
    heard: list[tuple[int, int]] = []
    token = LISTING_PROGRESS.set(lambda files, folders: heard.append((files, folders)))
    try:
        items = Reader(settings).list(base + "/", complete=False)
    finally:
        LISTING_PROGRESS.reset(token)
    assert sorted(i.url[len(base) + 1 :] for i in items) == [
        "fast/deep/d0.bin", "fast/f0.bin", "fast/f1.bin", "slow/s0.bin", "slow/s1.bin", "slow/s2.bin"]
    # /slow/ was answered only once /fast/deep/ had been asked for: /fast/'s page was read, and its
    # subfolder sent, while /slow/ was in flight. Fetched and read by levels, /slow/ waited HOLD_S.
    assert handler.released == [True]
    # The listing said so: /fast/'s 2 files and 3 folders, before /slow/'s 3 files.
    assert (2, 3) in heard and heard[-1] == (6, 3)
