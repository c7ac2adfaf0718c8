"""An object rewritten on the remote is never served as a mix of its versions (nginx, a real server)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload.cache import Cache
from fastload.config import Settings
from fastload.errors import RemoteChangedError
from fastload.read.reader import Reader

pytestmark = pytest.mark.integration

MB = 1024**2


def _rewrite(path: Path, version: int) -> bytes:
    """The file rewritten in place at the same size, with a later mtime (nginx's ETag is mtime-size)."""
    data = bytes([version]) * (4 * MB)
    with path.open("r+b") as f:
        f.write(data)
    os.utime(path, (1_700_000_000 + version, 1_700_000_000 + version))
    return data


def _evict(settings: Settings, url: str, blocks: set[int]) -> None:
    cache = Cache(settings)
    for entry in list(cache.entries()):
        if entry.url == url and entry.block in blocks:
            assert cache.drop(entry.key)
    cache.close()


def test_a_rewritten_object_is_a_remote_changed_error_never_a_torn_read(
    tmp_path: Path, nginx_server: Callable[..., Any]
) -> None:
    # Stage a 4 MiB file (1 MiB blocks), rewrite it at the same size, evict part, read;
    # repeat: the read returned blocks 0-1 of version 3, block 2 of 1 and block 3 of 2.
    (tmp_path / "www").mkdir()
    path = tmp_path / "www" / "obj.bin"
    path.write_bytes(b"")
    v1 = _rewrite(path, 1)
    server = nginx_server(tmp_path / "www")
    folder = server.url.rstrip("/") + "/"
    settings = Settings(cache_dir=tmp_path / "cache", block_bytes=MB, retries=2, backoff_s=0.01)
    fastload.stage(folder, settings=settings, progress=False)
    reader = Reader(settings)
    (item,) = reader.list(folder)
    assert reader.read(item) == v1
    _rewrite(path, 2)
    _evict(settings, item.url, {2, 3})
    for reader in (Reader(settings), Reader(settings)):  # a first read, then one of a warm process
        (item,) = reader.list(folder)  # the recorded listing: version 1's size and ETag
        with pytest.raises(RemoteChangedError, match=r"obj\.bin: remote now has .*the object changed; fix: `fastload cache --refresh`"):
            reader.read(item)
    _rewrite(path, 3)
    _evict(settings, item.url, {0, 1})
    reader = Reader(settings)
    (item,) = reader.list(folder)
    with pytest.raises(RemoteChangedError, match=r"obj\.bin"):
        reader.read(item)
    fastload.stage(folder, settings=settings, progress=False, refresh=True)  # the fix the message names
    reader = Reader(settings)
    (item,) = reader.list(folder)
    assert reader.read(item) == bytes([3]) * (4 * MB)
