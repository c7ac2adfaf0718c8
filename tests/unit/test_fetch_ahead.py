"""Fetches ahead as the read that reaches them takes them: started per batch, waited for per chunk."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from _loader_helpers import local_items

from fastload.config import Settings
from fastload.read.reader import Reader
from fastload.source import RemoteItem, Source


def test_a_read_takes_its_chunks_fetches_ahead_once_they_are_all_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A local store has no event loop to fetch ahead on; stand in for one with futures that a
    # thread answers one by one, as a loop does while the answers arrive.
    reader = Reader(Settings(cache_dir=tmp_path / "cache"))
    items = local_items(tmp_path, 6)
    futures: list[Future[Any]] = []
    starts: list[int] = []

    def start_first_many(self: Source, group: list[RemoteItem], nbytes: int) -> list[Future[Any]]:
        starts.append(len(group))
        made: list[Future[Any]] = [Future() for _ in group]
        futures.extend(made)
        return made

    monkeypatch.setattr(Source, "start_first_many", start_first_many)
    assert reader.fetcher.ahead(items) == len(items)
    assert starts == [len(items)]  # one call for the batch: one wake-up of the loop

    def answer() -> None:
        for item, future in zip(items, futures):
            time.sleep(0.01)
            future.set_result([Path(item.url[len("file://"):]).read_bytes()])

    finished: list[bool] = []
    real = Source.finish_first

    def finish_first(self: Source, item: RemoteItem, nbytes: int, future: Future[Any]) -> tuple[RemoteItem, bytes]:
        finished.append(all(f.done() for f in futures))
        return real(self, item, nbytes, future)

    monkeypatch.setattr(Source, "finish_first", finish_first)
    thread = threading.Thread(target=answer)
    thread.start()
    got = reader.fetcher.fetch([(item, 0) for item in items])
    thread.join()
    assert got == [bytes([k]) * 100 for k in range(len(items))]
    assert finished == [True] * len(items)  # waited for together, not woken once per answer
