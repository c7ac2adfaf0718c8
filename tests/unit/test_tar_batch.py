"""TarDataset's batch path and its kept blocks (fastload.read.blocks), over local shards.

Ground truth is tarfile's own extraction; the cache's block reads are counted by
wrapping fastload.cache.gather.gather, the one function every cached block read goes
through (Cache.read_into).
"""

from __future__ import annotations

import io
import os
import pickle
import random
import tarfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fastload.cache import gather
from fastload.config import Settings
from fastload.dataset import TarDataset
from fastload.read.blocks import DEFAULT_KEPT_BYTES, KeptBlocks


def write_shard(path: Path, samples: int, size: int = 3000, seed: int = 0) -> dict[str, dict[str, bytes]]:
    """A WebDataset shard of ``samples`` (.jpg of ``size`` random bytes, .cls); its members by key."""
    rng = random.Random(seed)
    want: dict[str, dict[str, bytes]] = {}
    with tarfile.open(path, "w") as tar:
        for k in range(samples):
            key = f"{path.stem}-{k:04d}"
            for ext, data in (("jpg", rng.randbytes(size + k)), ("cls", str(k).encode())):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
                want.setdefault(key, {})[ext] = data
    return want


@pytest.fixture
def gather_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[list[gather.Job]]]:
    """Every call of gather.gather (the cache's checked block reads), with its jobs."""
    calls: list[list[gather.Job]] = []
    real = gather.gather

    def counted(jobs: Any, out: Any, threads: int | None = None) -> Any:
        calls.append(list(jobs))
        return real(jobs, out, threads)

    monkeypatch.setattr(gather, "gather", counted)
    yield calls


def paths_read(calls: list[list[gather.Job]]) -> Counter[tuple[str, int | None]]:
    return Counter((job.path, job.offset) for jobs in calls for job in jobs)


@pytest.mark.parametrize("kept_bytes", [0, None])
def test_a_batch_equals_tarfile_and_item_reads_byte_for_byte_across_block_edges(
        tmp_path: Path, kept_bytes: int | None, backend: str) -> None:
    (tmp_path / "shards").mkdir()
    want = write_shard(tmp_path / "shards" / "a.tar", 40) | write_shard(tmp_path / "shards" / "b.tar", 30, seed=1)
    # 8 KiB blocks: most 3 KB members sit in one block, some straddle two.
    settings = Settings(cache_dir=tmp_path / "cache", block_bytes=8192)
    ds = TarDataset(str(tmp_path / "shards"), settings=settings, kept_bytes=kept_bytes)
    assert len(ds) == 70
    order = random.Random(3).sample(range(len(ds)), len(ds))
    batch = ds.read_batch(order)
    for i, sample in zip(order, batch):
        assert sample == ds[i]
        key = sample["__key__"]
        assert {k: v for k, v in sample.items() if not k.startswith("__")} == want[key]


def test_a_batch_in_one_block_reads_that_block_once(tmp_path: Path, gather_calls: list[list[gather.Job]]) -> None:
    (tmp_path / "shards").mkdir()
    write_shard(tmp_path / "shards" / "a.tar", 20)  # ~80 KB: one 8 MiB block
    ds = TarDataset(str(tmp_path / "shards"), settings=Settings(cache_dir=tmp_path / "cache"), kept_bytes=0)
    ds.read_batch([0])  # the first read fetches; later ones read the cache
    gather_calls.clear()
    ds.read_batch(list(range(20)))
    assert len(gather_calls) == 1 and sum(paths_read(gather_calls).values()) == 1  # 40 members, one block read


def test_kept_blocks_are_read_once_then_served_from_memory(tmp_path: Path, gather_calls: list[list[gather.Job]]) -> None:
    (tmp_path / "shards").mkdir()
    write_shard(tmp_path / "shards" / "a.tar", 20)
    ds = TarDataset(str(tmp_path / "shards"), settings=Settings(cache_dir=tmp_path / "cache"))
    assert ds.kept.limit_bytes == DEFAULT_KEPT_BYTES
    first = [ds[i] for i in range(20)]  # the block is fetched (cold) and kept
    gather_calls.clear()
    assert [ds[i] for i in range(20)] == first and ds.read_batch(list(range(20))) == first
    assert gather_calls == []  # kept: no cache read at all
    assert ds.kept.stats()["blocks"] == 1


def test_kept_blocks_stay_within_their_limit_and_evict(tmp_path: Path, gather_calls: list[list[gather.Job]]) -> None:
    (tmp_path / "shards").mkdir()
    want = write_shard(tmp_path / "shards" / "a.tar", 60)  # ~190 KB: 24 blocks of 8 KiB
    settings = Settings(cache_dir=tmp_path / "cache", block_bytes=8192)
    ds = TarDataset(str(tmp_path / "shards"), settings=settings, kept_bytes=3 * 8192)
    rng = random.Random(5)
    for _ in range(20):  # random access over far more blocks than the store holds, a block or two at a time
        order = rng.sample(range(len(ds)), 1)
        for sample in ds.read_batch(order):
            assert sample["jpg"] == want[sample["__key__"]]["jpg"]
        stats = ds.kept.stats()
        assert stats["blocks"] <= 3 and stats["bytes"] <= 3 * 8192
    assert ds.kept.stats()["evicted"] > 0
    # What was dropped is read from the cache again.
    gather_calls.clear()
    dropped = next(i for i in range(len(ds)) if all(
        ds.kept.get(ds.reader.identity.key(ds.items[0], b)) is None
        for b in range(ds.samples[i][2][0][1] // 8192, (ds.samples[i][2][0][1] + ds.samples[i][2][0][2]) // 8192 + 1)))
    assert ds[dropped]["jpg"] == want[ds.samples[dropped][1]]["jpg"] and gather_calls


def test_kept_blocks_drop_the_least_recently_used_and_pickle_as_their_limit() -> None:
    import numpy as np

    kept = KeptBlocks(3 * 100)
    for key in "abc":
        kept.put(key, np.zeros(100, dtype=np.uint8))
    assert kept.get("a") is not None  # a is now the most recently used
    kept.put("d", np.zeros(100, dtype=np.uint8))
    assert kept.get("b") is None and kept.get("a") is not None and kept.get("d") is not None
    kept.put("big", np.zeros(301, dtype=np.uint8))  # over the limit on its own: not kept, nothing dropped
    assert kept.get("big") is None and len(kept) == 3 and kept.nbytes == 300
    copy = pickle.loads(pickle.dumps(kept))  # a DataLoader worker: the limit, not the contents
    assert copy.limit_bytes == 300 and len(copy) == 0
    assert KeptBlocks(0).limit_bytes == 0


def test_an_index_of_the_old_grouping_rule_is_rebuilt(tmp_path: Path) -> None:
    from fastload.cache import keys

    (tmp_path / "shards").mkdir()
    write_shard(tmp_path / "shards" / "a.tar", 3)
    settings = Settings(cache_dir=tmp_path / "cache")
    ds = TarDataset(str(tmp_path / "shards"), settings=settings)
    item = ds.items[0]
    # What fastload recorded before issue 35: a bare list, no rule.
    ds.reader.cache.index.set(keys.tar_index(item.url, item.size, item.version), [["stale", [["jpg", 0, 1]]]])
    again = TarDataset(str(tmp_path / "shards"), settings=settings)
    assert [again[i]["__key__"] for i in range(len(again))] == ["a-0000", "a-0001", "a-0002"]


def test_hostile_sizes_stay_data(tmp_path: Path) -> None:
    # An empty member and a member of exactly one block read right in one batch.
    (tmp_path / "shards").mkdir()
    with tarfile.open(tmp_path / "shards" / "e.tar", "w") as tar:
        for name, data in (("x.txt", b""), ("x.cls", b"1"), ("y.txt", os.urandom(8192)), ("y.cls", b"2")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    ds = TarDataset(str(tmp_path / "shards"), settings=Settings(cache_dir=tmp_path / "cache", block_bytes=8192))
    x, y = ds.read_batch([0, 1])
    assert x["txt"] == b"" and len(y["txt"]) == 8192 and y["cls"] == b"2"


def test_a_batch_over_more_blocks_than_are_kept_reads_its_members_without_keeping(
        tmp_path: Path, gather_calls: list[list[gather.Job]]) -> None:
    # Read whole, its blocks would all be held at once: 64 members in 64 blocks of 8 MiB is 512 MiB.
    (tmp_path / "shards").mkdir()
    want = write_shard(tmp_path / "shards" / "a.tar", 60)
    settings = Settings(cache_dir=tmp_path / "cache", block_bytes=8192)
    ds = TarDataset(str(tmp_path / "shards"), settings=settings, kept_bytes=2 * 8192)
    ds.read_batch(list(range(len(ds))))  # fetch everything (cold)
    before = ds.kept.stats()
    gather_calls.clear()
    batch = ds.read_batch(list(range(0, 60, 3)))  # 20 members over ~20 blocks
    assert [s["jpg"] for s in batch] == [want[s["__key__"]]["jpg"] for s in batch]
    assert len(gather_calls) == 1  # one read_into of the members
    assert max(job.copies[0][1] for job in gather_calls[0]) < 8192  # member ranges, not whole blocks
    assert ds.kept.stats()["bytes"] <= 2 * 8192 and ds.kept.stats()["blocks"] <= before["blocks"]


def test_a_worker_copy_starts_with_an_empty_store_and_reads_alike(tmp_path: Path) -> None:
    (tmp_path / "shards").mkdir()
    write_shard(tmp_path / "shards" / "a.tar", 10)
    ds = TarDataset(str(tmp_path / "shards"), settings=Settings(cache_dir=tmp_path / "cache"), kept_bytes="64MB")
    first = ds.read_batch(range(10))
    assert len(ds.kept) == 1
    copy = pickle.loads(pickle.dumps(ds))  # what a DataLoader worker gets
    assert len(copy.kept) == 0 and copy.kept.limit_bytes == 64 * 10**6
    assert copy.read_batch(range(10)) == first
