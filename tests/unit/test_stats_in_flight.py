"""What loader.stats() shows beside the host limits: read threads, batches and fetches in flight, the regime."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
from _loader_helpers import local_items

import fastload
from fastload.config import Settings
from fastload.dataset import FileDataset
from fastload.fetch import Fetcher
from fastload.read.reader import Reader
from fastload.source import Source
from fastload.stats import LoaderStats, regime


@pytest.fixture()
def dataset(tmp_path: Path) -> FileDataset:
    root = tmp_path / "train"
    root.mkdir()
    for i in range(30):
        (root / f"{i:02d}.bin").write_bytes(b"%d " % i * 100)
    return FileDataset(str(root), pattern="*.bin", settings=Settings(cache_dir=tmp_path / "cache"))


class Plain(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return 30

    def __getitem__(self, i: int) -> int:
        return i


def test_fetcher_in_flight_counts_fetches_ahead_and_fetches_a_read_waits_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reader = Reader(Settings(cache_dir=tmp_path / "cache"))
    items = local_items(tmp_path, 5)
    assert reader.fetcher.in_flight() == {"ahead": 0, "fetching": 0}
    # Fetches ahead that never finish (a local store has no event loop to fetch ahead on).
    monkeypatch.setattr(Source, "start_first_many", lambda self, group, nbytes: [Future() for _ in group])
    assert reader.fetcher.ahead(items[:3]) == 3
    assert reader.fetcher.in_flight() == {"ahead": 3, "fetching": 0}
    # A read's own fetch, held until released.
    release, entered = threading.Event(), threading.Event()
    real = Source.fetch_many

    def held(self: Source, *args: Any, **kwargs: Any) -> list[Any]:
        entered.set()
        release.wait(10)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Source, "fetch_many", held)
    got: list[list[bytes]] = []
    reading = threading.Thread(target=lambda: got.append(reader.fetcher.fetch([(items[4], 0)])))
    reading.start()
    assert entered.wait(10)
    assert reader.fetcher.in_flight() == {"ahead": 3, "fetching": 1}
    release.set()
    reading.join(10)
    assert got == [[bytes([4]) * 100]]
    assert reader.fetcher.in_flight() == {"ahead": 3, "fetching": 0}


def test_read_threads_are_the_read_batch_pools_size(dataset: FileDataset) -> None:
    assert fastload.DataLoader(dataset, batch_size=4, read_threads=3).stats().read_threads == 3
    assert fastload.DataLoader(dataset, batch_size=4, read_threads=0).stats().read_threads == 0  # no pool
    assert fastload.DataLoader(Plain(), batch_size=4).stats().read_threads == 0  # read in the calling thread
    assert fastload.DataLoader(dataset, batch_size=4, num_workers=1).stats().read_threads == 0  # in workers


def test_batches_in_flight_are_measured_on_the_read_batch_path(dataset: FileDataset) -> None:
    loader = fastload.DataLoader(dataset, batch_size=2, read_ahead=2, read_threads=2)
    assert loader.stats().batches_in_flight == 0  # no pass yet
    it = iter(loader)
    next(it)
    assert loader.stats().batches_in_flight == 2  # read_ahead batches beyond the one returned
    rest = list(it)
    assert len(rest) == 14 and loader.stats().batches_in_flight == 0


def test_batches_in_flight_are_what_torchs_workers_hold(dataset: FileDataset) -> None:
    loader = fastload.DataLoader(dataset, batch_size=2, num_workers=2, prefetch_factor=3)
    it = iter(loader)
    next(it)
    assert loader.stats().batches_in_flight == 2 * 3  # num_workers x prefetch_factor, refilled
    assert len(list(it)) == 14 and loader.stats().batches_in_flight == 0


def test_fetches_in_flight_of_this_process_and_each_worker(dataset: FileDataset, monkeypatch: pytest.MonkeyPatch) -> None:
    assert fastload.DataLoader(Plain(), batch_size=4).stats().fetches_in_flight == {}  # no fastload cache
    loader = fastload.DataLoader(dataset, batch_size=4)
    assert dict(loader.stats().fetches_in_flight) == {"ahead": 0, "fetching": 0, "processes": {"main": {"ahead": 0, "fetching": 0}}}
    # Forked workers inherit the patch: each reports what its own Fetcher has in flight.
    monkeypatch.setattr(Fetcher, "in_flight", lambda self: {"ahead": 2, "fetching": 1})
    loader = fastload.DataLoader(dataset, batch_size=4, num_workers=2)
    list(loader)
    f = loader.stats().fetches_in_flight
    assert set(f["processes"]) == {"main", "worker 0", "worker 1"}
    assert (f["ahead"], f["fetching"]) == (6, 3)


def test_the_regime_is_cold_then_warm_by_the_cache_hit_rate(dataset: FileDataset) -> None:
    loader = fastload.DataLoader(dataset, batch_size=5)
    assert loader.stats().regime is None  # nothing read yet
    list(loader)
    cold = loader.stats()
    assert (cold.cache_hit_rate, cold.regime) == (0.0, "cold")
    loader.reset_stats()
    list(loader)
    warm = loader.stats()
    assert (warm.cache_hit_rate, warm.regime) == (1.0, "warm")
    d = warm.as_dict()
    assert d["regime"] == "warm" and d["read_threads"] == warm.read_threads and "fetches_in_flight" in d
    text = str(warm)
    assert "cache hit rate 100.0%: warm" in text
    assert f"read threads {warm.read_threads}; batches in flight 0; fetches in flight 0 ahead, 0 fetching" in text


def test_regime_is_one_definition() -> None:
    assert [regime(r) for r in (0.0, 0.49, 0.5, 1.0)] == ["cold", "cold", "warm", "warm"]
    assert (regime(None), regime(None, fresh=True), regime(None, fresh=False)) == (None, "cold", "warm")
    assert LoaderStats(counters={"cache_hit": 1, "cache_miss": 3}).regime == "cold"
