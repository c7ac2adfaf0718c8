"""fastload.DataLoader over the cached datasets: same samples as torch's, stats from the cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fastload
from fastload.config import Settings
from fastload.dataset import FileDataset


@pytest.fixture()
def dataset(tmp_path: Path) -> FileDataset:
    root = tmp_path / "train"
    for c in range(3):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(10):
            (root / f"c{c}" / f"{i}.bin").write_bytes(b"%d-%d " % (c, i) * 500)
    return FileDataset(str(root), pattern="**/*.bin", label="parent", settings=Settings(cache_dir=tmp_path / "cache"))


def urls(batches: list[dict]) -> list[str]:
    return [u for b in batches for u in b["url"]]


def test_same_batches_as_torch_for_the_same_seed(dataset: FileDataset) -> None:
    ours = list(fastload.DataLoader(dataset, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3)))
    theirs = list(torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3)))
    assert urls(ours) == urls(theirs)
    assert all(torch.equal(a["label"], b["label"]) and a["data"] == b["data"] for a, b in zip(ours, theirs))


def test_cold_then_warm_epoch_stats_come_from_the_cache(dataset: FileDataset) -> None:
    loader = fastload.DataLoader(dataset, batch_size=5)
    assert len(urls(list(loader))) == 30
    cold = loader.stats()
    assert cold.counters.get("cache_miss") == 30 and cold.op("fetch").items == 30
    assert cold.op("fetch").bytes == sum(i.size for i in dataset.items)
    loader.reset_stats()
    list(loader)
    warm = loader.stats()
    assert warm.counters.get("cache_hit") == 30 and warm.op("fetch").items == 0
    assert warm.cache_hit_rate == 1.0 and warm.batches == 6
    assert "cache_read" in str(warm) and "data stall" in str(warm)


def test_workers_reopen_the_cache_in_the_child(dataset: FileDataset) -> None:
    loader = fastload.DataLoader(dataset, batch_size=6, num_workers=2)
    assert sorted(urls(list(loader))) == sorted(i.url for i in dataset.items)


def test_worker_stats_reach_the_parent(dataset: FileDataset) -> None:
    # The workers' fetch / cache_read ops and cache counters travel with their
    # batches (fastload.loader.worker_stats); the user still gets torch's batches.
    loader = fastload.DataLoader(dataset, batch_size=4, num_workers=2)
    ours = list(loader)
    theirs = list(torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=2))
    assert urls(ours) == urls(theirs) and all(type(a) is type(b) for a, b in zip(ours, theirs))
    cold = loader.stats()
    assert cold.op("fetch").items == 30 and cold.counters.get("cache_miss") == 30
    assert cold.op("fetch").bytes == sum(i.size for i in dataset.items)
    assert cold.op("collate").items == 30 and cold.batches == 8
    loader.reset_stats()
    list(loader)
    warm = loader.stats()
    assert warm.op("cache_read").items == 30 and warm.counters.get("cache_hit") == 30
    assert warm.op("fetch").items == 0 and warm.cache_hit_rate == 1.0
    assert "cache_read" in str(warm)


def test_worker_stats_with_persistent_workers_and_device(dataset: FileDataset) -> None:
    # Persistent workers keep their running totals across epochs: each epoch gets only
    # its own records. The device prefetcher sees plain batches.
    loader = fastload.DataLoader(
        dataset, batch_size=5, num_workers=2, persistent_workers=True, device="cpu"
    )
    for epoch in range(2):
        loader.reset_stats()
        got = list(loader)
        assert urls(got) == [i.url for i in dataset.items]
        s = loader.stats()
        reads = s.op("fetch").items + s.op("cache_read").items
        assert reads == 30 and s.op("pin").items == 6, epoch
