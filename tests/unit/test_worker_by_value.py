"""Small tensors of a worker's batch cross by value, not as shared-memory handles (issue 36).

torch sends each tensor as a shared-memory file descriptor that the parent fetches over a
new socket to the worker (``multiprocessing.resource_sharer.DupFd.detach``): about 0.4 ms
a batch for a label tensor. These tests count those hand-offs in the parent.
"""

from __future__ import annotations

import pickle
from multiprocessing import resource_sharer
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import pytest
import torch
from _loader_helpers import assert_same
from torch.utils.data import Dataset

import fastload
from fastload.config import Settings
from fastload.dataset import FileDataset
from fastload.device.worker_pack import BY_VALUE_MAX_BYTES, by_value
from fastload.loader.chain import _WORKER_COLLATE
from fastload.loader.torch_surface import TORCH_DATALOADER


@pytest.fixture()
def handoffs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the shared-memory file descriptors the parent fetches from workers."""
    if torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
        pytest.skip("counts torch's file_descriptor sharing strategy (Linux's default)")
    seen: list[int] = []
    detach = resource_sharer.DupFd.detach

    def counted(self: Any) -> Any:
        seen.append(1)
        return detach(self)

    monkeypatch.setattr(resource_sharer.DupFd, "detach", counted)
    return seen


def _cross(batch: Any) -> Any:
    """What torch's queue does to a worker's batch: ForkingPickler out, pickle in."""
    return pickle.loads(ForkingPickler.dumps(by_value(batch)))


def test_small_tensors_arrive_equal_with_dtype_strides_and_aliases() -> None:
    base = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    label = torch.tensor([3, 1, 4])
    batch = {"t": base.t(), "row": base[1], "labels": [label, label], "empty": torch.empty(0, 5)}
    got = _cross(batch)
    assert_same(batch, got)
    assert got["t"].stride() == (1, 4) and got["t"].dtype is torch.bfloat16
    assert got["labels"][0] is got["labels"][1]  # one object twice is one object again
    # Two views of one storage still share it, as torch's shared-memory tensors do.
    assert got["t"].untyped_storage().data_ptr() == got["row"].untyped_storage().data_ptr()
    got["row"][0] = 100
    assert got["t"][0, 1] == 100


def test_tensors_torch_must_rebuild_are_left_to_torch() -> None:
    big = torch.zeros(BY_VALUE_MAX_BYTES // 4 + 1)
    view = big[:2]  # small, but its storage is not: the whole storage would cross
    grad = torch.ones(2, requires_grad=True)
    batch = [big, view, grad, torch.nn.Parameter(torch.ones(2))]
    out = by_value(batch)
    assert all(a is b for a, b in zip(out, batch))


class _Labelled(Dataset):
    """Sample i -> (a 2 KB feature vector, label i)."""

    def __init__(self, n: int, width: int = 512) -> None:
        self.n, self.width = n, width

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((self.width,), float(i)), i


def test_a_torch_datasets_small_batches_cross_without_handoffs(handoffs: list[int]) -> None:
    ds = _Labelled(40)
    kw: dict[str, Any] = dict(batch_size=4, num_workers=2, shuffle=True)
    got = list(fastload.DataLoader(ds, generator=torch.Generator().manual_seed(3), **kw))
    assert not handoffs  # 10 batches of a (4, 512) float tensor and 4 labels: all by value
    assert_same(list(TORCH_DATALOADER(ds, generator=torch.Generator().manual_seed(3), **kw)), got)


def test_large_tensors_still_cross_as_shared_memory(handoffs: list[int]) -> None:
    ds = _Labelled(8, width=BY_VALUE_MAX_BYTES // 4)  # a batch of 4 is 4x the limit
    batches = list(fastload.DataLoader(ds, batch_size=4, num_workers=2))
    assert len(batches) == 2 and len(handoffs) == 2  # the features; the labels by value


@pytest.fixture()
def files(tmp_path: Path) -> FileDataset:
    for c in range(3):
        (tmp_path / "train" / f"c{c}").mkdir(parents=True)
        for i in range(12):
            (tmp_path / "train" / f"c{c}" / f"{i:02d}.bin").write_bytes(bytes([i]) * (2000 + 100 * i))
    return FileDataset(
        str(tmp_path / "train"), "**/*.bin", label="parent", settings=Settings(cache_dir=tmp_path / "cache")
    )


def test_file_batches_hand_off_only_their_buffers(files: FileDataset, handoffs: list[int]) -> None:
    # Each batch is spans into a reused buffer and a label tensor: the parent fetches a
    # descriptor per buffer, once, and none per batch (it fetched the labels' per batch).
    loader = fastload.DataLoader(files, batch_size=4, num_workers=2, persistent_workers=True)
    got = list(loader) + list(loader)
    assert_same(list(TORCH_DATALOADER(files, batch_size=4)) * 2, got)
    buffers = _WORKER_COLLATE[loader._iterator].buffers
    assert buffers is not None
    # One per buffer (2 x depth), plus a one-off buffer now and then where a loaded machine kept
    # the parent from giving one back in time: far fewer than one per batch (the labels' were 18).
    assert len(got) == 18 and 0 < len(handoffs) <= len(got) // 2
    loader._iterator._shutdown_workers()


def _same_size(tmp_path: Path) -> FileDataset:
    (tmp_path / "train").mkdir()
    for i in range(36):
        (tmp_path / "train" / f"{i:02d}.bin").write_bytes(bytes([i]) * 3000)
    return FileDataset(str(tmp_path / "train"), "*.bin", settings=Settings(cache_dir=tmp_path / "cache"))


def test_workers_of_later_passes_take_over_the_buffers(tmp_path: Path, handoffs: list[int]) -> None:
    # Without persistent workers each pass forks new ones; they map what the parent
    # mapped, so they reuse the buffers of the pass before: no new segment to hand over.
    # (Files of one size, so no buffer grows: at most one hand-off per buffer in all.)
    files = _same_size(tmp_path)
    loader = fastload.DataLoader(files, batch_size=4, num_workers=2)
    got = [b for _ in range(4) for b in loader]
    assert_same(list(TORCH_DATALOADER(files, batch_size=4)) * 4, got)
    buffers, _ = loader.__dict__["_fl_buffers"]
    assert 0 < len(handoffs) <= 2 * buffers.depth  # a new set per pass: 2 or more each, 8+ in all
    assert buffers.idle()


def test_two_passes_at_once_never_share_buffers(tmp_path: Path) -> None:
    # Two sets of live workers writing the same buffers would corrupt each other's
    # batches: only a pass whose workers are gone hands its buffers on.
    files = _same_size(tmp_path)
    loader = fastload.DataLoader(files, batch_size=4, num_workers=2)
    list(loader)
    done, _ = loader.__dict__["_fl_buffers"]
    first, second = iter(loader), iter(loader)
    a, b = _WORKER_COLLATE[first._torch].buffers, _WORKER_COLLATE[second._torch].buffers
    assert a is done and b is not None and b is not a
    expected = list(TORCH_DATALOADER(files, batch_size=4))
    assert_same([expected, expected], [list(x) for x in zip(*zip(first, second))])
