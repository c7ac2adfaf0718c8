"""Area 10: hostile and bad input: fuzzed payloads, hostile names, bad URLs, corrupt JPEGs, bad arrays."""

from __future__ import annotations

import gc
import io
import os
import random
import re
import struct
import tarfile
import traceback
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
from faults import FAULTS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastload
from fastload import _servers, codec
from fastload.cache import Cache, keys
from fastload.cli import main as cli_main
from fastload.config import Settings
from fastload.errors import (
    CodecError,
    ConfigError,
    CredentialsError,
    DecodeError,
    RemoteNotFoundError,
)
from fastload.read.reader import Reader

pytestmark = pytest.mark.integration

VARIANTS = [pytest.param("short", id="short"), pytest.param("full", id="full", marks=pytest.mark.slow)]
FIELDS = {  # header field -> (struct format, offset)
    "magic": ("<4s", 0), "version": ("<B", 4), "codec": ("<B", 5), "reserved": ("<H", 6), "raw_size": ("<Q", 8),
    "chunk_bytes": ("<I", 16), "n_chunks": ("<I", 20), "checksum": ("<Q", 24), "meta_len": ("<I", 32),
}  # fmt: skip


def _bounded_decode(payload: bytes) -> bytes | None:
    """decode(), asserting it raises only CodecError and allocates within the codec's bound."""
    tracemalloc.start()
    try:
        try:
            return codec.decode(payload)
        except CodecError:
            return None
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        # LZ4 cannot expand more than 255x: a header may not buy more than that.
        assert peak <= 256 * len(payload) + 2**20, f"{peak} B allocated for a {len(payload)} B payload"


@pytest.mark.parametrize("variant", VARIANTS)
def test_fuzzed_payloads_never_crash_overread_or_overallocate(variant: str, tmp_path: Path, record: Callable[..., None]) -> None:
    n = FAULTS["fuzz-codec"].trials_full if variant == "full" else FAULTS["fuzz-codec"].trials_short
    fuzz = settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    calls = {"bytes": 0, "fields": 0, "cache": 0}

    @fuzz
    @given(st.binary(max_size=512), st.sampled_from([b"", codec.MAGIC, codec.MAGIC + b"\x01\x00", codec.MAGIC + b"\x01\x01"]))
    def arbitrary_bytes(blob: bytes, prefix: bytes) -> None:
        calls["bytes"] += 1
        _bounded_decode(prefix + blob)

    @fuzz
    @given(
        raw=st.binary(max_size=3000).map(lambda b: b * 3),
        chunk=st.sampled_from([4096, 8192]),
        field=st.sampled_from(sorted(FIELDS)),
        value=st.integers(0, 2**64 - 1),
        table=st.lists(st.tuples(st.integers(0, 64), st.integers(0, 2**32 - 1)), max_size=3),
    )
    def mutated_fields(raw: bytes, chunk: int, field: str, value: int, table: list[tuple[int, int]]) -> None:
        calls["fields"] += 1
        payload = bytearray(codec.encode(raw, chunk_bytes=chunk))
        fmt, offset = FIELDS[field]
        if field == "magic":
            struct.pack_into(fmt, payload, offset, value.to_bytes(8, "little")[:4])
        else:
            struct.pack_into(fmt, payload, offset, value % (1 << (8 * struct.calcsize(fmt))))
        info_ok = codec.HEADER_BYTES + 2  # meta "{}"
        for slot, v in table:  # chunk-table entries (LZ4 payloads) or body bytes
            pos = info_ok + 4 * slot
            if pos + 4 <= len(payload):
                struct.pack_into("<I", payload, pos, v)
        out = _bounded_decode(bytes(payload))
        assert out is None or out == raw  # if it decodes, the checksum says it is the original

    cache = Cache(Settings(cache_dir=tmp_path / "cache"))
    good = bytes(random.Random(1).getrandbits(8) for _ in range(64)) * 50

    @fuzz
    @given(st.binary(max_size=600), st.integers(0, 3400), st.booleans())
    def cache_files(junk: bytes, at: int, splice: bool) -> None:
        # A payload file replaced (or spliced) with junk, under a valid index entry:
        # both read paths (Cache.get and the batch gather, native when built) must
        # return the original or a miss, and nothing else.
        calls["cache"] += 1
        key = "f" * 40
        cache.drop(key)
        entry = cache.put(key, good, url="memory://fuzz/x")
        path = cache.data_dir / entry.path
        if entry.offset is None:
            body = path.read_bytes()
            path.write_bytes(body[:at] + junk + body[at + len(junk) :] if splice else junk)
        else:  # in a pack: the junk goes over its range only (a short one reads as zeros after it)
            with open(path, "r+b") as f:
                f.seek(entry.offset)
                body = f.read(entry.stored)
                new = body[:at] + junk + body[at + len(junk) :] if splice else junk
                f.seek(entry.offset)
                f.write(new[: entry.stored].ljust(entry.stored, b"\0"))
        rec = cache.index.get(keys.entry(key))
        got = cache.get(key)
        assert got is None or got == good
        cache.index.set(keys.entry(key), rec)
        out = np.zeros(len(good), dtype=np.uint8)
        missed = cache.read_into([(key, [(0, len(good), 0)])], out)
        assert missed == [0] or out.tobytes() == good

    arbitrary_bytes()
    mutated_fields()
    cache_files()
    cache.close()
    assert min(calls.values()) >= n, calls
    record(
        "fuzz-codec", n,
        f"pass: 3 properties x {n} examples (arbitrary bytes; mutated header fields and chunk tables; "
        "junk payload files under valid index entries, read by Cache.get and the batch gather): only CodecError "
        "or a miss, peak allocation within 256x the input",
        calls=calls,
    )  # fmt: skip


# -- hostile names ------------------------------------------------------------------------

HOSTILE_MEMBERS = ["../evil.txt", "/abs/evil2.txt", "a/../../evil3.txt", "ok/../../../etc/evil4.txt", "x" * 300 + "/long.txt"]


def _hostile_tar() -> tuple[bytes, dict[str, bytes]]:
    buf = io.BytesIO()
    files = {}
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for i, name in enumerate(HOSTILE_MEMBERS):
            data = f"member {i} {name}".encode() * 50
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
            files[name] = data
        for name, kind, target in [("link", tarfile.SYMTYPE, "/etc/passwd"), ("hard", tarfile.LNKTYPE, "../evil.txt"),
                                   ("dev", tarfile.CHRTYPE, "")]:  # fmt: skip
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, target
            tar.addfile(info)
    return buf.getvalue(), files


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_hostile_tar_members_and_remote_names_never_reach_a_path(tmp_path: Path, record: Callable[..., None]) -> None:
    shard, members = _hostile_tar()
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "s0.tar").write_bytes(shard)
    settings = Settings(cache_dir=tmp_path / "cache")
    before = _tree(tmp_path)
    ds = fastload.TarDataset(str(tmp_path / "shards"), settings=settings)
    seen = {}
    for i in range(len(ds)):
        sample = ds[i]
        (ext,) = [k for k in sample if not k.startswith("__")]
        seen[sample["__key__"] + "." + ext] = sample[ext]
    assert seen == members  # every file member read bit-exact; links and the device skipped
    names = ["../../escape.bin", "a/../../../b.bin", "nul\x00name.bin", "n" * 4000 + ".bin", "new\nline.bin", "..", "./."]
    mem = fsspec.filesystem("memory")
    reader = Reader(settings)
    for j, name in enumerate(names):
        url = f"memory://hostile/{j}/{name}"
        data = f"payload {j}".encode() * 100
        mem.pipe_file(url, data)
        assert reader.read(url) == data
    assert not Path("/abs/evil2.txt").exists() and not Path("/etc/evil4.txt").exists()
    new = _tree(tmp_path) - before
    pattern = re.compile(r"^cache(/(index|tmp|data|evict\.lock)(/.*)?|/flights(/[0-9a-f]{2}\.lock)?)?$")
    assert all(pattern.match(p) for p in new), sorted(p for p in new if not pattern.match(p))
    stored = [p for p in new if p.startswith("cache/data/") and p.endswith((".flp", ".pack"))]
    layout = re.compile(r"cache/data/([0-9a-f]{2}/[0-9a-f]{40}-[0-9a-f]{12}\.flp|packs/[0-9]+-[0-9a-f]{16}\.pack)")
    assert stored and all(layout.fullmatch(p) for p in stored), stored
    record(
        "hostile-names", len(HOSTILE_MEMBERS) + 3 + len(names),
        f"pass: {len(HOSTILE_MEMBERS)} hostile tar members read bit-exact as plain keys, 3 link/device members "
        f"skipped, {len(names)} hostile remote names (.., NUL, 4000 chars, newline) cached under hashed names; "
        "no file written outside the cache dir",
    )  # fmt: skip


# -- malformed URLs, credentials, buckets ---------------------------------------------------


def test_bad_urls_credentials_and_buckets_get_specific_errors(
    tmp_path: Path, moto_server: Any, s3_bucket: str, monkeypatch: pytest.MonkeyPatch,
    record: Callable[..., None], capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    trials = FAULTS["bad-urls"].trials_short
    settings = Settings(cache_dir=tmp_path / "cache", retries=2, backoff_s=0.01, request_timeout_s=5)
    s3 = _servers.s3_storage_options(moto_server.endpoint_url)
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    no_creds = {"client_kwargs": s3["client_kwargs"], "skip_instance_cache": True}
    cases: list[tuple[str, dict[str, Any], type[Exception], str]] = [
        ("s3:/bucket/train/", {}, ConfigError, r"needs two slashes after 's3:'; fix: write 's3://bucket/train/'"),
        ("htps://example.com/x", {}, ConfigError, r"Protocol not known: htps; check the protocol"),
        ("http://", {}, ConfigError, r"names no host; fix:"),
        ("http://[::1/x", {}, ConfigError, r"is malformed \(Invalid IPv6 URL\); fix:"),
        ("http://127.0.0.1:99999/x", {}, ConfigError, r"is malformed \(Port out of range"),
        ("s3://", s3, ConfigError, r"names no bucket; fix:"),
        (str(tmp_path / "no" / "such" / "dir") + "/", {}, RemoteNotFoundError, r"not found .*; fix: check"),
        (f"s3://{s3_bucket}/", no_creds, CredentialsError, r"credentials.*fix: pass credentials in storage_options"),
        (f"s3://no-such-bucket-{s3_bucket[-6:]}/train/", s3, RemoteNotFoundError, r"not found.*; fix: check the bucket"),
    ]
    assert len(cases) == trials
    for url, options, error, pattern in cases:
        with pytest.raises(error, match=pattern) as info:
            fastload.stage(url, storage_options=options, settings=settings, progress=False)
        shown = url.split("://")[0] if url.startswith("s3://") and len(url) <= 5 else url.rstrip("/")
        assert shown in str(info.value) or url in str(info.value), info.value
    # The CLI: exit 1 and the same message on stderr.
    capsys.readouterr()
    assert cli_main(["cache", "s3:/bucket/train/", "--cache-dir", str(tmp_path / "cache")]) == 1
    assert "needs two slashes" in capsys.readouterr().err
    record(
        "bad-urls", trials,
        f"pass: {trials} cases, each its own error class naming the URL and the fix (ConfigError for 6 malformed "
        "URLs, RemoteNotFoundError for a missing path and a missing bucket, CredentialsError without credentials); "
        "CLI exit 1",
    )  # fmt: skip


# -- corrupt JPEG -----------------------------------------------------------------------------


def decode_jpeg(data: bytes) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return np.asarray(img.convert("RGB"))


def _jpeg(seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(out, format="JPEG")
    return out.getvalue()


def as_list(batch: list[Any]) -> list[Any]:
    return batch


def test_corrupt_jpeg_names_the_file(tmp_path: Path, record: Callable[..., None], fast_worker_shutdown: None) -> None:
    pytest.importorskip("PIL")
    trials = FAULTS["corrupt-jpeg"].trials_short
    good = _jpeg(0)
    bad = {"truncated": good[: len(good) // 2], "garbage": os.urandom(2000), "empty": b""}
    assert len(bad) == trials
    seen = []
    for kind, data in bad.items():
        root = tmp_path / kind
        root.mkdir()
        for i in range(6):
            (root / f"ok{i}.jpg").write_bytes(_jpeg(i))
        (root / "bad.jpg").write_bytes(data)
        ds = fastload.FileDataset(str(root), transform=decode_jpeg, settings=Settings(cache_dir=tmp_path / "cache"))
        bad_url = next(i.url for i in ds.items if i.url.endswith("bad.jpg"))
        for workers in (0, 2):
            loader = fastload.DataLoader(ds, batch_size=2, num_workers=workers, collate_fn=as_list)
            with pytest.raises(OSError) as info:  # PIL's own error type (UnidentifiedImageError is an OSError)
                list(loader)
            text = "".join(traceback.format_exception(info.value))
            # The note names the file and that the transform raised, blaming neither.
            assert f"the transform raised {type(info.value).__name__} on {bad_url}" in text, text[-2000:]
            assert "the file may be bad, or the transform may not handle it" in text, text[-2000:]
            seen.append(type(info.value).__name__)
            # The traceback keeps the failed iterator (and its workers) alive; end it
            # here, not in a gc pass inside some reader thread later.
            del info, loader
            gc.collect()
    # The decode stage itself (fastload.pipelines, torch backend on CPU): a DecodeError
    # naming the file, or the sample skipped and counted.
    pipelines = pytest.importorskip("fastload.pipelines")
    skipped = 0
    for kind in bad:
        ds = fastload.FileDataset(str(tmp_path / kind), label=lambda rel: 0, settings=Settings(cache_dir=tmp_path / "cache"))
        bad_url = next(i.url for i in ds.items if i.url.endswith("bad.jpg"))

        def pipe(on_error: str) -> Any:
            return pipelines.ImageClassification(train=False, size=16, device="cpu", backend="torch", on_error=on_error, threads=1)

        with pytest.raises(DecodeError, match=rf"cannot decode sample \d+ of the batch \({re.escape(bad_url)}\).*fix:"):
            list(fastload.DataLoader(ds, batch_size=7, collate_fn=pipe("raise")))
        loader = fastload.DataLoader(ds, batch_size=7, collate_fn=pipe("skip"))
        (batch,) = list(loader)
        assert batch["image"].shape[0] == 6 and bad_url not in batch["url"]
        skipped += loader.stats().counters.get("decode_skipped", 0)
    assert skipped == len(bad)
    record(
        "corrupt-jpeg", trials,
        f"pass: truncated, garbage and empty JPEGs: with a user transform, PIL's own error "
        f"({', '.join(sorted(set(seen)))}) with a note naming the URL and that the transform raised there, in the loader's threads "
        "and from 2 workers; through fastload.pipelines.ImageClassification (torch backend, CPU), a "
        "DecodeError naming the URL and the fix, or with on_error='skip' the batch without it and "
        f"decode_skipped={skipped}",
    )  # fmt: skip


# -- wrong dtype / shape metadata --------------------------------------------------------------


def _npy(header: str, body: bytes) -> bytes:
    h = header.encode("latin1")
    h += b" " * (64 - (10 + len(h) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(h)) + h + body


def test_wrong_array_metadata_is_a_decode_error(tmp_path: Path, record: Callable[..., None]) -> None:
    trials = FAULTS["bad-array-meta"].trials_short
    settings = Settings(cache_dir=tmp_path / "cache")
    cases = {
        "shape larger than the file": _npy("{'descr': '<f4', 'fortran_order': False, 'shape': (1000, 4), }", bytes(64)),
        "shape that overflows int64": _npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 4611686018427387904, 4), }", bytes(64)),
        "object dtype (a pickle)": _npy("{'descr': '|O', 'fortran_order': False, 'shape': (2,), }", bytes(64)),
        "Fortran order": _npy("{'descr': '<f4', 'fortran_order': True, 'shape': (4, 4), }", bytes(64)),
        "not a .npy header": b"NOTNUMPY" + bytes(100),
    }
    outcomes = []
    for i, (what, data) in enumerate(cases.items()):
        path = tmp_path / f"a{i}.npy"
        path.write_bytes(data)
        with pytest.raises(DecodeError, match=r"fix:|check dtype") as info:
            ds = fastload.ArrayDataset(str(path), settings=settings)
            ds[0]
        assert path.name in str(info.value), info.value
        outcomes.append(what)
    (tmp_path / "tokens.bin").write_bytes(bytes(1001))
    with pytest.raises(DecodeError, match=r"tokens\.bin: 1001 B is not a whole number of int32 tokens; check dtype="):
        fastload.TokenDataset(str(tmp_path / "tokens.bin"), 8, dtype="int32", settings=settings)
    outcomes.append("token file of the wrong dtype")
    assert len(outcomes) == trials
    record(
        "bad-array-meta", trials,
        f"pass: {trials} files ({'; '.join(outcomes)}), each a DecodeError naming the file and the fix",
    )  # fmt: skip
