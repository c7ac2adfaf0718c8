"""Lookahead: index batches announced to the dataset before the readers reach them."""

from __future__ import annotations

import logging

import pytest

from fastload.lookahead import LOOKAHEAD_ITEMS, Lookahead, depth_for


def test_batches_pass_unchanged_and_each_is_announced_once_depth_ahead() -> None:
    batches = [[0, 1], [2, 3], [4, 5], [6, 7], [8]]
    hinted: list[list[int]] = []
    it = Lookahead(iter(batches), 2, hint=hinted.append)
    first = next(it)
    assert first == [0, 1] and hinted == batches[:3]  # the one returned and 2 beyond it
    rest = list(it)
    assert [first, *rest] == batches
    assert hinted == batches  # each exactly once, in order


def test_a_failing_hint_never_ends_the_epoch(caplog: pytest.LogCaptureFixture) -> None:
    def boom(_: list[int]) -> None:
        raise OSError("remote down")

    with caplog.at_level(logging.DEBUG, logger="fastload"):
        assert list(Lookahead(iter([[1], [2]]), 1, hint=boom)) == [[1], [2]]
    assert "remote down" in caplog.text


def test_depth_covers_about_lookahead_items() -> None:
    assert depth_for(64) == LOOKAHEAD_ITEMS // 64
    assert depth_for(10_000) == 1 and depth_for(None) == LOOKAHEAD_ITEMS
