"""Listing odd HTTP remotes: folder levels fetched together, index pages, empty folders, patterns.

Real servers: the standard library's ThreadingHTTPServer (backlog 5, as users run
``python -m http.server``) and nginx's autoindex.
"""

from __future__ import annotations

import functools
import http.server
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload.cli import main as cli_main
from fastload.config import Settings
from fastload.errors import EmptyDatasetError
from fastload.read.reader import Reader
from fastload.source import Source

pytestmark = pytest.mark.integration


class _Recorder:
    """Requests a server saw: (method, path, status), and the most folder pages in flight at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.log: list[tuple[str, str, int]] = []
        self.active = 0
        self.peak = 0


class _Handler(http.server.SimpleHTTPRequestHandler):
    recorder: _Recorder
    page_delay_s = 0.0

    def send_response(self, code: int, message: str | None = None) -> None:
        with self.recorder.lock:
            self.recorder.log.append((self.command, self.path, code))
        super().send_response(code, message)

    def do_GET(self) -> None:
        if self.path.endswith("/"):
            with self.recorder.lock:
                self.recorder.active += 1
                self.recorder.peak = max(self.recorder.peak, self.recorder.active)
            time.sleep(self.page_delay_s)  # one round trip of a slow link, so pages in flight overlap
            # A page leaves the count before its first byte is sent: the client frees its slot
            # once the body has arrived, and could start the next page before this thread,
            # descheduled on a loaded machine, counted it out (peaks of 2 at a limit of 1).
            with self.recorder.lock:
                self.recorder.active -= 1
        super().do_GET()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture()
def py_server() -> Iterator[Callable[..., tuple[str, _Recorder]]]:
    """Factory: ``py_server(root, page_delay_s=0)`` -> (base URL, recorder); stopped on teardown."""
    started: list[tuple[http.server.ThreadingHTTPServer, threading.Thread]] = []

    def start(root: Path, page_delay_s: float = 0.0) -> tuple[str, _Recorder]:
        recorder = _Recorder()
        handler = type("H", (_Handler,), {"recorder": recorder, "page_delay_s": page_delay_s})
        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(root)))
        thread = threading.Thread(target=httpd.serve_forever, daemon=True)
        thread.start()
        started.append((httpd, thread))
        return f"http://127.0.0.1:{httpd.server_address[1]}", recorder

    yield start
    for httpd, thread in started:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


@pytest.fixture()
def settings(tmp_path: Path) -> Settings:
    return Settings(cache_dir=tmp_path / "cache", block_bytes=64 * 1024, max_requests=4, retries=2, backoff_s=0.01, request_timeout_s=10)


def _nested(root: Path, classes: int = 12) -> dict[str, bytes]:
    files = {}
    for c in range(classes):
        for k in range(2):
            rel = f"class_{c:02d}/img_{k}.jpg"
            files[rel] = os.urandom(3000 + c)
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(files[rel])
    return files


def test_a_level_of_subfolders_is_listed_together_and_redirects_once(
    tmp_path: Path, py_server: Callable[..., tuple[str, _Recorder]], settings: Settings
) -> None:
    files = _nested(tmp_path / "www" / "data")
    (tmp_path / "www" / "data" / "class_00" / "deeper").mkdir()
    (tmp_path / "www" / "data" / "class_00" / "deeper" / "x.jpg").write_bytes(b"deep")
    base, rec = py_server(tmp_path / "www", page_delay_s=0.2)
    items = Reader(settings).list(base + "/data", "**/*.jpg", complete=False)
    assert sorted(i.url[len(base) + 6 :] for i in items) == sorted([*files, "class_00/deeper/x.jpg"])
    pages = [(m, p, c) for m, p, c in rec.log if p.endswith("/") or p == "/data"]
    # The root once (one redirect to its "/" form, followed once), each of 13 folders once, no HEAD.
    assert [(m, p, c) for m, p, c in pages if p in ("/data", "/data/")] == [("GET", "/data", 301), ("GET", "/data/", 200)]
    assert sorted(p for m, p, c in pages if p.count("/") > 2) == sorted(
        [f"/data/class_{c:02d}/" for c in range(12)] + ["/data/class_00/deeper/"]
    )
    assert not [r for r in rec.log if r[0] == "HEAD"]
    # The 12 folders of one level were in flight together, within the host's limit (at most
    # max_requests=4, fastload.transport.hostlimit); one after another (fsspec's walk) this was 1.
    assert 1 < rec.peak <= settings.max_requests


def test_empty_python_server_folder_is_an_error_not_its_listing_page(
    tmp_path: Path, py_server: Callable[..., tuple[str, _Recorder]], settings: Settings
) -> None:
    (tmp_path / "www" / "empty").mkdir(parents=True)
    base, _ = py_server(tmp_path / "www")
    for url in (base + "/empty/", base + "/empty"):
        with pytest.raises(EmptyDatasetError, match=r"/empty: no data items: the listing found 0 folders and 0 files; fix: check the URL"):
            fastload.FileDataset(url, settings=settings)
    # An index page is never an item, also beside real files.
    (tmp_path / "www" / "empty" / "a.bin").write_bytes(b"data")
    ds = fastload.FileDataset(base + "/empty", settings=Settings(cache_dir=tmp_path / "c2"))
    assert [s["data"] for s in (ds[i] for i in range(len(ds)))] == [b"data"]


def test_empty_nginx_folder_names_the_cause_and_the_fix(
    tmp_path: Path, nginx_server: Callable[..., Any], settings: Settings
) -> None:
    (tmp_path / "www" / "empty").mkdir(parents=True)
    server = nginx_server(tmp_path / "www")
    for url in (server.url + "/empty/", server.url + "/empty"):
        with pytest.raises(EmptyDatasetError, match=r"no data items: the listing found 0 folders and 0 files") as err:
            fastload.stage(url, settings=settings, progress=False)
        assert "reports no size" not in str(err.value)


def test_a_pattern_that_matches_nothing_exits_1_and_suggests_the_nested_glob(
    tmp_path: Path, nginx_server: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    _nested(tmp_path / "www")
    server = nginx_server(tmp_path / "www")
    code = cli_main(["cache", server.url + "/", "--pattern", "*.jpg", "--cache-dir", str(tmp_path / "c"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert f"{server.url}: pattern '*.jpg' matches nothing: the listing found 12 folders and 24 files, 0 matching" in err
    assert "fix: pass --pattern '**/*.jpg'" in err


def test_an_empty_local_folder_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    code = cli_main(["cache", str(tmp_path / "empty"), "--cache-dir", str(tmp_path / "c"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1 and "no data items: the listing found 0 folders and 0 files" in err, err
    (tmp_path / "empty" / "sub").mkdir()
    (tmp_path / "empty" / "sub" / "a.png").write_bytes(b"x")
    assert cli_main(["cache", str(tmp_path / "empty"), "--pattern", "*.jpg", "--cache-dir", str(tmp_path / "c")]) == 1
    err = capsys.readouterr().err
    assert "1 folder and 1 file, 0 matching" in err and "'sub/a.png'" in err, err


def test_a_recorded_listing_serves_a_new_pattern_with_the_remote_offline(
    tmp_path: Path, nginx_server: Callable[..., Any], settings: Settings
) -> None:
    files = _nested(tmp_path / "www")
    (tmp_path / "www" / "class_03" / "notes.txt").write_text("not an image")
    server = nginx_server(tmp_path / "www")
    fastload.stage(server.url + "/", settings=settings, progress=False)
    base = server.url
    server.stop()  # from here on, a listing would fail
    ds = fastload.FileDataset(base + "/", pattern="**/*.jpg", settings=settings, label="parent")
    assert len(ds) == len(files) and len(ds.classes) == 12
    assert {ds[i]["url"][len(base) + 1 :]: ds[i]["data"] for i in range(len(ds))} == files
    # A subfolder of the recorded one is covered too.
    sub = fastload.FileDataset(base + "/class_03", settings=settings)
    assert sorted(s["url"].rsplit("/", 1)[1] for s in (sub[i] for i in range(len(sub)))) == ["img_0.jpg", "img_1.jpg", "notes.txt"]
    with pytest.raises(EmptyDatasetError, match=r"pattern '\*\.png' matches nothing: the listing found 12 folders and 25 files"):
        fastload.FileDataset(base + "/", pattern="*.png", settings=settings)


@pytest.mark.timeout(60)
def test_a_listing_with_one_request_allowed_in_flight_completes(
    tmp_path: Path, py_server: Callable[..., tuple[str, _Recorder]]
) -> None:
    # Each folder page takes one slot of the host's limit: it used to take two (the
    # retry loop's and the page's own), so with one slot (--workers 1, or a limit cut
    # to 1 by a busy server) the first page waited for itself forever.
    files = _nested(tmp_path / "www" / "data", classes=3)
    base, rec = py_server(tmp_path / "www")
    settings = Settings(cache_dir=tmp_path / "cache", max_requests=1, retries=1, request_timeout_s=10)
    items = Reader(settings).list(base + "/data/", "**/*.jpg", complete=False)
    assert sorted(i.url[len(base) + 6 :] for i in items) == sorted(files)
    assert rec.peak == 1


def test_python_server_pages_show_no_sizes_so_planning_heads_each_file(
    tmp_path: Path, py_server: Callable[..., tuple[str, _Recorder]], settings: Settings
) -> None:
    # http.server lists names only: its items have no index_size, and planning by bytes
    # costs a HEAD each (nginx's pages cost none: tests/integration/test_http_listing_sizes.py).
    files = _nested(tmp_path / "www", classes=3)
    base, rec = py_server(tmp_path / "www")
    src = Source(base + "/", settings=settings)
    items = src.list("**/*.jpg", complete=False)
    assert [i.index_size for i in items] == [-1] * len(files)
    sizes, headed = src.plan_sizes(items)
    assert sizes == [len(files[i.url[len(base) + 1 :]]) for i in items]
    assert sorted(p for m, p, c in rec.log if m == "HEAD") == sorted(f"/{rel}" for rel in files)
    assert sorted(headed) == list(range(len(files))) and all(i.version for i in headed.values())
