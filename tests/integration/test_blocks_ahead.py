"""Shard datasets fetch the blocks of announced batches ahead of their reads (fastload/read/ahead.py), over nginx.

Each test reads a cold dataset through ``fastload.DataLoader`` with a slow transform (the
decode a training job does) and records when each block was first asked of the Fetcher and
when each batch's read began. The blocks of every batch past the first few were asked for
before that batch's read began, by the fetch-ahead threads; nginx's access log shows each
block fetched once; the samples are the bytes written; no fetch-ahead thread outlives the pass.
"""

from __future__ import annotations

import gc
import gzip
import io
import json
import re
import struct
import tarfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import fastload
from fastload.cache import Cache, keys
from fastload.config import Settings
from fastload.errors import RemoteChangedError
from fastload.formats.mds import MDSDataset

pytestmark = pytest.mark.integration

BLOCK = 16 * 1024
BATCH = 8
SKIP = 12  # the first batches are read while the first announcement is still being planned
_GET = re.compile(r'"GET /ds/([^ ]+) HTTP/1\.1" (\d+) (\d+)')


def _settings(cache: Path) -> Settings:
    return Settings(cache_dir=cache, block_bytes=BLOCK, retries=1, backoff_s=0.01, request_timeout_s=10)


def _write_mds(out: Path, rows: list[bytes], per_shard: int, gz: bool) -> None:
    """MDS shards of one ``bytes`` column, as MDSWriter lays them out; gzip-compressed whole with ``gz``."""
    out.mkdir(parents=True)
    shards = []
    for s in range(0, len(rows), per_shard):
        samples = [struct.pack("<I", len(r)) + r for r in rows[s : s + per_shard]]
        offsets = np.cumsum([4 + 4 * (len(samples) + 1)] + [len(x) for x in samples]).astype("<u4")
        data = struct.pack("<I", len(samples)) + offsets.tobytes() + b"".join(samples)
        name = f"shard.{s // per_shard:05d}.mds"
        entry: dict[str, Any] = {"column_encodings": ["bytes"], "column_names": ["b"], "column_sizes": [None],
                                 "compression": None, "format": "mds", "hashes": [], "samples": len(samples),
                                 "raw_data": {"basename": name, "bytes": len(data), "hashes": {}},
                                 "size_limit": None, "version": 2, "zip_data": None}
        if gz:
            data = gzip.compress(data, 1)
            entry.update(compression="gz:1", zip_data={"basename": name + ".gz", "bytes": len(data), "hashes": {}})
            name += ".gz"
        (out / name).write_bytes(data)
        shards.append(entry)
    (out / "index.json").write_text(json.dumps({"shards": shards, "version": 2}))


class _Watch:
    """When each block was first asked of the dataset's Fetcher (and by which thread), and when each batch's read began."""

    def __init__(self, ds: Any) -> None:
        self.asked: dict[tuple[str, int], tuple[float, str]] = {}
        self.reads: list[tuple[float, list[int]]] = []
        self._lock = threading.Lock()
        fetch, read = ds.reader.fetcher.fetch, ds._read

        def watched_fetch(blocks: Sequence[Any], **kw: Any) -> Any:
            now, name = time.monotonic(), threading.current_thread().name
            with self._lock:
                for item, b in blocks:
                    self.asked.setdefault((item.url, b), (now, name))
            return fetch(blocks, **kw)

        def watched_read(indices: Sequence[int]) -> Any:
            with self._lock:
                self.reads.append((time.monotonic(), list(indices)))
            return read(indices)

        ds.reader.fetcher.fetch = watched_fetch
        ds._read = watched_read


def _slow(sample: Any) -> Any:
    time.sleep(0.004)  # a decode's worth: the reads fall behind the announcements
    return sample


def _read_all(ds: Any, key: Callable[[Any], Any]) -> list[Any]:
    loader = fastload.DataLoader(ds, batch_size=BATCH, num_workers=0, collate_fn=list, read_ahead=2)
    return [key(sample) for batch in loader for sample in batch]


def _gets(server: Any) -> dict[str, list[int]]:
    """Bytes of each GET nginx answered, by file name."""
    got: dict[str, list[int]] = {}
    for name, status, size in _GET.findall((server.workdir / "access.log").read_text()):
        assert status in ("200", "206"), (name, status)
        got.setdefault(name, []).append(int(size))
    return got


def _check_ahead(watch: _Watch, blocks_of: Callable[[list[int]], set[tuple[str, int]]]) -> None:
    """Every block of every batch past the first SKIP was asked for before that batch's read began, and
    by a fetch-ahead thread unless an earlier batch's read asked for it first."""
    assert len(watch.reads) > SKIP + 4
    for began, indices in sorted(watch.reads)[SKIP:]:
        for block in blocks_of(indices):
            asked, thread = watch.asked[block]
            assert asked < began, (block, indices, thread)
    ahead = {b for b, (_, thread) in watch.asked.items() if thread == "fastload-blocks-ahead"}
    assert len(ahead) >= len(watch.asked) // 2, (len(ahead), len(watch.asked))


def _no_thread_left(ds: Any) -> None:
    deadline = time.monotonic() + 10
    while any(t.name == "fastload-blocks-ahead" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not [t for t in threading.enumerate() if t.name == "fastload-blocks-ahead"]
    stats = ds.__dict__["_blocks_ahead"].stats()
    assert stats["threads"] == stats["queued"] == stats["running"] == stats["bytes"] == 0 and stats["failed"] == 0


@pytest.mark.parametrize("kind", ["kept", "uncached_store", "gz"])  # kept blocks, kept_bytes=0, compressed shards
def test_mds_blocks_are_fetched_ahead_once_each(tmp_path: Path, nginx_server: Callable, kind: str) -> None:
    rng = np.random.default_rng(0)
    rows = [rng.bytes(3000) for _ in range(240)]
    _write_mds(tmp_path / "www" / "ds", rows, per_shard=40, gz=kind == "gz")
    server = nginx_server(tmp_path / "www")
    ds = MDSDataset(f"{server.url}/ds", settings=_settings(tmp_path / "cache"), transform=_slow,
                    kept_bytes=0 if kind == "uncached_store" else None)
    watch = _Watch(ds)
    assert _read_all(ds, lambda s: s["b"]) == rows  # the bytes written, in order

    def blocks_of(indices: list[int]) -> set[tuple[str, int]]:
        out = set()
        for i in indices:
            shard, k = ds._locate(i)
            item = ds.items[shard]
            if kind == "gz":
                out |= {(item.url, b) for b in range(-(-item.size // BLOCK))}
            else:
                table = ds._tables[shard]
                out |= {(item.url, b) for b in range(int(table[k]) // BLOCK, -(-int(table[k + 1]) // BLOCK))}
        return out

    _check_ahead(watch, blocks_of)
    for shard, item in zip(ds.shards, ds.items):  # each block fetched once, whoever asked first
        assert sorted(_gets(server)[shard.name]) == sorted(hi - lo for lo, hi in map(
            lambda b: ds.reader.identity.span(item, b), ds.reader.identity.blocks(item)))
    _no_thread_left(ds)


def test_unread_shards_tables_are_fetched_ahead_together(tmp_path: Path, nginx_server: Callable) -> None:
    """The blocks holding unread shards' tables are fetched ahead like any other block, so the next shard's
    table is asked for while the one before it is still in flight. Read by the planning thread instead, each
    waited for the one before it, and the link idled while each was stored (benchmarks/formats, MDS)."""
    rng = np.random.default_rng(3)
    rows = [rng.bytes(3000) for _ in range(160)]
    _write_mds(tmp_path / "www" / "ds", rows, per_shard=40, gz=False)
    server = nginx_server(tmp_path / "www")
    ds = MDSDataset(f"{server.url}/ds", settings=_settings(tmp_path / "cache"))
    asked: set[tuple[str, int]] = set()
    lock = threading.Lock()
    answer = threading.Event()
    fetch = ds.reader.fetcher.fetch

    def held(blocks: Sequence[Any], **kw: Any) -> Any:  # nothing is answered until both tables are asked for
        with lock:
            asked.update((item.url.rsplit("/", 1)[1], b) for item, b in blocks)
        answer.wait(10)
        return fetch(blocks, **kw)

    def seen() -> set[tuple[str, int]]:
        with lock:
            return set(asked)

    ds.reader.fetcher.fetch = held  # type: ignore[method-assign]
    heads = {("shard.00000.mds", 0), ("shard.00001.mds", 0)}
    ds.fetch_ahead(list(range(80)))  # shards 0 and 1, neither table read yet
    deadline = time.monotonic() + 5
    while not heads <= seen() and time.monotonic() < deadline:
        time.sleep(0.01)
    before_any_answer = seen()
    answer.set()
    assert heads <= before_any_answer, sorted(before_any_answer)
    _no_thread_left(ds)
    # Each table's samples were planned once it was in: all their blocks fetched ahead, each once.
    gets = _gets(server)
    for shard, item in list(zip(ds.shards, ds.items))[:2]:
        assert len(gets[shard.name]) == len(ds.reader.identity.blocks(item)) and sum(gets[shard.name]) == item.size
    assert [s["b"] for s in ds.read_batch(list(range(80)))] == rows[:80]
    assert _gets(server) == gets  # read from what was fetched ahead


def test_tar_blocks_are_fetched_ahead_once_each(tmp_path: Path, nginx_server: Callable) -> None:
    (tmp_path / "www" / "ds").mkdir(parents=True)
    rng = np.random.default_rng(1)
    want = []
    for s in range(3):
        with tarfile.open(tmp_path / "www" / "ds" / f"shard-{s}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            for k in range(60):
                data = rng.bytes(3000)
                info = tarfile.TarInfo(f"{s}-{k:03d}.jpg")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
                want.append(data)
    server = nginx_server(tmp_path / "www")
    url = f"{server.url}/ds/shard-{{0..2}}.tar"
    # Indexing a shard reads all of it; a cache holding only the recorded indexes reads cold with no
    # block fetched at construction, as a second node or an evicted cache does.
    indexed = fastload.TarDataset(url, settings=_settings(tmp_path / "indexed"))
    cold = _settings(tmp_path / "cache")
    cache = Cache(cold)
    for item in indexed.items:
        name = keys.tar_index(item.url, item.size, item.version)
        cache.index.set(name, indexed.reader.cache.index.get(name))
    cache.close()
    before = sum(map(len, _gets(server).values()))
    ds = fastload.TarDataset(url, settings=cold, transform=_slow)
    assert sum(map(len, _gets(server).values())) == before  # the recorded indexes: nothing fetched
    watch = _Watch(ds)
    assert _read_all(ds, lambda s: s["jpg"]) == want

    def blocks_of(indices: list[int]) -> set[tuple[str, int]]:
        out = set()
        for i in indices:
            shard, _, members = ds.samples[i]
            url = ds.items[shard].url
            out |= {(url, b) for _, off, size in members for b in range(off // BLOCK, -(-(off + size) // BLOCK))}
        return out

    _check_ahead(watch, blocks_of)
    gets = _gets(server)
    for item in ds.items:  # the cold pass's GETs: one per block, after the indexing pass's own
        name = item.url.rsplit("/", 1)[1]
        blocks = len(ds.reader.identity.blocks(item))
        assert len(gets[name]) == 2 * blocks and sum(gets[name][blocks:]) == item.size, (name, gets[name])
    _no_thread_left(ds)


def test_a_failed_fetch_ahead_is_met_by_the_read_as_without_it(tmp_path: Path, nginx_server: Callable) -> None:
    rng = np.random.default_rng(2)
    rows = [rng.bytes(3000) for _ in range(120)]
    _write_mds(tmp_path / "www" / "ds", rows, per_shard=40, gz=False)
    server = nginx_server(tmp_path / "www")
    ds = MDSDataset(f"{server.url}/ds", settings=_settings(tmp_path / "cache"), transform=_slow)
    (tmp_path / "www" / "ds" / "shard.00002.mds").unlink()  # gone since it was listed: its fetches 404
    seen = []
    with pytest.raises(RemoteChangedError, match="shard.00002.mds.*now missing on the remote"):
        for batch in fastload.DataLoader(ds, batch_size=BATCH, num_workers=0, collate_fn=list, read_ahead=2):
            seen += [s["b"] for s in batch]
    # The pass's iterator, held by the error's traceback, is collected here: collected on fsspec's
    # event loop thread, its close waited there for reads that need that loop (10 s, then a warning).
    gc.collect()
    assert seen == rows[: len(seen)] and len(seen) >= 40  # the shards before it, read whole
    assert ds.__dict__["_blocks_ahead"].stats()["failed"] >= 1  # the fetch ahead met the 404 first
    deadline = time.monotonic() + 10
    while any(t.name == "fastload-blocks-ahead" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not [t for t in threading.enumerate() if t.name == "fastload-blocks-ahead"]
