"""Staging's memory per object is bounded (issue 31): its cache-entry memo keeps the latest
writes only, and its passes over a listing work a slice of it at a time."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest

import fastload
from fastload.cache import keys
from fastload.config import Settings
from fastload.fetch import identity
from fastload.read.reader import Reader

pytestmark = pytest.mark.integration

stage_module = importlib.import_module("fastload.stage")


def test_staging_remembers_only_its_latest_entries_and_stages_every_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k in range(600):
        (tmp_path / "data" / f"d{k % 5}").mkdir(parents=True, exist_ok=True)
        (tmp_path / "data" / f"d{k % 5}" / f"{k:04d}.bin").write_bytes(os.urandom(300 + k))
    readers: list[Reader] = []

    class Kept(Reader):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            readers.append(self)

    monkeypatch.setattr(stage_module, "Reader", Kept)
    monkeypatch.setattr(stage_module, "STAGING_MEMO", 64)
    monkeypatch.setattr(identity, "ITEMS_PER_PASS", 50)  # several passes of pins and counts
    settings = Settings(cache_dir=tmp_path / "cache")
    url = (tmp_path / "data").as_uri()
    first = fastload.stage(url, settings=settings, progress=False)
    assert (first.items, first.fetched_blocks) == (600, 600)
    assert 0 < len(readers[0].cache.known) <= 64  # not one per object written
    again = fastload.stage(url, settings=settings, progress=False)  # each one cached, pinned and counted
    assert (again.fetched_blocks, again.skipped_blocks, again.stored_bytes) == (0, 600, first.stored_bytes)
    info = readers[1].identity.summaries()
    assert [(s["items"], s["cached_items"]) for s in info] == [(600, 600)]
    assert len(readers[1].cache.index.names(keys.PIN)) == 600  # every item pinned, across passes
