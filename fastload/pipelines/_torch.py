"""The torch backend: decode with torchvision (nvJPEG on CUDA) or Pillow, augment with torch ops.

It exists for machines without DALI (Windows, macOS, a CUDA mismatch) and keeps
the same output contract. Decoding, by what is importable and where outputs go:

==============  ==========================================  ==========================
device          torchvision importable                      otherwise
==============  ==========================================  ==========================
``cuda``        ``decode_jpeg(device="cuda")`` (nvJPEG);    Pillow on CPU threads;
                crop/resize/flip/normalize on the GPU       crop/resize on CPU, the
                                                            uint8 crop crosses the
                                                            link, normalize on the GPU
``cpu``         Pillow on CPU threads (torchvision's CPU decoder is the same libjpeg-turbo)
==============  ===========================================================================

Random draws are made in the calling thread, in sample order, from one
``torch.Generator`` seeded once, before any thread starts; a worker thread only
turns them into a crop once it knows the image size. So a seeded run gives the
same crops whatever the thread count or scheduling
(``tests/unit/test_pipelines.py::test_train_is_deterministic``).
"""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fastload.pipelines import _registry
from fastload.stats import current_collector

ATTEMPTS = 10  # random-resized-crop tries before the centre-crop fallback (torchvision's)
CPU_FALLBACK = "decode_cpu_fallback"  # the stats counter of images nvJPEG refused, decoded on the CPU


def decode_pil(buf: np.ndarray) -> torch.Tensor:
    """Decode encoded bytes to an RGB (3, H, W) uint8 tensor (channels-last memory).

    Raises whatever Pillow raises for a corrupt or truncated file (OSError,
    ``Image.DecompressionBombError``...); Pillow's ``LOAD_TRUNCATED_IMAGES`` is
    honoured if the user has set it.
    """
    image_mod = _registry.load("PIL.Image")
    with image_mod.open(io.BytesIO(buf.tobytes())) as img:
        rgb = img.convert("RGB")  # convert() forces the full decode: a truncated file raises here
    return torch.from_numpy(np.array(rgb)).permute(2, 0, 1)  # a writable copy: torch warns on read-only


def decode_torchvision(bufs: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor | BaseException]:
    """Decode on ``device`` with torchvision (batched nvJPEG on CUDA); one result per input.

    A batch that fails as a whole is retried one image at a time, so one bad file
    costs only itself; what nvJPEG refuses (not a JPEG, or a JPEG it cannot
    decode) goes through ``decode_image`` on the CPU and comes back as a CPU
    tensor, which is how the caller counts those fallbacks.
    """
    tvio = _registry.load("torchvision.io")
    mode = tvio.ImageReadMode.RGB
    tensors = [torch.from_numpy(b) for b in bufs]
    try:
        return list(tvio.decode_jpeg(tensors, device=device, mode=mode))
    except Exception:  # one bad file fails the batch call; isolate it below
        pass
    out: list[torch.Tensor | BaseException] = []
    for t in tensors:
        try:
            out.append(tvio.decode_jpeg(t, device=device, mode=mode))
        except Exception:  # not a JPEG, or corrupt: try the generic CPU decoder
            try:
                out.append(tvio.decode_image(t, mode=mode))
            except Exception as err:
                out.append(err)
    return out


def draw_crops(gen: torch.Generator, n: int) -> torch.Tensor:
    """Per sample: ATTEMPTS x (area, log-ratio, top, left) uniforms, then one flip uniform."""
    return torch.rand(n, ATTEMPTS * 4 + 1, generator=gen, dtype=torch.float64)


def rrc_box(
    h: int, w: int, draws: torch.Tensor, scale: tuple[float, float], ratio: tuple[float, float]
) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop box (top, left, height, width), from pre-drawn uniforms."""
    area = h * w
    lo, hi = math.log(ratio[0]), math.log(ratio[1])
    u = draws[: ATTEMPTS * 4].view(ATTEMPTS, 4).tolist()
    for a, r, y, x in u:
        target = area * (scale[0] + a * (scale[1] - scale[0]))
        aspect = math.exp(lo + r * (hi - lo))
        cw = int(round(math.sqrt(target * aspect)))
        ch = int(round(math.sqrt(target / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            return int(y * (h - ch + 1)), int(x * (w - cw + 1)), ch, cw
    in_ratio = w / h  # fallback: a centre crop at the nearest allowed aspect ratio
    if in_ratio < ratio[0]:
        cw, ch = w, int(round(w / ratio[0]))
    elif in_ratio > ratio[1]:
        ch, cw = h, int(round(h * ratio[1]))
    else:
        cw, ch = w, h
    return (h - ch) // 2, (w - cw) // 2, ch, cw


def val_size(h: int, w: int, resize: int) -> tuple[int, int]:
    """Shorter side -> ``resize``, longer side truncated (torchvision); the DALI graph matches."""
    short = min(h, w)
    return math.floor(h * resize / short + 1e-3), math.floor(w * resize / short + 1e-3)


def center(n: int, crop: int) -> int:
    """Crop anchor for a centred crop, rounded half up as DALI's crop_mirror_normalize does."""
    return math.floor((n - crop) / 2 + 0.5)


def resize(img: torch.Tensor, out_hw: tuple[int, int]) -> torch.Tensor:
    """Bilinear, antialiased resize of a (3, H, W) uint8 image; returns uint8 (rounded).

    uint8 in, uint8 out, like DALI's resize: on the CPU torch has a native uint8
    path for channels-last images; elsewhere it goes through float and rounds.
    """
    x = img.unsqueeze(0)
    if tuple(x.shape[-2:]) == tuple(out_hw):
        return img
    if x.device.type == "cpu":
        return F.interpolate(x, size=out_hw, mode="bilinear", antialias=True, align_corners=False)[0]
    y = F.interpolate(x.float(), size=out_hw, mode="bilinear", antialias=True, align_corners=False)
    return y.round_().clamp_(0, 255).to(torch.uint8)[0]


def geometry(
    img: torch.Tensor,
    draws: torch.Tensor | None,
    *,
    size: int,
    resize_to: int,
    scale: tuple[float, float],
    ratio: tuple[float, float],
    flip: float,
) -> torch.Tensor:
    """Train (``draws`` given): random-resized-crop + flip. Val: resize shorter side + centre crop."""
    h, w = int(img.shape[-2]), int(img.shape[-1])
    if draws is not None:
        top, left, ch, cw = rrc_box(h, w, draws, scale, ratio)
        out = resize(img[:, top : top + ch, left : left + cw], (size, size))
        if float(draws[-1]) < flip:
            out = out.flip(-1)
        return out
    nh, nw = val_size(h, w, resize_to)
    out = resize(img, (nh, nw))
    top, left = center(nh, size), center(nw, size)
    return out[:, top : top + size, left : left + size]


class Decoder:
    """Decodes and crops a batch on CPU threads (Pillow) or the GPU (torchvision).

    GPU decode runs on a stream of its own. torchvision allocates each output on
    the current stream, but nvJPEG writes it from torchvision's internal stream,
    which waits for nothing (pytorch/vision#9606): a block the caller's queued
    kernels still read could be overwritten. On the decode stream nothing but
    those outputs is ever allocated and no kernel runs, and each output is handed
    to the caller's stream with ``record_stream``, so a block returns to that pool
    only once the caller's work on it has completed.
    """

    def __init__(self, device: torch.device, threads: int) -> None:
        self.device = device
        self.threads = threads
        self.gpu_decode = device.type == "cuda" and _registry.available("torchvision.io")
        self._pool: ThreadPoolExecutor | None = None
        self._stream: torch.cuda.Stream | None = None
        #: Images nvJPEG refused that were decoded on the CPU instead (this decoder's lifetime).
        self.cpu_fallbacks = 0

    @property
    def where(self) -> str:
        """Human description of the decode path, for repr() and benchmarks."""
        if self.gpu_decode:
            text = "torchvision nvJPEG on " + str(self.device)
            if self.cpu_fallbacks:
                text += f", {self.cpu_fallbacks} image(s) nvJPEG refused decoded on the CPU ({CPU_FALLBACK})"
            return text
        return f"Pillow on {self.threads} CPU thread(s)"

    def _decode_on_device(self, bufs: Sequence[np.ndarray]) -> list[torch.Tensor | BaseException]:
        """torchvision's decode on the decode stream (class docstring), ordered after and before the caller's.

        In RGB mode torchvision queues no kernel of its own there (only its event
        wait on nvJPEG's stream), and fastload's crops run on the caller's stream.
        """
        consumer = torch.cuda.current_stream(self.device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        self._stream.wait_stream(consumer)  # what torchvision queues here runs after the caller's work
        with torch.cuda.stream(self._stream):
            decoded = decode_torchvision(bufs, self.device)
        consumer.wait_stream(self._stream)  # torchvision made the decode stream wait for nvJPEG's
        for img in decoded:
            if isinstance(img, torch.Tensor) and img.is_cuda:
                img.record_stream(consumer)
        return decoded

    def run(self, bufs: Sequence[np.ndarray], draws: torch.Tensor | None, **geo: Any) -> list[torch.Tensor | BaseException]:
        """One (3, size, size) uint8 tensor, or the exception, per input."""
        if self.gpu_decode:
            out: list[torch.Tensor | BaseException] = []
            fallbacks = 0
            for i, img in enumerate(self._decode_on_device(bufs)):
                if isinstance(img, BaseException):
                    out.append(img)
                    continue
                if img.device != self.device:  # nvJPEG refused it; decoded on the CPU
                    fallbacks += 1
                    img = img.to(self.device)
                out.append(geometry(img, None if draws is None else draws[i], **geo))  # on the caller's stream
            if fallbacks:
                self.cpu_fallbacks += fallbacks
                current_collector().count(CPU_FALLBACK, fallbacks)
            return out

        def one(i: int) -> torch.Tensor | BaseException:
            try:
                return geometry(decode_pil(bufs[i]), None if draws is None else draws[i], **geo)
            except Exception as err:  # reported per sample by the caller (raise or skip)
                return err

        if self.threads <= 1 or len(bufs) <= 1:
            return [one(i) for i in range(len(bufs))]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="fastload-decode")
        return list(self._pool.map(one, range(len(bufs))))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


@functools.lru_cache(maxsize=32)
def channel_constants(values: tuple[float, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``255 * values`` as a (1, C, 1, 1) tensor on ``device``, built once per device and dtype.

    Built per batch, ``torch.tensor(..., device="cuda")`` is a blocking copy that
    stalls the host's run-ahead every step; here the one copy ever made is
    ``non_blocking`` (from pageable memory CUDA copies it to its own buffer before returning, so the
    host tensor may go), and later batches reuse the device tensor
    (``tests/gpu/test_pipelines_gpu.py::test_torch_backend_makes_no_host_sync``).
    """
    host = torch.tensor([255.0 * v for v in values], dtype=dtype).view(1, len(values), 1, 1)
    return host if device.type == "cpu" else host.to(device, non_blocking=True)


def finish(
    batch: torch.Tensor, dtype: torch.dtype, mean: Sequence[float] | None, std: Sequence[float] | None, layout: str
) -> torch.Tensor:
    """(B, 3, S, S) uint8 on the device -> normalized ``dtype`` in ``layout``."""
    if dtype == torch.uint8:
        out = batch
    else:
        x = batch.float()
        if mean is not None and std is not None:
            m = channel_constants(tuple(mean), x.device, x.dtype)
            s = channel_constants(tuple(std), x.device, x.dtype)
            x = (x - m) / s
        out = x.to(dtype)
    if layout == "HWC":
        out = out.permute(0, 2, 3, 1).contiguous()
    return out
