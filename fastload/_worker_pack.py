"""Payload bytes of a worker's batch moved to the parent through reused shared memory.

torch's workers send each batch to the parent pickled through a pipe. Tensors
travel as shared memory (only a handle is pickled), but ``bytes`` - a
FileDataset sample's payload, collated into a list - are copied into the
pickle, through the pipe in 64 KB pieces and out again: with ``num_workers=2``
that cost most of the loader's speed (issue 13: 3,400-4,200 samples/s of 112 KB
against 10,600-13,400 with ``num_workers=0``). A fresh shared buffer per batch
is not enough either: the parent then maps new pages for every batch and
faults each one in.

So each worker keeps a ring of ``depth`` shared uint8 buffers, and the parent
maps each buffer once:

* :func:`pack` (in the worker, after the user's collate_fn) puts every ``bytes``
  of at least PACK_MIN_BYTES found in the batch's dicts, lists and tuples into a
  free buffer of its ring and leaves a :class:`Slot` in its place. The
  :class:`RingRef` it returns carries the buffer itself only the first time
  (or when the buffer grew); later batches name it by ``(worker, index, generation)``.
* The parent learns a buffer when a RingRef is unpickled (torch unpickles every
  result in arrival order, even results it then drops), so a name always refers
  to a buffer already seen. The unpickled RingRef holds the buffer's lease: when
  it is released (after :func:`unpack`, or when torch drops the batch) the
  buffer's flag in the ring's shared ``free`` table is set and the worker may
  reuse it. A worker that finds no free buffer uses a one-off one.
* :func:`unpack` (in the parent, before anything sees the batch) puts equal
  ``bytes`` back, so the batch the user gets is what their collate_fn returned
  (an object that appeared twice is one object again). Other containers and
  values travel untouched, as torch sends them.

Vocabulary: a *ring* is one loader iterator's set of buffers over all workers; a
*slot* is one packed ``bytes``' place in a buffer; a *lease* is the parent's hold
on a buffer until its bytes are copied out.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch

__all__ = ["PACK_MIN_BYTES", "Ring", "RingRef", "Slot", "pack", "unpack"]

#: Smaller bytes stay in the pickle: a slot and its copy cost more than they save.
PACK_MIN_BYTES = 1024
#: A buffer that must grow gets this much headroom, so slightly larger batches fit.
GROWTH = 1.25

_RING_IDS = itertools.count()
# Rings alive in this (parent) process, by id: where unpickled RingRefs find theirs.
_PARENT_RINGS: weakref.WeakValueDictionary[int, Ring] = weakref.WeakValueDictionary()


def _shared_bytes(size: int) -> torch.Tensor:
    # In shared memory from the start, as torch's default_collate allocates a batch
    # tensor inside a worker: pickling it sends a handle, never the bytes.
    storage = torch.empty(0, dtype=torch.uint8)._typed_storage()._new_shared(size)
    return torch.empty(0, dtype=torch.uint8).new(storage)  # type: ignore[call-overload,no-any-return]


class Ring:
    """Reused shared buffers, ``depth`` per worker; built in the parent before workers start.

    Pickled (or inherited by fork) into each worker with its ``free`` table, which
    stays shared; each worker process then keeps its own buffers.
    """

    def __init__(self, workers: int, depth: int) -> None:
        self.id = next(_RING_IDS)
        self.depth = depth
        self.free = torch.ones(workers * depth, dtype=torch.uint8).share_memory_()
        self._free = self.free.numpy()
        # worker side: index -> [generation, buffer, sent to the parent already]
        self._mine: dict[int, list[Any]] = {}
        # parent side: (worker, index) -> (generation, buffer as a memoryview)
        self.mapped: dict[tuple[int, int], tuple[int, memoryview]] = {}
        _PARENT_RINGS[self.id] = self

    def __getstate__(self) -> dict[str, Any]:
        return {"id": self.id, "depth": self.depth, "free": self.free}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.id, self.depth, self.free = state["id"], state["depth"], state["free"]
        self._free = self.free.numpy()
        self._mine, self.mapped = {}, {}

    def acquire(self, worker: int, size: int) -> tuple[RingRef | None, torch.Tensor]:
        """A buffer of at least ``size`` bytes for this worker's next batch, and its ref.

        The ref is None for a one-off buffer (every buffer of the ring is leased).
        """
        base = worker * self.depth
        free = self._free
        grow = None
        for j in range(self.depth):
            if not free[base + j]:
                continue
            held = self._mine.get(j)
            if held is not None and held[1].numel() >= size:
                free[base + j] = 0
                ref = RingRef(self.id, worker, j, held[0], None if held[2] else held[1])
                held[2] = True
                return ref, held[1]
            if grow is None:
                grow = j
        if grow is None:
            return None, _shared_bytes(size)
        gen = self._mine[grow][0] + 1 if grow in self._mine else 0
        buf = _shared_bytes(max(size, int(size * GROWTH)))
        self._mine[grow] = [gen, buf, True]
        free[base + grow] = 0
        return RingRef(self.id, worker, grow, gen, buf), buf

    def learn(self, worker: int, index: int, gen: int, buf: torch.Tensor) -> None:
        """Parent: map a buffer a worker sent (called while its batch is unpickled)."""
        self.mapped[(worker, index)] = (gen, buf.numpy().data)

    def release(self, worker: int, index: int) -> None:
        """Parent: the buffer's bytes are copied out (or its batch was dropped)."""
        self._free[worker * self.depth + index] = 1


class RingRef:
    """A batch's buffer: by name, plus the buffer itself the first time it crosses.

    In the parent it is the buffer's lease: :meth:`release` (or garbage collection)
    hands the buffer back to its worker.
    """

    __slots__ = ("ring", "worker", "index", "gen", "buf", "_ring", "__weakref__")

    def __init__(self, ring: int, worker: int, index: int, gen: int, buf: torch.Tensor | None) -> None:
        self.ring, self.worker, self.index, self.gen, self.buf = ring, worker, index, gen, buf
        self._ring: Ring | None = None  # set in the parent only: the lease is held

    def __reduce__(self) -> tuple[Any, ...]:
        return (_received, (self.ring, self.worker, self.index, self.gen, self.buf))

    def view(self) -> memoryview:
        """Parent: the buffer's bytes."""
        ring = self._ring
        if ring is None:
            raise RuntimeError(f"fastload: batch buffer {self.worker}/{self.index} arrived without its ring")
        gen, view = ring.mapped[(self.worker, self.index)]
        if gen != self.gen:
            raise RuntimeError(f"fastload: batch buffer {self.worker}/{self.index} is generation {gen}, not {self.gen}")
        return view

    def release(self) -> None:
        ring, self._ring = self._ring, None
        if ring is not None:
            ring.release(self.worker, self.index)

    def __del__(self) -> None:
        self.release()


def _received(ring_id: int, worker: int, index: int, gen: int, buf: torch.Tensor | None) -> RingRef:
    ref = RingRef(ring_id, worker, index, gen, None)
    ring = _PARENT_RINGS.get(ring_id)
    if ring is not None:
        if buf is not None:
            ring.learn(worker, index, gen, buf)
        ref._ring = ring
    return ref


class Slot:
    """Where a packed ``bytes`` was: its (offset, size) in the batch's buffer."""

    __slots__ = ("start", "size")

    def __init__(self, start: int, size: int) -> None:
        self.start, self.size = start, size

    def __reduce__(self) -> tuple[Any, ...]:
        return (Slot, (self.start, self.size))


class _Packer:
    def __init__(self) -> None:
        self.found: list[bytes] = []
        self.slots: list[Slot] = []
        self.slot_of: dict[int, Slot] = {}  # id(bytes) -> its slot, so aliases stay one object
        self.size = 0

    def walk(self, obj: Any) -> Any:
        kind = type(obj)
        if kind is bytes:
            if len(obj) < PACK_MIN_BYTES:
                return obj
            slot = self.slot_of.get(id(obj))
            if slot is None:
                slot = self.slot_of[id(obj)] = Slot(self.size, len(obj))
                self.found.append(obj)
                self.size += len(obj)
            return slot
        if kind is list:
            return [self.walk(x) for x in obj]
        if kind is dict:
            return {k: self.walk(v) for k, v in obj.items()}
        if kind is tuple:
            return tuple(self.walk(x) for x in obj)
        return obj  # tensors, str, custom types: travel as torch sends them


def pack(batch: Any, ring: Ring, worker: int) -> tuple[Any, RingRef | torch.Tensor | None]:
    """``batch`` with its large ``bytes`` replaced by slots, and where they went.

    Returns the batch unchanged and None when it holds no such bytes; else the
    packed batch and a RingRef (or, when the ring had no free buffer, a one-off
    shared tensor).
    """
    packer = _Packer()
    out = packer.walk(batch)
    if not packer.found:
        return batch, None
    ref, buf = ring.acquire(worker, packer.size)
    view = buf.numpy().data
    pos = 0
    for data in packer.found:
        view[pos : pos + len(data)] = data
        pos += len(data)
    return out, (ref if ref is not None else buf)


class _Unpacker:
    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.made: dict[int, bytes] = {}

    def walk(self, obj: Any) -> Any:
        kind = type(obj)
        if kind is Slot:
            data = self.made.get(obj.start)
            if data is None:
                data = self.made[obj.start] = bytes(self.view[obj.start : obj.start + obj.size])
            return data
        if kind is list:
            return [self.walk(x) for x in obj]
        if kind is dict:
            return {k: self.walk(v) for k, v in obj.items()}
        if kind is tuple:
            return tuple(self.walk(x) for x in obj)
        return obj


def unpack(batch: Any, where: RingRef | torch.Tensor) -> Any:
    """The batch :func:`pack` was given, with equal ``bytes`` copied out of the buffer."""
    if isinstance(where, RingRef):
        try:
            return _Unpacker(where.view()).walk(batch)
        finally:
            where.release()
    return _Unpacker(where.numpy().data).walk(batch)
