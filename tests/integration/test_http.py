"""Staging and reading over a real nginx (Range requests, autoindex listing)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import fsspec
import pytest

import fastload
from fastload.config import Settings
from fastload.errors import SourceError
from fastload.read.reader import Reader

pytestmark = pytest.mark.integration


def make_tree(root: Path, n: int = 12) -> dict[str, bytes]:
    files = {}
    for i in range(n):
        rel = f"class_{i % 3}/img_{i:03d}.bin"
        data = (b"pixel row %d " % i) * 2000 + os.urandom(500)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        files[rel] = data
    return files


@pytest.fixture()
def settings(tmp_path: Path) -> Settings:
    return Settings(
        cache_dir=tmp_path / "cache",
        block_bytes=64 * 1024,
        max_requests=4,
        retries=2,
        backoff_s=0.01,
        request_timeout_s=10,
    )


def test_stage_over_http_then_train_with_the_server_stopped(
    tmp_path: Path, nginx_server: Callable, settings: Settings
) -> None:
    root = tmp_path / "www"
    files = make_tree(root)
    (root / "notes.txt").write_text("not part of the pattern")
    server = nginx_server(root)
    report = fastload.stage(server.url + "/", pattern="**/*.bin", settings=settings, progress=False)
    assert (report.items, report.fetched_blocks, report.remote_bytes) == (
        len(files),
        len(files),
        sum(map(len, files.values())),
    )
    assert report.stored_bytes < report.remote_bytes  # LZ4 paid off on these rows

    base = server.url
    server.stop()  # from here on, any remote round trip would fail
    reader = Reader(settings)
    for rel, data in files.items():
        assert reader.read(f"{base}/{rel}") == data
        with fastload.open(f"{base}/{rel}", settings=settings) as f:
            assert f.read() == data
    assert reader.misses == 0
    assert len(reader.list(base + "/", "**/*.bin")) == len(files)


def test_fsspec_protocol_reads_through_the_cache(
    tmp_path: Path, nginx_server: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FASTLOAD_CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "www"
    files = make_tree(root, n=3)
    server = nginx_server(root)
    rel, data = next(iter(files.items()))
    assert fsspec.get_filesystem_class("fastload") is fastload.FastloadFileSystem  # entry point
    with fsspec.open(f"fastload::{server.url}/{rel}", "rb") as f:
        assert f.read() == data
    with fsspec.open(f"fastload::{server.url}/{rel}", "rb") as f:
        f.seek(100)
        assert f.read(50) == data[100:150]
    assert len(list(fastload.Cache(Settings.from_env()).entries())) == 1


def test_range_reads_of_a_large_file_fetch_only_needed_blocks(
    tmp_path: Path, nginx_server: Callable, settings: Settings
) -> None:
    root = tmp_path / "www"
    root.mkdir()
    big = os.urandom(40 * 64 * 1024)
    (root / "shard.tar").write_bytes(big)
    server = nginx_server(root)
    reader = Reader(settings)
    item = reader.stat(f"{server.url}/shard.tar")
    assert (
        reader.read_range(item, 20 * 65536 + 7, 20 * 65536 + 9000)
        == big[20 * 65536 + 7 : 20 * 65536 + 9000]
    )
    assert reader.misses == 1
    entries = list(reader.cache.entries())
    assert [e.block for e in entries] == [20] and entries[0].raw == 65536
    log = (
        (server.workdir / "access.log").read_text()
        if (server.workdir / "access.log").exists()
        else ""
    )
    if log:
        assert " 206 " in log  # served as a Range request, not the whole file


def test_stale_remote_is_refreshed_and_unpinned_reads_revalidate(
    tmp_path: Path, nginx_server: Callable, settings: Settings
) -> None:
    root = tmp_path / "www"
    root.mkdir()
    (root / "a.bin").write_bytes(b"first version")
    server = nginx_server(root)
    url = f"{server.url}/a.bin"
    assert Reader(settings).read(url) == b"first version"  # not staged: no manifest pin
    (root / "a.bin").write_bytes(b"second version!")
    assert Reader(settings).read(url) == b"second version!"

    fastload.stage(server.url + "/", settings=settings, progress=False)
    (root / "a.bin").write_bytes(b"third")
    assert Reader(settings).read(url) == b"second version!"  # staged snapshot, by design
    report = fastload.stage(server.url + "/", settings=settings, refresh=True, progress=False)
    assert report.fetched_blocks == 1
    assert Reader(settings).read(url) == b"third"


def test_a_dead_server_gives_a_named_error(
    tmp_path: Path, nginx_server: Callable, settings: Settings
) -> None:
    # A missing object is the Source contract's (tests/integration/test_source_contract.py).
    root = tmp_path / "www"
    root.mkdir()
    server = nginx_server(root)
    base = server.url
    server.stop()
    with pytest.raises(SourceError, match=rf"{base}/x\.bin.*failed after 2 attempts.*fix"):
        Reader(settings).read(f"{base}/x.bin")


def test_python_http_server_folder_pages_are_listed_not_staged_as_files(tmp_path: Path, settings: Settings) -> None:
    import functools
    import http.server
    import threading

    root = tmp_path / "www"
    files = make_tree(root, n=4)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{httpd.server_address[1]}"
        report = fastload.stage(base + "/", pattern="**/*.bin", settings=settings, progress=False)
        assert report.items == len(files) and report.remote_bytes == sum(map(len, files.values()))
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


def test_cold_epoch_with_workers_over_http_yields_the_files(
    tmp_path: Path, nginx_server: Callable, settings: Settings
) -> None:
    # Sizes come from each file's first GET inside the workers, and the payloads cross
    # to the parent through shared buffers (fastload/device/worker_pack.py): bytes as served.
    files = make_tree(tmp_path / "www", n=30)
    server = nginx_server(tmp_path / "www")
    ds = fastload.FileDataset(server.url + "/", pattern="**/*.bin", label="parent", settings=settings)
    loader = fastload.DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, seed=1)
    for _ in range(2):  # cold, then warm
        got = {url: data for batch in loader for url, data in zip(batch["url"], batch["data"])}
        assert got == {f"{server.url}/{rel}": data for rel, data in files.items()}
    assert loader.stats().counters.get("cache_miss") == len(files)
