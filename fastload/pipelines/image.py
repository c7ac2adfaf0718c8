"""Image classification: encoded images in, normalized tensors on the device out."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from fastload.config import default_decode_threads
from fastload.errors import ConfigError
from fastload.pipelines import _common, _dali, _torch
from fastload.stats import current_collector

__all__ = ["ImageClassification"]


class ImageClassification:
    """Decode, augment and normalize a batch of encoded images on the target device.

    The object is a ``collate_fn``: it takes the list of samples the loader
    gathered for one batch and returns ``{"image": tensor, "label": tensor}`` on
    ``device`` (plus ``"url"``, a list, when the samples carry URLs). Only the
    encoded bytes cross the GPU link, and labels travel with their images, also
    when bad samples are skipped.

    * train: random-resized-crop (``scale``, ``ratio``) to ``size`` x ``size``,
      horizontal flip with probability ``flip``.
    * val: resize the shorter side to ``resize`` (longer side truncated, as
      torchvision), centre crop ``size`` x ``size``.
    * both: ``(x / 255 - mean) / std`` in ``dtype`` (``uint8``: no normalization),
      layout ``CHW`` or ``HWC``.

    Args:
        train: Training (random) or validation (deterministic) transforms.
        size: Output height and width.
        resize: Val only: the shorter side before the centre crop (default
            ``round(size / 0.875)``: 256 for 224).
        scale, ratio: Train only: random-resized-crop area fraction and aspect range.
        flip: Train only: horizontal-flip probability.
        mean, std: Per-channel, in [0, 1] units (ImageNet's by default).
        dtype: ``"float32"``, ``"float16"``, ``"bfloat16"`` or ``"uint8"``.
        layout: ``"CHW"`` or ``"HWC"`` (per image; the batch dimension comes first).
        device: Where outputs land; None picks ``cuda`` when available, else ``cpu``.
            The pipeline's operators run there too (DALI ``mixed``/GPU operators, or
            CPU operators with ``device_id=None``).
        backend: ``"dali"``, ``"torch"``, or ``"auto"``: DALI when it imports, else torch.
        seed: Seed of the random draws; None follows ``torch.initial_seed()``. A
            seeded pipeline fed the same batches gives the same outputs (per backend:
            DALI and torch draw differently).
        on_error: ``"raise"`` a :class:`~fastload.errors.DecodeError` naming the
            sample's URL, or ``"skip"`` the sample (counted as ``decode_skipped``).
        threads: CPU decode threads (default: the cores this process may use).
        image_key, label_key: Where a dict sample keeps the encoded image and the
            label (``"data"``/``"label"`` for FileDataset; ``"jpg"``/``"cls"`` for tar
            shards). Tuple samples are read as ``(image, label)``.

    Raises:
        ConfigError: An argument is out of range, or ``device="cuda"`` without CUDA.
        ImportError: ``backend="dali"`` without DALI; the message says
            ``pip install 'fastload[dali]'``.

    Example:
        >>> from fastload.pipelines import ImageClassification
        >>> pipe = ImageClassification(train=False, size=224, device="cpu", backend="torch")
        >>> pipe.backend, pipe.placement
        ('torch', 'cpu')
    """

    def __init__(
        self,
        *,
        train: bool,
        size: int = 224,
        resize: int | None = None,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        flip: float = 0.5,
        mean: Sequence[float] | None = _common.IMAGENET_MEAN,
        std: Sequence[float] | None = _common.IMAGENET_STD,
        dtype: str = "float32",
        layout: str = "CHW",
        device: str | torch.device | None = None,
        backend: str = "auto",
        seed: int | None = None,
        on_error: str = "raise",
        threads: int | None = None,
        image_key: str = "data",
        label_key: str = "label",
    ) -> None:
        self._config = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        _common.check_choice("dtype", dtype, tuple(_common.DTYPES))
        _common.check_choice("layout", layout, ("CHW", "HWC"))
        if int(size) < 1:
            raise ConfigError(f"size={size} must be a positive number of pixels")
        self.train = bool(train)
        self.size = int(size)
        self.resize = int(resize) if resize is not None else round(self.size / 0.875)
        if self.resize < self.size:
            raise ConfigError(f"resize={self.resize} is smaller than size={self.size}: the centre crop would not fit")
        if not (0 < scale[0] <= scale[1] <= 1):
            raise ConfigError(f"scale={scale} must satisfy 0 < min <= max <= 1")
        if not (0 < ratio[0] <= ratio[1]):
            raise ConfigError(f"ratio={ratio} must satisfy 0 < min <= max")
        if not 0 <= flip <= 1:
            raise ConfigError(f"flip={flip} is a probability; use a value in [0, 1]")
        if (mean is None) != (std is None) or (mean is not None and (len(mean) != 3 or len(std or ()) != 3)):
            raise ConfigError("mean and std are both None or both three per-channel values")
        if std is not None and min(std) <= 0:
            raise ConfigError(f"std={tuple(std)} must be positive")
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        self.flip = float(flip)
        self.mean = None if mean is None else tuple(float(v) for v in mean)
        self.std = None if std is None else tuple(float(v) for v in std)
        self.dtype = dtype
        self.layout = layout
        self.device = _common.resolve_device(device)
        self.placement = "gpu" if self.device.type == "cuda" else "cpu"
        self.backend = _common.resolve_backend(backend, prefer_dali=True)
        self.seed = _common.derive_seed(seed)
        self.threads = int(threads) if threads is not None else default_decode_threads()
        if self.threads < 1:
            raise ConfigError(f"threads={threads} must be >= 1")
        self.image_key, self.label_key = image_key, label_key
        self.failures = _common.Failures(on_error, "ImageClassification")
        self.on_error = on_error
        self._dali: _dali.DaliRunner | None = None
        self._torch: _torch.Decoder | None = None
        self._gen = torch.Generator().manual_seed(self.seed)  # torch backend draws, in sample order
        self._h2d = _common.HostToDevice(self.device)

    # -- pickling: settings, not handles (DataLoader workers rebuild lazily) ----------

    def __getstate__(self) -> dict[str, Any]:
        return dict(self._config)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def __repr__(self) -> str:
        mode = "train" if self.train else "val"
        return (
            f"ImageClassification({mode}, size={self.size}, dtype={self.dtype}, layout={self.layout}, "
            f"backend={self.backend}, device={self.device}, on_error={self.on_error!r})"
        )

    # -- the batch call -------------------------------------------------------------

    def __call__(self, samples: Sequence[Any]) -> dict[str, Any]:
        """Decode and transform one batch; see the class docstring for the output."""
        _common.forbid_cuda_in_worker(self.device, "ImageClassification")
        t0 = time.perf_counter()
        bufs: list[np.ndarray] = []
        labels: list[Any] = []
        urls: list[str] = []
        where: list[int] = []  # position of each buffer in the batch, for messages
        for i, sample in enumerate(samples):
            url = _common.sample_url(sample, i)
            data = _common.field(sample, self.image_key, 0)
            if data is None:
                raise ConfigError(
                    f"sample {i} ({url}) has no {self.image_key!r} field; set image_key= "
                    "(e.g. 'jpg' for tar shards)"
                )
            buf = _common.as_bytes_array(data, url, i)
            if buf.size == 0:
                self.failures.bad(url, i, "the encoded image is empty (0 bytes)")
                continue
            bufs.append(buf)
            labels.append(_common.field(sample, self.label_key, 1))
            urls.append(url)
            where.append(i)
        if self.backend == "dali":
            images, kept = self._run_dali(bufs, urls, where)
        else:
            images, kept = self._run_torch(bufs, urls, where)
        out: dict[str, Any] = {"image": images}
        if labels and all(v is not None for v in labels):
            out["label"] = _common.labels_tensor([labels[k] for k in kept], self.device)
        if any(isinstance(s, dict) and ("url" in s or "__url__" in s) for s in samples):
            out["url"] = [urls[k] for k in kept]
        current_collector().add(
            "decode", items=len(kept), bytes=sum(int(bufs[k].size) for k in kept), seconds=time.perf_counter() - t0
        )
        return out

    def _empty(self) -> torch.Tensor:
        shape = (0, 3, self.size, self.size) if self.layout == "CHW" else (0, self.size, self.size, 3)
        return torch.empty(shape, dtype=_common.DTYPES[self.dtype], device=self.device)

    # -- DALI -----------------------------------------------------------------------

    def _runner(self) -> _dali.DaliRunner:
        if self._dali is None:
            graph_kwargs = {
                "placement": self.placement,
                "train": self.train,
                "size": self.size,
                "resize": self.resize,
                "scale": self.scale,
                "ratio": self.ratio,
                "flip": self.flip,
                "mean": self.mean,
                "std": self.std,
                "dtype": self.dtype,
                "layout": self.layout,
                "attempts": _torch.ATTEMPTS,
            }
            self._dali = _dali.DaliRunner(
                _dali.image_graph, graph_kwargs, device_index=self.device.index, threads=self.threads, seed=self.seed
            )
        return self._dali

    def _run_dali(self, bufs: list[np.ndarray], urls: list[str], where: list[int]) -> tuple[torch.Tensor, list[int]]:
        runner = self._runner()
        keep = list(range(len(bufs)))
        while keep:
            try:
                (batch,) = runner.run({"jpegs": [bufs[k] for k in keep]})
            except RuntimeError as err:
                bad = self._find_bad(runner, bufs, keep, err)
                if not bad:
                    raise  # not a per-sample failure: DALI's own error, unchanged
                for k in bad:
                    self.failures.bad(urls[k], where[k], f"DALI could not decode it ({_first_line(err)})", err)
                keep = [k for k in keep if k not in bad]
                continue
            images = _dali.to_torch(batch)
            if self.dtype == "bfloat16":
                images = images.to(torch.bfloat16)  # DALI has no bfloat16: cast its float32 on the device
            return images, keep
        return self._empty(), keep

    @staticmethod
    def _find_bad(runner: _dali.DaliRunner, bufs: list[np.ndarray], keep: list[int], err: BaseException) -> list[int]:
        pos = _dali.failed_sample(err)
        if pos is not None and pos < len(keep):
            return [keep[pos]]
        bad = []  # the message named no sample: try each alone (only ever on a failure)
        for k in keep:
            try:
                runner.run({"jpegs": [bufs[k]]})
            except RuntimeError:
                bad.append(k)
        return bad

    # -- torch ----------------------------------------------------------------------

    def _run_torch(self, bufs: list[np.ndarray], urls: list[str], where: list[int]) -> tuple[torch.Tensor, list[int]]:
        if self._torch is None:
            self._torch = _torch.Decoder(self.device, self.threads)
        draws = _torch.draw_crops(self._gen, len(bufs)) if self.train else None
        results = self._torch.run(
            bufs, draws, size=self.size, resize_to=self.resize, scale=self.scale, ratio=self.ratio, flip=self.flip
        )
        kept, images = [], []
        for k, res in enumerate(results):
            if isinstance(res, BaseException):
                self.failures.bad(urls[k], where[k], f"{type(res).__name__}: {res}", res)
                continue
            kept.append(k)
            images.append(res)
        if not images:
            return self._empty(), kept
        batch = torch.stack(images)  # uint8: the smallest form, which is what crosses the link
        if batch.device != self.device:
            batch = self._h2d(batch)
        return _torch.finish(batch, _common.DTYPES[self.dtype], self.mean, self.std, self.layout), kept

    def close(self) -> None:
        """Stop the decode threads and drop the DALI pipeline (both restart on the next call)."""
        if self._torch is not None:
            self._torch.close()
            self._torch = None
        self._dali = None


def _first_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    detail = [ln for ln in lines if "sample" in ln.lower() or "error" in ln.lower()]
    return (detail or lines or [type(err).__name__])[-1][:200]
