"""The ranks' listing check (fastload.loader.listing_check): digests, the first difference, the message.

The collective itself runs under torchrun in tests/integration/test_listing_agree.py.
"""

from __future__ import annotations

from fastload.loader import listing_check as lc
from fastload.loader.sampler import ShardedSampler

KEYS = [f"http://host/d/{i:05d}.bin" for i in range(3 * lc.CHUNK + 5)]


def test_digest_names_the_listing_and_the_chunk_that_differs() -> None:
    base = lc.digest(len(KEYS), KEYS)
    assert base == lc.digest(len(KEYS), list(KEYS)) and len(base.chunks) == 4
    moved = list(KEYS)
    moved[2 * lc.CHUNK + 7] = "http://host/d/other.bin"
    other = lc.digest(len(moved), moved)
    assert other.hex != base.hex
    assert [a == b for a, b in zip(base.chunks, other.chunks)] == [True, True, False, True]
    assert lc._first_chunk([base.chunks, other.chunks]) == 2
    # Sizes, the count, and how keys are cut all count.
    assert lc.digest(len(KEYS), KEYS, [1] * len(KEYS)).hex != lc.digest(len(KEYS), KEYS, [2] * len(KEYS)).hex
    assert lc.digest(10).hex != lc.digest(9).hex and lc.digest(10).chunks == ()
    assert lc.digest(2, ["ab", "c"]).hex != lc.digest(2, ["a", "bc"]).hex
    assert lc._first_chunk([base.chunks, base.chunks[:2]]) == 2  # a shorter listing differs where it ends


def test_first_item_and_message_group_ranks_by_digest() -> None:
    parts: dict[int, list[tuple[str, int | None]]] = {0: [("a", None), ("b", None), ("c", None)], 2: [("a", None), ("b", None)]}
    first = lc._first_item(100, parts)
    assert first == (102, {0: ("c", None), 2: None})
    assert lc._first_item(0, {0: [("a", 5)], 1: [("a", 5)]}) is None
    groups = {(10000, "ab12" * 8): [0, 1, 3, 4, 5], (9998, "cd34" * 8): [2]}
    text = lc.mismatch_message(groups, first, "s3://bucket/train/")
    assert "ranks 0-1,3-5: 10000 items (digest ab12ab12ab12); rank 2: 9998 items (digest cd34cd34cd34)" in text
    assert "First difference at item 102: rank 0 has 'c', rank 2 has no item" in text
    assert "`fastload cache s3://bucket/train/ --refresh`" in text and "refresh=True" in text
    assert "First difference" not in lc.mismatch_message(groups)


class NoListing:
    """A dataset whose listing must not be asked for."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        return i

    def item_keys(self) -> list[str]:
        raise AssertionError("listed with no process group to compare with")


def test_no_process_group_no_comparison_and_no_listing() -> None:
    # Ranks given by hand have no collective to compare through (docs/loader.md): the
    # sampler splits as before and never lists the dataset for a check.
    assert list(ShardedSampler(NoListing(), world_size=2, rank=1, shuffle=False)) == [1, 3, 5, 7]


class Keyed:
    def __len__(self) -> int:
        return 2

    def item_keys(self) -> list[str]:
        return ["x", "y"]


def test_dataset_listing_is_the_keys_or_nothing() -> None:
    assert lc.dataset_listing(Keyed()) == ["x", "y"]
    assert lc.dataset_listing(list(range(3))) == []  # no keys: only the count is compared
