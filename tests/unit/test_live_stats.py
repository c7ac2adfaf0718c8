"""``DataLoader(log_every=N, summary_writer=w)``: live stats through logging and add_scalar."""

from __future__ import annotations

import gc
import logging
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

from fastload.errors import ConfigError
from fastload.loader.dataloader import DataLoader
from fastload.loader.live import DEFAULT_WRITE_EVERY, LiveStats, interval
from fastload.stats import StatsCollector, current_collector


class FetchDS(Dataset):
    """Sample i -> tensor; read_batch records a ``fetch`` per item and a cache miss."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((4,), i)

    def read_batch(self, indices: list[int]) -> list[torch.Tensor]:
        col = current_collector()
        for _ in indices:
            col.add("fetch", items=1, bytes=1000, seconds=0.001)
            col.count("cache_miss")
        return [self[i] for i in indices]


class FakeWriter:
    """The SummaryWriter protocol fastload uses: add_scalar(tag, value, step)."""

    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, float(value), int(step)))

    def tags_at(self, step: int) -> set[str]:
        return {t for t, _, s in self.scalars if s == step}


def test_log_every_logs_one_line_per_interval(caplog):
    loader = DataLoader(list(range(40)), batch_size=2, log_every=5)
    with caplog.at_level(logging.INFO, logger="fastload.live"):
        batches = [b for b in loader]
    assert len(batches) == 20
    lines = [r.getMessage() for r in caplog.records if r.name == "fastload.live" and r.levelno == logging.INFO]
    assert [line.split(":")[1].strip() for line in lines] == [f"batch {n}" for n in (5, 10, 15, 20)]
    assert all("batches/s" in line and "data stall" in line for line in lines)


def test_log_lines_carry_cache_hits_and_the_slowest_op(caplog):
    # 12 batches, reports after 4, 8 and 12. Reads run ahead of the consumer, but each
    # interval submits and consumes a new one (batch k+3 goes out after report k).
    loader = DataLoader(FetchDS(36), batch_size=3, log_every=4, read_ahead=2)  # 2 batches ahead, not grouped
    with caplog.at_level(logging.DEBUG, logger="fastload.live"):
        list(loader)
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(info) == 3
    assert all("cache hits 0%" in line and "slowest op fetch 1000 items/s" in line for line in info)
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG and r.name == "fastload.live"]
    assert len(debug) == 3 and debug[0].splitlines()[1].split()[0] == "op" and "fetch" in debug[0]  # the full stats table


def test_summary_writer_gets_interval_scalars():
    writer = FakeWriter()
    loader = DataLoader(FetchDS(24), batch_size=2, log_every=4, summary_writer=writer, read_ahead=2)  # not grouped
    list(loader)
    steps = sorted({s for _, _, s in writer.scalars})
    assert steps == [4, 8, 12]
    for step in steps:
        tags = writer.tags_at(step)
        assert {"fastload/batches_per_s", "fastload/data_stall", "fastload/cache_hit_rate",
                "fastload/fetch/items_per_s", "fastload/fetch/MBps"} <= tags
    values = {(t, s): v for t, v, s in writer.scalars}
    assert all(0.0 <= values[("fastload/data_stall", s)] <= 1.0 for s in steps)
    assert all(values[("fastload/cache_hit_rate", s)] == 0.0 for s in steps)
    # Each interval covers 4 batches x 2 items of 1000 B in 0.001 s each: 1000 items/s, 1 MB/s.
    assert values[("fastload/fetch/items_per_s", 8)] == pytest.approx(1000.0)
    assert values[("fastload/fetch/MBps", 8)] == pytest.approx(1.0)


def test_writer_without_log_every_writes_every_default_interval_and_logs_nothing(caplog):
    writer = FakeWriter()
    loader = DataLoader(list(range(2 * DEFAULT_WRITE_EVERY)), batch_size=1, summary_writer=writer)
    with caplog.at_level(logging.INFO, logger="fastload.live"):
        list(loader)
    assert sorted({s for _, _, s in writer.scalars}) == [DEFAULT_WRITE_EVERY, 2 * DEFAULT_WRITE_EVERY]
    assert not [r for r in caplog.records if r.name == "fastload.live"]


def test_steps_count_across_epochs():
    writer = FakeWriter()
    loader = DataLoader(list(range(6)), batch_size=1, summary_writer=writer, log_every=4)
    for _ in range(2):
        list(loader)
    assert sorted({s for _, _, s in writer.scalars}) == [4, 8, 12]


def test_batches_are_unchanged_by_live_stats():
    torch.manual_seed(0)
    plain = [b.tolist() for b in DataLoader(list(range(30)), batch_size=4, shuffle=True, seed=3)]
    live = [b.tolist() for b in DataLoader(list(range(30)), batch_size=4, shuffle=True, seed=3, log_every=1,
                                           summary_writer=FakeWriter())]
    assert live == plain


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"log_every": 0}, ConfigError, "log_every=0 must be >= 1"),
        ({"log_every": 5, "stats": False}, ConfigError, "need stats=True"),
        ({"summary_writer": FakeWriter(), "stats": False}, ConfigError, "need stats=True"),
        ({"summary_writer": object()}, TypeError, "has no add_scalar"),
    ],
)
def test_bad_arguments_are_rejected(kwargs: dict[str, Any], error: type[Exception], match: str):
    with pytest.raises(error, match=match):
        DataLoader(list(range(4)), **kwargs)


def test_reporter_does_not_keep_its_loader_alive():
    loader = DataLoader(list(range(4)), log_every=1)
    reporter = loader._fl_live_stats
    assert isinstance(reporter, LiveStats)
    del loader
    gc.collect()
    assert reporter.report() is None


def test_interval_between_two_snapshots():
    col = StatsCollector()
    col.add("decode", items=10, bytes=10_000, seconds=0.5)
    col.record_batches(5, wait_seconds=1.0, wall_seconds=4.0)
    first = col.snapshot()
    col.add("decode", items=30, bytes=60_000, seconds=0.5)
    col.count("cache_hit", 3)
    col.count("cache_miss", 1)
    col.record_batches(10, wait_seconds=3.0, wall_seconds=4.0)
    iv = interval(col.snapshot(), first)
    assert iv["batches"] == 10 and iv["batches_per_s"] == pytest.approx(2.5)
    assert iv["data_stall"] == pytest.approx(0.75) and iv["cache_hit_rate"] == pytest.approx(0.75)
    assert iv["ops"]["decode"] == {"items": 30, "items_per_s": pytest.approx(60.0), "MBps": pytest.approx(0.12)}
    assert interval(first, None)["ops"]["decode"]["items"] == 10


_LOG_SCRIPT = """
import logging, sys
from fastload.loader.dataloader import DataLoader
if sys.argv[1] == "before":
    logging.basicConfig(format="USER %(message)s")  # root at WARNING, as most configs leave it
loader = DataLoader(list(range(8)), batch_size=2, log_every=2)
if sys.argv[1] == "after":
    logging.basicConfig(format="USER %(message)s")
for _ in loader:
    pass
"""


@pytest.mark.parametrize("config", ["none", "before", "after"])
def test_log_every_lines_reach_stderr_once(config: str) -> None:
    # A fresh interpreter: pytest's own capture handlers on the root logger would hide
    # the case that matters, a script that never configured logging.
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _LOG_SCRIPT, config], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "batches/s, data stall" in line]
    assert len(lines) == 2, done.stderr  # batches 2 and 4, each exactly once
    prefix = "fastload: batch" if config == "none" else "USER fastload: batch"
    assert all(line.startswith(prefix) for line in lines), lines
