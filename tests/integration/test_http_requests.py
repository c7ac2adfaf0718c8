"""How many requests staging and cold reads make over HTTP, counted in nginx's access log.

An HTTP listing has no sizes. A HEAD per object before its GET doubled the
per-object latency on a 20 ms link (benchmarks/peers), so a fresh stage now
completes each object with the GET of its first block (Source.fetch_first);
an interrupted stage's rerun still HEADs, so what is cached is skipped.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import fastload
from fastload._servers import NginxServer
from fastload.cache import keys
from fastload.config import Settings
from fastload.errors import RemoteNotFoundError
from fastload.read.reader import Reader
from fastload.source import RemoteItem, Source
from fastload.transport.curl import CurlRoute

pytestmark = pytest.mark.integration


def _tree(root: Path, n: int = 9) -> dict[str, bytes]:
    files = {}
    for i in range(n):
        rel = f"c{i % 3}/f{i:02d}.bin"
        # Item 0 spans several 64 KiB blocks: its first block comes with its size.
        data = os.urandom(200_000 if i == 0 else 5_000 + i)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        files[rel] = data
    return files


def _requests(server: NginxServer, method: str, suffix: str = ".bin") -> int:
    assert server.workdir is not None
    log = (server.workdir / "access.log").read_text()
    return sum(1 for line in log.splitlines() if f'"{method} ' in line and f"{suffix} HTTP" in line)


@pytest.fixture()
def settings(tmp_path: Path) -> Settings:
    return Settings(cache_dir=tmp_path / "cache", block_bytes=64 * 1024, max_requests=4, retries=2, backoff_s=0.01)


def test_fresh_stage_fetches_each_sizeless_object_with_one_get(
    tmp_path: Path, nginx_server: Callable, settings: Settings
) -> None:
    files = _tree(tmp_path / "www")
    server = nginx_server(tmp_path / "www")
    report = fastload.stage(server.url + "/", pattern="**/*.bin", settings=settings, progress=False)
    assert report.remote_bytes == sum(map(len, files.values()))
    assert _requests(server, "HEAD") == 0
    # One GET per object, plus the extra blocks of the 200 kB one (4 blocks of 64 KiB).
    assert _requests(server, "GET") == len(files) + 3

    # The identity a GET's headers gave is the one a HEAD-completed listing gives.
    headed = Reader(Settings(cache_dir=tmp_path / "other")).list(server.url + "/", "**/*.bin")
    staged = Reader(settings).list(server.url + "/", "**/*.bin")
    assert [(i.url, i.size, i.version) for i in staged] == [(i.url, i.size, i.version) for i in headed]
    assert all(i.version for i in staged)

    server.stop()  # every byte now comes from the cache
    reader = Reader(settings)
    for item in staged:
        rel = item.url.split("/", 3)[3]
        assert reader.read(item) == files[rel]


def test_interrupted_stage_reruns_with_heads_and_skips_what_is_cached(
    tmp_path: Path, nginx_server: Callable, settings: Settings
) -> None:
    files = _tree(tmp_path / "www")
    server = nginx_server(tmp_path / "www")
    url = server.url + "/"
    fastload.stage(url, pattern="**/*.bin", settings=settings, progress=False)
    reader = Reader(settings)
    root = reader.manifest_root(url)
    # Make it look interrupted: blocks cached, no manifest or pins, the marker left behind.
    index = reader.cache.index
    index.delete(keys.manifest(root, "**/*.bin"))
    for key in [k for k in index.iterkeys() if keys.of(keys.PIN, k) is not None]:
        index.delete(key)
    index.set(keys.staging(root, "**/*.bin"), time.time())
    gets = _requests(server, "GET")

    report = fastload.stage(url, pattern="**/*.bin", settings=settings, progress=False)
    assert (report.fetched_blocks, report.skipped_blocks) == (0, len(files) + 3)
    assert _requests(server, "HEAD") == len(files)
    assert _requests(server, "GET") == gets  # nothing refetched
    assert index.get(keys.staging(root, "**/*.bin")) is None  # done: marker gone


def test_misses_of_one_batch_are_fetched_concurrently(tmp_path: Path, settings: Settings) -> None:
    # A store without an event loop (here file://, its fetches stubbed slow): a thread pool.
    reader = Reader(settings)
    items = [RemoteItem(f"file://{tmp_path}/{i}.bin", 1000, "v1") for i in range(8)]
    lock, active, peak = threading.Lock(), [0], [0]

    def slow_fetch(url: str, start: int = 0, end: int | None = None, *, expect: int | None = None, listed: object = None) -> bytes:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.05)  # one round trip to a remote
        with lock:
            active[0] -= 1
        return url[-5].encode() * 1000

    reader.sources.of(items[0].url).fetch = slow_fetch  # type: ignore[method-assign]
    out = bytearray(8000)
    reader.read_into([(item, 0, 1000, 1000 * k) for k, item in enumerate(items)], out)
    assert bytes(out) == b"".join(str(k).encode() * 1000 for k in range(8))
    assert peak[0] > 1  # overlapped, not one after another
    assert reader.cache.get(reader.identity.key(items[3], 0)) == b"3" * 1000  # stored by the batch


def test_http_misses_of_one_batch_go_out_together(
    tmp_path: Path, nginx_server: Callable, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On libcurl's engine (fastload.source.ranged) where it runs, else on fsspec's event loop: either
    # way one batch of requests, not a thread per request.
    files = _tree(tmp_path / "www")
    server = nginx_server(tmp_path / "www")
    reader = Reader(settings)
    items = [reader.stat(f"{server.url}/{rel}") for rel in sorted(files) if not rel.endswith("f00.bin")]
    heads = _requests(server, "HEAD")
    calls: list[int] = []
    gather = fastload.source.aio.gather_ranges
    start_ranges = CurlRoute.start_ranges

    async def counting(fs: object, ranges: list, *args: object, **kwargs: object) -> list:
        calls.append(len(ranges))
        return await gather(fs, ranges, *args, **kwargs)

    def counting_engine(route: CurlRoute, spans: list, *args: object, **kwargs: object) -> list:
        calls.append(len(spans))
        return start_ranges(route, spans, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(fastload.source.aio, "gather_ranges", counting)
    monkeypatch.setattr(CurlRoute, "start_ranges", counting_engine)
    sizes = [i.size for i in items]
    out = bytearray(sum(sizes))
    offsets = [sum(sizes[:k]) for k in range(len(items))]
    reader.read_into([(item, 0, item.size, off) for item, off in zip(items, offsets)], out)
    rels = [r for r in sorted(files) if not r.endswith("f00.bin")]
    assert bytes(out) == b"".join(files[r] for r in rels)
    assert calls == [len(items)]  # one batch of requests, no thread per request
    assert _requests(server, "GET") == len(items) and _requests(server, "HEAD") == heads
    assert all(reader.cache.contains(reader.identity.key(i, 0)) for i in items)  # cached by one put_many


def test_file_dataset_over_http_sends_one_get_per_object_and_no_head(
    tmp_path: Path, nginx_server: Callable, settings: Settings
) -> None:
    files = _tree(tmp_path / "www")
    server = nginx_server(tmp_path / "www")
    url = server.url + "/"
    ds = fastload.FileDataset(url, pattern="**/*.bin", settings=settings)
    assert all(i.size < 0 for i in ds.items)  # an HTTP listing has no sizes: none asked for yet
    root = ds.reader.manifest_root(url) + "/"
    loader = fastload.DataLoader(ds, batch_size=4, collate_fn=lambda b: b)
    got = {s["url"][len(root):]: s["data"] for batch in loader for s in batch}
    assert got == files
    assert _requests(server, "HEAD") == 0
    # One GET per object (its first block gives size and version), plus the 200 kB one's other blocks.
    assert _requests(server, "GET") == len(files) + 3
    # Every size is known now: the listing became the manifest, so a new dataset lists nothing.
    listings = _requests(server, "GET", suffix="/")
    again = fastload.FileDataset(url, pattern="**/*.bin", settings=settings)
    assert all(i.size >= 0 for i in again.items) and _requests(server, "GET", suffix="/") == listings
    server.stop()  # the second epoch needs no server
    assert {s["url"][len(root):]: s["data"] for b in fastload.DataLoader(again, batch_size=4, collate_fn=lambda b: b) for s in b} == files


def test_announced_batches_are_fetched_ahead_without_fetching_twice(
    tmp_path: Path, nginx_server: Callable, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = _tree(tmp_path / "www", n=24)
    server = nginx_server(tmp_path / "www")
    ds = fastload.FileDataset(server.url + "/", pattern="**/*.bin", settings=settings)
    started: list[int] = []
    ahead = ds.reader.fetcher.ahead

    def counting(items: list[RemoteItem]) -> int:
        n = ahead(items)
        started.append(n)
        return n

    monkeypatch.setattr(ds.reader.fetcher, "ahead", counting)
    batches = list(fastload.DataLoader(ds, batch_size=4, shuffle=True, seed=3, collate_fn=lambda b: b))
    plain = list(fastload.DataLoader(ds, batch_size=4, shuffle=True, seed=3, collate_fn=lambda b: b))
    assert [[s["url"] for s in b] for b in batches] == [[s["url"] for s in b] for b in plain]  # same order
    assert sum(started) == len(files)  # every file fetched ahead once (the 200 kB one: its first block); none when cached
    assert _requests(server, "GET") == len(files) + 3 and _requests(server, "HEAD") == 0  # nothing twice


def test_fetch_first_many_overlaps_gets_and_names_a_missing_object(
    tmp_path: Path, nginx_server: Callable, settings: Settings
) -> None:
    files = _tree(tmp_path / "www")
    server = nginx_server(tmp_path / "www")
    src = Source(server.url + "/", settings=settings)
    sizeless = [RemoteItem(f"{server.url}/{rel}", -1, "") for rel in sorted(files)]
    got = src.fetch_first_many(sizeless, 64 * 1024)
    for (item, first), rel in zip(got, sorted(files)):
        assert item.size == len(files[rel]) and item.version
        assert first == files[rel][: 64 * 1024]
    assert _requests(server, "GET") == len(files) and _requests(server, "HEAD") == 0

    missing = [*sizeless[:2], RemoteItem(f"{server.url}/c0/gone.bin", -1, "")]
    with pytest.raises(RemoteNotFoundError, match="gone.bin"):
        src.fetch_first_many(missing, 64 * 1024)
