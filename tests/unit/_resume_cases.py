"""Datasets and a script runner for comparing fastload's resume with torchdata's StatefulDataLoader.

Importable by worker processes. No dataset here draws from an RNG: StatefulDataLoader
does not restore a worker's RNG mid-epoch, so samples are compared as plain ids.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info


def _shard(n: int) -> list[int]:
    info = get_worker_info()
    wid, workers = (0, 1) if info is None else (info.id, info.num_workers)
    return list(range(wid, n, workers))


class SelfIterStream(IterableDataset):
    """``__iter__`` returns self and sets up its position there; state_dict() is that position (issue 33, case 1)."""

    def __init__(self, n: int = 100) -> None:
        self.n = n

    def __iter__(self) -> SelfIterStream:
        self.items = _shard(self.n)
        self.iter_state = {"i": 0}
        return self

    def __next__(self) -> int:
        i = self.iter_state["i"]
        if i >= len(self.items):
            raise StopIteration
        self.iter_state["i"] = i + 1
        return self.items[i]

    def state_dict(self) -> dict[str, int]:
        return {"i": self.iter_state["i"]}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.iter_state["i"] = int(state["i"])


class EpochStream(IterableDataset):
    """A generator that counts its epochs after its last yield: sample = epoch * 1000 + id (case 2).

    Its state is faithful at the end of an epoch too: the next epoch's number, position 0.
    """

    def __init__(self, n: int = 24) -> None:
        self.n = n
        self.epoch = 0
        self.pos = 0
        self.start_at = 0

    def __iter__(self) -> Iterator[int]:
        mine = _shard(self.n)
        start, self.start_at = self.start_at, 0
        self.pos = start
        for x in mine[start:]:
            self.pos += 1
            yield self.epoch * 1000 + x
        self.epoch += 1  # work after the last yield
        self.pos = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.start_at = int(state["pos"])


class PlainGen(IterableDataset):
    """A plain generator: no state_dict() (case 4)."""

    def __init__(self, n: int = 24) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        yield from _shard(self.n)


class Ids(Dataset):
    """Map-style: sample i is i."""

    def __init__(self, n: int = 24) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def ids(batches: list[Any]) -> list[int]:
    """The sample ids of a list of batches, in order."""
    out: list[int] = []
    for b in batches:
        out.extend(int(x) for x in (b.reshape(-1) if isinstance(b, torch.Tensor) else b))
    return out


def run(
    make: Callable[[], Any], epochs: int, cuts: set[tuple[int, int]], as_json: bool = True
) -> list[int]:
    """The samples of ``epochs`` epochs of ``make()``, cut at ``cuts``: the samples, in order.

    A cut ``(e, k)`` saves ``state_dict()`` after batch ``k`` of epoch ``e`` (``k=-1``:
    after the epoch ended), drops the loader and goes on with a new one that loaded it
    (through JSON when ``as_json``), as a restarted training script does. Two cuts in
    one epoch save a state right after a restore.
    """
    out: list[Any] = []
    loader = make()

    def restart(old: Any) -> Any:
        state = old.state_dict()
        if as_json:
            state = json.loads(json.dumps(state))
        new = make()
        new.load_state_dict(state)
        return new

    for e in range(epochs):
        it = iter(loader)
        k = 0
        while True:
            if (e, k) in cuts:
                del it
                loader = restart(loader)
                it = iter(loader)
            try:
                out.append(next(it))
            except StopIteration:
                break
            k += 1
        del it
        if (e, -1) in cuts:
            loader = restart(loader)
    return ids(out)
