"""A recorded listing is written in chunks of rows under a small head row (issue 31): one row of
every item held them all at once while encoded, and passes SQLite's limit on one value at
ten million objects. A listing recorded before chunks still reads."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastload.cache import keys
from fastload.config import Settings
from fastload.errors import CacheError
from fastload.fetch import identity as identity_module
from fastload.read.reader import Reader
from fastload.source import RemoteItem

ROOT = "http://h/data"


def _items(n: int, version: str = "v1") -> list[RemoteItem]:
    return [RemoteItem(f"{ROOT}/d{k % 3}/{k:03d}.bin", 100 + k, version) for k in range(n)]


@pytest.fixture()
def reader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Reader:
    monkeypatch.setattr(identity_module, "ITEMS_PER_PASS", 10)
    return Reader(Settings(cache_dir=tmp_path / "cache"))


def _chunk_rows(reader: Reader, pattern: str | None = None) -> list[str]:
    return reader.cache.index.names(keys.manifest_chunks(ROOT, pattern))


def test_a_listing_is_recorded_in_chunks_and_read_back_in_order(reader: Reader) -> None:
    items = _items(25)
    reader.identity.save_manifest(ROOT, None, items)
    head = reader.cache.index.get(keys.manifest(ROOT, None))
    assert "items" not in head and (head["chunks"], head["count"]) == (3, 25)
    assert [len(reader.cache.index.get(n)) for n in sorted(_chunk_rows(reader))] == [10, 10, 5]
    assert reader.identity.manifest(ROOT, None) == items
    assert reader.list(ROOT + "/") == items  # a later listing reads the record, no request
    # A folder below the recorded one is served from its rows too.
    assert reader.identity.recorded(ROOT + "/d1", None) == [i for i in items if "/d1/" in i.url]
    assert [(s["items"], s["remote_bytes"]) for s in reader.identity.summaries()] == [(25, sum(i.size for i in items))]


def test_a_shorter_listing_recorded_again_leaves_no_chunk_behind(reader: Reader) -> None:
    reader.identity.save_manifest(ROOT, "**/*.bin", _items(25))
    reader.identity.save_manifest(ROOT, "**/*.bin", _items(7, "v2"))
    assert len(_chunk_rows(reader, "**/*.bin")) == 1
    assert reader.identity.manifest(ROOT, "**/*.bin") == _items(7, "v2")
    reader.identity.forget_manifest(ROOT, "**/*.bin")
    assert _chunk_rows(reader, "**/*.bin") == [] and reader.identity.manifest(ROOT, "**/*.bin") is None
    assert reader.identity.summaries() == []


def test_a_listing_recorded_before_chunks_still_reads(reader: Reader) -> None:
    items = _items(12)
    reader.cache.index.set(keys.manifest(ROOT, None), {"created": 1.0, "items": [i.to_json() for i in items],
                                                      "block_bytes": reader.settings.block_bytes})
    assert reader.identity.manifest(ROOT, None) == items
    assert [m["items"] for m in reader.identity.manifests()] == [items]
    assert [s["items"] for s in reader.identity.summaries()] == [12]  # its summary made from its rows


def test_a_missing_chunk_is_named_with_the_fix(reader: Reader) -> None:
    reader.identity.save_manifest(ROOT, None, _items(25))
    reader.cache.index.delete(sorted(_chunk_rows(reader))[1])
    with pytest.raises(CacheError, match=r"has 2 of its 3 chunks; fix: `fastload cache http://h/data --refresh`"):
        reader.identity.manifest(ROOT, None)
