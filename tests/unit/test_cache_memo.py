"""The per-process entry memo (reads.py): bounded without being emptied, keyed by the
caller's own key strings, and entries small (issue 31: a warm epoch at 100k+ objects)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from fastload.cache import MEMO_MAX, Cache, Entry, record
from fastload.cache.base import MEMO_EVICT
from fastload.config import Settings


@pytest.fixture()
def cache(tmp_path: Path) -> Cache:
    return Cache(Settings(cache_dir=tmp_path / "cache", cache_limit_bytes=10**8))


def _fill(cache: Cache, n: int) -> list[str]:
    keys = [f"key{i:04d}" for i in range(n)]
    cache.put_many([(k, k.encode() * 10, f"mem://{k}", 0) for k in keys])
    cache._memo.clear()
    return keys


def test_a_full_memo_forgets_its_oldest_not_everything(cache: Cache) -> None:
    keys = _fill(cache, 40)
    cache.memo_max = 16
    assert all(e is not None for e in cache.entries_for(keys[:16]))
    assert list(cache.known) == keys[:16]
    cache.entries_for(keys[16:17])
    # Emptied at its bound, the memo held 1 entry here, and a dataset larger than it found
    # none of a batch known: its fetch ahead then took a marker and a query per item.
    assert list(cache.known) == keys[16 // MEMO_EVICT : 17]
    for k in keys[17:]:
        cache.entries_for([k])
        assert len(cache.known) <= 16
    assert keys[-1] in cache.known and keys[-2] in cache.known
    assert all(e is not None and e.key == k for e, k in zip(cache.entries_for(keys), keys))  # the index has them all


def test_a_memo_of_zero_remembers_nothing_and_still_answers(cache: Cache) -> None:
    keys = _fill(cache, 5)
    cache.memo_max = 0
    assert [e.key for e in cache.entries_for(keys) if e is not None] == keys
    assert not cache.known
    assert MEMO_MAX > 0


def test_entries_are_remembered_under_the_callers_key_strings(cache: Cache) -> None:
    keys = _fill(cache, 3)
    asked = ["".join(k) for k in keys]  # equal strings, other objects
    found = cache.entries_for(asked)
    # The memo's key and the entry's are the caller's objects: its next look-up with them is
    # found by identity, not compared to a second copy (tests the memory a warm epoch reads).
    assert [e.key for e in found if e is not None] == keys
    assert all(e is not None and e.key is a for e, a in zip(found, asked))
    assert all(k is a for k, a in zip(cache.known, asked))
    assert cache.entries_for(asked + asked[:1])[-1] is found[0]  # repeats answered too


def test_packed_entries_share_their_pack_path_and_have_no_dict(cache: Cache) -> None:
    keys = _fill(cache, 4)
    found = [e for e in cache.entries_for(keys) if e is not None]
    assert all(e.offset is not None for e in found)  # small payloads are packed
    assert found[0].path is found[-1].path  # one string per pack, not a copy per entry
    assert not hasattr(found[0], "__dict__")
    again = pickle.loads(pickle.dumps(found[0]))
    assert again == found[0] and record(again) == record(found[0])
    assert Entry.from_record(found[0].key, record(found[0])) == found[0]
