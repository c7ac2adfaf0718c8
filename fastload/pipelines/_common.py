"""Shared plumbing of the pipelines: placement, backend choice, samples, bad input.

Nothing here imports DALI; :mod:`fastload.pipelines._registry` does, on first use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fastload.device.prefetch import DevicePrefetcher
from fastload.errors import ConfigError, DecodeError, LoaderError
from fastload.pipelines import _registry
from fastload.stats import current_collector

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

#: Output dtypes the pipelines produce, by name.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "uint8": torch.uint8,
}
BACKENDS = ("auto", "dali", "torch")
ON_ERROR = ("raise", "skip")
SKIPPED = "decode_skipped"  # the stats counter a skipped sample increments


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device outputs land on: ``cuda`` when available and ``device`` is None."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device={str(device)!r} but torch.cuda.is_available() is False; pass device='cpu' "
                "(or None to choose automatically)"
            )
        return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
    if dev.type != "cpu":
        raise ConfigError(f"device={str(device)!r}: the pipelines run on 'cuda' or 'cpu'")
    return dev


def resolve_backend(backend: str, *, prefer_dali: bool) -> str:
    """``"dali"`` or ``"torch"``: the one asked for, or for ``"auto"`` DALI when it imports.

    Raises:
        ConfigError: ``backend`` is not one of :data:`BACKENDS`.
        ImportError: ``backend="dali"`` and DALI is not installed (says how to install it).
    """
    if backend not in BACKENDS:
        raise ConfigError(f"backend={backend!r} is not one of {', '.join(map(repr, BACKENDS))}")
    if backend == "dali":
        _registry.load("dali")
        return "dali"
    if backend == "torch":
        return "torch"
    return "dali" if prefer_dali and _registry.available("dali") else "torch"


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not one of {', '.join(map(repr, choices))}")


def derive_seed(seed: int | None) -> int:
    """The pipeline's seed; None follows torch's (so ``torch.manual_seed`` makes runs repeat)."""
    base = torch.initial_seed() if seed is None else int(seed)
    return base % (2**31 - 1)


def forbid_cuda_in_worker(device: torch.device, what: str) -> None:
    """A CUDA pipeline must run in the main process: CUDA does not survive fork."""
    if device.type == "cuda" and torch.utils.data.get_worker_info() is not None:
        raise LoaderError(
            f"{what} on {device} was called inside a DataLoader worker process; CUDA cannot be "
            "used in forked workers. Use num_workers=0 (fastload datasets read in parallel "
            "threads through read_batch), or device='cpu' in workers"
        )


def as_bytes_array(data: Any, url: str, index: int) -> np.ndarray:
    """Encoded bytes (bytes, memoryview, uint8 ndarray or tensor) as a 1-D uint8 array."""
    if isinstance(data, torch.Tensor):
        data = data.numpy()
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8:
            raise DecodeError(f"sample {index} ({url}): encoded image is {data.dtype}, expected bytes/uint8")
        return np.ascontiguousarray(data.reshape(-1))
    if isinstance(data, (bytes, bytearray, memoryview)):
        return np.frombuffer(data, dtype=np.uint8)
    raise DecodeError(
        f"sample {index} ({url}): image field is a {type(data).__name__}, expected encoded bytes; "
        "pass the raw file bytes (FileDataset without transform=) or set image_key="
    )


def sample_url(sample: Any, index: int) -> str:
    if isinstance(sample, Mapping):
        for key in ("url", "__url__", "__key__"):
            if key in sample:
                return str(sample[key])
    return f"<sample {index} of the batch>"


def field(sample: Any, key: str, position: int) -> Any:
    """``sample[key]`` for dict samples, ``sample[position]`` for (data, label) tuples."""
    if isinstance(sample, Mapping):
        return sample.get(key)
    if isinstance(sample, (tuple, list)):
        return sample[position] if len(sample) > position else None
    return sample if position == 0 else None


def to_label(value: Any) -> int:
    """A label as an int: ints, numpy/torch scalars, and ASCII digits (tar ``.cls``)."""
    if isinstance(value, (bytes, bytearray)):
        value = value.decode("ascii").strip()
    if isinstance(value, str):
        return int(value)
    if isinstance(value, torch.Tensor):
        return int(value.item())
    return int(value)


def labels_tensor(labels: list[Any], device: torch.device) -> torch.Tensor:
    """The batch's labels as an int64 tensor on ``device``."""
    return torch.tensor([to_label(v) for v in labels], dtype=torch.int64).to(device, non_blocking=True)


class Failures:
    """What happens to a bad sample: raise a DecodeError, or skip it and count it."""

    def __init__(self, on_error: str, what: str) -> None:
        check_choice("on_error", on_error, ON_ERROR)
        self.on_error = on_error
        self.what = what
        self.skipped = 0  # over this pipeline's lifetime

    def bad(self, url: str, index: int, why: str, err: BaseException | None = None) -> None:
        """Raise (``on_error="raise"``) or count (``"skip"``) sample ``index`` of a batch."""
        if self.on_error == "skip":
            self.skipped += 1
            current_collector().count(SKIPPED)
            return
        raise DecodeError(
            f"{self.what}: cannot decode sample {index} of the batch ({url}): {why}; fix: repair "
            "or remove the file, or pass on_error='skip' to skip bad samples (counted as "
            f"'{SKIPPED}' in loader.stats())"
        ) from err


class HostToDevice:
    """Moves host batches to the device through a reused pinned ring (fastload.device.prefetch).

    One :class:`~fastload.device.prefetch.DevicePrefetcher` per pipeline: its slots are
    allocated once and reused, released by CUDA events, so no batch pins memory
    anew (pytorch/pytorch#97432). On a CPU device it returns the batch unchanged.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._ring: DevicePrefetcher[Any] | None = None

    def __call__(self, batch: Any) -> Any:
        if self.device.type == "cpu":
            return batch
        if self._ring is None:
            self._ring = DevicePrefetcher(None, self.device, slots=2, depth=0)
        return next(self._ring.iterate((batch,), depth=0))

    def __getstate__(self) -> dict[str, Any]:
        return {"device": self.device}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["device"])  # type: ignore[misc]
