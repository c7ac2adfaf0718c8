"""Datasets and samplers with their own state or RNG draws, for the resume tests (importable by workers)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info


class DrawingDS(Dataset):
    """Sample i -> (i, a draw from random, numpy and torch's global RNGs): an augmentation."""

    def __init__(self, n: int = 24) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), random.random(), float(np.random.rand()), float(torch.rand(()))], dtype=torch.float64)


class CountingStream(IterableDataset):
    """Yields ``start + k * step`` plus an RNG draw; shards by worker; state_dict() is its position.

    The position advances as items are yielded, as Hugging Face's IterableDataset
    tracks it; ``load_state_dict`` makes the next ``iter()`` start there.
    """

    def __init__(self, n: int = 30) -> None:
        self.n = n
        self.pos: int | None = None  # items of this worker's shard yielded so far
        self.start_at = 0

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos or 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.start_at = int(state["pos"])

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        wid, workers = (0, 1) if info is None else (info.id, info.num_workers)
        mine = list(range(wid, self.n, workers))
        self.pos, self.start_at = self.start_at, 0
        while self.pos < len(mine):
            i = mine[self.pos]
            self.pos += 1
            yield torch.tensor([float(i), random.random(), float(torch.rand(()))], dtype=torch.float64)


class PlainStream(IterableDataset):
    """An IterableDataset with no state_dict()."""

    def __iter__(self) -> Iterator[int]:
        return iter(range(10))


class OwnRandomSampler(Sampler[int]):
    """Shuffles with its own ``random.Random``; state_dict() holds that generator's state."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.rng = random.Random(seed)

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        order = list(range(self.n))
        self.rng.shuffle(order)
        return iter(order)

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = self.rng.getstate()
        return {"rng": [version, list(internal), gauss]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))


class CallCountDS(Dataset):
    """Sample i -> (i, calls so far in this process): a map-style dataset with its own state."""

    def __init__(self, n: int = 20) -> None:
        self.n = n
        self.calls = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.calls += 1
        return torch.tensor([i, self.calls])

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls = int(state["calls"])


class _Position(Iterator[torch.Tensor]):
    def __init__(self, items: list[int]) -> None:
        self.items, self.i = items, 0

    def __next__(self) -> torch.Tensor:
        if self.i >= len(self.items):
            raise StopIteration
        self.i += 1
        return torch.tensor([float(self.items[self.i - 1]), float(torch.rand(()))])

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.i = int(state["i"])


class StatefulIterStream(IterableDataset):
    """No state of its own: ``iter()`` returns an iterator with state_dict() (torchdata's other form)."""

    def __init__(self, n: int = 26) -> None:
        self.n = n

    def __iter__(self) -> _Position:
        info = get_worker_info()
        wid, workers = (0, 1) if info is None else (info.id, info.num_workers)
        return _Position(list(range(wid, self.n, workers)))
