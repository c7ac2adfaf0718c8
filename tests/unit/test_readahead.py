"""ReadAhead.close(): reads already running finish, and are recorded, before it returns."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from fastload.loader.dataloader import DataLoader
from fastload.loader.readahead import GROUP_SAMPLES, ReadAhead
from fastload.stats import StatsCollector, current_collector

READ_S = 0.3  # long enough that a close() which does not wait returns first


class _SlowReads:
    """read_fn: each call sleeps, then records into the active collector."""

    def __init__(self, need: int = 3) -> None:
        self.need = need  # reads started when two_started is set
        self.lock = threading.Lock()
        self.started: list[list[int]] = []
        self.threads: list[threading.Thread] = []
        self.two_started = threading.Event()  # set once 3 reads started

    def __call__(self, chunk: list[int]) -> list[int]:
        with self.lock:
            self.started.append(chunk)
            self.threads.append(threading.current_thread())
            if len(self.started) >= self.need:
                self.two_started.set()  # the first batch and two read ahead
        time.sleep(READ_S)
        current_collector().add("fetch", items=len(chunk))
        return list(chunk)


def test_close_waits_for_running_reads_and_joins_its_threads() -> None:
    reads = _SlowReads()
    col = StatsCollector()
    ra = ReadAhead(
        iter([[0], [1], [2], [3], [4]]),  # one chunk per batch
        reads,
        lambda samples: samples,
        auto_collation=True,
        threads=3,
        ahead=2,
        collector=col,
        group_samples=1,  # each batch its own read (grouped reads: test_small_batches_are_read_together...)
    )
    assert next(ra) == [0]
    assert reads.two_started.wait(5)
    ra.close()
    started = sum(len(c) for c in reads.started)
    assert started == 3  # batch 0 and the two read ahead; the rest were never started
    assert col.snapshot().op("fetch").items == started  # recorded before close() returned
    assert col.snapshot().op("assemble").items == started
    assert not any(t.is_alive() for t in reads.threads)


class _SlowReadBatch(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n
        self.reads = _SlowReads(need=2)  # batches of 4 are read in groups of 32 samples: two reads start

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return i

    def read_batch(self, indices: list[int]) -> list[int]:
        return self.reads(indices)


def test_an_epoch_stopped_early_leaks_no_records_into_the_next() -> None:
    ds = _SlowReadBatch(40)
    loader = DataLoader(ds, batch_size=4, read_threads=2, read_ahead=3)
    for _ in loader:
        assert ds.reads.two_started.wait(5)
        break  # drops the iterator: its ReadAhead closes and waits for running reads
    loader.reset_stats()
    time.sleep(READ_S * 2)  # any read still running would have recorded by now
    assert loader.stats().op("fetch").items == 0
    assert loader.stats().op("assemble").items == 0



def test_a_finalized_read_ahead_waits_for_its_reads_but_joins_no_thread(monkeypatch: Any) -> None:
    # A finalizer runs wherever a collection starts: once inside Thread.start's own
    # bookkeeping, which holds a lock that ending a thread takes again; the join in it
    # hung the whole suite. Running reads are still waited for (their records land here).
    gate, running, finished = threading.Event(), threading.Event(), threading.Event()

    def read(idx: list[int]) -> list[int]:
        if idx == [1]:
            running.set()
            gate.wait(5)
            finished.set()
        return list(idx)

    reads = ReadAhead(iter([[0], [1]]), read, lambda b: b, auto_collation=True, threads=2, ahead=1, group_samples=1)
    assert next(reads) == [0]
    # Only a read that has started is waited for (a queued one is cancelled): wait for it to run.
    assert running.wait(5), "the read of batch 1 never started"
    joins: list[str] = []
    real = threading.Thread.join
    monkeypatch.setattr(threading.Thread, "join", lambda self, timeout=None: joins.append(self.name) or real(self, timeout))
    threading.Timer(0.2, gate.set).start()
    reads.__del__()
    assert finished.is_set()  # the running read was waited for: it ended before __del__ returned
    assert [n for n in joins if n.startswith("fastload-read")] == []


def test_small_batches_are_read_together_and_a_failed_group_fails_only_its_own_batch() -> None:
    # batch_size=1 (torch's default) read one sample per read_batch call: a cache transaction per
    # sample, 2.6-3.7 ms of CPU per cold object against 0.5 in batches of 64. Small batches are read
    # in groups of GROUP_SAMPLES; a group whose read fails is read again batch by batch, so only
    # the batch with the bad sample raises, with its own error.
    calls: list[list[int]] = []

    def read(idx: list[int]) -> list[int]:
        calls.append(list(idx))
        if 37 in idx:
            raise ValueError("sample 37 is corrupt")
        return [i * 10 for i in idx]

    ra = ReadAhead(iter([[i] for i in range(70)]), read, lambda b: b, auto_collation=True, threads=2, ahead=2)
    got, errors = [], []
    while True:
        try:
            got.append(next(ra))
        except StopIteration:
            break
        except ValueError as err:
            errors.append(str(err))
    assert got == [[i * 10] for i in range(70) if i != 37]
    assert errors == ["sample 37 is corrupt"]
    grouped = [c for c in calls if len(c) > 1]
    assert grouped and all(len(c) == GROUP_SAMPLES for c in grouped[:2])  # 0-31, 32-63 (the failing one)
    assert [37] in calls and sum(len(c) == 1 for c in calls) >= GROUP_SAMPLES  # the failed group, batch by batch
