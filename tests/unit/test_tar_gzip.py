""".tar.gz / .tgz shards: decompressed once into the cache, read like a .tar (fastload.read.gunzip)."""

from __future__ import annotations

import gzip
import io
import random
import tarfile
from pathlib import Path

import pytest

from fastload.config import Settings
from fastload.dataset import TarDataset
from fastload.errors import DecodeError
from fastload.read import gunzip


def tar_shard(samples: int, seed: int, prefix: str) -> tuple[bytes, dict[str, dict[str, bytes]]]:
    rng = random.Random(seed)
    want: dict[str, dict[str, bytes]] = {}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for k in range(samples):
            key = f"{prefix}{k:04d}"
            for ext, data in (("jpg", rng.randbytes(2500 + k)), ("cls", str(k).encode())):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
                want.setdefault(key, {})[ext] = data
    return buf.getvalue(), want


def samples_of(ds: TarDataset) -> dict[str, dict[str, bytes]]:
    return {s["__key__"]: {k: v for k, v in s.items() if not k.startswith("__")} for s in ds.read_batch(range(len(ds)))}


@pytest.fixture
def decompressions(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real = gunzip._decompress

    def counted(reader, gz, size):  # type: ignore[no-untyped-def]
        calls.append(gz.url)
        return real(reader, gz, size)

    monkeypatch.setattr(gunzip, "_decompress", counted)
    return calls


@pytest.mark.parametrize("kept_bytes", [0, None])
def test_tar_gz_and_tgz_shards_read_like_their_tar(tmp_path: Path, kept_bytes: int | None, decompressions: list[str]) -> None:
    (tmp_path / "shards").mkdir()
    a, want_a = tar_shard(30, 0, "a")
    b, want_b = tar_shard(20, 1, "b")
    (tmp_path / "shards" / "a.tar.gz").write_bytes(gzip.compress(a))
    (tmp_path / "shards" / "b.tgz").write_bytes(gzip.compress(b))
    settings = Settings(cache_dir=tmp_path / "cache", block_bytes=8192)  # each tar spans many blocks
    urls = [str(tmp_path / "shards" / "a.tar.gz"), str(tmp_path / "shards" / "b.tgz")]
    ds = TarDataset(urls, settings=settings, kept_bytes=kept_bytes)
    assert samples_of(ds) == want_a | want_b
    assert ds[0]["__url__"].endswith("/a.tar.gz") and ds[len(ds) - 1]["__url__"].endswith("/b.tgz")
    assert len(decompressions) == 2
    again = TarDataset(urls, settings=settings, kept_bytes=kept_bytes)  # index and tar recorded: no decompression
    assert samples_of(again) == want_a | want_b and len(decompressions) == 2


def test_a_tar_gz_pattern_lists_gzip_shards(tmp_path: Path) -> None:
    (tmp_path / "shards").mkdir()
    a, want = tar_shard(5, 0, "a")
    (tmp_path / "shards" / "a.tar.gz").write_bytes(gzip.compress(a))
    ds = TarDataset(str(tmp_path / "shards"), pattern="**/*.tar.gz", settings=Settings(cache_dir=tmp_path / "cache"))
    assert samples_of(ds) == want


def test_dropped_decompressed_blocks_are_decompressed_again(tmp_path: Path, decompressions: list[str]) -> None:
    (tmp_path / "shards").mkdir()
    a, want = tar_shard(30, 0, "a")
    (tmp_path / "shards" / "a.tar.gz").write_bytes(gzip.compress(a))
    settings = Settings(cache_dir=tmp_path / "cache", block_bytes=8192)
    ds = TarDataset(str(tmp_path / "shards"), pattern="**/*.tar.gz", settings=settings, kept_bytes=0)
    tar = ds._tars[0]
    assert gunzip.is_tar_item(tar) and tar.size == len(a)
    for b in ds.reader.identity.blocks(tar):  # the cache drops the decompressed tar (eviction)
        assert ds.reader.cache.drop(ds.reader.identity.key(tar, b))
    assert samples_of(ds) == want and len(decompressions) == 2


def test_a_multi_member_gzip_is_sized_by_its_data_not_its_trailer(tmp_path: Path) -> None:
    # pigz and concatenated files: the trailer's size is the last member's only.
    (tmp_path / "shards").mkdir()
    a, want = tar_shard(30, 0, "a")
    cut = len(a) // 3
    (tmp_path / "shards" / "a.tar.gz").write_bytes(gzip.compress(a[:cut]) + gzip.compress(a[cut:]))
    ds = TarDataset(str(tmp_path / "shards"), pattern="**/*.tar.gz",
                    settings=Settings(cache_dir=tmp_path / "cache", block_bytes=8192))
    assert ds._tars[0].size == len(a) and samples_of(ds) == want


def test_a_bad_gzip_shard_is_a_decode_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "bad.tar.gz").write_bytes(b"\x1f\x8b\x08\x00" + b"not gzip at all" * 10)
    with pytest.raises(DecodeError, match=r"bad\.tar\.gz: not a readable gzip file"):
        TarDataset(str(tmp_path / "shards"), pattern="**/*.tar.gz", settings=Settings(cache_dir=tmp_path / "cache"))
