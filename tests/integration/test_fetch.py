"""The fetch layer (fastload.fetch) against real servers.

Honest hit rates, servers without Range (one GET per object, streamed), stops, and
one request per block or completion however many threads want it.
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
from _memory import peak_while

import fastload
from fastload.cli import main
from fastload.config import Settings
from fastload.errors import StoppedError
from fastload.fetch.identity import Identity
from fastload.read.reader import Reader
from fastload.samples import make_image_folder
from fastload.source import RemoteItem

pytestmark = pytest.mark.integration


def test_a_cold_epoch_over_http_counts_every_item_once_as_a_miss(
    tmp_path: Path, nginx_server: Callable, capsys: pytest.CaptureFixture[str]
) -> None:
    # An HTTP listing has no sizes: each item is completed by the GET of its first block,
    # which is stored; the read that follows used to count it again as a hit (50% cold).
    make_image_folder(tmp_path / "www" / "train", n=24)
    server = nginx_server(tmp_path / "www")
    settings = Settings(cache_dir=tmp_path / "cache")
    ds = fastload.FileDataset(server.url + "/train/", pattern="**/*.jpg", settings=settings)
    loader = fastload.DataLoader(ds, batch_size=4, shuffle=True, seed=0, collate_fn=lambda b: b)
    assert sum(len(b) for b in loader) == 24
    cold = loader.stats()
    assert (cold.counters.get("cache_hit", 0), cold.counters["cache_miss"], cold.cache_hit_rate) == (0, 24, 0.0)
    loader.reset_stats()
    assert sum(len(b) for b in loader) == 24
    assert loader.stats().cache_hit_rate == 1.0
    # One by one (__getitem__, torch's own fetch path) too.
    fresh = fastload.FileDataset(server.url + "/train/", pattern="**/*.jpg", settings=Settings(cache_dir=tmp_path / "c2"))
    before = fresh.reader.hits, fresh.reader.misses
    data = [fresh[i]["data"] for i in range(len(fresh))]
    assert (fresh.reader.hits - before[0], fresh.reader.misses - before[1]) == (0, 24)
    root = server.url + "/train/"
    assert data == [(tmp_path / "www" / "train" / u[len(root):]).read_bytes() for u in (i.url for i in fresh.items)]

    # fastload bench labels the fresh epoch cold and the next warm, from the same counters.
    code = main(["bench", server.url + "/train/", "--pattern", "**/*.jpg", "--json", "--epochs", "2",
                 "--batch-size", "4", "--cache-dir", str(tmp_path / "c3")])
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert code == 0
    assert [(r["regime"], r["cache_hit_rate"]) for r in runs] == [("cold", 0.0), ("warm", 1.0)]


@pytest.fixture
def rangeless_server(tmp_path: Path) -> Iterator[tuple[str, dict[str, int]]]:
    """Python's http.server (it ignores Range headers), counting GETs per path."""
    gets: dict[str, int] = {}
    lock = threading.Lock()

    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            with lock:
                gets[self.path] = gets.get(self.path, 0) + 1
            super().do_GET()

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
            pass

    (tmp_path / "www" / "big").mkdir(parents=True)
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(tmp_path / "www")))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", gets
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=10)


def test_a_server_without_range_support_stages_a_file_larger_than_a_block(
    tmp_path: Path, rangeless_server: tuple[str, dict[str, int]]
) -> None:
    base, gets = rangeless_server
    data = os.urandom(5 * 1024**2 + 123)
    (tmp_path / "www" / "big" / "large.bin").write_bytes(data)
    settings = Settings(cache_dir=tmp_path / "cache", block_bytes=1024**2, retries=2, backoff_s=0.01)
    # It used to fail: "remote now returns 5242998 B for block 1 ... the object changed".
    report = fastload.stage(base + "/big/", settings=settings, progress=False)
    assert report.items == 1 and report.blocks == 6 and report.fetched_bytes == len(data)
    assert gets["/big/large.bin"] <= 2  # the first GET (cut after block 0), then the whole object once
    again = fastload.stage(base + "/big/", settings=settings, progress=False, refresh=True)
    assert again.fetched_blocks == 0 and again.skipped_blocks == 6
    assert Reader(settings).read(base + "/big/large.bin") == data


def test_a_server_without_range_support_serves_a_random_read_from_one_whole_fetch(
    tmp_path: Path, rangeless_server: tuple[str, dict[str, int]]
) -> None:
    base, gets = rangeless_server
    data = os.urandom(3 * 1024**2)
    (tmp_path / "www" / "big" / "large.bin").write_bytes(data)
    reader = Reader(Settings(cache_dir=tmp_path / "cache", block_bytes=1024**2, retries=2, backoff_s=0.01))
    item = reader.stat(base + "/big/large.bin")
    assert reader.read_range(item, 2 * 1024**2 + 5, 2 * 1024**2 + 100) == data[2 * 1024**2 + 5 : 2 * 1024**2 + 100]
    assert reader.read(item) == data  # every block was kept from that one answer
    assert gets["/big/large.bin"] == 1


class _HoldingServer:
    """A ThreadingHTTPServer that counts file GETs and holds each answer until ``release`` is set."""

    def __init__(self, root: Path) -> None:
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.gets = 0
        self.held = 0
        server = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                with server.lock:
                    server.gets += 1
                    server.held += 1
                server.release.wait(timeout=120)
                with server.lock:
                    server.held -= 1
                super().do_GET()

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
                pass

        class Quiet(http.server.ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # a cancelled request's client hung up: expected here

        self.httpd = Quiet(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)


def _until(cond: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_stop_starts_no_fetch_ahead_and_ends_the_wait_for_one(tmp_path: Path) -> None:
    # Staging's Ctrl-C (Reader.stop): Fetcher.ahead once started requests after it, fetches
    # ahead queued for a slot went out when one came free, and finishing one waited for its
    # answer (up to twice the request timeout) instead of ending.
    (tmp_path / "www").mkdir()
    for k in range(8):
        (tmp_path / "www" / f"f{k}.bin").write_bytes(os.urandom(1000))
    server = _HoldingServer(tmp_path / "www")
    try:
        reader = Reader(Settings(cache_dir=tmp_path / "cache", max_requests=1, request_timeout_s=60, retries=1))
        items = [RemoteItem(f"{server.url}/f{k}.bin", -1, "") for k in range(8)]
        assert reader.fetcher.ahead(items[:5]) == 5  # one request in flight (the cap), four queued for its slot
        _until(lambda: server.held == 1, "the first fetch ahead never reached the server")
        reader.stop.set()
        assert reader.fetcher.ahead(items[5:]) == 0
        errors: list[BaseException] = []

        def complete() -> None:
            try:
                reader.fetcher.complete(items[:1])
            except BaseException as err:
                errors.append(err)

        thread = threading.Thread(target=complete, daemon=True)
        thread.start()
        thread.join(timeout=20)  # the server still holds its answer
        assert not thread.is_alive() and len(errors) == 1 and isinstance(errors[0], StoppedError), errors
        server.release.set()
        limit = reader.sources.of(items[0].url).host_limit
        assert limit is not None
        _until(lambda: limit.in_flight == 0 and not limit._waiters, "slots were not given back")
        assert server.gets == 1  # none of the queued fetches ahead went out once stopped
    finally:
        server.close()


def test_two_threads_completing_one_sizeless_item_send_one_request(tmp_path: Path) -> None:
    # Fetcher.complete had no in-flight entry: two threads completing the same sizeless
    # item at once (two staging chunks, or a read and a stage) each sent its first GET.
    (tmp_path / "www").mkdir()
    data = os.urandom(3000)
    (tmp_path / "www" / "a.bin").write_bytes(data)
    server = _HoldingServer(tmp_path / "www")
    try:
        reader = Reader(Settings(cache_dir=tmp_path / "cache", request_timeout_s=60, retries=1))
        item = RemoteItem(f"{server.url}/a.bin", -1, "")
        results: list[tuple[list[RemoteItem], dict[str, bytes]]] = []
        threads = [threading.Thread(target=lambda: results.append(reader.fetcher.complete([item])), daemon=True)
                   for _ in range(2)]
        threads[0].start()
        _until(lambda: server.held == 1, "the first completion never reached the server")
        assert reader.fetcher.ahead([item]) == 0  # nor is it fetched ahead: that GET brings its first block
        threads[1].start()
        time.sleep(0.5)  # time for the second thread's own GET to reach the server, if it sends one
        server.release.set()
        for t in threads:
            t.join(timeout=30)
        assert len(results) == 2
        assert server.gets == 1
        for done, fresh in results:
            assert done[0].size == len(data) and list(fresh.values()) == [data]
        assert results[0][0] == results[1][0]
        assert reader.misses == 1  # counted once, by the thread that fetched it
    finally:
        server.close()


def test_a_server_without_range_support_streams_a_large_object_into_the_cache(
    tmp_path: Path, rangeless_server: tuple[str, dict[str, int]]
) -> None:
    # Its whole-object answer was held in memory and then split (64 MB for a 64 MB object,
    # and more for the copies); now each block is stored as it arrives.
    base, gets = rangeless_server
    mb = 1024**2
    path = tmp_path / "www" / "big" / "huge.bin"
    with path.open("wb") as f:
        for _ in range(64):
            f.write(os.urandom(mb))
    reader = Reader(Settings(cache_dir=tmp_path / "cache", block_bytes=mb, retries=2, backoff_s=0.01))
    (item,), fresh = reader.fetcher.complete([RemoteItem(base + "/big/huge.bin", -1, "")])  # finds Range ignored
    assert item.size == 64 * mb and len(fresh) == 1
    block, peak = peak_while(lambda: reader.read_block(item, 40))
    assert peak < 16 * mb, f"{peak / mb:.1f} MB held while fetching a 64 MB object"
    assert gets["/big/huge.bin"] == 2  # the first GET (cut after block 0), then the whole object once
    with path.open("rb") as f:
        f.seek(40 * mb)
        assert block == f.read(mb)
        f.seek(0)
        for b in reader.identity.blocks(item):  # every block was stored from that one answer
            assert reader.cache.get(reader.identity.key(item, b)) == f.read(mb), b
    assert gets["/big/huge.bin"] == 2


def test_a_block_wanted_while_its_object_streams_waits_for_that_stream(tmp_path: Path) -> None:
    # The stream of a whole object (a server without Range) enters every block in the
    # in-flight table: a second thread reading another block of it waits for that GET
    # instead of sending a whole-object GET of its own.
    (tmp_path / "www").mkdir()
    mb = 1024**2
    data = os.urandom(3 * mb)
    (tmp_path / "www" / "a.bin").write_bytes(data)
    server = _HoldingServer(tmp_path / "www")
    try:
        reader = Reader(Settings(cache_dir=tmp_path / "cache", block_bytes=mb, request_timeout_s=60, retries=1))
        server.release.set()
        (item,), _ = reader.fetcher.complete([RemoteItem(f"{server.url}/a.bin", -1, "")])  # finds Range ignored
        server.release.clear()
        got: dict[int, bytes] = {}
        first = threading.Thread(target=lambda: got.update({1: reader.read_block(item, 1)}), daemon=True)
        first.start()
        _until(lambda: server.held == 1, "the whole-object GET never reached the server")
        second = threading.Thread(target=lambda: got.update({2: reader.read_block(item, 2)}), daemon=True)
        second.start()
        time.sleep(0.5)  # time for the second thread's own GET to reach the server, if it sends one
        server.release.set()
        first.join(timeout=30)
        second.join(timeout=30)
        assert got == {1: data[mb : 2 * mb], 2: data[2 * mb :]}
        assert server.gets == 2  # the first block's GET, then the whole object once
    finally:
        server.close()


def test_a_cold_batch_hands_out_fetched_objects_without_copying_them(
    tmp_path: Path, nginx_server: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A whole object fetched just now is its sample's bytes: only the rest of the batch
    # (cached items, objects larger than a block) goes through the batch buffer.
    import fastload.dataset as dataset_module

    www = tmp_path / "www"
    www.mkdir()
    files = {f"{i}.bin": os.urandom(3000 + i) for i in range(6)}
    files["big.bin"] = os.urandom(70_000)  # larger than a block: only its first block is fetched whole
    for name, data in files.items():
        (www / name).write_bytes(data)
    server = nginx_server(www)
    settings = Settings(cache_dir=tmp_path / "cache", block_bytes=16 * 1024)
    ds = fastload.FileDataset(server.url + "/", settings=settings)
    names = [p.rsplit("/", 1)[-1] for p in ds.relpaths]
    ds.read_batch([names.index("0.bin")])  # cached before the batch: read back, not fetched
    buffered: list[int] = []
    real = dataset_module._batch_buffer

    def spy(sizes: Any, **kw: Any) -> Any:
        buffered.extend(sizes)
        return real(sizes, **kw)

    monkeypatch.setattr(dataset_module, "_batch_buffer", spy)
    batch = ds.read_batch(list(range(len(ds))))
    assert [s["data"] for s in batch] == [files[n] for n in names]  # every sample right, in order
    assert sorted(buffered) == sorted([len(files["0.bin"]), len(files["big.bin"])])


def test_a_read_of_items_fetched_ahead_looks_up_their_pins_once(
    tmp_path: Path, nginx_server: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    # fetch_ahead looks up a sizeless item's pin before its GET; the read that takes that GET
    # does not look again (one index query per batch, not two, on the cold path).
    make_image_folder(tmp_path / "www" / "train", n=12)
    server = nginx_server(tmp_path / "www")
    ds = fastload.FileDataset(server.url + "/train/", pattern="**/*.jpg", settings=Settings(cache_dir=tmp_path / "cache"))
    looked: list[str] = []
    real = Identity.pinned

    def pinned(self: Identity, items: list[RemoteItem]) -> list[RemoteItem]:
        looked.extend(i.url for i in items)
        return real(self, items)

    monkeypatch.setattr(Identity, "pinned", pinned)
    batch = list(range(len(ds)))
    ds.fetch_ahead(batch)
    samples = ds.read_batch(batch)
    assert [s["data"][:3] for s in samples] == [b"\xff\xd8\xff"] * len(ds)
    assert sorted(looked) == sorted(ds.items[i].url for i in batch)  # each looked up once
