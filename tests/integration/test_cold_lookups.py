"""A cold batch looks each block up in the index once, not again when it stores it.

The fetch layer stores only blocks it found missing just before fetching them, under their
markers (a sized block by its key; a sizeless object by its pin, which a cached first block
always has), so Cache.put_many does not query the index for them again: that second query was
9% of a cold s3:// epoch's CPU (benchmarks/percore/profile_cold.py).
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload.cache import keys
from fastload.cache.index import IndexReads
from fastload.config import Settings

_CALLERS = ("put_many", "ahead", "read_into", "recheck")  # who asks, innermost first


@pytest.fixture()
def looked_up(monkeypatch: pytest.MonkeyPatch) -> Counter[tuple[str, str]]:
    """Every entry key asked of the index (get_many), counted by (key, the fastload function that asked)."""
    asked: Counter[tuple[str, str]] = Counter()
    real = IndexReads.get_many

    def get_many(self: IndexReads, names: Any) -> Any:
        names = list(names)
        frame, caller = sys._getframe(1), "other"
        while frame is not None:
            if frame.f_code.co_name in _CALLERS:
                caller = frame.f_code.co_name
                break
            frame = frame.f_back
        asked.update((n, caller) for n in names if n.startswith(keys.entry("")))
        return real(self, names)

    monkeypatch.setattr(IndexReads, "get_many", get_many)
    return asked


def _files(root: Path, n: int) -> dict[str, bytes]:
    root.mkdir(parents=True)
    data = {f"{i:02d}.bin": os.urandom(3000 + 100 * i) for i in range(n)}
    for name, body in data.items():
        (root / name).write_bytes(body)
    return data


def _epoch(ds: fastload.FileDataset) -> list[bytes]:
    return [d for batch in fastload.DataLoader(ds, batch_size=8, collate_fn=lambda b: [s["data"] for s in b]) for d in batch]


def test_a_sized_cold_batch_looks_each_block_up_once_ahead_and_not_when_storing(
        tmp_path: Path, looked_up: Counter[tuple[str, str]]) -> None:
    data = _files(tmp_path / "d", 20)
    ds = fastload.FileDataset(str(tmp_path / "d"), pattern="*.bin", settings=Settings(cache_dir=tmp_path / "c"))
    assert sorted(_epoch(ds)) == sorted(data.values())
    stored = {keys.entry(e.key) for e in ds.reader.cache.entries()}
    assert len(stored) == 20
    # Fetched ahead: looked up once before its marker is held, not again after (one process);
    # then its read's miss. Storing it asks nothing.
    assert {looked_up[(k, "ahead")] for k in stored} == {1}
    assert not any(looked_up[(k, "put_many")] for k in stored)


def test_a_sizeless_cold_batch_looks_no_block_up(
        tmp_path: Path, looked_up: Counter[tuple[str, str]], nginx_server: Any) -> None:
    data = _files(tmp_path / "www" / "d", 20)
    server = nginx_server(tmp_path / "www")
    urls = [f"{server.url}/d/{name}" for name in sorted(data)]  # a URL list: no sizes, so no keys before the GETs
    ds = fastload.FileDataset(urls, settings=Settings(cache_dir=tmp_path / "c"))
    assert _epoch(ds) == [data[name] for name in sorted(data)]
    stored = {keys.entry(e.key) for e in ds.reader.cache.entries()}
    assert len(stored) == 20 and not {k for k, _ in looked_up} & stored  # unpinned, so not cached: nothing to ask
    assert _epoch(ds) == [data[name] for name in sorted(data)]  # and the second epoch reads them from the cache
