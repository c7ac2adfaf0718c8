"""Datasets and comparisons shared by the loader tests (importable by worker processes)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from fastload.source import RemoteItem


def local_items(folder: Path, n: int) -> list[RemoteItem]:
    """``n`` local files of 100 bytes each (file k holds byte k), as sized items of version "v1"."""
    out = []
    for k in range(n):
        path = folder / f"{k}.bin"
        path.write_bytes(bytes([k]) * 100)
        out.append(RemoteItem(path.as_uri(), 100, "v1"))
    return out


class TensorDS(Dataset):
    """Sample i -> (float tensor of shape (3,), int label)."""

    def __init__(self, n: int = 23) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.arange(3, dtype=torch.float32) + 10 * i, i % 5


class DictDS(Dataset):
    """Sample i -> dict with a tensor, a numpy array, a string and a nested list."""

    def __init__(self, n: int = 17) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {
            "x": torch.full((2, 2), float(i)),
            "a": np.arange(3, dtype=np.int64) * i,
            "name": f"s{i}",
            "pair": [i, torch.tensor([i, -i], dtype=torch.int16)],
        }


class RandomDS(Dataset):
    """__getitem__ draws from the global torch RNG (an augmentation)."""

    def __init__(self, n: int = 12) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.rand(2) + i


class RangeIterDS(IterableDataset):
    """An IterableDataset yielding tensors 0..n-1 (with __len__)."""

    def __init__(self, n: int = 11) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = torch.utils.data.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            yield torch.tensor([i])


class ReadBatchDS(TensorDS):
    """A TensorDS with the read_batch hook; counts how samples were read."""

    def __init__(self, n: int = 23) -> None:
        super().__init__(n)
        self.lock = threading.Lock()
        self.getitem_calls = 0
        self.read_batch_calls = 0
        self.read_indices: list[int] = []
        self.threads: set[str] = set()

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        with self.lock:
            self.getitem_calls += 1
        return super().__getitem__(i)

    def read_batch(self, indices: list[int]) -> list[tuple[torch.Tensor, int]]:
        with self.lock:
            self.read_batch_calls += 1
            self.read_indices.extend(indices)
            self.threads.add(threading.current_thread().name)
        return [TensorDS.__getitem__(self, i) for i in indices]


class AnnouncingDS(TensorDS):
    """A dataset that can fetch ahead: sample i -> ``(TensorDS sample, announced)``.

    ``announced`` is 1 when the index batch holding i was announced to this process
    (``fetch_ahead``, through :func:`fastload.fetch.announce`, as fastload's
    datasets do) before its read, else 0. Each announcement is used up by one read.
    """

    def __init__(self, n: int = 23) -> None:
        super().__init__(n)
        self.announced: list[tuple[int, ...]] = []  # per process: each worker has its own copy

    def fetch_ahead(self, indices: list[int]) -> None:
        self.announced.append(tuple(indices))

    def __getitems__(self, indices: list[int]) -> list[Any]:
        from fastload.fetch import announce

        announce(indices, self.fetch_ahead)
        key = tuple(indices)
        hit = key in self.announced
        if hit:
            self.announced.remove(key)
        return [(self[i], int(hit)) for i in indices]


class CountingDS(TensorDS):
    """Records every index read through __getitem__ (in this process)."""

    def __init__(self, n: int = 23) -> None:
        super().__init__(n)
        self.reads: list[int] = []

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        self.reads.append(i)
        return super().__getitem__(i)


def assert_same(a: Any, b: Any, path: str = "batch") -> None:
    """Deep equality with types: tensors by dtype, shape and values."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {a.shape} != {b.shape}"
        assert torch.equal(a, b), f"{path}: {a} != {b}"
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: len {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
