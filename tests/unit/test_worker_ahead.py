"""Workers fetch ahead: index batches announced to the worker process that will read them.

Real worker processes of torch's multi-process iterator; the dataset
(``AnnouncingDS``) says per sample whether its batch was announced to the same
process before the read. Announcing must never change which samples come, in
what order, nor any RNG draw (fastload/fetch/ahead.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.utils.data as tud
from _loader_helpers import AnnouncingDS, TensorDS, assert_same

from fastload import DataLoader
from fastload.fetch import AheadSampler, depth_for
from fastload.loader.sampler import ResumableSampler

TIMEOUT_S = 60  # a batch that never comes fails the test instead of hanging it


def _seeded(seed: int = 5) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _samples(batches: list[Any]) -> list[Any]:
    return [sample for sample, _ in batches]


def _flags(batches: list[Any]) -> list[int]:
    return [int(f) for _, flags in batches for f in flags]


def _collate(batch: list[Any]) -> Any:
    return tud.default_collate([s for s, _ in batch]), [f for _, f in batch]


@pytest.mark.parametrize("persistent", [False, True])
def test_every_worker_batch_was_announced_to_its_worker_and_samples_match(persistent: bool) -> None:
    kw: dict[str, Any] = dict(batch_size=3, shuffle=True, collate_fn=_collate)
    loader = DataLoader(AnnouncingDS(40), num_workers=2, persistent_workers=persistent, generator=_seeded(),
                        timeout=TIMEOUT_S, **kw)
    plain = DataLoader(AnnouncingDS(40), generator=_seeded(), **kw)
    torch_loader = tud.DataLoader(AnnouncingDS(40), num_workers=2, persistent_workers=persistent, generator=_seeded(), **kw)
    for epoch in range(2):  # the second epoch: a new permutation, workers reused when persistent
        got, want, theirs = list(loader), list(plain), list(torch_loader)
        if epoch == 0 or not persistent:  # persistent workers draw no new base seed: torch's next order differs
            assert_same(_samples(got), _samples(want))
        assert_same(_samples(got), _samples(theirs))
        assert _flags(got) == [1] * 40  # every batch fetched ahead by the process that read it
        assert _flags(theirs) == [0] * 40  # torch's loader announces nothing


def test_announcing_draws_nothing_more_from_any_rng() -> None:
    kw: dict[str, Any] = dict(batch_size=4, shuffle=True, num_workers=2, collate_fn=_collate)
    torch.manual_seed(3)
    theirs = _samples(list(tud.DataLoader(AnnouncingDS(30), **kw)))
    after_theirs = torch.get_rng_state()
    torch.manual_seed(3)
    got = list(DataLoader(AnnouncingDS(30), timeout=TIMEOUT_S, **kw))
    assert torch.equal(torch.get_rng_state(), after_theirs)  # the base seed and RandomSampler's seed, as torch
    assert_same(_samples(got), theirs)
    assert _flags(got) == [1] * 30


def test_resumed_epoch_with_workers_is_unchanged_and_still_announced() -> None:
    kw: dict[str, Any] = dict(batch_size=3, shuffle=True, num_workers=2, collate_fn=_collate, timeout=TIMEOUT_S)
    full = list(DataLoader(AnnouncingDS(31), generator=_seeded(), **kw))
    first = DataLoader(AnnouncingDS(31), generator=_seeded(), **kw)
    it = iter(first)
    head = [next(it) for _ in range(3)]
    state = first.state_dict()
    del it
    resumed = DataLoader(AnnouncingDS(31), generator=_seeded(), **kw)
    resumed.load_state_dict(state)
    tail = list(resumed)
    assert_same(_samples(head + tail), _samples(full))
    # The resumed epoch's first batch goes to the worker that was next (fastload.loader.resume);
    # batch j still shares its worker with batch j + num_workers, so announcements land.
    assert _flags(tail) == [1] * len(_flags(tail))


def test_sharded_and_custom_batch_samplers_keep_their_batches() -> None:
    sharded = dict(batch_size=4, shuffle=True, distributed=True, rank=1, world_size=2, seed=9)
    got = list(DataLoader(AnnouncingDS(37), num_workers=2, collate_fn=_collate, timeout=TIMEOUT_S, **sharded))
    assert_same(_samples(got), _samples(list(DataLoader(AnnouncingDS(37), collate_fn=_collate, **sharded))))
    assert _flags(got) == [1] * len(_flags(got))

    lists = [[5, 1], [0, 2, 9], [3], [8, 4], [7, 6]]
    got = list(DataLoader(AnnouncingDS(10), batch_sampler=lists, num_workers=2, collate_fn=_collate, timeout=TIMEOUT_S))
    assert [b[0][0][:, 0].div(10).long().tolist() for b in got] == lists and _flags(got) == [1] * 10

    class Tuples(TensorDS):
        def fetch_ahead(self, indices: list[int]) -> None:
            pass

        def __getitems__(self, indices: Any) -> list[Any]:
            return [type(indices)] * len(indices)

    tuples = [(0, 1), (2, 3), (4,)]
    seen = list(DataLoader(Tuples(5), batch_sampler=tuples, num_workers=2, collate_fn=lambda b: b, timeout=TIMEOUT_S))
    assert seen == [[tuple, tuple], [tuple, tuple], [tuple]]  # other batch types reach the dataset unchanged


def test_a_wrong_guess_of_the_worker_still_yields_the_right_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    # Announce as if there were 3 workers while 2 read: most announcements reach the
    # wrong process. That costs only the fetch ahead; samples and order are unchanged.
    monkeypatch.setattr(DataLoader, "_workers_fetch_ahead", lambda self: 3)
    kw: dict[str, Any] = dict(batch_size=2, shuffle=True, collate_fn=_collate)
    got = list(DataLoader(AnnouncingDS(30), num_workers=2, generator=_seeded(), timeout=TIMEOUT_S, **kw))
    assert_same(_samples(got), _samples(list(DataLoader(AnnouncingDS(30), generator=_seeded(), **kw))))
    assert 0 in _flags(got)  # the guess was wrong for some batches


def test_no_announcing_where_a_worker_cannot_be_guessed_or_nothing_fetches_ahead() -> None:
    ahead = DataLoader(AnnouncingDS(), batch_size=2, num_workers=2)
    assert isinstance(ahead._index_sampler, AheadSampler)
    assert ahead._index_sampler.depth == depth_for(2, 2) and len(ahead._index_sampler) == len(ahead)
    for loader in (
        DataLoader(AnnouncingDS(), batch_size=2, num_workers=2, in_order=False),  # any worker with room
        DataLoader(TensorDS(), batch_size=2, num_workers=2),  # no fetch_ahead
        DataLoader(AnnouncingDS(), batch_size=2),  # no workers
        DataLoader(AnnouncingDS(), batch_size=None, num_workers=2),  # no index batches
    ):
        assert isinstance(loader._index_sampler, ResumableSampler)
    got = list(DataLoader(AnnouncingDS(12), batch_size=2, num_workers=2, in_order=False, collate_fn=_collate))
    assert sorted(i for s in _samples(got) for i in s[1].tolist()) == [i % 5 for i in sorted(range(12), key=lambda i: i % 5)]
    assert _flags(got) == [0] * 12
