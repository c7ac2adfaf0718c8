"""A cache staged before issue 25 (its index a diskcache) on a disk that refuses writes:
mounted read-only (the "stage once, mount read-only" pattern) or full. Its index cannot
be migrated (that writes), so it is read in place, and an epoch makes no request (issue 32)."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import make_noise_files

import fastload
from fastload.cache import Cache
from fastload.cache.index import INDEX_FILE
from fastload.cache.migrate import OLD_FILE
from fastload.config import Settings

pytestmark = pytest.mark.integration

N, SIZE = 40, 30_000


def _requests(server: Any) -> int:
    """Requests nginx has answered so far (its access log)."""
    return len((server.workdir / "access.log").read_text().splitlines())


def _epoch(url: str, settings: Settings, files: dict[str, bytes]) -> int:
    ds = fastload.FileDataset(url, settings=settings)
    root = ds.reader.manifest_root(url) + "/"
    n = 0
    for batch in fastload.DataLoader(ds, batch_size=8, shuffle=True, collate_fn=lambda b: b, seed=1):
        for sample in batch:
            assert sample["data"] == files[sample["url"][len(root) :]], sample["url"]
            n += 1
    return n


def _stage_old(url: str, settings: Settings) -> None:
    """Stage ``url``, then give the cache the index fastload wrote before issue 25: a diskcache
    with the same records (as tests/unit/test_cache_index.py makes one)."""
    diskcache = pytest.importorskip("diskcache", reason="building an index of the old format needs the diskcache package")
    fastload.stage(url, settings=settings, progress=False)
    cache = Cache(settings)
    records = {k: cache.index.get(k) for k in cache.index.iterkeys()}
    cache.close()
    index_dir = settings.cache_dir / "index"
    for p in index_dir.iterdir():
        p.unlink()
    old = diskcache.Cache(str(index_dir), eviction_policy="none", size_limit=2**62)
    for k, v in records.items():
        old.set(k, v)
    old.close()  # its last connection: the write-ahead log is checkpointed into cache.db


def _fill(path: Path) -> None:
    """Fill ``path``'s disk to its last block from outside fastload (a tmpfs refuses at its size)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError as err:
        assert err.errno == errno.ENOSPC, err
    finally:
        os.close(fd)
    assert os.statvfs(path.parent).f_bavail == 0


@pytest.mark.parametrize("disk_state", ["read-only", "full"])
def test_an_old_cache_on_a_disk_that_refuses_writes_serves_an_epoch_with_no_request(
    disk_state: str, tmp_path: Path, nginx_server: Callable[..., Any], tmpfs: Callable[..., Path]
) -> None:
    files = make_noise_files(tmp_path / "www", N, SIZE)
    server = nginx_server(tmp_path / "www")
    url = server.url + "/"
    disk = tmpfs(16 * 1024**2)
    settings = Settings(cache_dir=disk / "cache", block_bytes=64 * 1024, disk_reserve_bytes=0)
    _stage_old(url, settings)
    index_dir = settings.cache_dir / "index"
    if disk_state == "read-only":
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    else:
        filler = disk / "checkpoint.bin"
        _fill(filler)
    requests = _requests(server)

    cache = Cache(settings)
    assert cache.unwritable == disk_state and getattr(cache.index, "old", False), cache.unwritable
    cache.close()
    assert _epoch(url, settings, files) == N  # every sample right, from the old index read in place
    assert _requests(server) == requests  # not one request: listing and payloads came from the cache
    assert (index_dir / OLD_FILE).exists()  # not migrated

    if disk_state == "full":  # space comes back: the next open migrates it, and still serves
        filler.unlink()
        cache = Cache(settings)
        assert cache.unwritable is None and not (index_dir / OLD_FILE).exists() and (index_dir / INDEX_FILE).exists()
        cache.close()
        assert _epoch(url, settings, files) == N and _requests(server) == requests
