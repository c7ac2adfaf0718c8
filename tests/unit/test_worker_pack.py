"""Worker batches of a fastload dataset cross to the parent through reused shared buffers."""

from __future__ import annotations

import gc
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from _loader_helpers import assert_same

import fastload
from fastload._torch_surface import TORCH_DATALOADER
from fastload._worker_pack import PACK_MIN_BYTES, Ring, RingRef, Slot, pack, unpack
from fastload.config import Settings
from fastload.dataset import FileDataset
from fastload.loader import _WORKER_COLLATE


@pytest.fixture()
def dataset(tmp_path: Path) -> FileDataset:
    root = tmp_path / "train"
    for c in range(3):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(12):
            # Sizes differ, so buffers must grow; some are too small to pack.
            body = (b"%d-%d " % (c, i)) * (40 + 300 * i)
            (root / f"c{c}" / f"{i:02d}.bin").write_bytes(body)
    return FileDataset(str(root), pattern="**/*.bin", label="parent", settings=Settings(cache_dir=tmp_path / "cache"))


def _seeded() -> torch.Generator:
    return torch.Generator().manual_seed(5)


def _torch_batches(dataset: Any, epochs: int, **kw: Any) -> list[Any]:
    loader = TORCH_DATALOADER(dataset, generator=_seeded(), **kw)
    return [b for _ in range(epochs) for b in loader]


def _roundtrip(batch: Any, ring: Ring, worker: int = 0) -> Any:
    packed, where = pack(batch, ring, worker)
    # What torch's queue does: pickle in the worker, unpickle in the parent.
    got, where = pickle.loads(pickle.dumps((packed, where)))
    return packed, unpack(got, where) if where is not None else got


def test_pack_moves_large_bytes_and_unpack_restores_them() -> None:
    ring = Ring(workers=1, depth=2)
    big, other = b"x" * PACK_MIN_BYTES, bytes(range(256)) * 20
    batch = {"data": [big, other, big], "small": b"tiny", "t": torch.arange(3), "n": ("a", [other])}
    packed, got = _roundtrip(batch, ring)
    assert type(packed["data"][0]) is Slot and packed["small"] == b"tiny"
    assert_same(batch, got)
    assert got["data"][0] is got["data"][2]  # an object that appeared twice is one object again
    assert got["n"][1][0] is got["data"][1]


def test_batch_without_large_bytes_is_left_alone() -> None:
    batch = {"x": torch.ones(2), "s": ["a", "b"], "b": [b"ab"]}
    out, where = pack(batch, Ring(1, 2), 0)
    assert out is batch and where is None


def test_buffers_are_reused_once_the_parent_releases_them() -> None:
    ring = Ring(workers=2, depth=2)
    data = [b"a" * 5000]
    # The first crossing of a buffer carries it; later ones only name it.
    first = pickle.loads(pickle.dumps(pack(data, ring, 1)[1]))
    assert isinstance(first, RingRef) and ring.free.tolist() == [1, 1, 0, 1]
    assert (1, first.index) in ring.mapped
    del first
    gc.collect()
    assert ring.free.tolist() == [1, 1, 1, 1]  # a dropped batch releases its lease too
    again = pack(data, ring, 1)[1]
    assert isinstance(again, RingRef) and again.buf is None and again.index == 0
    second = pack(data, ring, 1)[1]
    assert isinstance(second, RingRef) and second.index == 1 and second.buf is not None
    third = pack(data, ring, 1)[1]  # every buffer leased: a one-off buffer
    assert isinstance(third, torch.Tensor) and third.is_shared()


def test_a_larger_batch_grows_its_buffer_with_a_new_generation() -> None:
    ring = Ring(workers=1, depth=1)
    ref = pickle.loads(pickle.dumps(pack([b"a" * 2000], ring, 0)[1]))
    assert unpack([Slot(0, 2000)], ref) == [b"a" * 2000]
    packed, where = pack([b"b" * 9000], ring, 0)
    got = pickle.loads(pickle.dumps(where))
    assert got.gen == 1 and unpack(packed, got) == [b"b" * 9000]


@pytest.mark.parametrize("persistent", [False, True])
def test_worker_batches_equal_torchs_and_reuse_buffers(dataset: FileDataset, persistent: bool) -> None:
    kw: dict[str, Any] = dict(batch_size=5, shuffle=True, num_workers=2, persistent_workers=persistent)
    expected = _torch_batches(dataset, 3, **kw)
    loader = fastload.DataLoader(dataset, generator=_seeded(), **kw)
    got = []
    for _ in range(3):
        it = iter(loader)
        got += list(it)
    assert_same(expected, got)
    ring = _WORKER_COLLATE[it._torch].ring
    assert ring is not None
    # Buffers were reused: at most depth per worker, not one per batch (8 per epoch).
    assert 0 < len(ring.mapped) <= 2 * ring.depth
    assert ring.free.tolist() == [1] * (2 * ring.depth)  # every lease handed back


def test_epoch_stopped_early_then_persistent_workers_resume(dataset: FileDataset) -> None:
    kw: dict[str, Any] = dict(batch_size=4, num_workers=2, persistent_workers=True)
    loader = fastload.DataLoader(dataset, **kw)
    it = iter(loader)
    next(it), next(it)  # torch drops the batches in flight when the next epoch starts
    assert_same(_torch_batches(dataset, 1, batch_size=4), list(loader))
    ring = _WORKER_COLLATE[loader._iterator].ring
    assert ring is not None and ring.free.tolist() == [1] * (2 * ring.depth)
    loader._iterator._shutdown_workers()


def _join(batch: list[dict[str, Any]]) -> dict[str, Any]:
    # A user collate_fn: it must see bytes samples, as with torch's loader.
    assert all(type(s["data"]) is bytes for s in batch)
    return {"blob": b"|".join(s["data"] for s in batch), "urls": tuple(s["url"] for s in batch)}


def test_user_collate_sees_torchs_samples_and_its_output_arrives(dataset: FileDataset) -> None:
    kw: dict[str, Any] = dict(batch_size=6, num_workers=2, collate_fn=_join)
    assert_same(_torch_batches(dataset, 1, **kw), list(fastload.DataLoader(dataset, stats=False, **kw)))
