"""First-block GETs and listing pages on libcurl's thread (fastload.transport.curl, native/_curl.c), against real servers.

What the aiohttp GET gives (size, version, bytes; a folder's files), this path must
give too; what it cannot take as it is goes back to aiohttp; the host limit's slots
it leases come back; none of it waits for aiohttp to import.
"""

from __future__ import annotations

import base64
import concurrent.futures
import http.server
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fastload.config import Settings
from fastload.dataset import FileDataset
from fastload.errors import ConfigError, CredentialsError, RemoteNotFoundError, StoppedError
from fastload.source import RemoteItem, Source
from fastload.source.aio import http_get_first as _http_get_first
from fastload.transport import curl, hostlimit

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(curl.engine() is None, reason=f"no curl engine here: {curl.unavailable()}"),
]


def _until(cond: Callable[[], bool], what: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


class _Server:
    """ThreadingHTTPServer (no Range support) that records each request's headers and answers
    ``status`` to the first ``refuse`` file GETs (folder pages with ``pages``); HTTP/1.1
    keep-alive, or ``http10`` as ``python -m http.server`` (a connection per answer); with
    ``login`` ("user:password") every request needs that Basic login, else 401; with
    ``unlisted`` a folder is 403, as nginx without autoindex answers."""

    def __init__(self, root: Path, *, refuse: int = 0, status: int = 503, http10: bool = False,
                 pages: bool = False, login: str | None = None, unlisted: bool = False) -> None:
        self.lock = threading.Lock()
        self.seen: list[dict[str, str]] = []
        self.refuse = refuse
        server = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            protocol_version = "HTTP/1.0" if http10 else "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if login is not None and self.headers.get("Authorization") != "Basic " + base64.b64encode(login.encode()).decode():
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Basic realm="data"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if unlisted and self.path.endswith("/"):
                    self.send_error(403)
                    return
                with server.lock:
                    server.seen.append(dict(self.headers))
                    refuse = server.refuse > 0 and self.path.endswith("/") == pages
                    if refuse:
                        server.refuse -= 1
                if refuse:
                    self.send_error(status)
                    return
                super().do_GET()

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: Handler(*a, directory=str(root)))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def py_server() -> Iterator[Callable[..., _Server]]:
    started: list[_Server] = []

    def start(root: Path, **kwargs: Any) -> _Server:
        started.append(_Server(root, **kwargs))
        return started[-1]

    yield start
    for s in started:
        s.close()


def _files(root: Path, n: int, size: int) -> dict[str, bytes]:
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for k in range(n):
        data = os.urandom(size + k)
        (root / f"f{k:02d}.bin").write_bytes(data)
        out[f"f{k:02d}.bin"] = data
    return out


def test_curl_gives_the_first_block_aiohttp_gives(tmp_path: Path, nginx_server: Any) -> None:
    files = _files(tmp_path / "www", 6, 3000)
    server = nginx_server(tmp_path / "www")
    src = Source(server.url + "/", settings=Settings(cache_dir=tmp_path / "c"))
    assert src.route is not None
    items = [RemoteItem(f"{server.url}/{name}", -1, "") for name in files]
    for nbytes in (1000, 1 << 20):  # cut at a range, and whole
        started = src.start_first_many(items, nbytes)
        assert started is not None and all(isinstance(p, curl.Pending) for p in started)
        for item, pending in zip(items, started):
            info, body = pending.result(timeout=10)
            want_info, want_body = src._sync(_http_get_first, src.fs, item.url, nbytes, 10.0)
            assert (info, body) == (want_info, want_body)
            assert body == files[item.url.rsplit("/", 1)[1]][:nbytes] and info["size"] == len(files[item.url.rsplit("/", 1)[1]])
            assert info["ETag"] and info["Last-Modified"]  # the version a HEAD reports


def test_a_server_that_ignores_ranges_is_cut_at_the_block_and_noted(tmp_path: Path, py_server: Any) -> None:
    files = _files(tmp_path / "www", 3, 50_000)
    server = py_server(tmp_path / "www", http10=True)
    src = Source(server.url + "/", settings=Settings(cache_dir=tmp_path / "c"))
    items = [RemoteItem(f"{server.url}/{name}", -1, "") for name in files]
    got = src.fetch_first_many(items, 4096)
    for (item, data), want in zip(got, files.values()):
        assert data == want[:4096] and item.size == len(want)
    assert src.ignores_ranges(items[0].url)
    limit = src.host_limit
    assert limit is not None
    _until(lambda: limit.closing, "http.server's HTTP/1.0 answers did not hold the limit to CLOSING_MAX")
    assert all(h.get("Range") == "bytes=0-4095" and h.get("Accept-Encoding") == "identity" for h in server.seen)
    # A host that closes its connections stays on libcurl (a connect per GET costs less CPU in C:
    # benchmarks/ordinary_server), at most CLOSING_MAX at once.
    started = src.start_first_many(items, 4096)
    assert started is not None and all(isinstance(f, curl.Pending) for f in started)
    for (item, data), want in zip((src.finish_first(i, 4096, f) for i, f in zip(items, started)), files.values()):
        assert data == want[:4096] and item.size == len(want)
    assert limit.limit <= hostlimit.CLOSING_MAX


def test_a_503_cuts_the_limit_and_the_object_is_still_read_whole(tmp_path: Path, py_server: Any) -> None:
    files = _files(tmp_path / "www", 4, 2000)
    server = py_server(tmp_path / "www", refuse=1, status=503)
    src = Source(server.url + "/", settings=Settings(cache_dir=tmp_path / "c", backoff_s=0.01))
    items = [RemoteItem(f"{server.url}/{name}", -1, "") for name in files]
    got = src.fetch_first_many(items, 1 << 20)
    assert [data for _, data in got] == list(files.values())  # the refused one redone on aiohttp
    limit = src.host_limit
    assert limit is not None
    _until(lambda: limit.cuts >= 1, "the 503 never reached the host's controller")
    assert limit.last_cut == "HTTP 503"


def test_leased_slots_come_back_once_an_epoch_ends(tmp_path: Path, nginx_server: Any) -> None:
    files = _files(tmp_path / "www" / "train", 40, 5000)
    server = nginx_server(tmp_path / "www")
    ds = FileDataset(server.url + "/train/", settings=Settings(cache_dir=tmp_path / "c"))
    ds.fetch_ahead(list(range(len(ds))))
    got = ds.read_batch(list(range(len(ds))))
    assert sorted(s["data"] for s in got) == sorted(files.values())
    limit = hostlimit.limit_for(hostlimit.host_of(server.url), ds.reader.settings.max_requests)
    _until(lambda: limit.in_flight == 0, f"{limit.in_flight} slots still held after the epoch")
    hosts = [h for h in curl._STATE.hosts.values() if h.limit is limit]
    assert hosts and curl._STATE.engine.counts(hosts[0].id) == (0, 0, 0)


def test_session_headers_reach_the_server_and_unknown_options_keep_aiohttp(tmp_path: Path, py_server: Any) -> None:
    files = _files(tmp_path / "www", 2, 100)
    server = py_server(tmp_path / "www")
    src = Source(server.url + "/", {"headers": {"X-Token": "abc"}}, settings=Settings(cache_dir=tmp_path / "c"))
    assert src.route is not None
    got = src.fetch_first_many([RemoteItem(f"{server.url}/{n}", -1, "") for n in files], 1 << 20)
    assert [d for _, d in got] == list(files.values())
    assert [h.get("X-Token") for h in server.seen] == ["abc", "abc"]
    # A session option curl has no word for: aiohttp, which honours it.
    assert Source(server.url + "/", {"client_kwargs": {"cookies": {"a": "b"}}}).route is None
    assert Source(server.url + "/", settings=Settings(http_client="aiohttp")).route is None


def test_http_client_curl_where_it_cannot_run_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = curl._State()
    state.reason = "libcurl not found (test)"
    monkeypatch.setattr(curl, "_STATE", state)
    with pytest.raises(ConfigError, match="http_client='curl' cannot run here: libcurl not found"):
        curl.route_for({}, "curl", str)
    assert curl.route_for({}, "auto", str) is None


def test_the_pump_thread_outlives_a_swapped_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """The thread that gives the engine's idle slots back once ended when it saw another _STATE
    (a test swapping it for a moment); later aiohttp requests then waited for slots the engine held."""
    eng = curl.engine()
    if eng is None:
        pytest.skip(f"libcurl's engine cannot run here: {curl.unavailable()}")
    pumps = [t for t in threading.enumerate() if t.name == "fastload-curl-pump"]
    assert len(pumps) == 1 and pumps[0].is_alive()
    with monkeypatch.context() as m:
        m.setattr(curl, "_STATE", curl._State())
        time.sleep(20 * curl.PUMP_S + 2 * curl.STOP_POLL_S)  # several turns of its loop
    assert pumps[0].is_alive()


def test_a_cancelled_or_dropped_get_leaves_nothing_queued(tmp_path: Path, nginx_server: Any) -> None:
    _files(tmp_path / "www", 3, 100)
    server = nginx_server(tmp_path / "www")
    eng = curl.engine()
    host = eng.host()  # a host of its own, with no permits: nothing starts
    urls = [f"{server.url}/f{k:02d}.bin" for k in range(3)]
    kept = eng.submit(host, urls, 1000, [], 5.0)
    dropped = eng.submit(host, urls, 1000, [], 5.0)
    _until(lambda: eng.counts(host) == (0, 0, 6), "the GETs never reached their host's queue")
    del dropped  # freed by the transfer thread
    kept[0].cancel()
    _until(lambda: eng.counts(host) == (0, 0, 2), "cancelled and dropped GETs stayed queued")
    assert eng.set_permits(host, 2) == 2 and eng.wait(kept[1:], 5.0)
    assert kept[0].result()[0] == -1 and [t.result()[:2] for t in kept[1:]] == [(0, 200), (0, 200)]
    eng.set_permits(host, 0)
    dead = eng.submit(host, ["http://127.0.0.1:9/x"], 10, [], 5.0)
    eng.set_permits(host, 1)
    assert eng.wait(dead, 5.0)
    eng.set_permits(host, 0)
    with pytest.raises(ConnectionRefusedError, match="libcurl error 7"):
        curl._answer(dead[0].result(), "http://127.0.0.1:9/x", 10)


class _FailedTransfer:
    """A finished transfer that failed with libcurl's ``code``."""

    def __init__(self, code: int = 60, message: str = "SSL peer certificate or SSH remote key was not OK") -> None:
        self.code, self.message = code, message

    def done(self) -> bool:
        return True

    def cancel(self) -> bool:
        return False

    def result(self) -> tuple[Any, ...]:
        return (self.code, 0, b"", None, None, None, None, None, None, False, self.message, None, None, None)


def test_a_host_libcurl_cannot_speak_to_goes_to_aiohttp_for_good(tmp_path: Path, py_server: Any) -> None:
    files = _files(tmp_path / "www", 2, 100)
    server = py_server(tmp_path / "www")
    src = Source(server.url + "/", settings=Settings(cache_dir=tmp_path / "c"))
    limit = src.host_limit
    assert limit is not None and src.route is not None
    host = curl._host(limit)
    # A body cut short (a flaky proxy) is one GET's failure: the host stays on libcurl.
    with pytest.raises(ConnectionError, match="libcurl error 18"):
        curl.Pending(_FailedTransfer(18, "Transferred a partial file"), server.url + "/f00.bin", 100, host).result(timeout=1)
    assert curl.broken(limit) == ""
    with pytest.raises(ConnectionError, match="libcurl error 60"):
        curl.Pending(_FailedTransfer(), server.url + "/f00.bin", 100, host).result(timeout=1)
    assert "libcurl error 60" in curl.broken(limit)
    items = [RemoteItem(f"{server.url}/{n}", -1, "") for n in files]
    assert src.start_first_many(items, 1 << 20) is not None  # aiohttp's futures now
    assert not any(isinstance(f, curl.Pending) for f in src.start_first_many(items, 1 << 20) or [])
    assert [d for _, d in src.fetch_first_many(items, 1 << 20)] == list(files.values())


class _Queued(curl.Pending):
    """A GET that waits in its host's queue until ``runs_at``, then answers at once (``None``: never runs)."""

    def __init__(self, runs_at: float | None, started: bool = False) -> None:
        self.runs_at, self.always_started = runs_at, started
        self.timeouts = 0  # result() calls that ended without an answer

    def started(self) -> bool:
        return self.always_started or (self.runs_at is not None and time.monotonic() >= self.runs_at)

    def done(self) -> bool:
        return self.runs_at is not None and time.monotonic() >= self.runs_at

    def cancel(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> tuple[dict[str, Any], bytes]:
        end = time.monotonic() + (timeout or 0)
        while not self.done():
            if time.monotonic() >= end:
                self.timeouts += 1
                raise concurrent.futures.TimeoutError
            time.sleep(0.005)
        return {"name": "u", "size": 1}, b"x"


def test_a_get_queued_for_its_slot_is_waited_for_past_the_request_timeout(tmp_path: Path) -> None:
    # The timeout of a GET starts once it holds a slot, as a coroutine's does: redoing a queued
    # one on aiohttp queued it for the same slots, and readers doing so starved the engine.
    src = Source(str(tmp_path), settings=Settings(cache_dir=tmp_path / "c"))
    queued = _Queued(time.monotonic() + 0.4)
    assert src._wait(queued, 0.05, "u") == ({"name": "u", "size": 1}, b"x")
    assert queued.timeouts >= 2  # its wait outlived the 0.05 s timeout more than once, and went on
    with pytest.raises(concurrent.futures.TimeoutError):  # once running, its own timeout holds
        src._wait(_Queued(None, started=True), 0.05, "u")
    src.stop.set()
    with pytest.raises(StoppedError):  # and a stop still ends the wait for a queued one
        src._wait(_Queued(None), 0.05, "u")


def _tree(root: Path) -> None:
    for rel in ("train/a/1.jpg", "train/a/2.jpg", "train/b/c/3.jpg", "train/b/4.jpg"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(os.urandom(500))
    (root / "train/empty").mkdir()
    (root / "big.bin").write_bytes(os.urandom(1 << 20))


def _listed(url: str, client: str, tmp_path: Path) -> list[tuple[str, int]]:
    src = Source(url, settings=Settings(cache_dir=tmp_path / "c", http_client=client))
    return sorted((i.url, i.size) for i in src.list(pattern="**/*.jpg", complete=False))


def test_a_listing_over_libcurl_gives_what_aiohttp_gives(tmp_path: Path, nginx_server: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    _tree(tmp_path / "www")
    server = nginx_server(tmp_path / "www")
    want = {url: _listed(url, "aiohttp", tmp_path) for url in (server.url + "/train/", server.url + "/train")}
    assert [u for u, _ in want[server.url + "/train/"]] == [f"{server.url}/train/{r}" for r in
                                                             ("a/1.jpg", "a/2.jpg", "b/4.jpg", "b/c/3.jpg")]
    pages: list[str] = []
    start_pages = curl.CurlRoute.start_pages

    def counted(self: Any, urls: Any, *args: Any, **kwargs: Any) -> Any:
        pages.extend(urls)
        return start_pages(self, urls, *args, **kwargs)

    def no_aiohttp(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a listing page went to aiohttp")

    monkeypatch.setattr(curl.CurlRoute, "start_pages", counted)
    monkeypatch.setattr("fastload.source.aio.http_page", no_aiohttp)
    for url, listed in want.items():  # "/train" is redirected to "/train/" (followed, its final URL kept)
        assert _listed(url, "auto", tmp_path) == listed
    assert sorted(set(pages)) == sorted({server.url + "/train", *(f"{server.url}/train/{d}/" for d in ("a", "b", "b/c", "empty")),
                                         server.url + "/train/"})
    monkeypatch.undo()
    # A missing folder is the error aiohttp's listing gives (its page is redone there).
    with pytest.raises(RemoteNotFoundError, match="nope"):
        Source(server.url + "/nope/", settings=Settings(cache_dir=tmp_path / "c")).list()


def test_a_data_file_met_as_a_page_is_not_downloaded(tmp_path: Path, nginx_server: Any) -> None:
    _tree(tmp_path / "www")
    server = nginx_server(tmp_path / "www")
    src = Source(server.url + "/big.bin", settings=Settings(cache_dir=tmp_path / "c"))
    limit, route = src.host_limit, src.route
    assert limit is not None and route is not None
    folder, data = route.start_pages([server.url + "/train/", server.url + "/big.bin"], 10.0, limit, src.stop)
    final, size, text = folder.result(timeout=10)
    assert final == server.url + "/train/" and text is not None and 'href="a/"' in text
    assert data.result(timeout=10) == (server.url + "/big.bin", 1 << 20, None)
    assert data.transfer.result()[2] == b""  # its megabyte was not read: the transfer ended at the headers
    assert src.list() == [src.info(server.url + "/big.bin")]  # the root is one object


def test_a_refused_page_is_read_again_on_aiohttp(tmp_path: Path, py_server: Any) -> None:
    _tree(tmp_path / "www")
    server = py_server(tmp_path / "www", refuse=1, pages=True)
    src = Source(server.url + "/train/", settings=Settings(cache_dir=tmp_path / "c"))
    assert src.route is not None
    got = sorted(i.url for i in src.list(pattern="**/*.jpg", complete=False))
    assert got == [f"{server.url}/train/{r}" for r in ("a/1.jpg", "a/2.jpg", "b/4.jpg", "b/c/3.jpg")]
    limit = src.host_limit
    assert limit is not None and limit.last_cut == "HTTP 503"  # libcurl's 503 reached the controller
    assert server.refuse == 0


def _python(code: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=timeout_s)


def test_the_listing_and_first_blocks_import_no_aiohttp(tmp_path: Path, nginx_server: Any) -> None:
    # aiohttp's import costs 0.1-0.2 s of CPU: a cold epoch over nginx never needs it (it
    # used to be imported on a thread ahead of use). A HEAD, on aiohttp, imports it then.
    _tree(tmp_path / "www")
    server = nginx_server(tmp_path / "www")
    proc = _python(f"""
    import sys
    from pathlib import Path
    from fastload.config import Settings
    from fastload.source import Source
    src = Source("{server.url}/train/", settings=Settings(cache_dir=Path("{tmp_path}/c")))
    items = src.list(pattern="**/*.jpg", complete=False)
    got = src.fetch_first_many(items, 1 << 20)
    assert [len(data) for _, data in got] == [500] * 4 and all(i.size == 500 and i.version for i, _ in got)
    assert "aiohttp" not in sys.modules, "the listing or a first block imported aiohttp"
    assert src.info(items[0].url).size == 500 and "aiohttp" in sys.modules
    print("ok", len(items))
    """)
    assert proc.returncode == 0 and "ok 4" in proc.stdout, proc.stdout + proc.stderr


def test_a_server_that_lists_no_folders_is_told_apart_in_the_error(tmp_path: Path, py_server: Any) -> None:
    _tree(tmp_path / "www")
    server = py_server(tmp_path / "www", unlisted=True)
    with pytest.raises(CredentialsError, match=r"HTTP 403: no login, or a wrong one; or it does not list folders") as err:
        Source(server.url + "/train/", settings=Settings(cache_dir=tmp_path / "c")).list()
    assert "pass the objects' URLs as a list (--url-list" in str(err.value)
    # Its objects still read, as a list of URLs.
    src = Source(server.url + "/train/a/1.jpg", settings=Settings(cache_dir=tmp_path / "c"))
    assert src.fetch_first(RemoteItem(src.url, -1, ""), 1 << 20)[0].size == 500


def test_a_failed_import_of_aiohttp_reaches_the_source_that_needs_it(tmp_path: Path) -> None:
    proc = _python("""
    import importlib.abc, sys
    from fastload.errors import ConfigError
    from fastload.source import Source
    src = Source("http://127.0.0.1:9/data/")
    class Broken(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "aiohttp":
                raise ImportError("aiohttp is broken here (test)")
            return None
    sys.meta_path.insert(0, Broken())
    try:
        src.fs
    except ConfigError as err:
        print("ok", err)
    """)
    assert proc.returncode == 0 and "ok URL 'http://127.0.0.1:9/data' needs a package that is missing" in proc.stdout, \
        proc.stdout + proc.stderr
    assert "aiohttp is broken here (test)" in proc.stdout and "pip install aiohttp" in proc.stdout
