"""Samplers and resume: stop after batch k, save, rebuild, load, continue == uninterrupted."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.data as tud
from _loader_helpers import CountingDS, RangeIterDS, ReadBatchDS, TensorDS, assert_same

from fastload.errors import ConfigError
from fastload.loader.dataloader import DataLoader
from fastload.loader.sampler import ResumableSampler, ShardedSampler

# -- ShardedSampler ----------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 7, 10, 13])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_sharded_matches_distributed_sampler(
    n: int, world: int, shuffle: bool, drop_last: bool
) -> None:
    if n == 0 and not drop_last and world > 1:
        pass  # both pad an empty list to nothing
    for rank in range(world):
        ours = ShardedSampler(range(n), world, rank, shuffle=shuffle, seed=5, drop_last=drop_last)
        theirs = tud.DistributedSampler(
            range(n), world, rank, shuffle=shuffle, seed=5, drop_last=drop_last
        )
        for epoch in (0, 3):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)
            assert len(ours) == len(theirs)


def test_sharded_padding_and_drop_semantics() -> None:
    pad = [list(ShardedSampler(range(10), 4, r, shuffle=False)) for r in range(4)]
    assert [len(p) for p in pad] == [3, 3, 3, 3]
    assert sorted(i for p in pad for i in p) == sorted([*range(10), 0, 1])  # head repeats
    cut = [list(ShardedSampler(range(10), 4, r, shuffle=False, drop_last=True)) for r in range(4)]
    assert [len(c) for c in cut] == [2, 2, 2, 2]
    flat = [i for c in cut for i in c]
    assert len(set(flat)) == 8 and set(flat) <= set(range(10))


def test_sharded_epochs_differ_and_start_offset() -> None:
    s = ShardedSampler(range(50), 2, 0, seed=1)
    e0 = list(s)
    s.set_epoch(1)
    e1 = list(s)
    assert e0 != e1 and sorted(e0) != sorted(range(50))
    s.set_start(10)
    assert list(s) == e1[10:]
    assert list(s) == e1  # the offset applies once
    with pytest.raises(ConfigError):
        ShardedSampler(range(5), 2, 2)
    s.load_state_dict({"epoch": 0, "seed": 1})
    assert list(s) == e0 and s.state_dict() == {"epoch": 0, "seed": 1}


def test_resumable_sampler_replays_lazy_and_eager_samplers() -> None:
    g = torch.Generator().manual_seed(4)
    lazy = ResumableSampler(tud.RandomSampler(range(30), generator=g), [g])
    full = list(lazy)
    snap = lazy.snapshot
    assert snap is not None and snap.phase == "next"
    list(lazy)  # the generator moves on
    lazy.resume_at(11, snap)
    assert list(lazy) == full[11:]

    dist = tud.DistributedSampler(range(30), num_replicas=2, rank=1, seed=2)
    eager = ResumableSampler(dist)
    full = list(eager)
    eager.resume_at(4)
    assert list(eager) == full[4:]


# -- resume through the loader ---------------------------------------------------------


def _seeded(seed: int = 11) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


CASES: dict[str, Callable[[], dict[str, Any]]] = {
    "shuffle-gen": lambda: dict(batch_size=4, shuffle=True, generator=_seeded()),
    "shuffle-global": lambda: dict(batch_size=4, shuffle=True),
    "workers-shuffle": lambda: dict(batch_size=4, shuffle=True, generator=_seeded(), num_workers=2),
    "workers-persistent": lambda: dict(
        batch_size=3, shuffle=True, generator=_seeded(), num_workers=2, persistent_workers=True
    ),
    "unbatched": lambda: dict(batch_size=None, shuffle=True, generator=_seeded()),
    "replacement": lambda: dict(
        batch_size=5, sampler=tud.RandomSampler(range(23), replacement=True, num_samples=31)
    ),
    "own-generator-sampler": lambda: dict(
        batch_size=4, sampler=tud.RandomSampler(range(23), generator=_seeded(3))
    ),
    "distributed-sampler": lambda: dict(
        batch_size=3, sampler=tud.DistributedSampler(range(23), num_replicas=2, rank=1, seed=7)
    ),
    "distributed-true": lambda: dict(
        batch_size=3, shuffle=True, distributed=True, rank=1, world_size=2
    ),
    "read-batch": lambda: dict(batch_size=4, shuffle=True, generator=_seeded()),
    "device-cpu": lambda: dict(batch_size=4, shuffle=True, generator=_seeded(), device="cpu"),
}


def _dataset(case: str) -> Any:
    return ReadBatchDS(23) if case == "read-batch" else TensorDS(23)


def _epoch(loader: DataLoader, epoch: int) -> list[Any]:
    loader.set_epoch(epoch)
    return list(loader)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("k", [0, 2])
def test_resume_mid_epoch_equals_uninterrupted(case: str, k: int) -> None:
    torch.manual_seed(0)
    ref = DataLoader(_dataset(case), **CASES[case]())
    expected = [_epoch(ref, e) for e in range(3)]
    expected_after = torch.rand(3)

    torch.manual_seed(0)
    first = DataLoader(_dataset(case), **CASES[case]())
    assert_same(_epoch(first, 0), expected[0])
    first.set_epoch(1)
    it = iter(first)
    head = [next(it) for _ in range(k)]
    buf = io.BytesIO()
    torch.save({"loader": first.state_dict(), "rng": torch.get_rng_state()}, buf)
    del it, first

    torch.manual_seed(12345)  # a fresh process, different RNG state
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    resumed = DataLoader(_dataset(case), **CASES[case]())
    resumed.load_state_dict(ckpt["loader"])
    torch.set_rng_state(ckpt["rng"])  # the training script restores its own RNG
    tail = list(resumed)
    assert_same(head + tail, expected[1])
    assert_same(_epoch(resumed, 2), expected[2])
    assert torch.equal(torch.rand(3), expected_after)  # the caller's global stream is undisturbed


@pytest.mark.parametrize("read_batch", [False, True])
def test_resume_does_not_read_skipped_samples(read_batch: bool) -> None:
    ds = ReadBatchDS(20) if read_batch else CountingDS(20)
    loader = DataLoader(ds, batch_size=4, shuffle=True, generator=_seeded(), read_ahead=0)
    order = [
        b[1].tolist()
        for b in DataLoader(TensorDS(20), batch_size=4, shuffle=True, generator=_seeded())
    ]
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    assert state["batches_yielded"] == 2

    fresh = ReadBatchDS(20) if read_batch else CountingDS(20)
    resumed = DataLoader(fresh, batch_size=4, shuffle=True, generator=_seeded(), read_ahead=0)
    resumed.load_state_dict(state)
    rest = list(resumed)
    reads = fresh.read_indices if read_batch else fresh.reads
    assert len(reads) == 12  # only the three remaining batches were read
    assert [b[1].tolist() for b in rest] == order[2:]


def test_resume_from_a_resumed_loader_counts_from_epoch_start() -> None:
    kw = lambda: dict(batch_size=2, shuffle=True, generator=_seeded())  # noqa: E731
    expected = list(DataLoader(TensorDS(14), **kw()))
    a = DataLoader(TensorDS(14), **kw())
    it = iter(a)
    got = [next(it), next(it)]
    b = DataLoader(TensorDS(14), **kw())
    b.load_state_dict(a.state_dict())
    it = iter(b)
    got += [next(it)]
    assert b.state_dict()["batches_yielded"] == 3
    c = DataLoader(TensorDS(14), **kw())
    c.load_state_dict(b.state_dict())
    got += list(c)
    assert_same(got, expected)


def test_state_at_epoch_boundary_resumes_next_epoch() -> None:
    ref = DataLoader(TensorDS(), batch_size=5, shuffle=True, generator=_seeded())
    e0, e1 = list(ref), list(ref)
    a = DataLoader(TensorDS(), batch_size=5, shuffle=True, generator=_seeded())
    assert_same(list(a), e0)
    state = a.state_dict()
    assert state["in_epoch"] is False and state["batches_yielded"] == 0
    b = DataLoader(TensorDS(), batch_size=5, shuffle=True, generator=_seeded(999))
    b.load_state_dict(state)
    assert_same(list(b), e1)


def test_iterable_dataset_resume_rules() -> None:
    loader = DataLoader(RangeIterDS(), batch_size=2)
    assert len(list(loader)) == 6
    DataLoader(RangeIterDS(), batch_size=2).load_state_dict(loader.state_dict())  # boundary: ok
    it = iter(loader)
    head = [next(it)]
    resumed = DataLoader(RangeIterDS(), batch_size=2)
    with pytest.warns(UserWarning, match=r"RangeIterDS \(an IterableDataset\).*after 1 batches.*state_dict\(\)"):
        resumed.load_state_dict(loader.state_dict())  # no state: replayed (issue 33)
    assert_same(head + list(resumed), list(DataLoader(RangeIterDS(), batch_size=2)))


def test_out_of_order_workers_resume_mid_epoch() -> None:
    # Issue 33: the state names the batches delivered; the rest comes, none twice.
    loader = DataLoader(TensorDS(), batch_size=2, num_workers=2, in_order=False)
    it = iter(loader)
    head = [next(it) for _ in range(3)]
    state = loader.state_dict()
    del it
    resumed = DataLoader(TensorDS(), batch_size=2, num_workers=2, in_order=False)
    resumed.load_state_dict(state)
    got = sorted(int(x) for b in head + list(resumed) for x in b[0].reshape(-1))
    assert got == sorted(int(x) for b in DataLoader(TensorDS(), batch_size=2) for x in b[0].reshape(-1))


def test_state_mismatches_are_config_errors() -> None:
    a = DataLoader(TensorDS(), distributed=True, rank=0, world_size=2)
    b = DataLoader(TensorDS(), distributed=True, rank=0, world_size=3)
    with pytest.raises(ConfigError, match="world_size=2"):
        b.load_state_dict(a.state_dict())
    with pytest.raises(ConfigError, match="version"):
        a.load_state_dict({**a.state_dict(), "version": 99})


def test_user_distributed_sampler_epoch_is_saved() -> None:
    sampler = tud.DistributedSampler(range(23), num_replicas=2, rank=0, seed=1)
    loader = DataLoader(TensorDS(), batch_size=3, sampler=sampler)
    sampler.set_epoch(5)  # set directly on the sampler, as DDP scripts do
    expected = list(loader)
    it = iter(loader)
    head = [next(it)]
    state = loader.state_dict()
    fresh = tud.DistributedSampler(range(23), num_replicas=2, rank=0, seed=1)
    resumed = DataLoader(TensorDS(), batch_size=3, sampler=fresh)
    resumed.load_state_dict(state)
    assert fresh.epoch == 5
    assert_same(head + list(resumed), expected)
