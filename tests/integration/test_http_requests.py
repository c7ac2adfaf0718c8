"""How many requests staging and cold reads make over HTTP, counted in nginx's access log.

An HTTP listing has no sizes. A HEAD per object before its GET doubled the
per-object latency on a 20 ms link (benchmarks/peers), so a fresh stage now
completes each object with the GET of its first block (Source.read_first);
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
from fastload.config import Settings
from fastload.errors import RemoteNotFoundError
from fastload.reader import Reader, manifest_key
from fastload.source import RemoteItem, Source

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
    return Settings(cache_dir=tmp_path / "cache", block_bytes=64 * 1024, workers=4, retries=2, backoff_s=0.01)


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
    index.delete(manifest_key(root, "**/*.bin"))
    for key in [k for k in index.iterkeys() if isinstance(k, str) and k.startswith("u:")]:
        index.delete(key)
    index.set("p:" + manifest_key(root, "**/*.bin"), time.time())
    gets = _requests(server, "GET")

    report = fastload.stage(url, pattern="**/*.bin", settings=settings, progress=False)
    assert (report.fetched_blocks, report.skipped_blocks) == (0, len(files) + 3)
    assert _requests(server, "HEAD") == len(files)
    assert _requests(server, "GET") == gets  # nothing refetched
    assert index.get("p:" + manifest_key(root, "**/*.bin")) is None  # done: marker gone


def test_misses_of_one_batch_are_fetched_concurrently(tmp_path: Path, settings: Settings) -> None:
    reader = Reader(settings)
    items = [RemoteItem(f"http://example.invalid/{i}.bin", 1000, "v1") for i in range(8)]
    lock, active, peak = threading.Lock(), [0], [0]

    def slow_fetch(item: RemoteItem, block: int, *, store: bool = True) -> bytes:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.05)  # one round trip to a remote
        with lock:
            active[0] -= 1
        data = item.url[-5].encode() * item.size
        reader.store_block(item, block, data)
        return data

    reader.fetch_block = slow_fetch  # type: ignore[method-assign]
    out = bytearray(8000)
    reader.read_into([(item, 0, 1000, 1000 * k) for k, item in enumerate(items)], out)
    assert bytes(out) == b"".join(str(k).encode() * 1000 for k in range(8))
    assert peak[0] > 1  # overlapped, not one after another
    assert reader.cache.get(reader.key(items[3], 0)) == b"3" * 1000


def test_read_first_many_overlaps_gets_and_names_a_missing_object(
    tmp_path: Path, nginx_server: Callable, settings: Settings
) -> None:
    files = _tree(tmp_path / "www")
    server = nginx_server(tmp_path / "www")
    src = Source(server.url + "/", settings=settings)
    sizeless = [RemoteItem(f"{server.url}/{rel}", -1, "") for rel in sorted(files)]
    got = src.read_first_many(sizeless, 64 * 1024)
    for (item, first), rel in zip(got, sorted(files)):
        assert item.size == len(files[rel]) and item.version
        assert first == files[rel][: 64 * 1024]
    assert _requests(server, "GET") == len(files) and _requests(server, "HEAD") == 0

    missing = [*sizeless[:2], RemoteItem(f"{server.url}/c0/gone.bin", -1, "")]
    with pytest.raises(RemoteNotFoundError, match="gone.bin"):
        src.read_first_many(missing, 64 * 1024)
