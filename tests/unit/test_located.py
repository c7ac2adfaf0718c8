"""A dataset's slots of where its samples lie in the cache (fastload/read/located.py): a warm
read finds each entry by index, with no key computed and no index or memo look-up; a slot gone
stale is read again the usual way and refilled; the fetch ahead skips located samples."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

from fastload import FileDataset
from fastload.cache import Cache
from fastload.config import Settings
from fastload.read.located import Located


@pytest.fixture()
def files(tmp_path: Path) -> dict[str, bytes]:
    root = tmp_path / "data"
    root.mkdir()
    out = {}
    for i in range(24):
        body = bytes([i]) * (100 + 37 * i)
        (root / f"{i:03d}.bin").write_bytes(body)
        out[f"{i:03d}.bin"] = body
    return out


def _dataset(tmp_path: Path, **settings: object) -> FileDataset:
    return FileDataset(str(tmp_path / "data"), settings=Settings(cache_dir=tmp_path / "cache", **settings))  # type: ignore[arg-type]


def _names(batch: list[dict[str, object]]) -> list[str]:
    return [str(s["url"]).rsplit("/", 1)[1] for s in batch]


def test_a_warm_read_finds_entries_by_index_not_by_key(tmp_path: Path, files: dict[str, bytes],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    ds = _dataset(tmp_path)
    order = [5, 3, 17, 0, 23, 11]
    first = ds.read_batch(order)
    assert ds._located is not None
    assert all(ds._located.location(i) is not None for i in order)
    assert all(ds._located.location(i) is None for i in range(24) if i not in order)

    def no_lookup(*args: object, **kwargs: object) -> object:
        raise AssertionError("a located sample was looked up")

    monkeypatch.setattr(ds.reader.identity, "key", no_lookup)
    monkeypatch.setattr(ds.reader.cache, "entries_for", no_lookup)
    monkeypatch.setattr(ds.reader.fetcher, "ahead", no_lookup)
    ds.fetch_ahead(order)  # all located: nothing to start, not even a call
    again = ds.read_batch(order)
    assert [s["data"] for s in again] == [s["data"] for s in first] == [files[n] for n in _names(first)]


def test_a_stale_slot_is_read_again_and_refilled(tmp_path: Path, files: dict[str, bytes]) -> None:
    ds = _dataset(tmp_path)
    ds.read_batch([1, 2, 3])
    assert ds._located is not None
    old = ds._located.location(2)
    assert old is not None
    # Another process drops the entry (eviction): the slot still points at where it was.
    other = Cache(Settings(cache_dir=tmp_path / "cache"))
    other.drop(ds.reader.identity.key(ds.items[2], 0))
    other.close()
    got = ds.read_batch([2, 1])
    assert [s["data"] for s in got] == [files[n] for n in _names(got)]
    new = ds._located.location(2)
    assert new is not None and new != old  # read back and stored anew


def test_a_dataset_larger_than_the_cache_keeps_no_slots(tmp_path: Path, files: dict[str, bytes]) -> None:
    # It streams: its entries are evicted each epoch, so slots would only point at what is gone.
    assert _dataset(tmp_path, cache_limit_bytes=sum(map(len, files.values())) // 2)._located is None
    assert _dataset(tmp_path)._located is not None


def test_slots_are_not_pickled_into_workers(tmp_path: Path, files: dict[str, bytes]) -> None:
    ds = _dataset(tmp_path)
    ds.read_batch(list(range(24)))
    copy = pickle.loads(pickle.dumps(ds))
    assert isinstance(copy._located, Located)
    assert [copy._located.location(i) for i in range(24)] == [None] * 24
    assert [s["data"] for s in copy.read_batch([4, 9])] == [files["004.bin"], files["009.bin"]]


def test_locate_fills_the_slots_of_cached_samples_from_the_index_reading_no_payload(
        tmp_path: Path, files: dict[str, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    range0 = range(0, 24, 2)
    _dataset(tmp_path).read_batch(list(range0))  # half the samples cached
    ds = _dataset(tmp_path)  # a new process's view: no slot known

    def no_read(*args: object, **kwargs: object) -> object:
        raise AssertionError("locate read a payload")

    monkeypatch.setattr(ds.reader.cache, "read_into", no_read)
    assert ds.locate() == 12
    assert ds._located is not None
    assert [i for i in range(24) if ds._located.location(i) is not None] == list(range0)
    monkeypatch.undo()
    assert [s["data"] for s in ds.read_batch([4, 5])] == [files["004.bin"], files["005.bin"]]


def test_locate_on_a_cold_cache_asks_only_its_probe(tmp_path: Path, files: dict[str, bytes],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # A cold first epoch: none of the probe's keys is held, so the other samples are not asked.
    from fastload.read import located

    monkeypatch.setattr(located, "PROBE", 5)
    ds = _dataset(tmp_path)
    asked: list[int] = []
    real = ds.reader.cache.entries_for
    monkeypatch.setattr(ds.reader.cache, "entries_for", lambda names: asked.append(len(names)) or real(names))
    assert ds.locate() == 0
    assert asked == [5]


def test_workers_forked_for_an_epoch_look_up_no_sample_their_parent_located(
        tmp_path: Path, files: dict[str, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    import multiprocessing
    import os

    import fastload

    if multiprocessing.get_start_method() != "fork":
        pytest.skip("workers start as forks only where fork is the start method")
    _dataset(tmp_path).read_batch(list(range(24)))  # a previous run staged every sample
    ds = _dataset(tmp_path)
    parent, real = os.getpid(), ds.reader.cache.entries_for

    def parent_only(names: object) -> object:
        assert os.getpid() == parent, "a worker looked samples up in the index"
        return real(names)  # type: ignore[arg-type]

    monkeypatch.setattr(ds.reader.cache, "entries_for", parent_only)
    for _ in range(2):  # each epoch forks new workers (no persistent_workers)
        got = [s for batch in fastload.DataLoader(ds, batch_size=5, num_workers=2) for s in batch["data"]]
        assert sorted(bytes(b) for b in got) == sorted(files.values())


def test_locate_sizes_a_sizeless_listing_from_its_pins_then_fills_its_slots(tmp_path: Path, files: dict[str, bytes]) -> None:
    urls = [str(tmp_path / "data" / name) for name in sorted(files)]  # a URL list: no sizes until read
    settings = Settings(cache_dir=tmp_path / "cache")
    ds = FileDataset(urls, settings=settings)
    assert ds._unsized == len(files)
    FileDataset(urls, settings=settings).read_batch(list(range(len(files))))  # another process read them all
    assert ds.locate() == len(files)
    assert ds._unsized == 0 and [i.size for i in ds.items] == [len(files[n]) for n in sorted(files)]


def test_workers_of_a_sizeless_listing_start_sized_and_located_after_the_first_epoch(
        tmp_path: Path, files: dict[str, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    # A first run over a listing without sizes: the first epoch's workers learn every size, and
    # that dies with them; the next epoch's workers must not pin and look up every batch again.
    import multiprocessing
    import os

    import fastload

    if multiprocessing.get_start_method() != "fork":
        pytest.skip("workers start as forks only where fork is the start method")
    urls = [str(tmp_path / "data" / name) for name in sorted(files)]
    ds = FileDataset(urls, settings=Settings(cache_dir=tmp_path / "cache"))

    def epoch() -> list[bytes]:
        return sorted(bytes(b) for batch in fastload.DataLoader(ds, batch_size=5, num_workers=2) for b in batch["data"])

    assert epoch() == sorted(files.values())  # cold: the workers fetch, size and pin every sample
    assert ds._unsized == len(files)  # what they learnt is not the parent's
    parent = os.getpid()

    def parent_only(real: Any) -> Any:
        def call(*args: Any) -> Any:
            assert os.getpid() == parent, "a worker looked samples up in the index"
            return real(*args)
        return call

    monkeypatch.setattr(ds.reader.cache, "entries_for", parent_only(ds.reader.cache.entries_for))
    monkeypatch.setattr(ds.reader.identity, "pinned", parent_only(ds.reader.identity.pinned))
    assert epoch() == sorted(files.values())
    assert ds._unsized == 0


def test_a_rotten_slot_is_dropped_counted_and_read_again_from_the_remote(tmp_path: Path, files: dict[str, bytes],
                                                                        backend: str) -> None:
    from fastload.cache import keys

    ds = _dataset(tmp_path)
    ds.read_batch([1, 2, 3])
    assert ds._located is not None
    where = ds._located.location(2)
    assert where is not None and where[1] is not None  # packed
    with open(tmp_path / "cache" / "data" / where[0], "r+b") as f:  # bit rot in the last byte of sample 2's payload
        entry = ds.reader.cache.entry(ds.reader.identity.key(ds.items[2], 0))
        assert entry is not None
        f.seek(where[1] + entry.stored - 1)
        last = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([last ^ 0xFF]))
    got = ds.read_batch([3, 2, 1])
    assert [s["data"] for s in got] == [files[n] for n in _names(got)]
    assert ds.reader.cache.index.get(keys.CORRUPT) == 1
    again = ds._located.location(2)
    assert again is not None and again != where  # refetched, stored anew and located there


def test_the_memo_forgets_what_the_slots_hold(tmp_path: Path, files: dict[str, bytes]) -> None:
    # At 1M samples the memo's entries took 440 MB beside the slots' 64 MB: one copy is enough.
    ds = _dataset(tmp_path)
    ds.read_batch(list(range(24)))
    keys = [ds.reader.identity.key(item, 0) for item in ds.items]
    assert not set(keys) & set(ds.reader.cache.known)
    again = _dataset(tmp_path)  # another process: slots filled from the index
    assert again.locate() == 24 and not set(keys) & set(again.reader.cache.known)
    assert [s["data"] for s in again.read_batch([7, 0])] == [files["007.bin"], files["000.bin"]]


def test_a_dataset_with_more_samples_than_the_memo_holds_has_slots(tmp_path: Path, files: dict[str, bytes],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # Slots once pointed at the memo's entries, so a dataset larger than the memo (ImageNet's
    # 1.28M samples against MEMO_MAX's 1,048,576) had none.
    from fastload.cache import base

    monkeypatch.setattr(base, "MEMO_MAX", 8)
    ds = _dataset(tmp_path)
    assert ds.reader.cache.memo_max == 8 and ds._located is not None
    for k in range(0, 24, 4):  # batches the memo holds while they are read (a real one holds 1M entries)
        ds.read_batch(list(range(k, k + 4)))
    assert all(ds._located.location(i) is not None for i in range(24))
    assert [s["data"] for s in ds.read_batch([23, 1])] == [files["023.bin"], files["001.bin"]]


def test_a_located_read_touches_no_listing_item(tmp_path: Path, files: dict[str, bytes], backend: str) -> None:
    # At 1M samples read at random an item, its size and its URL were three cache misses a
    # sample (0.75 us against 0.09 at 10k): sizes come from the slots, URLs from ds.urls.
    ds = _dataset(tmp_path)
    first = ds.read_batch([6, 2, 19])

    class Untouchable(list):  # type: ignore[type-arg]
        def __getitem__(self, i: Any) -> Any:
            raise AssertionError(f"item {i} was touched")

    ds.items = Untouchable(ds.items)
    again = ds.read_batch([6, 2, 19])
    assert [(s["url"], s["data"]) for s in again] == [(s["url"], s["data"]) for s in first]
    assert [s["data"] for s in again] == [files[n] for n in _names(again)]
