"""Deterministic sample data for the demo, tests and benchmarks.

Everything here is built from real photographs, never from random noise:
scikit-learn ships two JPEG photos in its wheel (``china.jpg`` and
``flower.jpg``, read by :func:`sklearn.datasets.load_sample_images`), and each
sample is a random view of one of them: a crop, a resize, a flip and a mild
colour jitter. Real photos matter because they decode, compress and cache like a
real dataset; noise does not.

The same arguments give byte-identical files on every run (pinned by
``tests/unit/test_samples.py``), and item ``i`` depends only on ``seed`` and
``i``, so a larger ``n`` extends a smaller one.

Example:
    >>> from fastload.samples import make_image_folder
    >>> paths = make_image_folder(Path("data/train"), n=300)  # doctest: +SKIP

Pillow and scikit-learn are optional: ``pip install 'fastload[samples]'``.
"""

from __future__ import annotations

import functools
import io
import tarfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["make_image_folder", "make_tar_shards", "make_token_file", "make_uint8_arrays"]

_INSTALL_HINT = "pip install 'fastload[samples]'"


def _imaging() -> tuple[Any, Any]:
    """Imports Pillow's Image and ImageFilter, or explains how to install them."""
    try:
        from PIL import Image, ImageFilter
    except ImportError as err:
        raise ImportError(f"fastload.samples needs Pillow: {_INSTALL_HINT}") from err
    return Image, ImageFilter


@functools.cache
def _photos() -> tuple[np.ndarray, ...]:
    """The bundled photos as read-only uint8 arrays (427 x 640 x 3 each)."""
    try:
        from sklearn.datasets import load_sample_images
    except ImportError as err:
        raise ImportError(
            f"fastload.samples needs scikit-learn for its bundled photos: {_INSTALL_HINT}"
        ) from err
    photos = tuple(np.ascontiguousarray(img, dtype=np.uint8) for img in load_sample_images().images)
    for photo in photos:
        photo.flags.writeable = False  # shared by every call through the cache
    return photos


def _check_count(name: str, value: int, minimum: int) -> None:
    if int(value) != value or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _view(
    rng: np.random.Generator,
    photo: np.ndarray,
    out_wh: tuple[int, int],
    anchor: tuple[float, float] = (0.5, 0.5),
    tint: np.ndarray | None = None,
) -> Any:
    """One random view of ``photo`` as a PIL image of size ``out_wh``.

    A crop of 45-100 % of the photo's area, near ``anchor`` (relative y, x),
    with the output's aspect ratio give or take 15 %; then a resize, a coin-flip
    mirror, and brightness/contrast/per-channel jitter of a few percent on top
    of the optional class ``tint``.
    """
    image_mod, _ = _imaging()
    height, width = photo.shape[:2]
    area = rng.uniform(0.45, 1.0) * height * width
    aspect = out_wh[0] / out_wh[1] * float(np.exp(rng.uniform(-0.15, 0.15)))
    crop_h = int(min(height, np.sqrt(area / aspect)))
    crop_w = int(min(width, crop_h * aspect))
    center_y = (anchor[0] + rng.normal(0.0, 0.08)) * height
    center_x = (anchor[1] + rng.normal(0.0, 0.08)) * width
    top = int(np.clip(center_y - crop_h / 2, 0, height - crop_h))
    left = int(np.clip(center_x - crop_w / 2, 0, width - crop_w))
    crop = image_mod.fromarray(photo[top : top + crop_h, left : left + crop_w])
    pixels = np.asarray(crop.resize(out_wh, image_mod.Resampling.LANCZOS), dtype=np.float32)
    if rng.random() < 0.5:
        pixels = pixels[:, ::-1]
    gains = rng.uniform(0.97, 1.03, 3) * (1.0 if tint is None else tint)
    contrast = rng.uniform(0.9, 1.1)
    mean = pixels.mean()
    pixels = ((pixels - mean) * contrast + mean) * rng.uniform(0.9, 1.1) * gains
    return image_mod.fromarray(np.clip(np.rint(pixels), 0, 255).astype(np.uint8))


def make_image_folder(
    dest: Path,
    n: int = 300,
    classes: int = 10,
    size: tuple[int, int] = (500, 375),
    quality: int = 90,
    seed: int = 0,
) -> list[Path]:
    """Writes an ImageNet-like folder of JPEGs: ``dest/class_00/00001.jpg`` ...

    Images are numbered 1..n across the whole folder; image ``i`` belongs to
    class ``(i - 1) % classes``. Each class has its own photo, region and colour
    tint, so the classes are learnable. At the defaults a file averages about
    95 KB, close to ImageNet's average.

    Args:
        dest: Root folder; created if missing.
        n: Number of images.
        classes: Number of class folders.
        size: Output (width, height) in pixels.
        quality: JPEG quality, 1-100.
        seed: Seed; the same seed gives byte-identical files.

    Returns:
        The written paths, sorted (the order torchvision's ImageFolder uses).

    Raises:
        ImportError: Pillow or scikit-learn is missing.
        ValueError: An argument is out of range.
    """
    _check_count("n", n, 0)
    _check_count("classes", classes, 1)
    if len(size) != 2 or min(size) < 1:
        raise ValueError(f"size must be (width, height) with both >= 1, got {size!r}")
    if not 1 <= quality <= 100:
        raise ValueError(f"quality must be in 1..100, got {quality!r}")
    _, filters = _imaging()
    photos = _photos()
    out_wh = (int(size[0]), int(size[1]))
    digits = max(2, len(str(classes - 1)))
    class_params = []
    for label in range(classes):
        crng = np.random.default_rng([seed, label, 1])
        anchor = (float(crng.uniform(0.3, 0.7)), float(crng.uniform(0.3, 0.7)))
        class_params.append((photos[label % len(photos)], anchor, crng.uniform(0.88, 1.12, 3)))
    # Mild sharpening stands in for a camera's own; without it these two soft
    # photos compress to ~50 KB, half of a typical ImageNet JPEG. 4:4:4 chroma
    # (subsampling=0) keeps colour detail for the same reason.
    sharpen = filters.UnsharpMask(radius=1.5, percent=130, threshold=2)
    paths = []
    for i in range(1, n + 1):
        label = (i - 1) % classes
        photo, anchor, tint = class_params[label]
        view = _view(np.random.default_rng([seed, i]), photo, out_wh, anchor, tint)
        path = Path(dest) / f"class_{label:0{digits}d}" / f"{i:05d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        view.filter(sharpen).save(path, format="JPEG", quality=quality, subsampling=0)
        paths.append(path)
    return sorted(paths)


def make_uint8_arrays(
    dest: Path, n: int, shape: tuple[int, ...] = (224, 224, 3), seed: int = 0
) -> list[Path]:
    """Writes ``n`` ``.npy`` files of uint8 photo crops: ``dest/00001.npy`` ...

    Args:
        dest: Folder; created if missing.
        n: Number of arrays.
        shape: ``(height, width, 3)`` for colour or ``(height, width)`` for grey.
        seed: Seed; the same seed gives byte-identical files.

    Returns:
        The written paths, in order.

    Raises:
        ImportError: Pillow or scikit-learn is missing.
        ValueError: ``n`` or ``shape`` is invalid.
    """
    _check_count("n", n, 0)
    shape = tuple(int(d) for d in shape)
    if len(shape) not in (2, 3) or min(shape) < 1 or (len(shape) == 3 and shape[2] != 3):
        raise ValueError(f"shape must be (height, width) or (height, width, 3), got {shape!r}")
    photos = _photos()
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(1, n + 1):
        view = _view(
            np.random.default_rng([seed, i]), photos[i % len(photos)], (shape[1], shape[0])
        )
        array = np.asarray(view.convert("L") if len(shape) == 2 else view, dtype=np.uint8)
        path = dest / f"{i:05d}.npy"
        np.save(path, np.ascontiguousarray(array), allow_pickle=False)
        paths.append(path)
    return paths


def make_token_file(
    dest: Path, n_tokens: int, dtype: str = "int32", seed: int = 0, vocab_size: int = 32000
) -> Path:
    """Writes ``n_tokens`` token ids as one raw little-endian 1-D array.

    Ids follow a Zipf-Mandelbrot law, p(rank k) ~ 1 / (k + 2.7) ** 1.07, the
    shape of word and subword frequencies in real text; rank k is id k, since
    BPE vocabularies give frequent tokens low ids. The file therefore compresses
    like real token ids, unlike uniform random ids.

    Args:
        dest: Output file path; its folder is created if missing.
        n_tokens: Number of tokens.
        dtype: Integer dtype, e.g. "uint16", "int32", "int64".
        seed: Seed; the same seed gives byte-identical files.
        vocab_size: Number of distinct ids (0 .. vocab_size - 1).

    Returns:
        ``dest``.

    Raises:
        ValueError: The dtype is not an integer type or cannot hold the ids.
    """
    _check_count("n_tokens", n_tokens, 0)
    _check_count("vocab_size", vocab_size, 1)
    kind = np.dtype(dtype)
    if kind.kind not in "iu":
        raise ValueError(f"dtype must be an integer type, got {dtype!r}")
    if np.iinfo(kind).max < vocab_size - 1:
        raise ValueError(
            f"dtype {kind.name} holds ids up to {np.iinfo(kind).max}, but vocab_size "
            f"{vocab_size} needs {vocab_size - 1}; use a wider dtype such as int32"
        )
    weights = 1.0 / (np.arange(vocab_size, dtype=np.float64) + 2.7) ** 1.07
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    rng = np.random.default_rng([seed, 7])
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    little = kind.newbyteorder("<")
    # Chunks bound memory for billion-token files; one generator drawn in order
    # keeps the output independent of the chunk size.
    chunk = 1 << 22
    with open(dest, "wb") as out:
        for start in range(0, n_tokens, chunk):
            draws = rng.random(min(chunk, n_tokens - start))
            ids = np.minimum(np.searchsorted(cdf, draws, side="right"), vocab_size - 1)
            out.write(ids.astype(little).tobytes())
    return dest


def make_tar_shards(
    dest: Path,
    files: Sequence[Path],
    per_shard: int = 100,
    labels: Sequence[int] | None = None,
) -> list[Path]:
    """Packs files into WebDataset-style tars: ``dest/shard-000000.tar`` ...

    Sample ``k`` (0-based over ``files``) becomes two members, ``{k:06d}.jpg``
    (the file's bytes, under the file's own suffix) and ``{k:06d}.cls`` (its
    label as ASCII digits). Members carry fixed metadata (mtime 0, uid 0, mode
    0644), so the same inputs give byte-identical tars.

    Args:
        dest: Folder for the shards; created if missing.
        files: Files to pack, in order.
        per_shard: Samples per shard.
        labels: One label per file; by default a file's label is the index of
            its parent folder's name among the sorted parent names, as
            torchvision's ImageFolder numbers class folders.

    Returns:
        The shard paths, in order.

    Raises:
        ValueError: ``per_shard`` < 1, or ``labels`` does not match ``files``.
    """
    _check_count("per_shard", per_shard, 1)
    files = [Path(f) for f in files]
    if labels is None:
        names = sorted({f.parent.name for f in files})
        labels = [names.index(f.parent.name) for f in files]
    if len(labels) != len(files):
        raise ValueError(f"got {len(labels)} labels for {len(files)} files")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    shards = []
    for first in range(0, len(files), per_shard):
        shard = dest / f"shard-{first // per_shard:06d}.tar"
        with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tar:
            for k in range(first, min(first + per_shard, len(files))):
                suffix = files[k].suffix.lower() or ".bin"
                _add_member(tar, f"{k:06d}{suffix}", files[k].read_bytes())
                _add_member(tar, f"{k:06d}.cls", str(int(labels[k])).encode("ascii"))
        shards.append(shard)
    return shards


def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    info.mtime = 0  # a real mtime would make reruns differ byte for byte
    tar.addfile(info, io.BytesIO(data))
