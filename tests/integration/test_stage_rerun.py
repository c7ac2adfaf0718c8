"""A rerun of `fastload cache` costs what it stages, not what the cache holds (issue 31).

A staged dataset whose summary still stands (nothing published or dropped since it was
counted) is checked from that summary: no key is computed, no entry looked up. Anything
else falls back to one pass over its entries, and fetches only what is missing.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import fastload
from fastload.cache import Cache
from fastload.config import Settings
from fastload.fetch.identity import Identity

pytestmark = pytest.mark.integration


def _folder(root: Path, n: int = 24) -> None:
    for k in range(n):
        # Every fourth object spans three 64 KiB blocks: "cached whole" means all of its blocks.
        size = 150_000 if k % 4 == 0 else 2_000 + k
        (root / f"d{k % 3}").mkdir(parents=True, exist_ok=True)
        (root / f"d{k % 3}" / f"f{k:02d}.bin").write_bytes(os.urandom(size))


@pytest.fixture()
def staged(tmp_path: Path) -> tuple[str, Settings, fastload.StageReport]:
    _folder(tmp_path / "data")
    settings = Settings(cache_dir=tmp_path / "cache", block_bytes=64 * 1024)
    url = (tmp_path / "data").as_uri()
    first = fastload.stage(url, settings=settings, progress=False)
    assert first.fetched_blocks == first.blocks == 24 - 6 + 6 * 3
    return url, settings, first


def _counting_keys(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    key = Identity.key

    def counted(self: Identity, item: object, block: int) -> str:
        calls[0] += 1
        return key(self, item, block)  # type: ignore[arg-type]

    monkeypatch.setattr(Identity, "key", counted)
    return calls


def test_a_rerun_of_a_staged_dataset_is_checked_from_its_summary(
    staged: tuple[str, Settings, fastload.StageReport], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, settings, first = staged
    calls = _counting_keys(monkeypatch)
    again = fastload.stage(url, settings=settings, progress=False)
    assert calls[0] == 0  # no key computed, so no entry looked up
    assert (again.fetched_blocks, again.skipped_blocks, again.blocks) == (0, first.blocks, first.blocks)
    assert (again.items, again.remote_bytes, again.stored_bytes) == (first.items, first.remote_bytes, first.stored_bytes)


def test_a_rerun_after_an_entry_was_dropped_fetches_only_that_one(
    staged: tuple[str, Settings, fastload.StageReport], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, settings, first = staged
    cache = Cache(settings)
    gone = next(e for e in cache.entries() if e.block == 1)  # the middle block of a three-block object
    assert cache.drop(gone.key)
    cache.close()
    calls = _counting_keys(monkeypatch)
    again = fastload.stage(url, settings=settings, progress=False)
    assert calls[0] >= first.blocks  # the summary no longer stands: every entry checked
    assert (again.fetched_blocks, again.skipped_blocks) == (1, first.blocks - 1)
    assert again.remote_bytes == first.remote_bytes
    # The block stored again may lie elsewhere in memory: its metadata's padding (codec.line_pad, < 64 B) differs.
    assert abs(again.stored_bytes - first.stored_bytes) < 64
    # Counted again at its end: the next rerun is checked from the summary once more.
    calls[0] = 0
    third = fastload.stage(url, settings=settings, progress=False)
    assert calls[0] == 0 and (third.fetched_blocks, third.skipped_blocks) == (0, first.blocks)


def test_a_rerun_lists_the_remote_again_and_names_what_changed(
    staged: tuple[str, Settings, fastload.StageReport], tmp_path: Path
) -> None:
    url, settings, first = staged
    (tmp_path / "data" / "d0" / "new.bin").write_bytes(b"x" * 100)
    (tmp_path / "data" / "d1" / "f01.bin").unlink()
    again = fastload.stage(url, settings=settings, progress=False)
    # The recorded snapshot is staged (all cached), and the remote's changes are named.
    assert (again.fetched_blocks, again.skipped_blocks) == (0, first.blocks)
    assert (again.remote_new, again.remote_gone) == (1, 1)
