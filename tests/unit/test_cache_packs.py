"""Pack files (fastload/cache/packs.py): small payloads appended to a pack per writing process."""

from __future__ import annotations

import errno
import multiprocessing
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fastload import codec
from fastload.cache import Cache, packs
from fastload.cache.entry import PACK_ALIGN, Entry, aligned
from fastload.config import Settings
from fastload.errors import CacheLimitError

SMALL, LARGE = 30_000, 300_000


@pytest.fixture()
def settings(tmp_path: Path) -> Settings:
    return Settings(cache_dir=tmp_path / "cache", cache_limit_bytes=10**8, pack_max_bytes=100_000)


@pytest.fixture(autouse=True)
def fresh_writers() -> Iterator[None]:
    packs._WRITERS.clear()  # each test's packs start with a writer of their own
    yield
    packs._WRITERS.clear()


def blob(i: int, n: int = SMALL) -> bytes:
    """Half noise, half one repeated byte (LZ4 stores it compressed); the same for the same ``i``."""
    return np.random.default_rng(i).bytes(n // 2) + bytes([i % 256]) * (n - n // 2)


def read_into(cache: Cache, keys: list[str], sizes: list[int]) -> tuple[bytes, list[int]]:
    out = bytearray(sum(sizes))
    starts = np.cumsum([0, *sizes[:-1]]).tolist()
    missed = cache.read_into([(k, [(0, n, dst)]) for k, n, dst in zip(keys, sizes, starts)], out)
    return bytes(out), missed


def rewrite(cache: Cache, e: Entry, at: int, data: bytes) -> None:
    """Overwrite bytes of an entry where they lie (in its pack, or its file)."""
    with open(cache.data_dir / e.path, "r+b") as f:
        f.seek((e.offset or 0) + at)
        f.write(data)


def allocated(path: Path) -> int:
    return path.stat().st_blocks * 512


def test_small_payloads_share_a_pack_and_large_ones_get_files(settings: Settings, backend: str) -> None:
    cache = Cache(settings)
    blobs = {f"k{i}": blob(i) for i in range(5)} | {"big": blob(9, LARGE)}
    entries = cache.put_many([(k, v, f"mem://{k}", 0) for k, v in blobs.items()])
    small, big = entries[:5], entries[5]
    assert len({e.path for e in small}) == 1 and small[0].path.startswith("packs/")
    assert all(e.offset is not None and e.offset % PACK_ALIGN == 0 for e in small)
    assert big.offset is None and big.path.endswith(".flp")
    assert not list(cache.data_dir.glob("*/*.part"))
    assert cache.volume() == sum(aligned(e.stored) for e in small) + big.stored
    fresh = Cache(settings)  # another reader: records from the index, bytes by pread
    for k, v in blobs.items():
        assert fresh.get(k) == v
        assert codec.decode(fresh.read_payload(k) or b"") == v
    got, missed = read_into(fresh, list(blobs), [len(v) for v in blobs.values()])
    assert missed == [] and got == b"".join(blobs.values())


def test_a_bad_packed_entry_is_dropped_and_counted_and_its_neighbours_are_kept(settings: Settings, backend: str) -> None:
    cache = Cache(settings)
    blobs = {f"k{i}": blob(i) for i in range(4)}
    entries = cache.put_many([(k, v, f"mem://{k}", 0) for k, v in blobs.items()])
    rewrite(cache, entries[1], entries[1].stored // 2, b"\xff\x00\xff")  # bit rot inside k1
    rewrite(cache, entries[2], 3, b"\x00")  # and in k2's header

    reader = Cache(settings)
    got, missed = read_into(reader, ["k0", "k1", "k3"], [SMALL] * 3)
    assert missed == [1] and got[:SMALL] == blobs["k0"] and got[2 * SMALL :] == blobs["k3"]
    assert reader.get("k2") is None
    assert reader.corrupt_count() == 2
    assert reader.entry("k1") is None and reader.entry("k2") is None  # dropped
    assert reader.get("k0") == blobs["k0"] and reader.get("k3") == blobs["k3"]
    reader.put("k1", blobs["k1"], url="mem://k1")  # refetched: a new location, read intact
    assert reader.get("k1") == blobs["k1"] and reader.corrupt_count() == 2


def test_a_read_racing_an_eviction_is_a_miss_not_corruption(settings: Settings, backend: str) -> None:
    writer = Cache(settings)
    writer.put_many([(f"k{i}", blob(i), f"mem://k{i}", 0) for i in range(4)])
    reader = Cache(settings)
    assert reader.entries_for(["k0", "k1", "k2", "k3"])  # looked up: this process remembers where they were
    evictor = Cache(settings)
    assert evictor.drop("k1") and evictor.drop("k2")  # punched out under the reader's feet
    assert reader.known["k1"].offset is not None  # the reader still thinks they are there
    got, missed = read_into(reader, ["k0", "k1"], [SMALL, SMALL])
    assert missed == [1] and got[:SMALL] == writer.get("k0")
    assert reader.get("k2") is None
    assert reader.corrupt_count() == 0 and reader.corrupt_seen == 0


def test_dropping_a_packed_entry_frees_its_disk_blocks(settings: Settings) -> None:
    cache = Cache(settings)
    entries = cache.put_many([(f"k{i}", os.urandom(SMALL), f"mem://k{i}", 0) for i in range(8)])
    pack = cache.data_dir / entries[0].path
    before = allocated(pack)
    assert before >= sum(e.charged for e in entries)
    for e in entries[:4]:
        assert cache.drop(e.key)
    # All but the block the last one shares with its live neighbour went back.
    assert before - allocated(pack) >= sum(e.charged for e in entries[:4]) - packs.BLOCK
    assert cache.volume() == sum(e.charged for e in entries[4:])
    assert all(cache.get(e.key) is not None for e in entries[4:])
    for e in entries[4:]:
        assert cache.drop(e.key)
    # The shared blocks too, once both sides were dropped; all but the pack's last block, which ends
    # the file part-way: punched to the end of the file, it may stay allocated (delayed allocation,
    # then written back: found by CI in about one layout in ten once codec.line_pad moved the ends).
    assert allocated(pack) <= packs.BLOCK


def test_small_objects_take_little_more_disk_than_their_bytes(settings: Settings) -> None:
    cache = Cache(settings)
    raw = [os.urandom(4096) for _ in range(256)]  # incompressible: stored raw, plus a header
    entries = cache.put_many([(f"k{i}", r, f"mem://k{i}", 0) for i, r in enumerate(raw)])
    assert allocated(cache.data_dir / entries[0].path) <= 1.05 * sum(map(len, raw))  # 2x with 4 KiB offsets


def test_a_block_shared_with_a_live_neighbour_is_freed_when_the_neighbour_goes(settings: Settings) -> None:
    cache = Cache(settings)
    entries = cache.put_many([(f"k{i}", os.urandom(10_000), f"mem://k{i}", 0) for i in range(3)])
    pack = cache.data_dir / entries[0].path
    full = allocated(pack)
    assert cache.drop("k1")  # both neighbours live: only the blocks wholly inside it go
    middle = allocated(pack)
    assert middle < full and cache.get("k0") is not None and cache.get("k2") is not None
    assert cache.drop("k0") and cache.drop("k2")
    assert allocated(pack) <= packs.BLOCK  # but the pack's last block, as in the test above


def test_eviction_keeps_packs_within_the_limit_and_unlinks_sealed_empty_packs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # fmt: skip
    monkeypatch.setattr(packs, "ROTATE_BYTES", 100_000)  # a new pack every 3 payloads
    s = Settings(cache_dir=tmp_path / "c", cache_limit_bytes=200_000, pack_max_bytes=100_000)
    cache = Cache(s)
    for i in range(30):
        cache.put(f"k{i}", os.urandom(SMALL), url=f"mem://k{i}")
        assert cache.volume() <= s.cache_limit_bytes
        held = list(cache.data_dir.glob("packs/*.pack"))
        on_disk = sum(allocated(p) for p in held)
        # Punched blocks are free: disk follows the counter, to within the partial blocks at the
        # ends of each pack's live entries (64 B offsets share blocks: cache/entry.py).
        assert on_disk <= cache.volume() + 2 * packs.BLOCK * len(held)
    names = sorted(p.name for p in cache.data_dir.glob("packs/*.pack"))
    sealed = [n for n in names if packs.is_sealed(cache.data_dir / "packs" / n)]
    assert len(names) <= 4 and len(sealed) == len(names) - 1  # older packs sealed; emptied ones unlinked
    assert cache.get("k29") is not None and cache.get("k0") is None


def _child_appends_and_dies(settings: Settings, publish: bool) -> None:
    cache = Cache(settings)
    if publish:
        cache.put("kept", b"x" * SMALL, url="mem://kept")
    # Bytes appended but never published: what a SIGKILL between write and COMMIT leaves.
    packs.writer(cache.data_dir / packs.FOLDER).append([(os.urandom(SMALL),), (os.urandom(SMALL),)])
    os.kill(os.getpid(), signal.SIGKILL)


def _run_child(target: object, *args: object) -> int:
    proc = multiprocessing.get_context("fork").Process(target=target, args=args)
    proc.start()
    proc.join(30)
    assert proc.exitcode == -signal.SIGKILL
    return int(proc.pid or 0)


def test_check_reclaims_a_dead_writers_unpublished_tail_and_its_empty_pack(settings: Settings) -> None:
    cache = Cache(settings)
    pid = _run_child(_child_appends_and_dies, settings, True)
    [pack] = [p for p in cache.data_dir.glob("packs/*.pack") if packs.owner(p.name) == str(pid)]
    kept = cache.entry("kept")
    assert kept is not None and kept.path.endswith(pack.name)
    assert pack.stat().st_size > kept.offset + kept.charged  # the orphan tail
    report = cache.check()
    assert report["pack_bytes_reclaimed"] >= 2 * SMALL and report["packs_removed"] == 0
    assert pack.stat().st_size == kept.offset + kept.charged
    assert cache.get("kept") == b"x" * SMALL and cache.corrupt_count() == 0

    pid = _run_child(_child_appends_and_dies, settings, False)
    assert [p for p in cache.data_dir.glob("packs/*.pack") if packs.owner(p.name) == str(pid)]
    assert cache.check()["packs_removed"] == 1
    assert not [p for p in cache.data_dir.glob("packs/*.pack") if packs.owner(p.name) == str(pid)]
    assert cache.check()["pack_bytes_reclaimed"] == 0  # nothing left to reclaim


def _child_puts(settings: Settings, key: str, conn: object) -> None:
    cache = Cache(settings)
    e = cache.put(key, blob(7), url=f"mem://{key}")
    conn.send((e.path, e.offset))  # type: ignore[attr-defined]


def test_a_forked_worker_appends_to_its_own_pack(settings: Settings) -> None:
    cache = Cache(settings)
    parent_pack = cache.put("parent", blob(1), url="mem://parent").path
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_puts, args=(settings, "child", send))
    proc.start()
    child_pack, _ = recv.recv()
    proc.join(30)
    assert proc.exitcode == 0
    assert child_pack != parent_pack and packs.owner(Path(child_pack).name) == str(proc.pid)
    assert cache.put("parent2", blob(2), url="mem://parent2").path == parent_pack  # the parent's pack goes on
    assert cache.get("child") == blob(7)


def test_without_hole_punching_small_payloads_get_files(settings: Settings, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    def refuse(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(packs, "punch", refuse)
    cache = Cache(settings)
    entries = cache.put_many([(f"k{i}", blob(i), f"mem://k{i}", 0) for i in range(3)])
    assert all(e.offset is None and e.path.endswith(".flp") for e in entries)
    assert cache.volume() == sum(e.stored for e in entries)  # reserved as packed, counted as files
    assert not list(cache.data_dir.glob("packs/*.pack"))
    assert "cannot punch holes" in caplog.text


def test_pack_max_0_stores_a_file_per_payload(tmp_path: Path) -> None:
    cache = Cache(Settings(cache_dir=tmp_path / "c", pack_max_bytes=0))
    assert cache.put("k", blob(1), url="mem://k").offset is None
    assert not (cache.data_dir / packs.FOLDER).exists()


def test_clear_deletes_packs_and_a_writer_starts_a_new_one(settings: Settings) -> None:
    cache = Cache(settings)
    first = cache.put("k0", blob(0), url="mem://k0").path
    cache.clear()
    assert not list(cache.data_dir.glob("packs/*.pack")) and cache.volume() == 0
    again = cache.put("k1", blob(1), url="mem://k1")
    assert again.path != first and cache.get("k1") == blob(1)


def test_a_limit_below_a_packed_payloads_aligned_size_is_a_clear_error(tmp_path: Path) -> None:
    cache = Cache(Settings(cache_dir=tmp_path / "c", cache_limit_bytes=4990, pack_max_bytes=100_000))
    with pytest.raises(CacheLimitError, match=r"cache limit .* is smaller than item 'mem://k'"):
        cache.put("k", os.urandom(4950), url="mem://k")  # 4,986 B stored, 4,992 counted in a pack (64 B offsets)
    assert cache.volume() == 0 and cache.entry("k") is None


def test_write_all_finishes_parts_the_kernel_wrote_only_in_part(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.pwritev

    def short(fd: int, buffers: list[memoryview], offset: int) -> int:  # at most 7 bytes per call
        left, out = 7, []
        for b in buffers:
            out.append(b[:left])
            left -= len(out[-1])
            if not left:
                break
        return real(fd, out, offset)

    monkeypatch.setattr(os, "pwritev", short)
    path = tmp_path / "f"
    path.write_bytes(b"")
    parts = [b"head-", memoryview(os.urandom(50)), b"", b"-tail"]
    fd = os.open(path, os.O_WRONLY)
    try:
        packs.write_all(fd, parts, 3)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"\0\0\0" + b"".join(bytes(p) for p in parts)
