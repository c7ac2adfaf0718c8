"""Batch assembly (fastload.cache.gather): the C extension and the pure-Python fallback agree.

Every test runs once per backend ("python", and "native" when fastload._native is
built and FASTLOAD_PURE_PYTHON is unset; FASTLOAD_REQUIRE_NATIVE=1 turns a missing
extension into a failure, for CI). Results and output bytes are compared with
what Cache.get would return for the same payload.
"""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastload import codec
from fastload.cache import Cache, gather
from fastload.config import Settings
from fastload.dataset import ArrayDataset, FileDataset, TokenDataset
from fastload.read.reader import Reader

NATIVE = gather.backend() == "native"


def text(n: int, seed: int = 0) -> bytes:
    """Compressible bytes (LZ4 picks them up), different per seed."""
    rng = np.random.default_rng(seed)
    words = [b"tok%d " % i for i in range(200)]
    out = b"".join(words[i] for i in rng.integers(0, 200, n // 3 + 1))
    return out[:n]


def write(tmp_path: Path, name: str, payload: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(payload)
    return str(path)


def job_for(path: str, payload: bytes, raw: bytes, copies: list[tuple[int, int, int]], *, intact: bool = True) -> gather.Job:
    info = codec.parse_header(payload)
    stored_checksum = codec.checksum(payload) if intact else None
    return gather.Job(path, len(payload), len(raw), info.codec, info.checksum, stored_checksum, copies)


def expected(raw: bytes, copies: list[tuple[int, int, int]], size: int) -> bytes:
    out = bytearray(size)
    for src, n, dst in copies:
        out[dst : dst + n] = raw[src : src + n]
    return bytes(out)


PAYLOADS = {
    "lz4_chunks": (lambda: text(50_000), {"chunk_bytes": 4096}),
    "lz4_one_chunk": (lambda: text(3000), {}),
    "raw": (lambda: os.urandom(20_000), {}),
    "empty": (lambda: b"", {}),
    "meta": (lambda: text(9000), {"chunk_bytes": 4096, "meta": {"dtype": "int32", "shape": [3]}}),
}


@pytest.mark.parametrize("kind", sorted(PAYLOADS))
@pytest.mark.parametrize("intact", [True, False])
def test_good_payloads_copy_exactly_the_requested_ranges(tmp_path: Path, backend: str, kind: str, intact: bool) -> None:
    make, kwargs = PAYLOADS[kind]
    raw = make()
    payload = codec.encode(raw, **kwargs)
    path = write(tmp_path, "p.flp", payload)
    n = len(raw)
    layouts = [[(0, n, 0)], [(0, n, 7)], [], [(0, 0, 0)]]
    if n > 100:
        layouts += [[(n // 2, n // 3, 0), (1, 50, n // 3 + 1), (n - 10, 10, n // 3 + 60)]]
    if n > 8200:  # ranges across chunk boundaries (4096 B chunks)
        layouts += [[(4095, 2, 0), (4096, 1, 5), (8000, 200, 10)]]
    for copies in layouts:
        size = max([dst + ln for _, ln, dst in copies] + [1])
        out = np.full(size, 0xEE, dtype=np.uint8)
        want = bytearray(out.tobytes())
        for src, ln, dst in copies:
            want[dst : dst + ln] = raw[src : src + ln]
        assert gather.gather([job_for(path, payload, raw, copies, intact=intact)], out) == [None]
        assert out.tobytes() == bytes(want), copies


def test_many_jobs_on_threads_equal_one_thread(tmp_path: Path, backend: str) -> None:
    raws = [text(10_000 + 997 * i, seed=i) for i in range(24)]
    jobs, pos = [], 0
    for i, raw in enumerate(raws):
        payload = codec.encode(raw, chunk_bytes=4096, min_saving=0.0 if i % 2 else 1.0)
        jobs.append(job_for(write(tmp_path, f"{i}.flp", payload), payload, raw, [(0, len(raw), pos)]))
        pos += len(raw)
    outs = []
    for threads in (1, 4):
        out = bytearray(pos)
        assert gather.gather(jobs, out, threads=threads) == [None] * len(jobs)
        outs.append(bytes(out))
    assert outs[0] == outs[1] == b"".join(raws)


def corruptions(payload: bytes) -> dict[str, tuple[bytes, dict[str, Any]]]:
    """Name -> (bytes on disk, Job fields to override)."""
    info = codec.parse_header(payload)
    mid = info.body_offset + (len(payload) - info.body_offset) // 2
    flipped = bytearray(payload)
    flipped[mid] ^= 0x5A
    table = bytearray(payload)
    struct.pack_into("<I", table, info.body_offset - 4 * len(info.chunk_sizes), 0xFFFF)
    return {
        "truncated": (payload[: len(payload) // 2], {}),
        "longer": (payload + b"x", {}),
        "body_flip": (bytes(flipped), {}),
        "bad_magic": (b"XLP1" + payload[4:], {}),
        "bad_version": (payload[:4] + b"\x07" + payload[5:], {}),
        "chunk_table": (bytes(table), {}),
        "header_only": (payload[: codec.HEADER_BYTES], {}),
        "tiny": (b"FL", {}),
        "index_raw": (payload, {"raw": info.raw_size + 1}),
        "index_checksum": (payload, {"checksum": info.checksum ^ 1}),
        "index_codec": (payload, {"codec": 1 - info.codec}),
        "index_stored_checksum": (payload, {"stored_checksum": codec.checksum(payload) ^ 1}),
    }


@pytest.mark.parametrize("intact", [True, False])
@pytest.mark.parametrize("raw_codec", [False, True])
def test_corrupt_payloads_are_reported_corrupt_never_copied_silently(
    tmp_path: Path, backend: str, intact: bool, raw_codec: bool
) -> None:
    raw = text(40_000)
    payload = codec.encode(raw, chunk_bytes=4096, min_saving=1.0 if raw_codec else 0.05)
    for name, (disk, override) in corruptions(payload).items():
        if raw_codec and name == "chunk_table":
            continue
        path = write(tmp_path, name + ".flp", disk)
        job = job_for(path, payload, raw, [(100, 5000, 0)], intact=intact)._replace(stored=len(disk))
        if name in ("truncated", "longer"):
            job = job._replace(stored=len(payload))
        job = job._replace(**override)
        result = gather.gather([job], bytearray(5000))
        assert result[0] is not None and result[0][0] == "corrupt", (name, result)


@pytest.mark.parametrize("meta", [None, {"dtype": "uint8"}])
def test_a_large_raw_payload_read_into_the_output_is_checked_byte_for_byte(tmp_path: Path, backend: str,
                                                                           meta: dict[str, str] | None) -> None:
    # A whole raw payload of 1 MiB or more is read straight into the output (native/_native.c,
    # direct_raw); every byte of it must still be covered by the checks: a flip anywhere in the
    # header, the metadata or the body, a short or long file, or an index that disagrees.
    raw = os.urandom(3 << 20)
    payload = codec.encode(raw, min_saving=1.0, meta=meta)
    head = len(payload) - len(raw)
    assert codec.parse_header(payload).codec == codec.RAW
    path = write(tmp_path, "big.flp", payload)
    out = on_line(len(raw) + 9, (head - 9) % 64)  # the body's place in a line, as on disk: read straight in
    shared = gather._STATE["native"].large_reads()["shared"] if NATIVE else 0
    assert gather.gather([job_for(path, payload, raw, [(0, len(raw), 9)])], out) == [None]
    assert bytes(out[9:]) == raw
    if backend == "native" and len(os.sched_getaffinity(0)) > 1:  # a CPU idle: a helper read pieces too
        assert gather._STATE["native"].large_reads()["shared"] == shared + 1
    flips = [*range(head), head, head + len(raw) // 2, len(payload) - 1]
    cases = {f"flip@{at}": (payload[:at] + bytes([payload[at] ^ 0x10]) + payload[at + 1:], {}) for at in flips}
    cases |= {"short": (payload[:-1], {}), "longer": (payload + b"x", {}),
              "index_checksum": (payload, {"checksum": codec.parse_header(payload).checksum ^ 1}),
              "index_raw": (payload, {"raw": len(raw) - 1}),
              "index_stored_checksum": (payload, {"stored_checksum": codec.checksum(payload) ^ 1})}
    for name, (disk, override) in cases.items():
        bad = write(tmp_path, "bad.flp", disk)
        job = job_for(bad, payload, raw, [(0, len(raw), 0)])._replace(**override)
        if "raw" in override:
            job = job._replace(copies=[(0, job.raw, 0)])
        result = gather.gather([job], bytearray(len(raw)))
        assert result[0] is not None and result[0][0] == "corrupt", (name, result)


def on_line(n: int, at: int) -> np.ndarray:
    """A zeroed buffer of ``n`` bytes whose first byte lies ``at`` bytes into a 64-byte line."""
    base = np.zeros(n + 128, dtype=np.uint8)
    skip = (-base.ctypes.data) % 64 + at
    return base[skip : skip + n]


@pytest.mark.skipif(not NATIVE, reason="counts the native backend's reads through scratch")
def test_a_large_raw_read_goes_through_scratch_only_where_the_kernels_copy_is_slow(tmp_path: Path) -> None:
    # native/_native.c slow_copy: a destination 1-31 bytes past the source's place in a line
    # (the kernel's `rep movsb` runs at a fifth of its speed there, benchmarks/open/align.py)
    # is read through a piece of scratch on a line; every other one straight into the output.
    # Both roads give the same bytes and the same checks.
    native = gather._STATE["native"]
    raw = os.urandom((2 << 20) + 5)
    payload = codec.encode(raw, min_saving=1.0)
    body_at = (len(payload) - len(raw)) % 64  # where the body starts within its line on disk
    path = write(tmp_path, "big.flp", payload)
    at_body = len(payload) - len(raw) + len(raw) // 2
    bad = write(tmp_path, "bad.flp", payload[:at_body] + bytes([payload[at_body] ^ 1]) + payload[at_body + 1 :])
    through = []
    for at in range(64):
        out = on_line(len(raw), at)
        before = native.large_reads()["lined"]
        assert gather.gather_native([job_for(path, payload, raw, [(0, len(raw), 0)])], out) == [None], at
        if native.large_reads()["lined"] > before:
            through.append(at)
        assert out.tobytes() == raw, at
        result = gather.gather_native([job_for(bad, payload, raw, [(0, len(raw), 0)])], on_line(len(raw), at))
        assert result[0] is not None and result[0][0] == "corrupt", (at, result)
    assert through == [at for at in range(64) if 0 < at - body_at < 32]


@pytest.mark.parametrize("n", [2048, 2049, 9000, 20_000])
def test_copies_out_of_scratch_are_exact_at_every_place_in_a_line(tmp_path: Path, backend: str, n: int) -> None:
    # finish()'s copies go through SSE2 loads and stores where memcpy would be slow (copy_out):
    # every destination offset within a line, lengths around its 64-byte steps.
    raw = os.urandom(20_000)
    payload = codec.encode(raw, min_saving=1.0)
    path = write(tmp_path, "raw.flp", payload)
    for at in range(64):
        copies = [(src, min(n, len(raw) - src), 0) for src in (0, 7, 64 - at)]
        for src, length, _ in copies:
            out = on_line(length + 3, at)
            assert gather.gather([job_for(path, payload, raw, [(src, length, 0)])], out) == [None]
            assert out[:length].tobytes() == raw[src : src + length], (at, src, length)
            assert not out[length:].any(), (at, src, length)  # nothing written past the copy


@pytest.mark.skipif(not NATIVE or not Path("/proc/self/statm").exists(), reason="the native backend's scratch buffers")
def test_a_large_raw_payload_is_not_copied_through_a_scratch_buffer(tmp_path: Path) -> None:
    # Issue 35: read back without a second copy. The old road grew a scratch buffer to the
    # payload's size (64 MiB here, kept between calls) and copied out of it.
    raw = os.urandom(64 << 20)
    payload = codec.encode(raw, min_saving=1.0)
    path = write(tmp_path, "big.flp", payload)
    del payload
    script = f"""
import numpy as np
from fastload import codec
from fastload.cache import gather
raw_n = {len(raw)}
data = open({path!r}, "rb").read()
info = codec.parse_header(data)
job = gather.Job({path!r}, len(data), raw_n, info.codec, info.checksum, codec.checksum(data), [(0, raw_n, 0)])
del data
out = np.ones(raw_n, dtype=np.uint8)  # touched: its pages count before the read


def rss_mb():  # resident now (a peak would hide the scratch buffer behind the read above)
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20


before = rss_mb()
assert gather.gather_native([job], out) == [None]
print(rss_mb() - before)
"""
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    grew_mb = int(res.stdout.split()[-1])
    assert grew_mb < 16, f"peak RSS grew {grew_mb} MB reading a 64 MiB raw payload: it went through scratch"


@pytest.mark.skipif(not NATIVE, reason="counts the native backend's opens")
@pytest.mark.parametrize("packs", [3, 20])  # 20: more than a thread holds open (OPEN_PACKS, 16)
def test_a_batch_opens_each_pack_once_per_thread_and_reads_every_payload_right(tmp_path: Path, packs: int) -> None:
    # A warm batch of small samples read each of a few packs many times; an open and a close per
    # sample cost more than the read (benchmarks/scale at 1M: 21-26 -> 18 us per sample).
    import random

    jobs, want, pos = [], [], 0
    for p in range(packs):
        blob = bytearray()
        for i in range(12):
            raw = text(3000 + 37 * i, seed=p * 100 + i)
            payload = codec.encode(raw, min_saving=1.0 if i % 2 else 0.0)
            info = codec.parse_header(payload)
            jobs.append(gather.Job(str(tmp_path / f"{p}.pack"), len(payload), len(raw), info.codec, info.checksum,
                                   codec.checksum(payload), [(0, len(raw), 0)], len(blob)))
            want.append(raw)
            blob += payload + b"\0" * 13  # payloads need not be adjacent
        (tmp_path / f"{p}.pack").write_bytes(bytes(blob))
    order = list(range(len(jobs)))
    random.Random(0).shuffle(order)
    placed = []
    for k in order:
        placed.append(jobs[k]._replace(copies=[(0, len(want[k]), pos)]))
        pos += len(want[k])
    out = bytearray(pos)
    before = gather._STATE["native"].opened()
    assert gather.gather_native(placed, out, threads=1) == [None] * len(placed)
    opened = gather._STATE["native"].opened() - before
    assert bytes(out) == b"".join(want[k] for k in order)
    assert opened == packs if packs <= 16 else packs <= opened < len(placed)


def test_invalid_metadata_is_corrupt_valid_metadata_is_not(tmp_path: Path, backend: str) -> None:
    raw = text(5000)
    good = codec.encode(raw, meta={"a": [1, 2]})
    meta_len = struct.unpack_from("<I", good, 32)[0]
    cases = {b'{"a":[1,2]}': None, b'[1,2,3,4,5]': "not a JSON object", b'{"a":[1,2]]': "not valid JSON", b"\xff\xfe" + b"x" * 9: "not valid JSON"}
    for meta, error in cases.items():
        assert len(meta) == meta_len
        payload = good[: codec.HEADER_BYTES] + meta + good[codec.HEADER_BYTES + meta_len :]
        path = write(tmp_path, "m.flp", payload)
        out = bytearray(len(raw))
        (result,) = gather.gather([job_for(path, good, raw, [(0, len(raw), 0)], intact=False)], out)
        if error is None:
            assert result is None and bytes(out) == raw
        else:
            assert result is not None and result[0] == "corrupt" and error in result[1]


def test_missing_file_and_os_errors(tmp_path: Path, backend: str) -> None:
    raw = text(1000)
    payload = codec.encode(raw)
    job = job_for(str(tmp_path / "gone.flp"), payload, raw, [(0, 10, 0)])
    (tmp_path / "a_dir").mkdir()
    assert gather.gather([job, job._replace(path=str(tmp_path / "a_dir"))], bytearray(10)) == [
        ("missing", "payload file is missing"),
        ("oserror", errno.EISDIR),
    ]


def test_bad_arguments_raise_before_any_io(tmp_path: Path, backend: str) -> None:
    raw = text(1000)
    payload = codec.encode(raw)
    job = job_for(str(tmp_path / "never-opened.flp"), payload, raw, [(0, 10, 0)])
    with pytest.raises(ValueError, match="outside the 1000 B payload"):
        gather.gather([job._replace(copies=[(995, 10, 0)])], bytearray(100))
    with pytest.raises(ValueError, match="outside the 100 B output buffer"):
        gather.gather([job._replace(copies=[(0, 10, 95)])], bytearray(100))
    with pytest.raises(ValueError):
        gather.gather([job._replace(copies=[(-1, 10, 0)])], bytearray(100))
    with pytest.raises(BufferError):
        gather.gather([job], bytes(100))
    with pytest.raises(BufferError):
        gather.gather([job], np.zeros((10, 10), dtype=np.uint8)[:, ::2])


def test_output_can_be_a_2d_array_or_a_tensor_view(tmp_path: Path, backend: str) -> None:
    torch = pytest.importorskip("torch")
    raw = np.arange(4096, dtype=np.int32).tobytes()
    payload = codec.encode(raw, chunk_bytes=4096)
    path = write(tmp_path, "t.flp", payload)
    slot = torch.zeros((4, 1024), dtype=torch.int32)  # a pinned slot on CUDA machines
    copies = [(k * 4096, 4096, (3 - k) * 4096) for k in range(4)]
    assert gather.gather([job_for(path, payload, raw, copies)], slot.numpy()) == [None]
    assert slot.flip(0).flatten().tolist() == list(range(4096))


@pytest.mark.skipif(sys.platform != "linux", reason="fork start method")
def test_native_pool_survives_fork(tmp_path: Path, backend: str) -> None:
    raws = [text(300_000, seed=i) for i in range(4)]
    jobs, pos = [], 0
    for i, raw in enumerate(raws):
        payload = codec.encode(raw, chunk_bytes=65536)
        jobs.append(job_for(write(tmp_path, f"{i}.flp", payload), payload, raw, [(0, len(raw), pos)]))
        pos += len(raw)
    out = bytearray(pos)
    assert gather.gather(jobs, out, threads=4) == [None] * 4  # starts the pool in the parent
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=_gather_in_child, args=(jobs, pos, b"".join(raws), backend))
    child.start()
    child.join(60)
    assert child.exitcode == 0


def _gather_in_child(jobs: list[gather.Job], size: int, want: bytes, backend: str) -> None:
    with gather.use_backend(backend):
        out = bytearray(size)
        ok = gather.gather(jobs, out, threads=4) == [None] * len(jobs) and bytes(out) == want
    os._exit(0 if ok else 1)


def test_pure_python_env_forces_the_fallback() -> None:
    code = "from fastload.cache import gather; print(gather.backend(), gather.info()['reason'])"
    env = {**os.environ, "FASTLOAD_PURE_PYTHON": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "python FASTLOAD_PURE_PYTHON is set"


def test_info_names_the_resolved_functions() -> None:
    info = gather.info()
    if info["backend"] == "native":
        assert "LZ4_decompress_safe from" in info["lz4"] and "XXH3_64bits" in info["xxh3"]
    else:
        assert info["reason"]


# -- differential fuzzing (short here; native/fuzz.py runs it for minutes) --------------


@pytest.mark.skipif(not NATIVE, reason="needs fastload._native to compare against")
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_native_agrees_with_python(data: st.DataObject) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "native"))
    try:
        import fuzz
    finally:
        sys.path.pop(0)
    fuzz.check_one(data.draw(fuzz.cases()))


# -- through the cache, the reader and the datasets -------------------------------------


@pytest.fixture()
def small_blocks(tmp_path: Path) -> Settings:
    return Settings(cache_dir=tmp_path / "cache", block_bytes=64 * 1024, chunk_bytes=16 * 1024, retries=1)


def test_read_into_drops_refetches_and_counts_bad_entries(tmp_path: Path, backend: str, small_blocks: Settings) -> None:
    small_blocks = small_blocks.replace(pack_max_bytes=0)  # a file per payload; packs: tests/unit/test_cache_packs.py
    remote = tmp_path / "remote"
    remote.mkdir()
    files = {f"f{i}.bin": text(100_000 + i, seed=i) for i in range(5)}
    for name, data in files.items():
        (remote / name).write_bytes(data)
    reader = Reader(small_blocks)
    items = reader.list(str(remote))
    for item in items:
        reader.read(item)  # cache everything
    cache = Cache(small_blocks)
    entries = sorted(cache.entries(), key=lambda e: (e.url, e.block))
    bad = {entries[0].key, entries[3].key, entries[6].key}
    flipped = bytearray((cache.data_dir / entries[0].path).read_bytes())
    flipped[-100] ^= 1
    (cache.data_dir / entries[0].path).write_bytes(bytes(flipped))
    with open(cache.data_dir / entries[3].path, "r+b") as f:
        f.truncate(10)
    (cache.data_dir / entries[6].path).unlink()

    reader = Reader(small_blocks)
    sizes = [i.size for i in items]
    out = bytearray(sum(sizes))
    starts = np.cumsum([0, *sizes[:-1]]).tolist()
    reader.read_into([(item, 0, item.size, dst) for item, dst in zip(items, starts)], out)
    assert bytes(out) == b"".join(files[Path(i.url).name] for i in items)
    assert reader.cache.corrupt_count() == 3 and reader.misses == 3
    assert reader.hits == len(entries) - 3
    fresh = {e.key: e.path for e in Cache(small_blocks).entries()}
    assert all(fresh[e.key] != e.path for e in entries if e.key in bad)  # refetched into new files
    assert all(Cache(small_blocks).get(k) is not None for k in fresh)
    # ranges that cross blocks, in any order, with gaps in the output
    out2 = bytearray(300_000)
    item = items[2]
    reqs = [(item, 65_000, 70_000, 200_000), (item, 0, 10, 0), (item, 60_000, 100_002, 100), (item, 5, 5, 5)]
    reader.read_into(reqs, out2)
    data = files[Path(item.url).name]
    assert bytes(out2[200_000:205_000]) == data[65_000:70_000]
    assert bytes(out2[100:40_102]) == data[60_000:100_002] and bytes(out2[:10]) == data[:10]


def test_dataset_read_batch_equals_getitem(tmp_path: Path, backend: str, small_blocks: Settings) -> None:
    tokens = np.random.default_rng(1).integers(0, 50_000, 200_003, dtype=np.int32)
    tokens.tofile(tmp_path / "tokens.bin")
    arr = np.arange(3000 * 7, dtype=np.float64).reshape(3000, 7)
    np.save(tmp_path / "rows.npy", arr)
    (tmp_path / "npys").mkdir()
    for i in range(5):
        np.save(tmp_path / "npys" / f"{i}.npy", np.full((3, i + 1), i, dtype=np.int16 if i % 2 else np.float32))
    (tmp_path / "files" / "a").mkdir(parents=True)
    for i in range(6):
        (tmp_path / "files" / "a" / f"{i}.bin").write_bytes(text(30_000 * i + 1, seed=i))
    datasets = [
        TokenDataset(str(tmp_path / "tokens.bin"), seq_len=2049, dtype="int32", settings=small_blocks),
        TokenDataset(str(tmp_path / "tokens.bin"), seq_len=100, stride=37, dtype="int32", settings=small_blocks),
        ArrayDataset(str(tmp_path / "rows.npy"), settings=small_blocks),
        ArrayDataset(str(tmp_path / "npys"), settings=small_blocks),
        FileDataset(str(tmp_path / "files"), pattern="**/*.bin", label="parent", transform=bytes.upper, settings=small_blocks),
    ]
    for ds in datasets:
        n = len(ds)
        indices = [0, n - 1, -1, n // 2, 1 % n, n // 3, 0]
        for _ in range(2):  # cold (fetches), then warm (cache hits)
            got, want = ds.read_batch(indices), [ds[i] for i in indices]
            assert len(got) == len(want)
            for g, w in zip(got, want):
                assert g.keys() == w.keys()
                for k in w:
                    if isinstance(w[k], np.ndarray):
                        assert g[k].dtype == w[k].dtype and g[k].shape == w[k].shape
                        np.testing.assert_array_equal(g[k], w[k])
                    else:
                        assert g[k] == w[k]
        with pytest.raises(IndexError):
            ds.read_batch([0, n])


def test_loader_over_a_token_dataset_matches_torch(tmp_path: Path, backend: str, small_blocks: Settings) -> None:
    import torch

    import fastload

    tokens = np.random.default_rng(2).integers(0, 50_000, 120_000, dtype=np.int32)
    tokens.tofile(tmp_path / "t.bin")
    ds = TokenDataset(str(tmp_path / "t.bin"), seq_len=513, settings=small_blocks)
    ours = list(fastload.DataLoader(ds, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(5)))
    theirs = list(torch.utils.data.DataLoader(ds, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(5)))
    assert len(ours) == len(theirs) > 1
    for a, b in zip(ours, theirs):
        assert torch.equal(a["data"], b["data"]) and torch.equal(a["index"], b["index"])


def test_meta_json_is_the_same_check_as_the_codec() -> None:
    assert gather._check_meta(json.dumps({"x": 1}).encode()) is None
    assert gather._check_meta(b"1") == ("corrupt", "payload metadata is not a JSON object")


def test_subclass_with_its_own_getitem_keeps_one_by_one_reads(tmp_path: Path, small_blocks: Settings) -> None:
    tokens = np.arange(10_000, dtype=np.int32)
    tokens.tofile(tmp_path / "t.bin")

    class Tagged(TokenDataset):
        def __getitem__(self, index: int) -> dict[str, Any]:
            return {**super().__getitem__(index), "tag": index * 2}

    ds = Tagged(str(tmp_path / "t.bin"), seq_len=10, settings=small_blocks)
    assert [s["tag"] for s in ds.read_batch([3, 1])] == [6, 2]


def test_resolve_names_what_it_tried_when_a_symbol_is_missing() -> None:
    import ctypes.util

    libc = ctypes.util.find_library("c") or "libc.so.6"
    with pytest.raises(OSError, match="exports none of LZ4_no_such_function"):
        gather._resolve(["LZ4_no_such_function"], [libc])
    with pytest.raises(OSError, match="/nonexistent/liblz4.so"):
        gather._resolve(["LZ4_decompress_safe"], ["/nonexistent/liblz4.so"])
    address, where = gather._resolve(["strlen"], ["/nonexistent/liblz4.so", libc])
    assert address > 0 and where == f"strlen from {libc}"


@pytest.mark.parametrize("size", [3000, 110_000, 3 << 20])
def test_cached_bodies_lie_at_their_memorys_place_and_read_back_with_no_metadata_parse(
        tmp_path: Path, backend: str, size: int) -> None:
    # The cache writes with codec.line_pad: the body lies in its file at the place in a line its
    # bytes had in memory (a pack slot or a file starts on a line). The native read takes the
    # padding for what it is ("{}" and spaces: no metadata), with no JSON parse in Python.
    cache = Cache(Settings(cache_dir=tmp_path / "cache"))
    raws = [os.urandom(size) for _ in range(4)]
    entries = [cache.put(f"k{i}", raw, url=f"u{i}") for i, raw in enumerate(raws)]
    for raw, e in zip(raws, entries):
        assert e.codec == codec.RAW
        assert ((e.offset or 0) + e.stored - e.raw) % 64 == np.frombuffer(raw, dtype=np.uint8).ctypes.data % 64
    out = bytearray(sum(map(len, raws)))
    jobs, at = [], 0
    for e in entries:
        jobs.append(gather.Job(cache.data_prefix + e.path, e.stored, e.raw, e.codec, e.checksum, e.stored_checksum, [(0, e.raw, at)], e.offset))
        at += e.raw
    if backend == "native":  # the C results themselves: no ("meta", ...) handed to Python
        assert gather._STATE["native"].gather(jobs, out, 1) == [None] * 4
    else:
        assert gather.gather(jobs, out) == [None] * 4
    assert bytes(out) == b"".join(raws)


# -- split: a batch's samples copied out as bytes ---------------------------------------


def test_split_copies_each_span_exactly_at_every_place_in_a_line(backend: str) -> None:
    # Spans at every offset within a line, sizes around the native copy's 2 KiB and 64 KiB
    # steps (line_copy; the GIL released), an empty one, and two that overlap.
    src = np.frombuffer(os.urandom(300_000), dtype=np.uint8)
    raw = src.tobytes()
    spans = [(at, n) for at in range(64) for n in (0, 1, 2047, 2048, 5000)] + [(100, 70_000), (5, 200_000)]
    got = gather.split(src, spans)
    assert all(type(b) is bytes for b in got)
    assert got == [raw[s : s + n] for s, n in spans]
    assert gather.split(memoryview(raw)[10:], [(0, 3)]) == [raw[10:13]]  # any buffer, from its start


@pytest.mark.parametrize("span", [(-1, 4), (0, -1), (299_999, 2), (300_001, 0)])
def test_split_refuses_a_span_outside_the_buffer(backend: str, span: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="outside the buffer of 300000 bytes"):
        gather.split(bytes(300_000), [(0, 10), span])


@pytest.mark.skipif(not NATIVE, reason="the native split releases the GIL")
def test_split_lets_other_threads_run_while_it_copies() -> None:
    import threading

    big = np.frombuffer(os.urandom(64 * 1024**2), dtype=np.uint8)
    spans = [(i * 1024**2, 1024**2) for i in range(64)]
    ticks = 0
    stop = threading.Event()

    def count() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1

    t = threading.Thread(target=count)
    t.start()
    try:
        while ticks == 0:
            pass
        before = sys.getswitchinterval()
        # Five splits take well under 0.5 s: holding the GIL, they would leave the counter none.
        sys.setswitchinterval(0.5)
        try:
            start = ticks
            for _ in range(5):
                gather.split(big, spans)
            ran = ticks - start
        finally:
            sys.setswitchinterval(before)
    finally:
        stop.set()
        t.join()
    assert ran > 0
