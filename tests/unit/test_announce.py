"""Announcer (fastload.fetch.ahead): index batches announced to the dataset before the readers reach them."""

from __future__ import annotations

import logging
import pickle

import pytest

from fastload.errors import ConfigError
from fastload.fetch import AHEAD_ITEMS, Announced, Announcer, announce, depth_for
from fastload.fetch.ahead import HINT_ITEMS


def test_batches_pass_unchanged_and_each_is_announced_once_depth_ahead() -> None:
    batches = [[0, 1], [2, 3], [4, 5], [6, 7], [8]]
    hinted: list[list[int]] = []
    it = Announcer(iter(batches), 2, hint=hinted.append)
    first = next(it)
    assert first == [0, 1] and sum(hinted, []) == [0, 1, 2, 3, 4, 5]  # the one returned and 2 beyond it
    rest = list(it)
    assert [first, *rest] == batches
    assert sum(hinted, []) == sum(batches, [])  # each exactly once, in order


def test_small_batches_are_announced_together_and_always_before_their_read() -> None:
    # Batches of 1 (torch's default) announced one by one cost a fetch-ahead call per sample:
    # they are held and announced HINT_ITEMS at a time, and a held batch about to be read is
    # announced first.
    hinted: list[list[int]] = []
    it = Announcer(iter([[i] for i in range(300)]), depth_for(1), hint=hinted.append)
    for k, batch in enumerate(it):
        assert batch == [k] and k in sum(hinted, [])  # announced before it is read
    assert sum(hinted, []) == list(range(300))
    assert all(len(h) == HINT_ITEMS for h in hinted[:-1]) and len(hinted) == -(-300 // HINT_ITEMS)


def test_a_failing_hint_never_ends_the_epoch(caplog: pytest.LogCaptureFixture) -> None:
    def boom(_: list[int]) -> None:
        raise OSError("remote down")

    with caplog.at_level(logging.DEBUG, logger="fastload"):
        assert list(Announcer(iter([[1], [2]]), 1, hint=boom)) == [[1], [2]]
    assert "remote down" in caplog.text


def test_depth_covers_about_ahead_items() -> None:
    assert depth_for(64) == AHEAD_ITEMS // 64
    assert depth_for(10_000) == 1 and depth_for(None) == AHEAD_ITEMS


def _carried(batch: list[int]) -> list[list[int]]:
    return getattr(batch, "ahead", [])


def test_with_workers_each_batch_rides_to_its_worker_once_on_that_workers_earliest_batch() -> None:
    batches = [[k] for k in range(10)]
    out = list(Announcer(iter(batches), 4, workers=2))
    assert out == batches  # the same batches, in order, equal to plain lists
    # Worker w reads batches w, w+2, ...: its first carries itself and the batches of
    # the same worker up to depth 4 beyond it; each later one the batch 4 beyond it.
    assert _carried(out[0]) == [[0], [2], [4]] and _carried(out[1]) == [[1], [3], [5]]
    assert [_carried(b) for b in out[2:]] == [[[6]], [[7]], [[8]], [[9]], [], [], [], []]
    announced = [b for batch in out for b in _carried(batch)]
    assert sorted(announced) == batches  # each batch announced exactly once
    for k, batch in enumerate(out):
        assert all(b[0] % 2 == k % 2 and b[0] >= k for b in _carried(batch))  # to the worker that reads it, no later


def test_announced_batches_pickle_with_what_they_carry() -> None:
    batch = Announced([3, 1, 2], [[3, 1, 2], [7, 8]])
    back = pickle.loads(pickle.dumps(batch))
    assert back == [3, 1, 2] and isinstance(back, list) and back.ahead == [[3, 1, 2], [7, 8]]
    hinted: list[list[int]] = []
    announce(back, hinted.append)
    announce([5, 6], hinted.append)  # a plain batch carries nothing
    assert hinted == [[3, 1, 2], [7, 8]]


def test_batches_that_are_not_plain_lists_pass_unchanged() -> None:
    batches = [(0, 1), (2, 3), (4, 5)]
    assert list(Announcer(iter(batches), 2, workers=1)) == batches
    assert all(type(b) is tuple for b in Announcer(iter(batches), 2, workers=1))


def test_announcing_needs_one_way() -> None:
    with pytest.raises(ConfigError, match="pass exactly one"):
        Announcer(iter([]), 1)
    with pytest.raises(ConfigError, match="pass exactly one"):
        Announcer(iter([]), 1, hint=print, workers=2)


def test_depth_scales_with_the_processes_that_read() -> None:
    assert depth_for(64, 2) == 2 * depth_for(64) and depth_for(64, 0) == depth_for(64)
