"""Reader pins: each item's (size, version) recorded once, and found again without a request."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastload.cache import keys
from fastload.config import Settings
from fastload.read.reader import Reader
from fastload.source import RemoteItem


def _pin_writes(reader: Reader, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The pin rows the index is asked to set from now on (one by one or batched)."""
    index = reader.cache.index
    written: list[str] = []
    real_set, real_many = index.set, index.set_many

    def one(key: str, value: object, *args: object, **kwargs: object) -> object:
        written.extend([key] if keys.of(keys.PIN, key) is not None else [])
        return real_set(key, value, *args, **kwargs)

    def many(rows: dict[str, object]) -> None:
        written.extend(k for k in rows if keys.of(keys.PIN, k) is not None)
        real_many(rows)

    monkeypatch.setattr(index, "set", one)
    monkeypatch.setattr(index, "set_many", many)
    return written


def test_saving_a_manifest_writes_only_pins_not_already_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reader = Reader(Settings(cache_dir=tmp_path / "cache"))
    root = (tmp_path / "remote").as_posix()
    items = [RemoteItem(f"file://{root}/{i}.jpg", 100 + i, f"v{i}") for i in range(6)]
    reader.identity.pin(items[:4])  # as the reads' stores pin them, with their first blocks
    changed = RemoteItem(items[1].url, 7, "v-new")  # the remote changed since
    written = _pin_writes(reader, monkeypatch)

    reader.identity.save_manifest(root, None, [items[0], changed, *items[2:]])

    assert sorted(written) == sorted(keys.pin(i.url) for i in [changed, items[4], items[5]])
    got = reader.cache.index.get_many([keys.pin(i.url) for i in items])
    assert got[keys.pin(items[1].url)] == (7, "v-new")
    assert [got[keys.pin(i.url)] for i in [items[0], *items[2:]]] == [(i.size, i.version) for i in [items[0], *items[2:]]]
    assert reader.identity.manifest(root, None)[1] == changed


def test_a_warm_stat_asks_the_index_for_a_pin_once_and_sees_this_readers_own_repins(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fastload.open stats its URL on every open: a pin lookup in the index was a fifth of a warm open."""
    root = tmp_path / "remote"
    root.mkdir()
    (root / "a.bin").write_bytes(b"x" * 10)
    url = (root / "a.bin").as_uri()
    writer = Reader(Settings(cache_dir=tmp_path / "cache"))
    writer.identity.pin([RemoteItem(writer.canonical(url), 10, "v1")])
    reader = Reader(Settings(cache_dir=tmp_path / "cache"))  # another reader: it learns the pin from the index
    asked: list[str] = []
    real_get = reader.cache.index.get
    monkeypatch.setattr(reader.cache.index, "get", lambda key, *a, **k: asked.append(key) or real_get(key, *a, **k))
    assert [reader.stat(url).version for _ in range(3)] == ["v1"] * 3
    assert asked == [keys.pin(reader.canonical(url))]  # once, not once per stat
    reader.identity.pin([RemoteItem(reader.canonical(url), 12, "v2")])  # this reader re-pinned it (a refresh)
    assert (reader.stat(url).size, reader.stat(url).version) == (12, "v2") and len(asked) == 1
