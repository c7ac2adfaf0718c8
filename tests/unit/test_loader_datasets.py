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
    assert cold.counters.get("cache_miss") == 30 and cold.stage("fetch").items == 30
    assert cold.stage("fetch").bytes == sum(i.size for i in dataset.items)
    loader.reset_stats()
    list(loader)
    warm = loader.stats()
    assert warm.counters.get("cache_hit") == 30 and warm.stage("fetch").items == 0
    assert warm.cache_hit_rate == 1.0 and warm.batches == 6
    assert "cache_read" in str(warm) and "data stall" in str(warm)


def test_workers_reopen_the_cache_in_the_child(dataset: FileDataset) -> None:
    loader = fastload.DataLoader(dataset, batch_size=6, num_workers=2)
    assert sorted(urls(list(loader))) == sorted(i.url for i in dataset.items)
