"""StatsCollector, LoaderStats and the loader's own recording."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from _loader_helpers import ReadBatchDS, TensorDS

from fastload.device.batch_tree import nbytes
from fastload.loader.dataloader import DataLoader
from fastload.stats import (
    LoaderStats,
    OpStats,
    StatsCollector,
    current_collector,
    default_collector,
    use_collector,
)
from fastload.transport import hostlimit


def test_add_count_timer_snapshot() -> None:
    col = StatsCollector()
    col.add("fetch", items=2, bytes=100, seconds=0.5)
    col.add("fetch", items=1, bytes=50, seconds=0.25)
    col.count("cache_hit")
    col.count("cache_hit", 2)
    col.count("cache_miss")
    with col.timer("decode", items=3, bytes=30):
        time.sleep(0.01)
    s = col.snapshot()
    assert s.op("fetch") == OpStats(3, 150, 0.75)
    assert s.op("fetch").items_per_s == pytest.approx(4.0)
    assert s.op("fetch").bytes_per_s == pytest.approx(200.0)
    assert s.op("decode").items == 3 and s.op("decode").seconds >= 0.01
    assert s.op("absent") == OpStats()
    assert dict(s.counters) == {"cache_hit": 3, "cache_miss": 1}
    assert s.cache_hit_rate == pytest.approx(0.75)


def test_timer_records_even_when_the_body_raises() -> None:
    col = StatsCollector()
    with pytest.raises(ZeroDivisionError), col.timer("decode", items=1):
        1 / 0  # noqa: B018
    assert col.snapshot().op("decode").items == 1


def test_disabled_collector_records_nothing() -> None:
    # Even after this process has talked to a host (its request limit is process-wide).
    with hostlimit.limit_for("http://disabled-collector.invalid", 2).slot():
        pass
    col = StatsCollector(enabled=False)
    col.add("fetch", items=1)
    col.count("x")
    col.record_batches(1, 1.0, 2.0)
    assert col.snapshot() == LoaderStats()


def test_concurrent_threads_lose_no_counts() -> None:
    col = StatsCollector()
    n_threads, n_adds = 8, 2000
    barrier = threading.Barrier(n_threads)

    def work() -> None:
        barrier.wait()
        for _ in range(n_adds):
            col.add("cache_read", items=1, bytes=3, seconds=0.001)
            col.count("cache_hit")

    threads = [threading.Thread(target=work) for _ in range(n_threads)]
    for t in threads:
        t.start()
    mid = col.snapshot()  # reading while writers run must not raise
    for t in threads:
        t.join(10)
    assert mid.op("cache_read").items <= n_threads * n_adds
    s = col.snapshot()
    assert s.op("cache_read").items == n_threads * n_adds
    assert s.op("cache_read").bytes == 3 * n_threads * n_adds
    assert s.counters["cache_hit"] == n_threads * n_adds
    assert len(col._shards) == 0  # dead threads were folded into one retired shard
    assert col.snapshot().op("cache_read").items == n_threads * n_adds  # and kept


def test_reset_forgets_everything() -> None:
    col = StatsCollector()
    col.add("fetch", items=5)
    col.record_batches(1, 0.1, 0.2)
    col.reset()
    # Host request limits are the process's state, not counts: reset leaves them.
    assert dataclasses.replace(col.snapshot(), concurrency={}) == LoaderStats()
    col.add("fetch", items=1)
    assert col.snapshot().op("fetch").items == 1


def test_stall_fraction_table_and_json() -> None:
    col = StatsCollector()
    col.add("cache_read", items=10, bytes=2_000_000, seconds=0.5)
    col.add("my_op", items=1, seconds=0.1)
    col.count("cache_miss")
    col.record_batches(1, 0.25, 1.0)
    col.record_batches(1, 0.25, 1.0)
    s = col.snapshot()
    assert s.batches == 2
    assert s.data_stall_fraction == pytest.approx(0.25)
    text = str(s)
    lines = text.splitlines()
    assert lines[0].split() == ["op", "items", "MB", "busy", "s", "items/s", "MB/s"]
    assert lines[1].split()[:3] == ["cache_read", "10", "2.0"]
    assert lines[2].split()[0] == "my_op"  # non-canonical ops after canonical ones
    assert "data stall 25.0%" in text and "cache hit rate 0.0%" in text
    data = json.loads(json.dumps(s.as_dict()))
    assert data["ops"]["cache_read"]["bytes_per_s"] == pytest.approx(4e6)
    assert LoaderStats().data_stall_fraction == 0.0 and LoaderStats().cache_hit_rate is None


def test_nbytes_counts_nested_buffers() -> None:
    obj = {
        "t": torch.zeros(4, dtype=torch.float32),
        "a": np.zeros(3, dtype=np.int16),
        "b": [b"xy", "str", 7],
    }
    assert nbytes(obj) == 16 + 6 + 2


def test_active_collector_scoping() -> None:
    assert current_collector() is default_collector()
    mine = StatsCollector()
    with use_collector(mine):
        assert current_collector() is mine
        seen: list[StatsCollector] = []
        t = threading.Thread(target=lambda: seen.append(current_collector()))
        t.start()
        t.join()
        assert seen == [default_collector()]  # not inherited by other threads
    assert current_collector() is default_collector()


class _RecordingDS(TensorDS):
    """Records into whatever collector is active, as fastload datasets do."""

    def __getitem__(self, i: int) -> Any:
        current_collector().add("cache_read", items=1, bytes=12, seconds=0.0)
        current_collector().count("cache_hit" if i % 2 else "cache_miss")
        return super().__getitem__(i)


class _RecordingReadBatch(ReadBatchDS):
    def read_batch(self, indices: list[int]) -> list[Any]:
        current_collector().add("fetch", items=len(indices), bytes=100 * len(indices))
        return super().read_batch(indices)


def test_loader_records_dataset_ops_and_its_own() -> None:
    # Other tests read through the cache outside any loader, into the process default.
    leaked_before = default_collector().snapshot().op("cache_read").items
    loader = DataLoader(_RecordingDS(10), batch_size=4)
    assert len(list(loader)) == 3
    s = loader.stats()
    assert s.batches == 3
    assert s.op("cache_read").items == 10 and s.op("cache_read").bytes == 120
    assert s.counters["cache_hit"] == 5 and s.counters["cache_miss"] == 5
    assert s.op("assemble").items == 10 and s.op("collate").items == 10
    assert s.op("collate").bytes == nbytes(next(iter(DataLoader(TensorDS(10), batch_size=10))))
    assert 0 < s.wait_seconds <= s.wall_seconds
    assert default_collector().snapshot().op("cache_read").items == leaked_before  # nothing leaked
    loader.reset_stats()
    assert loader.stats().batches == 0


def test_read_batch_threads_record_into_the_loader() -> None:
    loader = DataLoader(_RecordingReadBatch(12), batch_size=4, read_threads=3)
    list(loader)
    s = loader.stats()
    assert s.op("fetch").items == 12 and s.op("fetch").bytes == 1200
    assert s.op("assemble").items == 12 and s.op("collate").items == 12


def test_device_ops_recorded() -> None:
    loader = DataLoader(TensorDS(12), batch_size=3, device="cpu")
    list(loader)
    s = loader.stats()
    assert s.op("pin").items == 4
    assert s.op("h2d").items >= 2


def test_stats_false_records_nothing() -> None:
    loader = DataLoader(_RecordingDS(8), batch_size=4, stats=False)
    list(loader)
    assert loader.stats() == LoaderStats()
    # the dataset's records then go to the process-wide collector
    assert default_collector().snapshot().op("cache_read").items >= 8
    default_collector().reset()


class _SlowDS(TensorDS):
    def __getitem__(self, i: int) -> Any:
        time.sleep(0.004)
        return super().__getitem__(i)


def test_data_stall_fraction_tells_slow_data_from_slow_step() -> None:
    slow_data = DataLoader(_SlowDS(12), batch_size=4)
    for _ in slow_data:
        pass  # no compute: the loop only waits for data
    fast_data = DataLoader(TensorDS(12), batch_size=4)
    for _ in fast_data:
        time.sleep(0.03)  # a long training step
    assert slow_data.stats().data_stall_fraction > 0.8
    assert fast_data.stats().data_stall_fraction < 0.3


def _child_counts(q: Any) -> None:
    q.put(dict(default_collector().snapshot().counters))


def test_forked_child_starts_with_a_fresh_default_collector() -> None:
    default_collector().count("parent_only")
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_counts, args=(q,))
    p.start()
    counts = q.get(timeout=20)
    p.join(20)
    assert counts == {}
    assert default_collector().snapshot().counters["parent_only"] == 1
    default_collector().reset()


def test_loader_scope_lasts_the_pass() -> None:
    # The pass's collector stays active between batches (it is not set and reset per
    # batch, see fastload.loader.iterator), yields to use_collector and other loaders, and
    # is gone when the pass ends.
    a, b = DataLoader(_RecordingDS(6), batch_size=2), DataLoader(_RecordingDS(6), batch_size=2)
    mine = StatsCollector()
    seen = []
    for _ in zip(a, b):  # interleaved passes: each dataset records into its own loader
        seen.append(current_collector())
        with use_collector(mine):
            current_collector().count("in_step")
    assert seen[0] is b._fl_collector  # the latest next() was b's
    assert current_collector() is default_collector()
    assert a.stats().op("cache_read").items == 6 and b.stats().op("cache_read").items == 6
    assert mine.snapshot().counters == {"in_step": 3}
    outer = StatsCollector()
    with use_collector(outer):
        for _ in a:
            for _ in b:  # a nested pass ends; a's next batch takes its scope back
                pass
        assert current_collector() is outer
    assert a.stats().op("cache_read").items == 12 and b.stats().op("cache_read").items == 24
    assert outer.snapshot().ops == {}


def test_loader_stopped_early_gives_its_scope_back() -> None:
    loader = DataLoader(_RecordingDS(8), batch_size=2)
    for _ in loader:
        assert current_collector() is loader._fl_collector
        break
    assert current_collector() is default_collector()
    assert loader.stats().batches == 1


def test_fast_loop_waits_are_sampled_and_scaled(monkeypatch: pytest.MonkeyPatch) -> None:
    # Batches closer than FAST_BATCH_S apart are timed one in ~SAMPLE_EVERY; the
    # untimed ones are charged the sampled mean, so the stall fraction stays right.
    # A FAST_BATCH_S of 1 s makes any loop "fast" after its first tick.
    import fastload.loader.iterator as li

    monkeypatch.setattr(li, "FAST_BATCH_S", 1.0)
    monkeypatch.setattr(li, "TICK_S", 0.01)
    reads = []

    def clock() -> float:
        reads.append(1)
        return time.perf_counter()

    monkeypatch.setattr(li, "perf_counter", clock)
    slow_data = DataLoader(_SlowDS(150), batch_size=1)
    for _ in slow_data:
        pass
    assert len(reads) < 100  # timing every batch reads the clock twice per batch
    fast_data = DataLoader(TensorDS(150), batch_size=1)
    for _ in fast_data:
        time.sleep(0.004)
    s, f = slow_data.stats(), fast_data.stats()
    assert s.batches == f.batches == 150
    assert s.op("assemble").items == f.op("collate").items == 150
    assert s.data_stall_fraction > 0.8
    assert f.data_stall_fraction < 0.3
    assert 0.5 < s.wait_seconds / (150 * 0.004) < 2.0  # charged about 4 ms per batch, not 1/8


def test_sampled_collate_split_and_exact_items() -> None:
    # collate_fn is timed and measured on a sample of batches; items stay exact, also
    # for a short last batch and for a batch_sampler fastload cannot predict.
    loader = DataLoader(TensorDS(203), batch_size=10)
    list(loader)
    s = loader.stats()
    assert s.op("collate").items == s.op("assemble").items == 203
    per_item = nbytes(next(iter(DataLoader(TensorDS(1), batch_size=1))))
    assert s.op("collate").bytes == pytest.approx(203 * per_item, rel=0.01)
    # Timed (a sampled estimate, so not compared with other clocks: that would test timing).
    assert s.op("collate").seconds > 0
    custom = DataLoader(TensorDS(10), batch_sampler=[[0, 1, 2], [3], [4, 5, 6, 7, 8, 9]])
    list(custom)
    assert custom.stats().op("collate").items == 10


def test_the_old_names_of_ops_still_answer_with_a_warning() -> None:
    stats = LoaderStats(ops={"fetch": OpStats(items=3)})
    with pytest.warns(FutureWarning, match="'stages' is now 'ops'"):
        assert stats.stages == stats.ops
    with pytest.warns(FutureWarning, match=r"'stage\(\)' is now 'op\(\)'"):
        assert stats.stage("fetch").items == 3
