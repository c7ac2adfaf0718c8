"""Datasets over cached URLs: labels, arrays, token windows, tar shards, listing once."""

from __future__ import annotations

import io
import os
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from fastload.config import Settings
from fastload.dataset import ArrayDataset, FileDataset, TarDataset, TokenDataset
from fastload.errors import DecodeError, EmptyDatasetError


@pytest.fixture()
def settings(tmp_path: Path) -> Settings:
    return Settings(cache_dir=tmp_path / "cache", block_bytes=64 * 1024)


def image_folder(root: Path) -> dict[str, bytes]:
    files = {}
    for cls in ["zebra", "ant", "Bee"]:
        for i in range(3):
            rel = f"{cls}/{i}.jpg"
            (root / cls).mkdir(parents=True, exist_ok=True)
            data = f"{cls}-{i}".encode() * 100
            (root / rel).write_bytes(data)
            files[rel] = data
    (root / "README.txt").write_text("not an image")
    return files


def test_file_dataset_labels_like_imagefolder(tmp_path: Path, settings: Settings) -> None:
    files = image_folder(tmp_path / "train")
    ds = FileDataset(str(tmp_path / "train"), pattern="**/*.jpg", label="parent", settings=settings)
    assert ds.classes == ["Bee", "ant", "zebra"]  # sorted() order, as torchvision's ImageFolder
    assert len(ds) == 9
    for i in range(len(ds)):
        sample = ds[i]
        rel = sample["url"].split("/train/", 1)[1]
        assert sample["data"] == files[rel]
        assert sample["label"] == ds.class_to_idx[rel.split("/")[0]]


def test_file_dataset_lists_once_and_works_in_torch_workers(tmp_path: Path, settings: Settings) -> None:
    image_folder(tmp_path / "train")
    ds = FileDataset(str(tmp_path / "train"), pattern="**/*.jpg", label="parent", settings=settings)
    (tmp_path / "train" / "ant" / "late.jpg").write_bytes(b"added after listing")
    again = FileDataset(str(tmp_path / "train"), pattern="**/*.jpg", label="parent", settings=settings)
    assert len(again) == len(ds)  # the recorded listing is reused, not re-listed
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, collate_fn=lambda b: b)
    got = sorted(s["url"] for batch in loader for s in batch)
    assert got == sorted(i.url for i in ds.items)


def test_transform_runs_on_cpu(tmp_path: Path, settings: Settings) -> None:
    image_folder(tmp_path / "train")
    ds = FileDataset(str(tmp_path / "train"), pattern="**/*.jpg", transform=len, settings=settings)
    assert ds[0]["data"] == len(b"Bee-0") * 100 and "label" not in ds[0]


def test_array_dataset_rows_of_one_npy(tmp_path: Path, settings: Settings) -> None:
    arr = np.arange(500 * 7 * 3, dtype=np.float32).reshape(500, 7, 3)
    np.save(tmp_path / "feats.npy", arr)
    ds = ArrayDataset(str(tmp_path / "feats.npy"), settings=settings)
    assert len(ds) == 500
    for i in (0, 1, 250, 499, -1):
        np.testing.assert_array_equal(ds[i]["data"], arr[i])


def test_array_dataset_one_npy_per_sample(tmp_path: Path, settings: Settings) -> None:
    (tmp_path / "arrs").mkdir()
    arrays = [np.full((4, 5), i, dtype=np.uint8) for i in range(6)]
    for i, a in enumerate(arrays):
        np.save(tmp_path / "arrs" / f"{i}.npy", a)
    ds = ArrayDataset(str(tmp_path / "arrs"), settings=settings)
    assert [int(ds[i]["data"][0, 0]) for i in range(len(ds))] == list(range(6))


def test_object_arrays_are_refused_never_unpickled(tmp_path: Path, settings: Settings) -> None:
    np.save(tmp_path / "evil.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(DecodeError, match="never unpickles"):
        ArrayDataset(str(tmp_path / "evil.npy"), settings=settings)


def test_token_windows_match_numpy(tmp_path: Path, settings: Settings) -> None:
    tokens = np.random.default_rng(0).integers(0, 50_000, 100_003, dtype=np.int32)
    tokens.tofile(tmp_path / "tokens.bin")
    ds = TokenDataset(str(tmp_path / "tokens.bin"), seq_len=2049, dtype="int32", settings=settings)
    assert len(ds) == (100_003 - 2049) // 2049 + 1
    for i in (0, 1, len(ds) - 1):
        np.testing.assert_array_equal(ds[i]["data"], tokens[i * 2049 : i * 2049 + 2049])
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_a_token_file_shorter_than_one_window_is_an_empty_dataset(tmp_path: Path, settings: Settings) -> None:
    np.arange(1000, dtype=np.int32).tofile(tmp_path / "tokens.bin")
    with pytest.raises(EmptyDatasetError, match=r"tokens\.bin: 1000 int32 tokens \(4000 B\), fewer than one window of seq_len=10000000"):
        TokenDataset(str(tmp_path / "tokens.bin"), seq_len=10**7, dtype="int32", settings=settings)
    assert len(TokenDataset(str(tmp_path / "tokens.bin"), seq_len=1000, dtype="int32", settings=settings)) == 1


def tar_bytes(members: list[tuple[str, bytes, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data, kind in members:
            info = tarfile.TarInfo(name)
            if kind == b"link":
                info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_tar_dataset_groups_members_and_never_trusts_paths(tmp_path: Path, settings: Settings) -> None:
    (tmp_path / "shards").mkdir()
    img = os.urandom(3000)
    (tmp_path / "shards" / "s0.tar").write_bytes(tar_bytes([
        ("a/000.jpg", img, b""), ("a/000.cls", b"3", b""),
        ("../../escape.jpg", b"evil", b""), ("../../escape.cls", b"0", b""),
        ("/abs/001.jpg", img, b""), ("/abs/001.cls", b"1", b""),
        ("link.jpg", b"", b"link"),
    ]))
    ds = TarDataset(str(tmp_path / "shards"), settings=settings)
    keys = {ds[i]["__key__"]: ds[i] for i in range(len(ds))}
    assert keys["a/000"]["jpg"] == img and keys["a/000"]["cls"] == b"3"
    assert keys["../../escape"]["jpg"] == b"evil"  # just a string key, never a path
    assert "link" not in keys  # symlink members are skipped
    assert set(os.listdir(tmp_path)) == {"shards", "cache"} and not (tmp_path.parent / "escape.jpg").exists()


def test_a_truncated_tar_shard_is_a_decode_error_naming_the_shard_and_offset(tmp_path: Path, settings: Settings) -> None:
    # tarfile stops quietly at a cut header and never reads members' data: a shard cut in
    # half yielded its samples, the last one missing members, with no error.
    (tmp_path / "shards").mkdir()
    whole = tar_bytes([(f"{k:03d}.{ext}", os.urandom(2000), b"") for k in range(6) for ext in ("jpg", "cls")])
    for cut in (len(whole) // 2, 2560 * 2 + 100, 2560 * 2):  # in a member's data, in a header, at a header
        shutil.rmtree(tmp_path / "cache", ignore_errors=True)
        (tmp_path / "shards" / "s0.tar").write_bytes(whole[:cut])
        with pytest.raises(DecodeError, match=rf"s0\.tar: tar shard truncated at byte \d+ of {cut}"):
            TarDataset(str(tmp_path / "shards"), settings=settings)
    (tmp_path / "shards" / "s0.tar").write_bytes(whole)
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)
    assert len(TarDataset(str(tmp_path / "shards"), settings=settings)) == 6


def test_a_tar_sample_missing_a_member_names_the_shard_key_and_member(tmp_path: Path, settings: Settings) -> None:
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "s0.tar").write_bytes(tar_bytes([
        ("000.jpg", b"a", b""), ("000.cls", b"0", b""), ("001.jpg", b"b", b""), ("002.jpg", b"c", b""), ("002.cls", b"2", b""),
    ]))
    ds = TarDataset(str(tmp_path / "shards"), settings=settings)
    assert ds[0]["cls"] == b"0" and ds[2]["cls"] == b"2"
    with pytest.raises(DecodeError, match=r"s0\.tar: sample '001' has no 'cls' member"):
        ds[1]


def test_corrupt_tar_shard_names_the_url(tmp_path: Path, settings: Settings) -> None:
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "bad.tar").write_bytes(b"\x00garbage" * 200)
    with pytest.raises(DecodeError, match=r"bad\.tar"):
        TarDataset(str(tmp_path / "shards"), settings=settings)
