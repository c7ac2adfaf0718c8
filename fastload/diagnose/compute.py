"""Compute on the data path: CPU JPEG decode, cache payload decode (LZ4), GPU decode.

All three run on real JPEGs: the dataset's own when the diagnosed URL holds
JPEGs, else ImageNet-like samples built from real photos by
:mod:`fastload.samples` (never noise: noise decodes and compresses unlike photos).

* **CPU decode.** Pillow, one thread: decode only, and decode + resize to the
  training size (what a CPU pipeline does per image), per CPU-second of that
  thread (so other busy processes do not lower a "per core" rate). Then all
  usable cores as threads (Pillow releases the GIL while decoding), per wall
  second: what this machine gives now.
* **Payload decode.** :func:`fastload.codec.decode` (with the checksum, as the
  cache reads) of the JPEGs (stored raw) and of their decoded pixels (stored LZ4).
* **GPU decode.** ``torchvision.io.decode_jpeg(device='cuda')`` (nvJPEG) in
  batches, where torchvision and CUDA exist; skipped with the reason otherwise.
"""

from __future__ import annotations

import io
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from fastload.diagnose._util import MissingOptional, ok, optional, skipped, timed_loop

__all__ = ["IMAGE_KINDS", "cpu_decode", "data_kind", "gpu_decode", "is_jpeg", "payload_decode", "sample_jpegs"]


IMAGE_KINDS = frozenset({"jpeg", "png", "webp", "gif"})


def data_kind(head: bytes) -> str:
    """What a file holds, from its first bytes (512 are enough): an image format, ``npy``,
    ``tar``, ``text``, or ``binary`` (raw arrays, tokens: nothing to decode)."""
    if head.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if head.startswith(b"\x93NUMPY"):
        return "npy"
    if head[257:262] == b"ustar":
        return "tar"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError:
        return "binary"
    return "text" if head else "binary"


def is_jpeg(data: bytes) -> bool:
    """True for JPEG bytes (SOI marker)."""
    return data[:3] == b"\xff\xd8\xff"


def sample_jpegs(n: int = 8) -> list[bytes]:
    """``n`` ImageNet-like JPEGs (500x375, q90) from :mod:`fastload.samples`."""
    from fastload.samples import make_image_folder

    with tempfile.TemporaryDirectory(prefix="fastload-diag-") as tmp:
        return [p.read_bytes() for p in make_image_folder(Path(tmp), n=n)]


def cpu_decode(jpegs: list[bytes], *, image_size: int = 224, budget_s: float = 0.5, threads: int = 1) -> dict[str, Any]:
    """Pillow decode rates on one core and on ``threads`` threads."""
    image = optional("PIL")
    size = (image_size, image_size)
    bilinear = image.Resampling.BILINEAR

    def decode(b: bytes) -> Any:
        im = image.open(io.BytesIO(b))
        im.load()
        return im

    def decode_resize(b: bytes) -> Any:
        return decode(b).convert("RGB").resize(size, bilinear)

    first = decode(jpegs[0])
    dims = first.size

    def loop(fn: Any) -> float:
        def batch() -> int:
            for b in jpegs:
                fn(b)
            return len(jpegs)

        n, secs = timed_loop(batch, budget_s)
        return n / secs

    one = loop(decode)
    one_resize = loop(decode_resize)
    aggregate = None
    if threads > 1:
        counts = [0] * threads
        errors: list[BaseException] = []
        deadline = time.perf_counter() + budget_s

        def work(k: int) -> None:
            try:
                while time.perf_counter() < deadline:
                    for b in jpegs:
                        decode_resize(b)
                    counts[k] += len(jpegs)
            except BaseException as err:  # re-raised below, in the caller's thread
                errors.append(err)

        pool = [threading.Thread(target=work, args=(k,), daemon=True) for k in range(threads)]
        t0 = time.perf_counter()
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        if errors:
            raise errors[0]
        aggregate = sum(counts) / (time.perf_counter() - t0)
    return ok(
        images=len(jpegs),
        avg_jpeg_bytes=sum(map(len, jpegs)) / len(jpegs),
        width_height=list(dims),
        decode_per_core=one,
        decode_resize_per_core=one_resize,
        resize_to=image_size,
        threads=threads,
        decode_resize_all_threads=aggregate,
        thread_scaling=None if aggregate is None else aggregate / one_resize,
    )


def payload_decode(jpegs: list[bytes], *, budget_s: float = 0.3, raw_only: bool = False) -> dict[str, Any]:
    """``codec.decode`` GB/s (one core, checksum on) for JPEG bytes and for decoded pixels;
    ``raw_only``: for the data's own bytes (not images: nothing else is cached)."""
    from fastload import codec

    out: dict[str, Any] = {}
    blobs = {"raw" if raw_only else "jpeg": b"".join(jpegs)}
    try:
        if not raw_only:
            image = optional("PIL")
            blobs["uint8_pixels"] = b"".join(image.open(io.BytesIO(b)).convert("RGB").tobytes() for b in jpegs)
    except MissingOptional:
        pass  # only the JPEG bytes are measured; the pixel row is absent
    for name, raw in blobs.items():
        payload = codec.encode(raw)
        info = codec.parse_header(payload)

        def one(p: bytes = payload) -> int:
            codec.decode(p)
            return 1

        n, secs = timed_loop(one, budget_s, min_calls=3)
        out[name] = {
            "stored_as": info.codec_name,
            "ratio": len(raw) / len(payload),
            "raw_bytes": len(raw),
            "decode_bps_per_core": n * len(raw) / secs,
        }
    return ok(**out)


def gpu_decode(jpegs: list[bytes], *, batch: int = 64, budget_s: float = 1.0) -> dict[str, Any]:
    """nvJPEG decode rate through torchvision on CUDA device 0; skipped without it."""
    try:
        torch = optional("torch")
    except MissingOptional as err:
        return skipped(str(err))
    if not torch.cuda.is_available():
        return skipped("no CUDA device: torch.cuda.is_available() is False")
    try:
        tvio = optional("torchvision")
    except MissingOptional as err:
        return skipped(f"GPU decode is measured with torchvision.io.decode_jpeg(device='cuda'): {err}")
    data = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in jpegs]
    data = (data * (batch // len(data) + 1))[:batch]
    dev = torch.device("cuda", 0)
    tvio.decode_jpeg(data, device=dev)  # warm-up: nvJPEG handles and buffers
    torch.cuda.synchronize(dev)

    def one() -> int:
        tvio.decode_jpeg(data, device=dev)
        torch.cuda.synchronize(dev)
        return len(data)

    n, secs = timed_loop(one, budget_s, min_calls=2, cpu=False)
    return ok(backend="torchvision.io.decode_jpeg (nvJPEG)", device=torch.cuda.get_device_name(0),
              batch=len(data), img_per_s=n / secs)
