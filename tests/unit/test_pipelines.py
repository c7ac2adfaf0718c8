"""fastload.pipelines on the CPU: real DALI (device_id=None) and the torch backend, on real photos.

DALI tests skip, with the reason, where nvidia-dali is not installed; ``make test``
installs it, so CI runs them. The GPU paths are in tests/gpu/test_pipelines_gpu.py.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fastload import codec
from fastload.config import Settings
from fastload.dataset import FileDataset
from fastload.errors import ConfigError, DecodeError
from fastload.loader.dataloader import DataLoader
from fastload.pipelines import (
    ArrayPipeline,
    CompressedArrayDataset,
    ImageClassification,
    Payload,
    _registry,
    available,
)
from fastload.samples import make_image_folder, make_uint8_arrays
from fastload.stats import StatsCollector, use_collector

HAS_DALI = available("dali")
needs_dali = pytest.mark.skipif(
    not HAS_DALI, reason="nvidia-dali not installed (pip install 'fastload[dali]'; make test installs it)"
)
BACKENDS = [pytest.param("dali", marks=needs_dali), "torch"]

# Measured dali-vs-torch agreement of the val transforms on these photos (docs/pipelines.md):
# decode is bit-identical (both libjpeg-turbo); the antialiased bilinear resizes differ
# only in rounding, so no pixel differs by more than 1 level of 255 and the mean
# difference is ~0.14 levels. The bounds leave a little room, nothing more.
AGREE_MAX_LEVELS = 1.0 + 1e-3
AGREE_MEAN_LEVELS = 0.25
STD255 = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255


@pytest.fixture(autouse=True)
def _own_collector() -> Any:
    """Record into a private collector: the process-wide default stays clean for other tests."""
    with use_collector(StatsCollector()) as col:
        yield col


@pytest.fixture(scope="module")
def photo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("photos")
    make_image_folder(root / "train", n=24, classes=4)
    return root / "train"


@pytest.fixture(scope="module")
def samples(photo_dir: Path) -> list[dict[str, Any]]:
    paths = sorted(photo_dir.glob("*/*.jpg"))
    return [{"data": p.read_bytes(), "label": int(p.parent.name[-2:]), "url": str(p)} for p in paths]


def _val(backend: str, **kw: Any) -> ImageClassification:
    return ImageClassification(train=False, device="cpu", backend=backend, threads=2, **kw)


def _train(backend: str, **kw: Any) -> ImageClassification:
    return ImageClassification(train=True, device="cpu", backend=backend, threads=2, **kw)


# -- backend selection ---------------------------------------------------------------


def test_backend_selection() -> None:
    assert _val("torch").backend == "torch"
    assert _val("auto").backend == ("dali" if HAS_DALI else "torch")
    # arrays gain nothing from DALI without a GPU (its inflate is GPU-only)
    assert ArrayPipeline(device="cpu").backend == "torch"
    with pytest.raises(ConfigError, match="backend='tensorflow'"):
        _val("tensorflow")
    with pytest.raises(ConfigError, match="dtype"):
        _val("torch", dtype="float64")
    with pytest.raises(ConfigError, match="resize=100 is smaller than size=224"):
        _val("torch", resize=100)


def test_missing_dali_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    gone = _registry.Optional_("fastload_tests_no_such_module", "pip install 'fastload[dali]'")
    monkeypatch.setitem(_registry.OPTIONAL, "dali", gone)
    monkeypatch.setattr(_registry, "_loaded", {})
    monkeypatch.setattr(_registry, "_failed", {})
    with pytest.raises(ImportError, match=r"pip install 'fastload\[dali\]'"):
        _val("dali")
    assert _val("auto").backend == "torch"  # auto falls back instead of failing
    assert not available("dali")


def test_broken_optional_import_is_an_import_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # torchvision built for another torch fails on import with RuntimeError, not ImportError.
    (tmp_path / "fastload_tests_broken.py").write_text("raise RuntimeError('operator does not exist')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(_registry.OPTIONAL, "torchvision.io", _registry.Optional_("fastload_tests_broken", "hint"))
    monkeypatch.setattr(_registry, "_loaded", {})
    monkeypatch.setattr(_registry, "_failed", {})
    assert not available("torchvision.io")
    with pytest.raises(ImportError, match="RuntimeError: operator does not exist"):
        _registry.load("torchvision.io")


# -- transforms ----------------------------------------------------------------------


@needs_dali
@pytest.mark.parametrize("dtype", ["float32", "uint8"])
def test_val_backends_agree(samples: list[dict[str, Any]], dtype: str) -> None:
    a = _val("dali", dtype=dtype)(samples)
    b = _val("torch", dtype=dtype)(samples)
    assert a["image"].shape == b["image"].shape == (len(samples), 3, 224, 224)
    assert a["image"].dtype == b["image"].dtype
    diff = (a["image"].float() - b["image"].float()).abs()
    if dtype == "float32":
        diff = diff * STD255  # back to pixel levels
    assert diff.max().item() <= AGREE_MAX_LEVELS
    assert diff.mean().item() <= AGREE_MEAN_LEVELS
    assert torch.equal(a["label"], b["label"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_train_is_deterministic(samples: list[dict[str, Any]], backend: str) -> None:
    runs = [_train(backend, seed=7) for _ in range(2)]
    first = [r(samples[:12])["image"] for r in runs]
    second = [r(samples[12:])["image"] for r in runs]
    assert torch.equal(first[0], first[1]) and torch.equal(second[0], second[1])
    other = _train(backend, seed=8)(samples[:12])["image"]
    assert not torch.equal(first[0], other)
    assert first[0].shape == (12, 3, 224, 224)
    # train crops differ from the deterministic val crop
    assert not torch.equal(first[0], _val(backend)(samples[:12])["image"])


def test_torch_train_draws_do_not_depend_on_threads(samples: list[dict[str, Any]]) -> None:
    one = ImageClassification(train=True, device="cpu", backend="torch", seed=5, threads=1)(samples)
    four = ImageClassification(train=True, device="cpu", backend="torch", seed=5, threads=4)(samples)
    assert torch.equal(one["image"], four["image"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_dtypes_and_layouts(samples: list[dict[str, Any]], backend: str) -> None:
    batch = samples[:4]
    ref = _val(backend)(batch)["image"]
    assert ref.dtype == torch.float32
    for dtype, tol in (("float16", 2e-2), ("bfloat16", 5e-2)):
        out = _val(backend, dtype=dtype)(batch)["image"]
        assert out.dtype == getattr(torch, dtype)
        assert (out.float() - ref).abs().max().item() <= tol
    raw = _val(backend, dtype="uint8")(batch)["image"]
    assert raw.dtype == torch.uint8
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255
    assert ((raw.float() - mean) / STD255 - ref).abs().max().item() <= 1e-4  # uint8 = un-normalized
    hwc = _val(backend, layout="HWC")(batch)["image"]
    assert hwc.shape == (4, 224, 224, 3)
    assert torch.equal(hwc, ref.permute(0, 2, 3, 1))
    small = _val(backend, size=96, resize=110, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))(batch)["image"]
    assert small.shape == (4, 3, 96, 96) and -1.0 <= small.min() and small.max() <= 1.0


@needs_dali
def test_dali_outputs_outlive_the_next_run(samples: list[dict[str, Any]]) -> None:
    pipe = _val("dali")
    kept = pipe(samples[:6])["image"]
    snapshot = kept.clone()
    for _ in range(3):
        pipe(samples[6:12])
    assert torch.equal(kept, snapshot)


@needs_dali
def test_dali_outputs_are_copied_into_torch_memory() -> None:
    # A DLPack view would leave the buffer in DALI's hands, which frees it in its own
    # stream's order; to_torch copies into a tensor torch allocated (the GPU test
    # test_dali_outputs_survive_the_next_run_while_torch_is_busy checks the stream side).
    from fastload.pipelines import _dali

    runner = _dali.DaliRunner(_dali.array_graph, {"placement": "cpu"}, device_index=None, threads=1, seed=0)
    rows = [np.arange(6, dtype=np.uint8) + i for i in range(3)]
    (batch,) = runner.run({"payload": rows})
    out = _dali.to_torch(batch)
    assert out.dtype == torch.uint8 and torch.equal(out, torch.from_numpy(np.stack(rows)))
    assert out.data_ptr() != batch.as_tensor().data_ptr()
    assert out.untyped_storage().resizable()  # allocated by torch, not wrapped from DLPack


def test_tuple_and_tar_style_samples(samples: list[dict[str, Any]]) -> None:
    pipe = _val("torch")
    ref = pipe(samples[:3])
    tuples = pipe([(s["data"], s["label"]) for s in samples[:3]])
    assert torch.equal(tuples["image"], ref["image"]) and torch.equal(tuples["label"], ref["label"])
    assert "url" not in tuples
    tar = _val("torch", image_key="jpg", label_key="cls")(
        [{"jpg": s["data"], "cls": str(s["label"]).encode(), "__url__": s["url"]} for s in samples[:3]]
    )
    assert torch.equal(tar["label"], ref["label"]) and tar["url"] == ref["url"]
    with pytest.raises(ConfigError, match="has no 'data' field"):
        pipe([{"jpg": samples[0]["data"]}])


def test_pickles_settings_not_handles(samples: list[dict[str, Any]]) -> None:
    pipe = _train("torch", seed=3, dtype="float16")
    pipe(samples[:2])  # starts its thread pool
    clone = pickle.loads(pickle.dumps(pipe))
    assert repr(clone) == repr(pipe)
    assert torch.equal(clone(samples[:4])["image"], _train("torch", seed=3, dtype="float16")(samples[:4])["image"])


# -- bad input -----------------------------------------------------------------------


def _corrupt(samples: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    batch = [dict(s) for s in samples[:5]]
    data = batch[2]["data"]
    if kind == "truncated":
        batch[2]["data"] = data[: len(data) // 2]
    elif kind == "garbage":
        batch[2]["data"] = data[:2] + bytes(len(data) - 2)  # a JPEG start marker, then zeros
    else:
        batch[2]["data"] = b""
    batch[2]["url"] = f"s3://bucket/bad-{kind}.jpg"
    return batch


@pytest.mark.parametrize("kind", ["truncated", "garbage", "empty"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_image_raises_naming_the_url(samples: list[dict[str, Any]], backend: str, kind: str) -> None:
    with pytest.raises(DecodeError, match=f"sample 2 of the batch \\(s3://bucket/bad-{kind}.jpg\\)"):
        _val(backend)(_corrupt(samples, kind))


@pytest.mark.parametrize("kind", ["truncated", "garbage", "empty"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_image_skipped_and_counted(samples: list[dict[str, Any]], backend: str, kind: str) -> None:
    batch = _corrupt(samples, kind)
    col = StatsCollector()
    with use_collector(col):
        out = _val(backend, on_error="skip")(batch)
    good = [s for i, s in enumerate(batch) if i != 2]
    ref = _val(backend)(good)
    assert out["image"].shape[0] == 4
    assert torch.equal(out["image"], ref["image"])
    assert out["label"].tolist() == [s["label"] for s in good]  # labels stay with their images
    assert out["url"] == [s["url"] for s in good]
    snap = col.snapshot()
    assert snap.counters["decode_skipped"] == 1
    assert snap.ops["decode"].items == 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_bad_gives_an_empty_batch(samples: list[dict[str, Any]], backend: str) -> None:
    out = _val(backend, on_error="skip", dtype="float16")([{"data": b"\xff\xd8junk", "label": 1, "url": "u"}])
    assert out["image"].shape == (0, 3, 224, 224) and out["image"].dtype == torch.float16
    assert out["label"].shape == (0,) and out["url"] == []


# -- through the DataLoader ----------------------------------------------------------


def test_loader_collate_with_shuffle_and_resume(photo_dir: Path, tmp_path: Path) -> None:
    settings = Settings(cache_dir=tmp_path / "cache")
    ds = FileDataset(str(photo_dir), pattern="**/*.jpg", label="parent", settings=settings)

    def loader() -> DataLoader:
        pipe = ImageClassification(train=False, size=64, resize=72, device="cpu", threads=2)
        return DataLoader(ds, batch_size=5, shuffle=True, seed=3, collate_fn=pipe)

    full = list(loader())
    assert len(full) == 5 and full[-1]["image"].shape == (4, 3, 64, 64)
    urls = [u for b in full for u in b["url"]]
    assert sorted(urls) == sorted(i.url for i in ds.items)  # a permutation: shuffled, all there
    assert urls != [i.url for i in ds.items]
    for b in full:  # labels travel with images: each label is its file's class folder
        assert b["label"].tolist() == [ds.class_to_idx[u.rsplit("/", 2)[-2]] for u in b["url"]]

    first = loader()
    it = iter(first)
    next(it), next(it)
    state = first.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == 3
    for got, want in zip(rest, full[2:]):
        assert got["url"] == want["url"]
        assert torch.equal(got["label"], want["label"]) and torch.equal(got["image"], want["image"])
    assert resumed.stats().ops["decode"].items == 14


# -- arrays: LZ4 payloads ------------------------------------------------------------


@pytest.fixture
def array_ds(tmp_path: Path) -> CompressedArrayDataset:
    make_uint8_arrays(tmp_path / "arrs", n=10, shape=(224, 224, 3))
    # 32 KiB chunks: an LZ4 payload holds 5 blocks, the last one short. Photo crops
    # compress by 6-19%, so 9 of these 10 are stored LZ4 and one raw (a mixed batch).
    settings = Settings(cache_dir=tmp_path / "cache", chunk_bytes=32768)
    return CompressedArrayDataset(str(tmp_path / "arrs"), settings=settings)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lz4_array_round_trip_is_bit_exact(array_ds: CompressedArrayDataset, tmp_path: Path, backend: str) -> None:
    samples = [array_ds[i] for i in range(len(array_ds))]
    infos = [codec.parse_header(s["payload"].data) for s in samples]
    lz4 = [i for i in infos if i.codec == codec.LZ4]
    assert len(lz4) >= 8 and all(len(i.chunk_sizes) == 5 for i in lz4)  # shipped compressed
    assert sum(len(s["payload"].data) for s in samples) < 0.95 * sum(i.raw_size for i in infos)
    out = ArrayPipeline(device="cpu", backend=backend, threads=2)(samples)
    want = np.stack([np.load(tmp_path / "arrs" / f"{i + 1:05d}.npy") for i in range(len(samples))])
    assert out["data"].dtype == torch.uint8 and out["data"].shape == (10, 224, 224, 3)
    assert np.array_equal(out["data"].numpy(), want)
    assert out["index"].tolist() == list(range(10))
    half = ArrayPipeline(device="cpu", backend=backend, dtype="float16")(samples[:3])["data"]
    assert half.dtype == torch.float16 and torch.equal(half, torch.from_numpy(want[:3]).half())


def test_compressed_dataset_through_the_loader(array_ds: CompressedArrayDataset, tmp_path: Path) -> None:
    loader = DataLoader(array_ds, batch_size=4, shuffle=True, seed=1, collate_fn=ArrayPipeline(device="cpu"))
    seen = {}
    for batch in loader:
        for idx, row in zip(batch["index"].tolist(), batch["data"]):
            seen[idx] = row.numpy()
    assert sorted(seen) == list(range(10))
    for idx, row in seen.items():
        assert np.array_equal(row, np.load(tmp_path / "arrs" / f"{idx + 1:05d}.npy"))
    cold = loader.stats().counters
    # Each payload counted once: a miss fetched (and stored) is not also a hit when it is read
    # back (one file was read when the dataset learnt its dtype, so it hits).
    assert cold.get("cache_miss", 0) + cold.get("cache_hit", 0) == 10 and cold["cache_miss"] >= 9
    loader.reset_stats()
    assert sum(len(b["index"]) for b in loader) == 10
    assert loader.stats().cache_hit_rate == 1.0


def test_decoded_arrays_are_batched_and_cast() -> None:
    samples = [{"data": np.full((2, 3), i, np.int32), "label": i, "url": f"u{i}"} for i in range(3)]
    out = ArrayPipeline(device="cpu", backend="torch", dtype="int64")(samples)
    assert out["data"].dtype == torch.int64 and out["data"][:, 0, 0].tolist() == [0, 1, 2]
    assert out["label"].tolist() == [0, 1, 2] and out["url"] == ["u0", "u1", "u2"]
    with pytest.raises(ConfigError, match="differ in dtype/shape"):
        ArrayPipeline(device="cpu")([{"data": np.zeros(2)}, {"data": np.zeros(3)}])
    with pytest.raises(ConfigError, match="not a torch dtype"):
        ArrayPipeline(dtype="nope")


def _bad_payloads(array_ds: CompressedArrayDataset) -> tuple[list[dict[str, Any]], list[str]]:
    samples = [dict(array_ds[i]) for i in range(5)]
    p1, p3 = samples[1]["payload"], samples[3]["payload"]
    # 1: truncated, so the body is shorter than the header's chunk table says
    samples[1]["payload"] = Payload("s3://b/truncated.npy", p1.data[:-100], p1.dtype, p1.shape, p1.offset)
    # 3: an intact payload whose raw size disagrees with the array it should hold
    samples[3]["payload"] = Payload("s3://b/other-shape.npy", p3.data, p3.dtype, (224, 224, 4), p3.offset)
    return samples, ["s3://b/truncated.npy", "s3://b/other-shape.npy"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_payload_raises_naming_the_url(array_ds: CompressedArrayDataset, backend: str) -> None:
    samples, _ = _bad_payloads(array_ds)
    with pytest.raises(DecodeError, match=r"sample 1 of the batch \(s3://b/truncated.npy\).*body is"):
        ArrayPipeline(device="cpu", backend=backend)(samples)
    with pytest.raises(DecodeError, match=r"sample 2 of the batch \(s3://b/other-shape.npy\).*header says 150656 B raw"):
        ArrayPipeline(device="cpu", backend=backend)([s for i, s in enumerate(samples) if i != 1])
    flipped = dict(samples[0])
    p = flipped["payload"]
    body = bytearray(p.data)
    body[-5] ^= 0xFF  # a flipped bit in the last LZ4 chunk: caught by LZ4 or the checksum
    flipped["payload"] = Payload("s3://b/flipped.npy", bytes(body), p.dtype, p.shape, p.offset)
    with pytest.raises(DecodeError, match=r"s3://b/flipped.npy.*does not decode"):
        ArrayPipeline(device="cpu", backend=backend)([flipped])


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_payload_skipped_and_counted(array_ds: CompressedArrayDataset, backend: str) -> None:
    samples, _ = _bad_payloads(array_ds)
    col = StatsCollector()
    with use_collector(col):
        out = ArrayPipeline(device="cpu", backend=backend, on_error="skip")(samples)
    assert out["index"].tolist() == [0, 2, 4]
    assert col.snapshot().counters["decode_skipped"] == 2
    ref = ArrayPipeline(device="cpu", backend=backend)([samples[i] for i in (0, 2, 4)])
    assert torch.equal(out["data"], ref["data"])


def test_compressed_dataset_rejects_what_it_cannot_ship(tmp_path: Path) -> None:
    np.save(tmp_path / "one.npy", np.zeros((4, 3), np.uint8))
    with pytest.raises(ConfigError, match="needs one .npy per sample"):
        CompressedArrayDataset(str(tmp_path / "one.npy"), settings=Settings(cache_dir=tmp_path / "c"))
    (tmp_path / "big").mkdir()
    np.save(tmp_path / "big" / "a.npy", np.zeros(70000, np.uint8))
    with pytest.raises(ConfigError, match="exceed one cache block"):
        CompressedArrayDataset(str(tmp_path / "big"), settings=Settings(cache_dir=tmp_path / "c2", block_bytes=65536))


# -- public names and examples -------------------------------------------------------


def test_public_names_and_examples_run() -> None:
    import doctest

    import fastload.pipelines as pipelines
    from fastload.pipelines import array, image

    assert pipelines.__all__ == sorted(pipelines.__all__)
    assert all(getattr(pipelines, name) is not None for name in pipelines.__all__)
    for module in (image, array):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0, module.__name__
    doc = Path(__file__).resolve().parents[2] / "docs" / "pipelines.md"
    result = doctest.testfile(str(doc), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
