"""Stream order of the GPU pipelines: what their outputs and inputs share with the caller's stream.

Each test keeps the caller's (torch's current) stream busy with ``torch.cuda._sleep``
while the pipeline runs, so work that forgot to wait for that stream, or memory
handed back too early, shows up as wrong values, not as a timing. Skipped (with
the reason) without CUDA, and per test without DALI or torchvision.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch

from fastload.config import Settings
from fastload.pipelines import ArrayPipeline, CompressedArrayDataset, ImageClassification, available
from fastload.samples import make_uint8_arrays
from fastload.stats import StatsCollector, use_collector

pytestmark = pytest.mark.gpu
needs_dali = pytest.mark.skipif(not available("dali"), reason="nvidia-dali not installed")
needs_torchvision = pytest.mark.skipif(not available("torchvision.io"), reason="torchvision does not import here")
BUSY_CYCLES = 200_000_000  # ~0.1 s of GPU time queued on the caller's stream


def _unlabelled(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Samples without labels: a label tensor's copy from pageable memory may wait for the
    busy stream on the host, which would close the window these tests look into."""
    return [{k: v for k, v in r.items() if k in ("data", "payload")} for r in rows]


def _decoded_sizes(batch: list[dict[str, Any]]) -> list[int]:
    import torchvision.io as tvio

    return [int(tvio.decode_jpeg(torch.frombuffer(bytearray(s["data"]), dtype=torch.uint8),
                                 mode=tvio.ImageReadMode.RGB).numel()) for s in batch]


@needs_torchvision
def test_gpu_decode_never_writes_into_memory_the_callers_queued_kernels_read(samples: list[dict[str, Any]]) -> None:
    # torchvision allocates nvJPEG's outputs on the current stream and writes them from
    # its own stream, which waits for nothing (pytorch/vision#9606). Tensors freed on the
    # caller's stream while reductions over them are still queued there are the blocks
    # such an allocation would get. Batch b (a in reverse) is decoded before a's crops
    # have run, so a decode block reused too early (no record_stream) shows in a's images.
    pipe = ImageClassification(train=False, device="cuda", backend="torch", dtype="uint8")
    a = _unlabelled(samples[:8])
    b = a[::-1]
    want_a = pipe(a)["image"].cpu()  # warm-up: nvJPEG handles, the decode stream
    assert pipe._torch is not None and pipe._torch.gpu_decode
    sizes = _decoded_sizes(a)
    torch.cuda.synchronize()
    for trial in range(10):
        held = [torch.ones(n, dtype=torch.uint8, device="cuda") for n in sizes]
        torch.cuda._sleep(BUSY_CYCLES)  # the caller's stream is busy when the decode starts
        sums = [t.sum(dtype=torch.int64) for t in held]  # read after the sleep
        del held  # freed on the caller's stream, its reductions still queued
        got_a = pipe(a)["image"]
        got_b = pipe(b)["image"]
        assert [int(s) for s in sums] == sizes, f"trial {trial}: a decode wrote into memory a queued kernel read"
        assert torch.equal(got_a.cpu(), want_a), f"trial {trial}: batch b's decode landed in a's images"
        assert torch.equal(got_b.cpu(), want_a.flip(0))


@needs_torchvision
def test_gpu_decode_counts_images_decoded_on_the_cpu(samples: list[dict[str, Any]]) -> None:
    from PIL import Image

    png = io.BytesIO()
    with Image.open(io.BytesIO(samples[0]["data"])) as img:
        img.save(png, format="PNG")  # nvJPEG refuses it; torchvision's decode_image takes it on the CPU
    batch = [samples[1], {**samples[0], "data": png.getvalue()}, samples[2]]
    pipe = ImageClassification(train=False, device="cuda", backend="torch", dtype="uint8")
    col = StatsCollector()
    with use_collector(col):
        out = pipe(batch)["image"]
    assert out.shape[0] == 3 and out.is_cuda
    assert col.snapshot().counters["decode_cpu_fallback"] == 1
    assert pipe._torch is not None and "1 image(s) nvJPEG refused decoded on the CPU" in pipe._torch.where
    # The PNG holds Pillow's pixels of that JPEG: the CPU pipeline's image, up to the GPU resize's rounding.
    cpu = ImageClassification(train=False, device="cpu", backend="torch", dtype="uint8")([samples[0]])["image"]
    assert (out[1].cpu().float() - cpu[0].float()).abs().max() <= 1


def _image_sums(out: dict[str, Any]) -> torch.Tensor:
    x = out["image"] if "image" in out else out["data"]
    return x.float().flatten(1).sum(1)


@needs_dali
@pytest.mark.parametrize("what", ["float32", "bfloat16", "arrays"])
def test_dali_outputs_survive_the_next_run_while_torch_is_busy(
    samples: list[dict[str, Any]], tmp_path: Path, what: str
) -> None:
    # DALI frees an output's buffer in its own stream's order; a torch kernel queued on
    # the output (the user's reduction, the bf16 cast, the array stack) behind busy work
    # must still read this run's values after the next run, which DALI starts at once.
    if what == "arrays":
        make_uint8_arrays(tmp_path / "arrs", n=16, shape=(224, 224, 3))
        ds = CompressedArrayDataset(str(tmp_path / "arrs"), settings=Settings(cache_dir=tmp_path / "c", chunk_bytes=65536))
        rows = _unlabelled([ds[i] for i in range(len(ds))])
        pipe: Any = ArrayPipeline(device="cuda", backend="dali")
    else:
        rows = _unlabelled(samples)
        pipe = ImageClassification(train=False, device="cuda", backend="dali", dtype=what)
    a, b = rows[:8], rows[8:16]
    want = _image_sums(pipe(a)).cpu()
    assert not torch.allclose(want, _image_sums(pipe(b)).cpu())
    torch.cuda.synchronize()
    for trial in range(5):
        torch.cuda._sleep(BUSY_CYCLES)  # nothing queued on torch's stream runs for a while
        sums = _image_sums(pipe(a))  # queued behind the sleep; the output itself is dropped
        pipe(b)
        pipe(b)
        got = sums.cpu()
        assert torch.allclose(got, want, rtol=1e-6), f"trial {trial}: DALI reused a's buffer before torch read it"
