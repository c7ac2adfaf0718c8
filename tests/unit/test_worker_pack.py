"""Worker batches of a fastload dataset cross to the parent through reused shared buffers."""

from __future__ import annotations

import gc
import pickle
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _loader_helpers import assert_same

import fastload
from fastload.config import Settings
from fastload.dataset import FileDataset
from fastload.device.worker_pack import (
    BY_VALUE_MAX_BYTES,
    PACK_MIN_BYTES,
    BufferRef,
    SharedBuffers,
    Span,
    pack,
    unpack,
)
from fastload.loader.chain import _WORKER_COLLATE
from fastload.loader.torch_surface import TORCH_DATALOADER


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


def _roundtrip(batch: Any, buffers: SharedBuffers, worker: int = 0) -> Any:
    packed, where = pack(batch, buffers, worker)
    # What torch's queue does: pickle in the worker, unpickle in the parent.
    got, where = pickle.loads(pickle.dumps((packed, where)))
    return packed, unpack(got, where) if where is not None else got


def test_pack_moves_large_bytes_and_unpack_restores_them() -> None:
    buffers = SharedBuffers(workers=1, depth=2)
    big, other = b"x" * PACK_MIN_BYTES, bytes(range(256)) * 20
    batch = {"data": [big, other, big], "small": b"tiny", "t": torch.arange(3), "n": ("a", [other])}
    packed, got = _roundtrip(batch, buffers)
    assert type(packed["data"][0]) is Span and packed["small"] == b"tiny"
    assert_same(batch, got)
    assert got["data"][0] is got["data"][2]  # an object that appeared twice is one object again
    assert got["n"][1][0] is got["data"][1]


def test_batch_without_large_bytes_is_left_alone() -> None:
    # (A small tensor would be set to cross by value: tests/unit/test_worker_by_value.py.)
    batch = {"x": torch.ones(BY_VALUE_MAX_BYTES), "s": ["a", "b"], "b": [b"ab"]}
    out, where = pack(batch, SharedBuffers(1, 2), 0)
    assert out is batch and where is None


def test_buffers_are_reused_once_the_parent_releases_them() -> None:
    buffers = SharedBuffers(workers=2, depth=2)
    data = [b"a" * 5000]
    # The first crossing of a buffer carries it; later ones only name it.
    first = pickle.loads(pickle.dumps(pack(data, buffers, 1)[1]))
    assert isinstance(first, BufferRef) and buffers.free.tolist() == [1, 1, 0, 1]
    assert (1, first.index) in buffers.mapped
    del first
    gc.collect()
    assert buffers.free.tolist() == [1, 1, 1, 1]  # a dropped batch releases its lease too
    again = pack(data, buffers, 1)[1]
    assert isinstance(again, BufferRef) and again.buf is None and again.index == 0
    second = pack(data, buffers, 1)[1]
    assert isinstance(second, BufferRef) and second.index == 1 and second.buf is not None
    third = pack(data, buffers, 1)[1]  # every buffer leased: a one-off buffer
    assert isinstance(third, torch.Tensor) and third.is_shared()


def test_a_larger_batch_grows_its_buffer_with_a_new_generation() -> None:
    buffers = SharedBuffers(workers=1, depth=1)
    ref = pickle.loads(pickle.dumps(pack([b"a" * 2000], buffers, 0)[1]))
    assert unpack([Span(0, 2000)], ref) == [b"a" * 2000]
    packed, where = pack([b"b" * 9000], buffers, 0)
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
    buffers = _WORKER_COLLATE[it._torch].buffers
    assert buffers is not None
    # Buffers were reused: at most depth per worker, not one per batch (8 per epoch).
    assert 0 < len(buffers.mapped) <= 2 * buffers.depth
    assert buffers.free.tolist() == [1] * (2 * buffers.depth)  # every lease handed back


def test_epoch_stopped_early_then_persistent_workers_resume(dataset: FileDataset) -> None:
    kw: dict[str, Any] = dict(batch_size=4, num_workers=2, persistent_workers=True)
    loader = fastload.DataLoader(dataset, **kw)
    it = iter(loader)
    next(it), next(it)  # torch drops the batches in flight when the next epoch starts
    assert_same(_torch_batches(dataset, 1, batch_size=4), list(loader))
    buffers = _WORKER_COLLATE[loader._iterator].buffers
    assert buffers is not None and buffers.free.tolist() == [1] * (2 * buffers.depth)
    loader._iterator._shutdown_workers()


def _join(batch: list[dict[str, Any]]) -> dict[str, Any]:
    # A user collate_fn: it must see bytes samples, as with torch's loader.
    assert all(type(s["data"]) is bytes for s in batch)
    return {"blob": b"|".join(s["data"] for s in batch), "urls": tuple(s["url"] for s in batch)}


def test_user_collate_sees_torchs_samples_and_its_output_arrives(dataset: FileDataset) -> None:
    kw: dict[str, Any] = dict(batch_size=6, num_workers=2, collate_fn=_join)
    assert_same(_torch_batches(dataset, 1, **kw), list(fastload.DataLoader(dataset, stats=False, **kw)))


def _upper(data: bytes) -> bytes:
    return data.upper()


def _big_label(relpath: str) -> bytes:
    return relpath.encode() * 200  # large bytes beside the spans a worker reads into


@pytest.mark.parametrize("change", ["transform", "label"])
def test_samples_user_code_sees_are_bytes_and_arrive_equal(dataset: FileDataset, change: str) -> None:
    # A transform sees bytes (no spans read straight into a buffer); a label function's
    # large bytes make the worker turn its spans back into bytes before packing.
    if change == "transform":
        dataset.transform = _upper
    else:
        dataset.label = _big_label
    kw: dict[str, Any] = dict(batch_size=5, num_workers=2, shuffle=True)
    expected = _torch_batches(dataset, 2, **kw)
    loader = fastload.DataLoader(dataset, generator=_seeded(), **kw)
    assert_same(expected, [b for _ in range(2) for b in loader])
    if change == "transform":
        assert expected[0]["data"][0] == expected[0]["data"][0].upper()


def test_read_buffer_is_only_lent_in_a_packing_worker() -> None:
    from fastload.device.worker_pack import read_buffer

    assert read_buffer(100) is None  # the parent: datasets read into their own buffers


def _as_array(data: bytes) -> Any:
    import numpy as np

    return np.frombuffer(data, dtype=np.uint8).copy()


def _arrays(batch: list[dict[str, Any]]) -> list[Any]:
    return [s["data"] for s in batch]  # numpy arrays: pickled through the pipe


@pytest.fixture()
def big(tmp_path: Path) -> FileDataset:
    """Batches of 12 files are 1.2 MB."""
    (tmp_path / "big").mkdir()
    for i in range(24):
        (tmp_path / "big" / f"{i:02d}.bin").write_bytes(bytes([i]) * 100_000)
    return FileDataset(str(tmp_path / "big"), "*.bin", settings=Settings(cache_dir=tmp_path / "c"))


def test_slow_worker_configuration_warns_once_with_the_number_and_the_fix(big: FileDataset) -> None:
    dataset = big
    dataset.transform = _as_array
    loader = fastload.DataLoader(dataset, batch_size=12, num_workers=2, collate_fn=_arrays)
    pattern = r"1\.2 MB of each batch from FileDataset .*pickled.*fix: .*torch tensors.*num_workers=0"
    with pytest.warns(UserWarning, match=pattern) as caught:
        list(loader)
        list(loader)
    assert len([w for w in caught if "pickled" in str(w.message)]) == 1


def test_packed_batches_do_not_warn(big: FileDataset, recwarn: pytest.WarningsRecorder) -> None:
    batches = list(fastload.DataLoader(big, batch_size=12, num_workers=2, collate_fn=_join))
    assert len(batches) == 2 and len(batches[0]["blob"]) == 12 * 100_000 + 11
    assert not [w for w in recwarn if "pickled" in str(w.message)]


def test_spawned_workers_get_the_shared_buffers_by_pickle(big: FileDataset) -> None:
    # Workers get settings, not handles: the buffers's free table crosses as shared memory.
    kw: dict[str, Any] = dict(batch_size=4, num_workers=2, multiprocessing_context="spawn", persistent_workers=True)
    loader = fastload.DataLoader(big, **kw)
    got = list(loader) + list(loader)
    assert_same(_torch_batches(big, 1, batch_size=4) * 2, got)
    buffers = _WORKER_COLLATE[loader._iterator].buffers
    assert buffers is not None and 0 < len(buffers.mapped) <= 2 * buffers.depth
    loader._iterator._shutdown_workers()


def test_a_packed_batch_survives_torchs_pin_memory_thread() -> None:
    # With an accelerator torch's pin_memory thread calls WorkerBatch.pin_memory before
    # the parent unpacks: the spans and the buffer's lease must come through.
    from torch.utils.data._utils.pin_memory import pin_memory

    from fastload.loader.worker_stats import Unwrap, WorkerBatch

    buffers = SharedBuffers(workers=1, depth=2)
    batch = {"data": [b"a" * 3000, b"b" * 4000], "url": ["u0", "u1"]}
    packed, where = pack(batch, buffers, 0)
    sent = pickle.loads(pickle.dumps(WorkerBatch(packed, None, where, 17)))
    pinned = pin_memory(sent)
    assert type(pinned) is WorkerBatch and pinned.packed is sent.packed and pinned.pickled == 17
    seen: list[int] = []
    box = [pinned]
    got = Unwrap(box.pop, None, None, seen.append)()
    assert got == batch and seen == [17]
    del sent, pinned
    gc.collect()
    assert buffers.free.tolist() == [1, 1]


@pytest.fixture()
def packing_worker() -> Any:
    """This process as a worker that packs with a user collate_fn (as WorkerCollate sets it up)."""
    from fastload.device import worker_pack

    buffers = SharedBuffers(workers=1, depth=2)
    worker_pack.activate(buffers, 0, default_collate=False)
    yield buffers
    worker_pack._READING = None


def _split_batch(extra: bytes | None) -> tuple[dict[str, Any], Any]:
    from fastload.device.worker_pack import read_buffer, split_read

    assert read_buffer(100) is None  # spans as samples need torch's default_collate
    lent = read_buffer(12_000, spans=False)
    assert lent is not None
    lent[:] = np.frombuffer((bytes(range(200)) * 60)[:12_000], dtype=np.uint8)
    samples = split_read(lent, [(0, 5000), (6000, 3000), (9000, 500)])
    assert [type(s) for s in samples] == [bytes] * 3 and samples[1] == bytes(lent[6000:9000])
    return ({"data": samples} if extra is None else {"data": samples, "label": extra}), lent


def test_bytes_split_from_the_lent_buffer_cross_as_spans_of_it(packing_worker: SharedBuffers) -> None:
    # A user collate_fn sees bytes; those still in its batch cross in the buffer they were
    # read into, with no second copy into another buffer.
    batch, _ = _split_batch(None)
    gc.disable()  # the refcounts below are the packer's, not the collector's
    try:
        base = sys.getrefcount(batch["data"][0])
        packed, where = pack(batch, packing_worker, 0)
        assert sys.getrefcount(batch["data"][0]) == base  # the worker keeps none of them
    finally:
        gc.enable()
    assert [(s.start, s.size) for s in packed["data"][:2]] == [(0, 5000), (6000, 3000)]  # where they were read
    assert packed["data"][2] is batch["data"][2]  # under PACK_MIN_BYTES: in the pickle
    assert isinstance(where, BufferRef) and packing_worker.free.tolist() == [0, 1]  # the one lent buffer
    got, where = pickle.loads(pickle.dumps((packed, where)))
    assert_same(batch, unpack(got, where))


def test_other_large_bytes_beside_split_ones_are_copied_with_them(packing_worker: SharedBuffers) -> None:
    batch, _ = _split_batch(b"e" * 2000)  # made by user code: not in the lent buffer
    packed, where = pack(batch, packing_worker, 0)
    assert [(s.start, s.size) for s in packed["data"][:2]] == [(0, 5000), (5000, 3000)]  # copied, in order
    assert type(packed["label"]) is Span and packing_worker.free.tolist() == [0, 1]
    got, where = pickle.loads(pickle.dumps((packed, where)))
    assert_same(batch, unpack(got, where))


def test_pack_keeps_no_bytes_once_it_returns() -> None:
    # Bytes a packer held waited for the cyclic GC (a fresh worker faulted new memory for
    # each of its first dozen batches); they are free as soon as pack returns.
    buffers = SharedBuffers(workers=1, depth=2)
    data = b"y" * 5000
    gc.collect()
    gc.disable()
    try:
        base = sys.getrefcount(data)
        packed, where = pack([data, data], buffers, 0)
        assert type(packed[0]) is Span and sys.getrefcount(data) == base
    finally:
        gc.enable()


def _ready(batch: list[dict[str, Any]]) -> dict[str, Any]:
    # Runs in the worker after its dataset read the batch: was that read into a shared buffer?
    from fastload.device import worker_pack

    return {"ready": worker_pack._READING is not None, "data": [s["data"] for s in batch]}


@pytest.mark.parametrize("persistent", [False, True])
def test_a_forked_worker_reads_its_first_batch_into_a_shared_buffer(dataset: FileDataset, persistent: bool) -> None:
    # Before, a worker packed only from its second batch: its first was read into memory of its
    # own, then copied into a buffer (a fresh worker each epoch without persistent workers).
    loader = fastload.DataLoader(dataset, batch_size=6, num_workers=2, collate_fn=_ready, persistent_workers=persistent)
    for _ in range(2):
        batches = list(loader)
        assert [b["ready"] for b in batches] == [True] * 6
        assert sorted(d for b in batches for d in b["data"]) == sorted(s["data"] for s in dataset)
    if persistent:
        loader._iterator._shutdown_workers()
