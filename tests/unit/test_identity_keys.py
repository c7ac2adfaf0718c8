"""Identity's key memo: remembered by (url, block) with the item beside it, so another
version of a URL is never given the first one's key, and bounded without being emptied."""

from __future__ import annotations

from pathlib import Path

from fastload.cache import Cache, entry_key
from fastload.cache.base import MEMO_EVICT
from fastload.config import Settings
from fastload.fetch.identity import Identity
from fastload.source import RemoteItem


def _identity(tmp_path: Path) -> Identity:
    settings = Settings(cache_dir=tmp_path / "cache")
    return Identity(settings, Cache(settings))


def test_another_version_of_a_url_gets_its_own_key(tmp_path: Path) -> None:
    identity = _identity(tmp_path)
    old, new = RemoteItem("http://h/a.bin", 10, "v1"), RemoteItem("http://h/a.bin", 12, "v2")
    bb = identity.block_bytes
    assert identity.key(old, 0) == entry_key(old.url, 10, "v1", 0, bb)
    assert identity.key(new, 0) == entry_key(new.url, 12, "v2", 0, bb)  # not old's, remembered under the same URL
    assert identity.key(RemoteItem("http://h/a.bin", 10, "v1"), 0) == entry_key(old.url, 10, "v1", 0, bb)  # an equal item


def test_a_full_key_memo_forgets_its_oldest_not_everything(tmp_path: Path) -> None:
    identity = _identity(tmp_path)
    identity.keys_max = 16
    items = [RemoteItem(f"http://h/{i}.bin", 5, "v") for i in range(40)]
    for item in items[:17]:
        identity.key(item, 0)
    assert [url for url, _ in identity._keys] == [i.url for i in items[16 // MEMO_EVICT : 17]]
    for item in items[17:]:
        identity.key(item, 0)
        assert len(identity._keys) <= 16
    assert (items[-1].url, 0) in identity._keys
