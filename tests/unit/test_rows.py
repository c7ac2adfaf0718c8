"""Cache entries as rows of numbers (fastload/cache/rows.py) read by gather.gather_rows: the C
extension and the fallback read each row's whole payload to its place with the checks of
gather(), and name the picks that failed; Cache.read_rows empties those rows."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from fastload import codec
from fastload.cache import Cache, Entry, gather
from fastload.cache.rows import Rows
from fastload.config import Settings


def _entry(name: str, payload: bytes, raw: bytes, *, offset: int | None = None, intact: bool = True) -> Entry:
    info = codec.parse_header(payload)
    return Entry(key=name, path=name if offset is None else "one.pack", stored=len(payload), raw=len(raw), codec=info.codec,
                 checksum=info.checksum, url=f"http://h/{name}", block=0,
                 stored_checksum=codec.checksum(payload) if intact else None, offset=offset)


@pytest.fixture()
def stored(tmp_path: Path) -> tuple[Rows, list[bytes], list[Entry]]:
    """Six payloads: four in one pack (LZ4 and raw, with and without a stored checksum), two whole files."""
    raws = [os.urandom(3000), b"abc" * 2000, os.urandom(1), b"x" * 5000, os.urandom(700), b"yz" * 900]
    prefix = str(tmp_path) + os.sep
    pack, entries = bytearray(), []
    for k, raw in enumerate(raws[:4]):
        payload = codec.encode(raw)
        offset = len(pack)
        pack += payload + bytes(gather_align(len(payload)) - len(payload))
        entries.append(_entry(f"p{k}", payload, raw, offset=offset, intact=k != 1))
    (tmp_path / "one.pack").write_bytes(pack)
    for k, raw in enumerate(raws[4:], 4):
        payload = codec.encode(raw)
        (tmp_path / f"f{k}").write_bytes(payload)
        entries.append(_entry(f"f{k}", payload, raw, intact=k != 5))
    rows = Rows(10, prefix)
    rows.put([9, 3, 0, 7, 5, 2], entries)
    return rows, raws, entries


def gather_align(n: int) -> int:
    return -(-n // 64) * 64


def _offsets(raws: list[bytes]) -> tuple[np.ndarray, int]:
    dsts = np.cumsum([0] + [len(r) + 3 for r in raws[:-1]]).astype(np.uint64)  # 3 B gaps: nothing written past a sample
    return dsts, int(dsts[-1]) + len(raws[-1]) + 3


def test_rows_read_each_payload_whole_to_its_place(backend: str, stored: tuple[Rows, list[bytes], list[Entry]]) -> None:
    rows, raws, _ = stored
    picks = np.array([2, 0, 9, 7, 3, 5], dtype=np.int64)  # the rows of raws 5, 2, 0, 3, 1, 4
    order = [5, 2, 0, 3, 1, 4]
    dsts, size = _offsets([raws[k] for k in order])
    out = bytearray(b"\xee" * size)
    assert gather.gather_rows(rows.paths, rows.table, picks, dsts, out) == []
    expect = bytearray(b"\xee" * size)
    for k, dst in zip(order, dsts.tolist()):
        expect[dst : dst + len(raws[k])] = raws[k]
    assert out == expect
    assert rows.location(3) == ("one.pack", _offset_of(stored, 1)) and rows.location(2) == ("f5", None)
    assert rows.location(1) is None and rows.has(np.array([1, 2, 9])).tolist() == [False, True, True]


def _offset_of(stored: tuple[Rows, list[bytes], list[Entry]], k: int) -> int | None:
    return stored[2][k].offset


def test_rows_name_the_picks_that_failed_and_copy_the_rest(backend: str, tmp_path: Path,
                                                          stored: tuple[Rows, list[bytes], list[Entry]]) -> None:
    rows, raws, entries = stored
    pack = bytearray((tmp_path / "one.pack").read_bytes())
    pack[entries[2].offset + entries[2].stored - 1] ^= 0xFF  # type: ignore[operator]  # rot in raw 2's payload
    (tmp_path / "one.pack").write_bytes(pack)
    (tmp_path / "f4").unlink()
    picks = np.array([9, 0, 7, 5], dtype=np.int64)  # raws 0, 2, 3, 4
    dsts, size = _offsets([raws[k] for k in (0, 2, 3, 4)])
    out = bytearray(size)
    failed = gather.gather_rows(rows.paths, rows.table, picks, dsts, out)
    assert [(i, res[0]) for i, res in failed if res is not None] == [(1, "corrupt"), (3, "missing")]
    assert out[: len(raws[0])] == raws[0] and out[int(dsts[2]) : int(dsts[2]) + len(raws[3])] == raws[3]


def test_rows_refuse_a_pick_without_a_row_or_a_place_outside_the_output(backend: str,
                                                                         stored: tuple[Rows, list[bytes], list[Entry]]) -> None:
    rows, raws, _ = stored
    one = np.zeros(1, dtype=np.uint64)
    with pytest.raises(ValueError, match="names no path"):
        gather.gather_rows(rows.paths, rows.table, np.array([1]), one, bytearray(10_000))
    with pytest.raises(ValueError, match="outside the"):
        gather.gather_rows(rows.paths, rows.table, np.array([9]), np.array([5], dtype=np.uint64), bytearray(len(raws[0])))


def test_read_rows_empties_the_rows_that_failed_and_reads_the_rest(tmp_path: Path, backend: str) -> None:
    cache = Cache(Settings(cache_dir=tmp_path / "c"))
    raws = {f"k{i}": os.urandom(500 + i) for i in range(4)}
    for key, raw in raws.items():
        cache.put(key, raw, url=f"http://h/{key}")
    rows = Rows(4, cache.data_prefix)
    rows.put(range(4), cache.entries_for(list(raws)))
    gone = cache.entry("k2")
    assert gone is not None and gone.offset is not None  # small payloads are packed
    cache.drop("k2")  # evicted since the row was put: its range reads as zeros
    dsts, size = _offsets(list(raws.values()))
    out = bytearray(size)
    assert cache.read_rows(rows, np.arange(4), dsts, out) == [2]
    assert rows.has(np.arange(4)).tolist() == [True, True, False, True]
    for (key, raw), dst in zip(raws.items(), dsts.tolist()):
        if key != "k2":
            assert out[dst : dst + len(raw)] == raw
    cache.close()
