"""fastload.samples: deterministic, realistic sample data."""

from __future__ import annotations

import io
import sys
import tarfile
from pathlib import Path

import lz4.block
import numpy as np
import pytest

from fastload import samples

Image = pytest.importorskip("PIL.Image", reason="needs Pillow: pip install 'fastload[samples]'")
pytest.importorskip(
    "sklearn.datasets", reason="needs scikit-learn: pip install 'fastload[samples]'"
)


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_image_folder_layout_is_class_folders_numbered_from_one(tmp_path):
    paths = samples.make_image_folder(tmp_path, n=11, classes=4, size=(64, 48))

    assert paths == sorted(paths)
    assert [p.relative_to(tmp_path).as_posix() for p in paths] == [
        "class_00/00001.jpg", "class_00/00005.jpg", "class_00/00009.jpg",
        "class_01/00002.jpg", "class_01/00006.jpg", "class_01/00010.jpg",
        "class_02/00003.jpg", "class_02/00007.jpg", "class_02/00011.jpg",
        "class_03/00004.jpg", "class_03/00008.jpg",
    ]  # fmt: skip
    with Image.open(paths[0]) as image:
        assert (image.format, image.mode, image.size) == ("JPEG", "RGB", (64, 48))


def test_image_folder_is_byte_identical_per_seed_and_prefix_stable(tmp_path):
    first = samples.make_image_folder(tmp_path / "a", n=6, classes=3, size=(120, 90))
    samples.make_image_folder(tmp_path / "b", n=6, classes=3, size=(120, 90))
    samples.make_image_folder(tmp_path / "c", n=4, classes=3, size=(120, 90))
    samples.make_image_folder(tmp_path / "d", n=6, classes=3, size=(120, 90), seed=1)

    a, b, c, d = (_tree_bytes(tmp_path / x) for x in "abcd")
    assert len(first) == 6 and a == b
    assert c == {k: v for k, v in a.items() if k in c} and len(c) == 4
    assert all(a[k] != d[k] for k in a)


def test_default_images_average_about_100_kb_and_look_like_photos(tmp_path):
    paths = samples.make_image_folder(tmp_path, n=20)

    sizes = [p.stat().st_size for p in paths]
    assert 70_000 < np.mean(sizes) < 130_000
    for path in paths[:5]:
        pixels = np.asarray(Image.open(path), dtype=np.int16)
        assert pixels.shape == (375, 500, 3)
        # Neighbouring pixels of a photo are close (6-34 here); uniform noise differs by ~85.
        assert np.abs(np.diff(pixels, axis=1)).mean() < 40
        assert pixels.std() > 20  # and it is not a flat colour either


def test_image_folder_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="n must be"):
        samples.make_image_folder(tmp_path, n=-1)
    with pytest.raises(ValueError, match="classes must be"):
        samples.make_image_folder(tmp_path, classes=0)
    with pytest.raises(ValueError, match="quality must be in 1..100, got 0"):
        samples.make_image_folder(tmp_path, quality=0)
    with pytest.raises(ValueError, match="size must be"):
        samples.make_image_folder(tmp_path, size=(0, 10))


def test_missing_pillow_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "PIL", None)  # makes `import PIL` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'fastload\[samples\]'"):
        samples.make_image_folder(tmp_path, n=1)


def test_uint8_arrays_are_real_crops_and_deterministic(tmp_path):
    paths = samples.make_uint8_arrays(tmp_path / "a", n=3, shape=(32, 48, 3))
    again = samples.make_uint8_arrays(tmp_path / "b", n=3, shape=(32, 48, 3))
    grey = samples.make_uint8_arrays(tmp_path / "g", n=1, shape=(32, 48))

    assert [p.name for p in paths] == ["00001.npy", "00002.npy", "00003.npy"]
    assert [p.read_bytes() for p in paths] == [p.read_bytes() for p in again]
    arrays = [np.load(p, allow_pickle=False) for p in paths]
    assert {(a.shape, a.dtype.name) for a in arrays} == {((32, 48, 3), "uint8")}
    assert not np.array_equal(arrays[0], arrays[1])
    assert np.load(grey[0]).shape == (32, 48)
    with pytest.raises(ValueError, match="shape must be"):
        samples.make_uint8_arrays(tmp_path, n=1, shape=(32, 48, 4))


def test_token_file_is_zipf_like_raw_and_deterministic(tmp_path):
    n = 200_000
    path = samples.make_token_file(tmp_path / "tok.bin", n)
    again = samples.make_token_file(tmp_path / "again.bin", n)
    prefix = samples.make_token_file(tmp_path / "prefix.bin", 1000)

    raw = path.read_bytes()
    assert len(raw) == 4 * n and raw == again.read_bytes()
    assert raw[:4000] == prefix.read_bytes()
    ids = np.frombuffer(raw, dtype="<i4")
    assert ids.min() >= 0 and ids.max() < 32000
    counts = np.bincount(ids, minlength=32000)
    # Zipf: the most frequent id is far above uniform (n / 32000 ~ 6), ranks fall off.
    assert counts[0] > 1000 * n / 32000
    assert counts[0] > counts[10] > counts[1000]
    # The cache's codec is LZ4 block: uniform int32 ids in 0..31999 give ~1.02, these ~1.5.
    assert len(raw) / len(lz4.block.compress(raw, store_size=False)) > 1.3


def test_token_file_dtypes(tmp_path):
    small = samples.make_token_file(tmp_path / "u16.bin", 10, dtype="uint16")
    assert small.stat().st_size == 20
    with pytest.raises(ValueError, match="int8 holds ids up to 127"):
        samples.make_token_file(tmp_path / "x.bin", 10, dtype="int8")
    with pytest.raises(ValueError, match="integer type"):
        samples.make_token_file(tmp_path / "x.bin", 10, dtype="float32")


def test_tar_shards_are_webdataset_style_and_deterministic(tmp_path):
    files = samples.make_image_folder(tmp_path / "img", n=7, classes=3, size=(40, 30))

    shards = samples.make_tar_shards(tmp_path / "a", files, per_shard=3)
    again = samples.make_tar_shards(tmp_path / "b", files, per_shard=3)

    assert [s.name for s in shards] == ["shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]
    assert [s.read_bytes() for s in shards] == [s.read_bytes() for s in again]
    members = []
    for shard in shards:
        with tarfile.open(shard) as tar:
            for info in tar.getmembers():
                members.append((info.name, tar.extractfile(info).read(), info.mtime))
    assert [m[0] for m in members[:4]] == ["000000.jpg", "000000.cls", "000001.jpg", "000001.cls"]
    assert len(members) == 14 and {m[2] for m in members} == {0}
    for k, path in enumerate(files):
        assert members[2 * k][1] == path.read_bytes()
        assert members[2 * k + 1][1] == str(int(path.parent.name[-2:])).encode()
    with Image.open(io.BytesIO(members[0][1])) as image:
        assert image.size == (40, 30)


def test_tar_shards_take_explicit_labels(tmp_path):
    files = [tmp_path / "x.bin", tmp_path / "y.bin"]
    for f in files:
        f.write_bytes(f.name.encode())

    (shard,) = samples.make_tar_shards(tmp_path / "out", files, labels=[7, 3])

    with tarfile.open(shard) as tar:
        assert tar.getnames() == ["000000.bin", "000000.cls", "000001.bin", "000001.cls"]
        assert tar.extractfile("000001.cls").read() == b"3"
    with pytest.raises(ValueError, match="got 1 labels for 2 files"):
        samples.make_tar_shards(tmp_path / "out", files, labels=[1])
