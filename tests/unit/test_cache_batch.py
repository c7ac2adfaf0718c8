"""Batched cache operations: put_many, get_many, the per-process entry memo."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest

from fastload import codec
from fastload.cache import Cache, keys, record
from fastload.config import Settings, default_read_threads
from fastload.errors import CacheLimitError


@pytest.fixture()
def settings(tmp_path: Path) -> Settings:
    return Settings(cache_dir=tmp_path / "cache", cache_limit_bytes=10**8)


def _blob(i: int, n: int = 5000) -> bytes:
    return os.urandom(n // 2) + bytes([i % 256]) * (n - n // 2)


def test_put_many_stores_each_block_and_serves_existing_ones(settings: Settings) -> None:
    cache = Cache(settings)
    first = cache.put("k1", b"old", url="mem://1")
    blobs = {f"k{i}": _blob(i) for i in range(1, 6)}
    entries = cache.put_many([(k, v, f"mem://{k}", 0) for k, v in blobs.items()] + [("k3", blobs["k3"], "mem://k3", 0)])
    assert [e.key for e in entries] == ["k1", "k2", "k3", "k4", "k5", "k3"]
    assert entries[0] == first  # first writer wins: the existing entry is served, not replaced
    assert cache.get("k1") == b"old"
    for k in ("k2", "k3", "k4", "k5"):
        assert cache.get(k) == blobs[k]
    assert cache.volume() == sum(e.charged for e in cache.entries())  # bytes counted once each
    assert not cache.temp_files()


def test_put_many_refuses_an_item_over_the_limit_and_publishes_nothing(tmp_path: Path) -> None:
    cache = Cache(Settings(cache_dir=tmp_path / "c", cache_limit_bytes=10_000))
    with pytest.raises(CacheLimitError, match=r"mem://big.*block 0"):
        cache.put_many([("a", _blob(1, 2000), "mem://a", 0), ("big", os.urandom(20_000), "mem://big", 0)])
    assert list(cache.entries()) == [] and cache.volume() == 0


def test_get_many_agrees_with_get(settings: Settings) -> None:
    cache = Cache(settings)
    cache.put_many([(f"k{i}", _blob(i), f"mem://{i}", 0) for i in range(700)])  # more than one IN chunk
    names = [keys.entry(f"k{i}") for i in range(0, 700, 3)] + [keys.entry("missing")]
    got = cache.index.get_many(names)
    assert set(got) == set(names) - {keys.entry("missing")}
    assert all(got[k] == cache.index.get(k) for k in got)


def test_a_rewritten_entry_is_found_again_not_dropped(settings: Settings) -> None:
    # Process A remembers an entry; process B (another Cache) drops it and writes it anew.
    a, b = Cache(settings), Cache(settings)
    a.put("k", b"x" * 3000, url="mem://k")
    old = a.entry("k")
    assert b.drop("k")
    b.put("k", b"x" * 3000, url="mem://k")
    assert b.entry("k") != old  # a new payload file
    assert a.get("k") == b"x" * 3000  # A's memo is stale: it looks the entry up again
    out = np.zeros(3000, dtype=np.uint8)
    a._memo["k"] = old  # stale again, for the batch path
    assert a.read_into([("k", [(0, 3000, 0)])], out) == []
    assert bytes(out) == b"x" * 3000
    assert a.corrupt_count() == 0 and a.corrupt_seen == 0  # a miss of the memo is not damage


def test_a_payload_deleted_under_its_live_entry_is_still_counted_corrupt(settings: Settings) -> None:
    cache = Cache(settings)
    entry = cache.put("k", b"y" * 3000, url="mem://k")
    (cache.data_dir / entry.path).unlink()
    assert cache.get("k") is None
    assert cache.corrupt_count() == 1 and cache.entry("k") is None


def test_default_read_threads_is_the_cpus_between_2_and_8(monkeypatch: pytest.MonkeyPatch) -> None:
    for cpus, want in ((1, 2), (2, 2), (6, 6), (64, 8)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cpus: set(range(n)))
        assert default_read_threads() == want


def test_read_payload_is_checked_like_get(settings: Settings) -> None:
    cache = Cache(settings)
    entry = cache.put("k", _blob(7, 20_000), url="mem://k")
    path = cache.data_dir / entry.path
    assert cache.read_payload("k") == path.read_bytes()  # the stored (compressed) bytes, not decoded
    damaged = bytearray(path.read_bytes())
    damaged[-1] ^= 0x01
    path.write_bytes(bytes(damaged))
    assert cache.read_payload("k") is None  # bit rot is not shipped to a GPU decoder
    assert cache.corrupt_count() == 1 and cache.entry("k") is None


def test_read_payload_decodes_entries_without_a_stored_checksum(settings: Settings) -> None:
    # Entries written before the stored checksum existed: only the raw checksum can
    # catch a flip, and nvCOMP would inflate it silently, so the host decodes them.
    entry = Cache(settings).put("k", _blob(7, 20_000), url="mem://k")
    old = Cache(settings)  # a fresh process: no memo
    old.index.set(keys.entry("k"), record(dataclasses.replace(entry, stored_checksum=None)))
    path = old.data_dir / entry.path
    assert codec.parse_header(path.read_bytes()).codec == codec.LZ4
    assert old.read_payload("k") == path.read_bytes()  # intact: served as stored
    damaged = bytearray(path.read_bytes())
    damaged[-1] ^= 0x01  # the last literal of the last chunk: the header still parses
    path.write_bytes(bytes(damaged))
    assert Cache(settings).read_payload("k") is None
    assert old.corrupt_count() == 1


def test_put_many_sets_other_rows_in_its_publishing_transaction(settings: Settings) -> None:
    cache = Cache(settings)
    transactions = []
    inner = cache.index.transact

    def counting():  # type: ignore[no-untyped-def]
        transactions.append(1)
        return inner()

    cache.index.transact = counting  # type: ignore[method-assign]
    cache.put_many([("k1", _blob(1), "mem://1", 0), ("k2", _blob(2), "mem://2", 0)], rows={keys.pin("mem://1"): (5000, "v1")})
    assert cache.index.get(keys.pin("mem://1")) == (5000, "v1")
    published = len(transactions)
    cache.put_many([("k1", _blob(1), "mem://1", 0)], rows={keys.pin("mem://1"): (5000, "v2")})  # cached already
    assert cache.index.get(keys.pin("mem://1")) == (5000, "v2")
    assert published == 2 and len(transactions) == 3  # reserve + publish (pins in it); then the pins alone


def test_batched_index_writes_read_back_as_single_writes_do(settings: Settings) -> None:
    # add_many / set_many write many rows per statement: single reads must find them
    # (values, count), add must not overwrite, set must.
    cache = Cache(settings)
    index = cache.index
    index.set("x:kept", ("old", 1))
    with index.transact():
        added = index.add_many([("x:kept", ("new", 2)), ("x:a", ("a", 3)), ("x:b", [4, "b"]), ("x:a", ("again", 5))])
    assert added == {"x:a", "x:b"}
    assert index.get("x:kept") == ("old", 1) and index.get("x:a") == ("a", 3) and index.get("x:b") == (4, "b")
    with index.transact():
        index.set_many({"x:kept": ("replaced", 6), "x:c": 7, "x:s": "text"})
    assert [index.get(k) for k in ("x:kept", "x:c", "x:s")] == [("replaced", 6), 7, "text"]
    assert [k for k, _ in index.scan("x:")] == ["x:a", "x:b", "x:c", "x:kept", "x:s"]
    assert index.get_many(["x:a", "x:c", "x:missing"]) == {"x:a": ("a", 3), "x:c": 7}
    cache.close()
