"""GPU paths of fastload.pipelines: DALI mixed decode, nvCOMP inflate, torchvision nvJPEG.

Each is checked against the CPU path that tests/unit/test_pipelines.py pins, on
the same real photos. Skipped (with the reason) without CUDA, and per test without
DALI or an importable torchvision.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fastload import codec
from fastload.config import Settings
from fastload.pipelines import (
    ArrayPipeline,
    CompressedArrayDataset,
    ImageClassification,
    _registry,
    available,
)
from fastload.samples import make_uint8_arrays

pytestmark = pytest.mark.gpu
needs_dali = pytest.mark.skipif(not available("dali"), reason="nvidia-dali not installed")
needs_torchvision = pytest.mark.skipif(not available("torchvision.io"), reason="torchvision does not import here")
STD255 = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255
# nvJPEG's IDCT, colour conversion and (on GPUs with hardware JPEG engines) chroma
# upsampling are not libjpeg-turbo's. torchvision's own GPU decode test
# (test/test_image.py::test_decode_jpeg_cuda) bounds only the mean absolute
# difference, below 2 levels, and no maximum; resizing only averages differences.
GPU_MEAN_LEVELS = 2.0


def _levels(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.float().cpu() - b.float().cpu()).abs() * STD255


def _check_close(gpu: dict[str, Any], cpu: dict[str, Any], record_property: Any) -> None:
    assert gpu["image"].device.type == "cuda" and gpu["label"].device.type == "cuda"
    diff = _levels(gpu["image"], cpu["image"])
    record_property("max_levels", round(diff.max().item(), 3))  # into gpu-check's report
    record_property("mean_levels", round(diff.mean().item(), 4))
    assert diff.mean().item() < GPU_MEAN_LEVELS
    assert torch.equal(gpu["label"].cpu(), cpu["label"])


@needs_dali
def test_dali_mixed_decode_matches_cpu(samples: list[dict[str, Any]], record_property: Any) -> None:
    gpu = ImageClassification(train=False, device="cuda", backend="dali")(samples)
    cpu = ImageClassification(train=False, device="cpu", backend="dali")(samples)
    _check_close(gpu, cpu, record_property)
    train = ImageClassification(train=True, device="cuda", backend="dali", seed=1, dtype="float16")
    out = train(samples)["image"]
    assert out.shape == (16, 3, 224, 224) and out.dtype == torch.float16 and out.is_cuda
    bad = [dict(s) for s in samples[:3]]
    bad[1]["data"] = bad[1]["data"][:1000]
    skipped = ImageClassification(train=False, device="cuda", backend="dali", on_error="skip")(bad)
    assert skipped["image"].shape[0] == 2 and skipped["url"] == [bad[0]["url"], bad[2]["url"]]


@needs_dali
def test_dali_inflate_round_trip_bit_exact(tmp_path: Path, sample_photos: None) -> None:
    make_uint8_arrays(tmp_path / "arrs", n=12, shape=(224, 224, 3))
    ds = CompressedArrayDataset(str(tmp_path / "arrs"), settings=Settings(cache_dir=tmp_path / "c", chunk_bytes=32768))
    samples = [ds[i] for i in range(len(ds))]
    assert sum(codec.parse_header(s["payload"].data).codec == codec.LZ4 for s in samples) >= 8
    pipe = ArrayPipeline(device="cuda", backend="dali")
    out = pipe(samples)
    want = np.stack([np.load(tmp_path / "arrs" / f"{i + 1:05d}.npy") for i in range(12)])
    assert out["data"].is_cuda and np.array_equal(out["data"].cpu().numpy(), want)
    half = ArrayPipeline(device="cuda", backend="dali", dtype="float16")(samples)["data"]
    assert torch.equal(half.cpu(), torch.from_numpy(want).half())


@needs_torchvision
def test_torchvision_gpu_decode_matches_cpu(samples: list[dict[str, Any]], record_property: Any) -> None:
    pipe = ImageClassification(train=False, device="cuda", backend="torch")
    assert pipe(samples[:1]) and pipe._torch is not None and pipe._torch.gpu_decode
    _check_close(pipe(samples), ImageClassification(train=False, device="cpu", backend="torch")(samples), record_property)


def test_torch_backend_cuda_without_torchvision(samples: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    # Pillow on CPU threads, the uint8 crop crosses the link, normalize on the GPU.
    monkeypatch.setattr(_registry, "_failed", {"torchvision.io": "hidden by the test"})
    monkeypatch.setattr(_registry, "_loaded", {k: v for k, v in _registry._loaded.items() if k != "torchvision.io"})
    gpu = ImageClassification(train=False, device="cuda", backend="torch")(samples)
    cpu = ImageClassification(train=False, device="cpu", backend="torch")(samples)
    assert gpu["image"].is_cuda
    assert _levels(gpu["image"], cpu["image"]).max().item() <= 1e-3  # same CPU decode and resize
    arrays = [{"data": np.full((4, 4), i, np.uint8)} for i in range(3)]
    out = ArrayPipeline(device="cuda", backend="torch", dtype="float32")(arrays)["data"]
    assert out.is_cuda and out[:, 0, 0].tolist() == [0.0, 1.0, 2.0]


def test_torch_backend_makes_no_host_sync(samples: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    # A blocking copy per batch (mean/std built with torch.tensor(..., device=cuda))
    # would end the host's run-ahead every step; "error" turns any sync into a raise.
    monkeypatch.setattr(_registry, "_failed", {"torchvision.io": "hidden by the test"})
    monkeypatch.setattr(_registry, "_loaded", {k: v for k, v in _registry._loaded.items() if k != "torchvision.io"})
    images = ImageClassification(train=True, device="cuda", backend="torch", seed=3)
    arrays = ArrayPipeline(device="cuda", backend="torch", dtype="float16")
    rows = [{"data": np.full((8, 8), i, np.uint8), "label": i} for i in range(4)]
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = [images(samples[:4]) for _ in range(3)] + [arrays(rows) for _ in range(3)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert outs[0]["image"].is_cuda and outs[0]["image"].shape == (4, 3, 224, 224)
    assert outs[-1]["data"][:, 0, 0].tolist() == [0.0, 1.0, 2.0, 3.0]


@needs_dali
def test_corrupt_chunk_of_an_entry_without_stored_checksum_never_reaches_inflate(
    tmp_path: Path, sample_photos: None
) -> None:
    # nvCOMP would inflate a flipped chunk into wrong bytes without an error, so the
    # cache decodes such (old) entries on the host and refetches a bad one.
    from fastload.cache import keys, record

    make_uint8_arrays(tmp_path / "arrs", n=4, shape=(64, 64, 3))
    settings = Settings(cache_dir=tmp_path / "c", chunk_bytes=4096)
    ds = CompressedArrayDataset(str(tmp_path / "arrs"), settings=settings)
    [ds[i] for i in range(len(ds))]  # cached
    cache = ds.reader.cache
    key = ds.reader.identity.key(ds.items[1], 0)
    entry = cache.entry(key)
    assert entry is not None and entry.codec == codec.LZ4
    cache.index.set(keys.entry(key), record(dataclasses.replace(entry, stored_checksum=None)))  # as written before stored checksums
    with open(cache.data_dir / entry.path, "r+b") as f:  # its last byte, in its file or its pack
        f.seek((entry.offset or 0) + entry.stored - 1)
        last = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([last ^ 0x01]))
    fresh = CompressedArrayDataset(str(tmp_path / "arrs"), settings=settings)
    out = ArrayPipeline(device="cuda", backend="dali")([fresh[i] for i in range(len(fresh))])
    want = np.stack([np.load(tmp_path / "arrs" / f"{i + 1:05d}.npy") for i in range(4)])
    assert np.array_equal(out["data"].cpu().numpy(), want)
    assert fresh.reader.cache.corrupt_count() == 1
