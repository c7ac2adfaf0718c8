"""Requests in flight per host (fastload.transport.hostlimit), counted at a real server.

The server is the standard library's ThreadingHTTPServer (listen backlog 5, no
Range support, one connection per request), as ``python -m http.server`` runs it.
It counts the connections it holds open at once: a connection is counted from
its accept until the last byte of its answer is about to be written, so a client
that keeps N requests in flight never shows more than N.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload.cli import main
from fastload.config import Settings
from fastload.transport import hostlimit

pytestmark = pytest.mark.integration


class CountingServer:
    """A ThreadingHTTPServer over ``root`` that counts connections and requests.

    Args:
        root: Folder to serve.
        delay_s: Sleep before each answer, so that requests overlap.
        capacity: Answer ``busy_status`` to a request that finds this many already being served.
        busy_status: 503 or 429.
    """

    def __init__(self, root: Path, *, delay_s: float = 0.0, capacity: int | None = None, busy_status: int = 503) -> None:
        self.lock = threading.Lock()
        self.open = 0
        self.peak = 0
        self.busy = 0  # answers refused with busy_status
        self.gets: dict[str, int] = {}
        server = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def setup(self) -> None:
                super().setup()
                self.counted = True
                with server.lock:
                    server.open += 1
                    server.peak = max(server.peak, server.open)

            def uncount(self) -> None:
                if self.counted:
                    self.counted = False
                    with server.lock:
                        server.open -= 1

            def finish(self) -> None:
                self.uncount()
                super().finish()

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                with server.lock:
                    server.gets[self.path] = server.gets.get(self.path, 0) + 1
                    refuse = capacity is not None and server.open > capacity
                    server.busy += refuse
                time.sleep(delay_s)
                if refuse:
                    self.uncount()
                    self.send_error(busy_status, "busy")
                    return
                super().do_GET()

            def copyfile(self, source: Any, outputfile: Any) -> None:
                data = source.read()
                outputfile.write(data[:-1])
                outputfile.flush()
                self.uncount()  # before the last byte: the client cannot have finished yet
                outputfile.write(data[-1:])

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
        assert self.httpd.request_queue_size == 5  # the listen backlog users' servers have
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def file_gets(self) -> dict[str, int]:
        with self.lock:
            return {p: n for p, n in self.gets.items() if p.endswith(".bin")}


@pytest.fixture
def counting_server() -> Iterator[Callable[..., CountingServer]]:
    started: list[CountingServer] = []

    def start(root: Path, **kwargs: Any) -> CountingServer:
        server = CountingServer(root, **kwargs)
        server.thread.start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.httpd.shutdown()
        server.httpd.server_close()
        server.thread.join(timeout=10)


def make_files(root: Path, n: int, size: int) -> None:
    for i in range(n):
        folder = root / "data" / f"c{i % 4}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i:04d}.bin").write_bytes(os.urandom(size))


def settings_for(tmp_path: Path, **kwargs: Any) -> Settings:
    return Settings(cache_dir=tmp_path / "cache", request_timeout_s=20, backoff_s=0.05, **kwargs)


def test_workers_caps_the_connections_a_server_sees(
    tmp_path: Path, counting_server: Callable[..., CountingServer], capsys: pytest.CaptureFixture[str]
) -> None:
    make_files(tmp_path / "www", 120, 20_000)
    server = counting_server(tmp_path / "www", delay_s=0.01)
    code = main(["cache", server.url + "/data/", "--max-requests", "4", "--cache-dir", str(tmp_path / "cache"), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["items"] == 120 and report["fetched_blocks"] == 120
    assert server.peak == 4  # requests overlapped, and never more than --max-requests 4
    assert report["concurrency"]["cap"] == 4 and 1 <= report["concurrency"]["limit"] <= 4


def test_training_reads_respect_the_cap_too(tmp_path: Path, counting_server: Callable[..., CountingServer]) -> None:
    make_files(tmp_path / "www", 150, 20_000)
    server = counting_server(tmp_path / "www", delay_s=0.01)
    ds = fastload.FileDataset(server.url + "/data/", pattern="**/*.bin", settings=settings_for(tmp_path, max_requests=3))
    loader = fastload.DataLoader(ds, batch_size=16, collate_fn=lambda b: b)
    assert sum(len(b) for b in loader) == 150
    assert 1 < server.peak <= 3
    assert loader.stats().concurrency[server.url]["cap"] == 3


def test_worker_processes_report_their_own_limits_to_the_parent(
    tmp_path: Path, counting_server: Callable[..., CountingServer]
) -> None:
    # Each DataLoader worker process has its own host limits (a cap per process): the
    # parent's stats once showed only its own (from listing), never the workers' fetches.
    make_files(tmp_path / "www", 120, 20_000)
    server = counting_server(tmp_path / "www", delay_s=0.005)
    ds = fastload.FileDataset(server.url + "/data/", pattern="**/*.bin", settings=settings_for(tmp_path, max_requests=3))
    loader = fastload.DataLoader(ds, batch_size=8, num_workers=2, collate_fn=lambda b: b)
    assert sum(len(b) for b in loader) == 120
    state = loader.stats().concurrency[server.url]
    procs = state["processes"]
    assert {"worker 0", "worker 1"} <= set(procs), procs
    assert all(procs[w]["cap"] == 3 and 1 <= procs[w]["peak"] <= 3 for w in ("worker 0", "worker 1")), procs
    assert state["cap"] == 3 and state["limit"] == sum(p["limit"] for p in procs.values())
    assert server.peak <= 3 * len(procs)  # a cap per process: the host sees at most their sum
    text = str(loader.stats())
    assert f"requests in flight to {server.url}: settled at {state['limit']} over {len(procs)} processes" in text
    assert "cap 3 per process" in text


def test_a_standard_library_server_is_not_flooded(tmp_path: Path, counting_server: Callable[..., CountingServer]) -> None:
    # Defaults, as a new user runs it: 300 objects, each requested once (no request
    # failed and was retried), and never more than the cap at once; before the cap,
    # ~100 connections at once overflowed the backlog and TCP retried SYNs for seconds.
    make_files(tmp_path / "www", 300, 10_000)
    server = counting_server(tmp_path / "www")
    settings = settings_for(tmp_path, retries=1)  # a request that failed would fail the run
    report = fastload.stage(server.url + "/data/", settings=settings, progress=False)
    assert report.fetched_blocks == 300
    gets = server.file_gets()
    assert len(gets) == 300 and set(gets.values()) == {1}
    assert server.peak <= settings.max_requests


@pytest.mark.parametrize("status", [503, 429])
def test_the_limit_is_cut_when_the_server_says_it_is_busy(
    tmp_path: Path, counting_server: Callable[..., CountingServer], status: int
) -> None:
    # A server that can serve 2 requests at once and refuses the rest with 503 / 429:
    # the limit must come down from where it started (4) and staging still completes.
    make_files(tmp_path / "www", 150, 5_000)
    server = counting_server(tmp_path / "www", delay_s=0.01, capacity=2, busy_status=status)
    settings = settings_for(tmp_path, max_requests=16, retries=10, backoff_max_s=0.2)
    report = fastload.stage(server.url + "/data/", settings=settings, progress=False)
    assert report.fetched_blocks == 150
    assert server.busy > 0  # the server did refuse some
    state = hostlimit.settled()[server.url]
    assert state["cuts"] >= 1
    assert state["limit"] < hostlimit.START + 2  # held near the server's capacity, not grown toward 16


def test_diagnose_reports_the_limit_it_settled_on_and_advises_with_it(
    tmp_path: Path, counting_server: Callable[..., CountingServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    from fastload.diagnose import storage
    from fastload.diagnose.verdict import Inputs, make_verdict

    make_files(tmp_path / "www", 40, 20_000)
    server = counting_server(tmp_path / "www", delay_s=0.005, capacity=2)
    monkeypatch.setenv("FASTLOAD_MAX_REQUESTS", "3")
    budget = storage.StorageBudget(level_s=0.3, ttfb_requests=2, objects=8, head_requests=8, max_connections=2)
    result = storage.probe_storage(server.url + "/data/", pattern="**/*.bin", budget=budget)
    settled = result["settled_concurrency"]
    assert settled["cap"] == 3 and settled["cuts"] >= 1  # the server's 503s cut it
    verdict = make_verdict(Inputs(sample_bytes=20_000, storage_url=server.url, storage_bps=result["best_bps"],
                                  storage_connections=8, storage_settled=settled, cached_fraction=0.0))
    text = "\n".join(verdict.lines())
    assert f"settled at {settled['limit']} in flight (cap --max-requests 3, cut" in text
    assert f"fastload cache {server.url} --max-requests 8" in text  # storage saturates above the cap


def test_a_server_that_closes_each_connection_is_held_to_closing_max(
    tmp_path: Path, counting_server: Callable[..., CountingServer]
) -> None:
    # http.server answers HTTP/1.0 and closes: every request passes its 5-deep listen
    # queue. The session's response class sees that; slow start would grow past 4 otherwise.
    make_files(tmp_path / "www", 120, 5_000)
    server = counting_server(tmp_path / "www", delay_s=0.01)
    report = fastload.stage(server.url + "/data/", settings=settings_for(tmp_path, max_requests=64), progress=False)
    assert report.fetched_blocks == 120
    assert hostlimit.limit_for(server.url, 64).closing
    assert server.peak <= hostlimit.CLOSING_MAX


def test_a_connect_that_tcp_had_to_retry_cuts_the_limit(tmp_path: Path) -> None:
    # A listen queue that is full drops the SYN; TCP resends it a second later. The
    # session's connector times its connects and reports that one as congestion.
    import asyncio
    import contextlib
    import socket

    from fastload.source import Source

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    while len(fillers) < 4:  # fill the accept queue (its depth depends on the kernel)
        try:
            fillers.append(socket.create_connection(("127.0.0.1", port), timeout=0.3))
        except OSError:
            break

    def serve() -> None:
        time.sleep(1.5)  # past the client's first SYN retry
        listener.settimeout(0.2)
        conns = []
        with contextlib.suppress(OSError):
            while True:  # the fillers
                conns.append(listener.accept()[0])
        listener.settimeout(10)
        conn = listener.accept()[0]  # the client, on its next SYN retry
        conns.append(conn)
        conn.settimeout(10)
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        time.sleep(0.5)
        for c in conns:
            c.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    source = Source(url + "/x", settings=settings_for(tmp_path, retries=1))

    async def get() -> bytes:
        session = await source.fs.set_session()
        async with session.get(url + "/x") as r:
            return await r.read()

    try:
        hostlimit.limit_for(url, 64)
        body = asyncio.run_coroutine_threadsafe(get(), source.fs.loop).result(timeout=20)
    finally:
        thread.join(timeout=15)
        for s in fillers:
            s.close()
        listener.close()
    state = hostlimit.settled()[url]
    assert body == b"ok" and state["cuts"] == 1 and state["last_cut"] == "slow connect"
