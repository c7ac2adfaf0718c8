"""What a state holds: the next batch's position in every state, JSON, worker RNG, stateful datasets."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from _loader_helpers import TensorDS, assert_same
from _resume_helpers import (
    CallCountDS,
    CountingStream,
    DrawingDS,
    OwnRandomSampler,
    PlainStream,
    StatefulIterStream,
)

from fastload.errors import ConfigError, LoaderError
from fastload.loader.dataloader import DataLoader

# Three workers on a two-CPU machine make torch warn; the rotation needs more than two.
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def _values(loader: Any) -> list[list[int]]:
    return [b.tolist() for b in loader]


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _json(state: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(state))  # fails on tensors, bytes, tuples-as-keys


# -- state_dict() is the next batch's position: restored, mid-epoch, between epochs -------


def test_state_right_after_a_restore_is_the_restored_position() -> None:
    ds = list(range(10))
    a = DataLoader(ds, batch_size=2)
    it = iter(a)
    next(it), next(it)
    b = DataLoader(ds, batch_size=2)
    b.load_state_dict(a.state_dict())
    c = DataLoader(ds, batch_size=2)
    c.load_state_dict(b.state_dict())  # saved before b iterated: no replay
    assert _values(c) == [[4, 5], [6, 7], [8, 9]]


def test_loading_into_a_loader_mid_epoch_reports_the_loaded_position() -> None:
    ds = list(range(10))
    a = DataLoader(ds, batch_size=2)
    it = iter(a)
    next(it)
    s1 = a.state_dict()
    next(it), next(it)
    a.load_state_dict(s1)  # the old iterator is at batch 3
    assert a.state_dict()["batches_yielded"] == 1
    fresh = DataLoader(ds, batch_size=2)
    fresh.load_state_dict(a.state_dict())
    assert _values(fresh) == [[2, 3], [4, 5], [6, 7], [8, 9]]
    assert _values(a) == [[2, 3], [4, 5], [6, 7], [8, 9]]


def test_state_between_epochs_fixes_the_next_epochs_order() -> None:
    # shuffle=True without a generator: the order comes from the global torch RNG.
    torch.manual_seed(3)
    ref = DataLoader(list(range(12)), batch_size=4, shuffle=True)
    _values(ref)
    state = _json(ref.state_dict())
    expected = _values(ref)
    torch.manual_seed(999)  # a new process, another global RNG
    resumed = DataLoader(list(range(12)), batch_size=4, shuffle=True)
    resumed.load_state_dict(state)
    assert _values(resumed) == expected


@pytest.mark.parametrize("persistent", [False, True])
def test_state_between_epochs_with_workers_fixes_the_next_epoch(persistent: bool) -> None:
    # Global-RNG shuffle and draws inside the workers. Persistent workers draw no new
    # base seed for the next epoch and carry their RNG on: the state must too.
    def make() -> DataLoader:
        return DataLoader(DrawingDS(12), batch_size=3, shuffle=True, num_workers=2, persistent_workers=persistent)

    torch.manual_seed(5)
    ref = make()
    list(ref)
    state = _json(ref.state_dict())
    expected = list(ref)
    torch.manual_seed(77)
    resumed = make()
    resumed.load_state_dict(state)
    assert_same(list(resumed), expected)


# -- JSON ----------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_json_round_trip_resumes_exactly(workers: int) -> None:
    def make() -> DataLoader:
        # device="cpu" with workers: the prefetcher takes batches (and their worker
        # states) ahead of the consumer; the state must still be the consumer's.
        return DataLoader(
            DrawingDS(), batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(5),
            num_workers=workers, device="cpu" if workers else None, prefetch_to_device=3,
        )  # fmt: skip

    _seed_all(0)
    expected = list(make())
    _seed_all(0)
    a = make()
    it = iter(a)
    head = [next(it) for _ in range(3)]
    text = json.dumps(a.state_dict())  # raises on a tensor
    del it
    _seed_all(99)
    b = make()
    b.load_state_dict(json.loads(text))
    assert_same(head + list(b), expected)


# -- worker RNG ------------------------------------------------------------------------------


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("seeded", [True, False])
def test_worker_rng_draws_repeat_after_resume(persistent: bool, seeded: bool) -> None:
    # DrawingDS draws from random, numpy and torch in __getitem__, inside the workers.
    def make() -> DataLoader:
        gen = torch.Generator().manual_seed(7) if seeded else None
        return DataLoader(
            DrawingDS(), batch_size=2, shuffle=True, generator=gen, num_workers=2, persistent_workers=persistent
        )

    torch.manual_seed(1)
    ref = make()
    expected = [list(ref) for _ in range(3)]
    for k in (1, 4):  # k=1: worker 1 has produced nothing yet
        torch.manual_seed(1)
        a = make()
        assert_same(list(a), expected[0])
        it = iter(a)
        head = [next(it) for _ in range(k)]
        state = _json(a.state_dict())
        rng = torch.get_rng_state()
        del it, a
        torch.manual_seed(4321)
        b = make()
        b.load_state_dict(state)
        torch.set_rng_state(rng)  # the script restores its own RNG
        assert_same(head + list(b), expected[1])
        assert_same(list(b), expected[2])  # the next epoch too


def test_resume_across_another_num_workers_keeps_the_order() -> None:
    kw: dict[str, Any] = dict(batch_size=3, shuffle=True)
    expected = list(DataLoader(TensorDS(), generator=torch.Generator().manual_seed(2), num_workers=2, **kw))
    a = DataLoader(TensorDS(), generator=torch.Generator().manual_seed(2), num_workers=2, **kw)
    it = iter(a)
    head = [next(it) for _ in range(3)]
    b = DataLoader(TensorDS(), generator=torch.Generator().manual_seed(2), num_workers=0, **kw)
    b.load_state_dict(_json(a.state_dict()))
    assert_same(head + list(b), expected)


# -- stateful datasets and samplers -----------------------------------------------------------


def _stopped_and_resumed(make: Callable[[], DataLoader], k: int, other_seed: int) -> list[Any]:
    """``k`` batches of a seeded epoch, its state through JSON, then the rest from a new loader
    whose process RNG was reseeded to ``other_seed`` (the state must carry what it needs)."""
    _seed_all(0)
    a = make()
    it = iter(a)
    head = [next(it) for _ in range(k)]
    state = _json(a.state_dict())
    del it
    _seed_all(other_seed)
    b = make()
    b.load_state_dict(state)
    return head + list(b)


@pytest.mark.parametrize(("workers", "every"), [(0, 1), (2, 1), (2, 3), (3, 2), (2, 0)])
def test_stateful_iterable_dataset_resumes_mid_epoch(workers: int, every: int) -> None:
    def make() -> DataLoader:
        return DataLoader(CountingStream(), batch_size=2, num_workers=workers, snapshot_every_n_steps=every)

    _seed_all(0)
    expected = [list(make_ := make()), list(make_)]
    for k in (1, 5, 8):
        assert_same(_stopped_and_resumed(make, k, 99), expected[0], f"k={k}")
    assert sorted(int(x[0]) for b in expected[0] for x in b) == list(range(30))


@pytest.mark.parametrize(("workers", "every"), [(0, 1), (2, 1), (2, 2)])
def test_stateful_iterator_of_a_stateless_dataset_resumes(workers: int, every: int) -> None:
    def make() -> DataLoader:
        return DataLoader(StatefulIterStream(), batch_size=3, num_workers=workers, snapshot_every_n_steps=every)

    _seed_all(0)
    expected = list(make())
    for k in (1, 4):
        assert_same(_stopped_and_resumed(make, k, 7), expected, f"k={k}")


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_map_dataset_resumes_in_each_worker(workers: int) -> None:
    def make() -> DataLoader:
        return DataLoader(CallCountDS(), batch_size=3, num_workers=workers)

    expected = list(make())
    for k in (1, 2, 4):  # with 2 workers: next batch from worker 1, 0, 0
        a = make()
        it = iter(a)
        head = [next(it) for _ in range(k)]
        state = _json(a.state_dict())
        del it
        b = make()
        b.load_state_dict(state)
        assert_same(head + list(b), expected, f"k={k}")


def test_stateful_sampler_resumes_with_its_own_rng() -> None:
    def make() -> DataLoader:
        return DataLoader(TensorDS(20), batch_size=3, sampler=OwnRandomSampler(20, seed=9))

    ref = make()
    expected = [list(ref), list(ref)]
    a = make()
    list(a)
    it = iter(a)
    head = [next(it) for _ in range(2)]
    b = make()
    b.load_state_dict(_json(a.state_dict()))
    assert_same(head + list(b), expected[1])


def test_iterable_dataset_without_state_is_replayed_and_names_the_fix() -> None:
    # Issue 33: replayed from the epoch's start (as torchdata), with a warning naming the fix.
    a = DataLoader(PlainStream(), batch_size=2)
    it = iter(a)
    head = [next(it)]
    b = DataLoader(PlainStream(), batch_size=2)
    with pytest.warns(UserWarning, match=r"PlainStream.*after 1 batches.*state_dict\(\) and load_state_dict\(\)"):
        b.load_state_dict(a.state_dict())
    assert _values(head) + _values(b) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]


def test_iterable_state_needs_the_same_workers() -> None:
    a = DataLoader(CountingStream(), batch_size=2, num_workers=2)
    it = iter(a)
    next(it), next(it)
    state = a.state_dict()
    del it
    with pytest.raises(LoaderError, match="num_workers=3.*saved by 2 worker"):
        DataLoader(CountingStream(), batch_size=2, num_workers=3).load_state_dict(state)


def test_snapshot_every_n_steps_is_checked() -> None:
    with pytest.raises(ConfigError, match="snapshot_every_n_steps=-1"):
        DataLoader(TensorDS(), snapshot_every_n_steps=-1)
