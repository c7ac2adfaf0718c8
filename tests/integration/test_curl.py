"""First-block GETs on libcurl's thread (fastload.curl, native/_curl.c), against real servers.

What the aiohttp GET gives (size, version, bytes), this path must give too; what it
cannot take as it is goes back to aiohttp; the host limit's slots it leases come back.
"""

from __future__ import annotations

import concurrent.futures
import http.server
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fastload import curl, hostlimit
from fastload.config import Settings
from fastload.dataset import FileDataset
from fastload.errors import ConfigError, StoppedError
from fastload.source import RemoteItem, Source, _http_get_first

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
    ``status`` to the first ``refuse`` file GETs; HTTP/1.1 keep-alive, or ``http10`` as
    ``python -m http.server`` (a connection per answer)."""

    def __init__(self, root: Path, *, refuse: int = 0, status: int = 503, http10: bool = False) -> None:
        self.lock = threading.Lock()
        self.seen: list[dict[str, str]] = []
        self.refuse = refuse
        server = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            protocol_version = "HTTP/1.0" if http10 else "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                with server.lock:
                    server.seen.append(dict(self.headers))
                    refuse = server.refuse > 0 and not self.path.endswith("/")
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
    got = src.read_first_many(items, 4096)
    for (item, data), want in zip(got, files.values()):
        assert data == want[:4096] and item.size == len(want)
    assert src.ignores_ranges(items[0].url)
    limit = src.host_limit
    assert limit is not None
    _until(lambda: limit.closing, "http.server's HTTP/1.0 answers did not hold the limit to CLOSING_MAX")
    assert all(h.get("Range") == "bytes=0-4095" and h.get("Accept-Encoding") == "identity" for h in server.seen)
    # A host that closes its connections: its GETs go back to aiohttp (measured faster there).
    started = src.start_first_many(items, 4096)
    assert started is not None and not any(isinstance(f, curl.Pending) for f in started)
    for f in started:
        f.cancel()


def test_a_503_cuts_the_limit_and_the_object_is_still_read_whole(tmp_path: Path, py_server: Any) -> None:
    files = _files(tmp_path / "www", 4, 2000)
    server = py_server(tmp_path / "www", refuse=1, status=503)
    src = Source(server.url + "/", settings=Settings(cache_dir=tmp_path / "c", backoff_s=0.01))
    items = [RemoteItem(f"{server.url}/{name}", -1, "") for name in files]
    got = src.read_first_many(items, 1 << 20)
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
    limit = hostlimit.limit_for(hostlimit.host_of(server.url), ds.reader.settings.workers)
    _until(lambda: limit.in_flight == 0, f"{limit.in_flight} slots still held after the epoch")
    hosts = [h for h in curl._STATE.hosts.values() if h.limit is limit]
    assert hosts and curl._STATE.engine.counts(hosts[0].id) == (0, 0, 0)


def test_session_headers_reach_the_server_and_unknown_options_keep_aiohttp(tmp_path: Path, py_server: Any) -> None:
    files = _files(tmp_path / "www", 2, 100)
    server = py_server(tmp_path / "www")
    src = Source(server.url + "/", {"headers": {"X-Token": "abc"}}, settings=Settings(cache_dir=tmp_path / "c"))
    assert src.route is not None
    got = src.read_first_many([RemoteItem(f"{server.url}/{n}", -1, "") for n in files], 1 << 20)
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
        curl.route_for(object(), "curl")
    assert curl.route_for(object(), "auto") is None


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
        return (self.code, 0, b"", None, None, None, None, None, None, False, self.message)


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
    assert [d for _, d in src.read_first_many(items, 1 << 20)] == list(files.values())


class _Queued(curl.Pending):
    """A GET that waits in its host's queue until ``runs_at``, then answers at once (``None``: never runs)."""

    def __init__(self, runs_at: float | None, started: bool = False) -> None:
        self.runs_at, self.always_started = runs_at, started

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
                raise concurrent.futures.TimeoutError
            time.sleep(0.005)
        return {"name": "u", "size": 1}, b"x"


def test_a_get_queued_for_its_slot_is_waited_for_past_the_request_timeout(tmp_path: Path) -> None:
    # The timeout of a GET starts once it holds a slot, as a coroutine's does: redoing a queued
    # one on aiohttp queued it for the same slots, and readers doing so starved the engine.
    src = Source(str(tmp_path), settings=Settings(cache_dir=tmp_path / "c"))
    t0 = time.monotonic()
    assert src._wait(_Queued(t0 + 0.4), 0.05, "u") == ({"name": "u", "size": 1}, b"x")
    assert time.monotonic() - t0 >= 0.4
    with pytest.raises(concurrent.futures.TimeoutError):  # once running, its own timeout holds
        src._wait(_Queued(None, started=True), 0.05, "u")
    src.stop.set()
    with pytest.raises(StoppedError):  # and a stop still ends the wait for a queued one
        src._wait(_Queued(None), 0.05, "u")
