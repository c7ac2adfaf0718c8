"""Payload bytes of a worker's batch moved to the parent through reused shared memory.

torch's workers send each batch to the parent pickled through a pipe. Tensors
travel as shared memory (only a handle is pickled), but ``bytes`` - a
FileDataset sample's payload, collated into a list - are copied into the
pickle, through the pipe in 64 KB pieces and out again: with ``num_workers=2``
that cost most of the loader's speed (issue 13: 3,400-4,200 samples/s of 112 KB
against 10,600-13,400 with ``num_workers=0``). A fresh shared buffer per batch
is not enough either: the parent then maps new pages for every batch and
faults each one in.

So each worker keeps ``depth`` shared uint8 buffers (one :class:`SharedBuffers`
holds them all), and the parent maps each buffer once. A loader keeps its
SharedBuffers across passes: workers forked for the next pass map what the parent
maps, so they take over the buffers of the workers before them (:meth:`SharedBuffers.idle`).

* :func:`pack` (in the worker, after the user's collate_fn) puts every ``bytes``
  of at least PACK_MIN_BYTES found in the batch's dicts, lists and tuples into a
  free buffer of its own and leaves a :class:`Span` in its place. The
  :class:`BufferRef` it returns carries the buffer itself only the first time
  (or when the buffer grew); later batches name it by ``(worker, index, generation)``.
* The parent learns a buffer when a BufferRef is unpickled (torch unpickles every
  result in arrival order, even results it then drops), so a name always refers
  to a buffer already seen. The unpickled BufferRef holds the buffer's lease: when
  it is released (after :func:`unpack`, or when torch drops the batch) the
  buffer's flag in the shared ``free`` table is set and the worker may
  reuse it. A worker that finds no free buffer uses a one-off one.
* When no user code looks at a worker's samples before they are collated (the
  dataset has no transform and the collate_fn is torch's default_collate), a
  FileDataset reads a batch straight into a leased buffer (:func:`read_buffer`)
  and its samples hold Spans instead of ``bytes``; torch's default_collate lists
  them as it lists bytes. The payload is then copied once, in the parent, as
  with ``num_workers=0``.
* Any other collate_fn sees ``bytes``: a FileDataset still reads the batch into a
  leased buffer and makes the bytes from it (:func:`split_read`), and those bytes,
  where they are still in the collated batch, cross as spans of that buffer: no second
  copy into a buffer in the worker.
* :func:`unpack` (in the parent, before anything sees the batch) puts equal
  ``bytes`` back, so the batch the user gets is what their collate_fn returned
  (an object that appeared twice is one object again). Other containers and
  values travel untouched, as torch sends them.

Small tensors (a batch's labels) cross by value, any dataset's (:func:`by_value`): torch
sends each tensor as a shared-memory file descriptor that the parent fetches over a
new socket to the worker, with an authentication handshake, about 0.4 ms a tensor
(where 64 KB by value costs 0.1 ms), and a thread in the worker woken to answer it.

Vocabulary: a *span* is one packed ``bytes``' place (offset, size) in a buffer;
a *lease* is the parent's hold on a buffer until its bytes are copied out;
a tensor *by value* crosses inside the pickle, its storage's bytes copied.
("Slot" and "ring" are the device prefetcher's words; they are not used here.)
"""

from __future__ import annotations

import io
import itertools
import os
import pickle
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import get_worker_info

from fastload.cache.gather import split

__all__ = [
    "BY_VALUE_MAX_BYTES", "PACK_MIN_BYTES", "BufferRef", "SharedBuffers", "Span", "activate", "by_value", "pack",
    "pickled_bytes", "read_buffer", "set_forking", "split_read", "unpack",
]  # fmt: skip

#: Smaller bytes stay in the pickle: a span and its copy cost more than they save.
PACK_MIN_BYTES = 1024
#: A buffer that must grow gets this much headroom, so slightly larger batches fit.
GROWTH = 1.25
#: Tensors whose storage is at most this large cross by value (see the module docstring;
#: benchmarks/loader/results/workers-issue36.md measured the two ways).
BY_VALUE_MAX_BYTES = 64 * 1024

_SET_IDS = itertools.count()
# SharedBuffers alive in this (parent) process, by id: where unpickled BufferRefs find theirs.
_PARENT_BUFFERS: weakref.WeakValueDictionary[int, SharedBuffers] = weakref.WeakValueDictionary()


def _shared_bytes(size: int) -> torch.Tensor:
    # In shared memory from the start, as torch's default_collate allocates a batch
    # tensor inside a worker: pickling it sends a handle, never the bytes.
    storage = torch.empty(0, dtype=torch.uint8)._typed_storage()._new_shared(size)
    return torch.empty(0, dtype=torch.uint8).new(storage)  # type: ignore[call-overload,no-any-return]


class SharedBuffers:
    """Reused shared buffers, ``depth`` per worker; built in the parent before workers start.

    Pickled (or inherited by fork) into each worker with its ``free`` table, which
    stays shared; each worker process then keeps its own buffers.
    """

    def __init__(self, workers: int, depth: int) -> None:
        self.id = next(_SET_IDS)
        self.workers, self.depth = workers, depth
        self.free = torch.ones(workers * depth, dtype=torch.uint8).share_memory_()
        self._free = self.free.numpy()
        # worker side: index -> [generation, buffer, sent to the parent already]
        self._mine: dict[int, list[Any]] = {}
        self._pid = os.getpid()  # the process _mine belongs to
        # parent side: (worker, index) -> (generation, buffer as a memoryview, the buffer)
        self.mapped: dict[tuple[int, int], tuple[int, memoryview, torch.Tensor]] = {}
        _PARENT_BUFFERS[self.id] = self

    def __getstate__(self) -> dict[str, Any]:
        return {"id": self.id, "workers": self.workers, "depth": self.depth, "free": self.free}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.id, self.workers, self.depth, self.free = state["id"], state["workers"], state["depth"], state["free"]
        self._free = self.free.numpy()
        self._mine, self.mapped, self._pid = {}, {}, os.getpid()

    def idle(self) -> bool:
        """Parent: no buffer is leased (every batch sent was copied out or dropped)."""
        return bool(self._free.all())

    def _adopt(self, worker: int) -> None:
        # A worker forked from the parent maps every buffer the parent mapped: the
        # buffers of the previous workers with this id are its own, already known to
        # the parent (no new segment, no descriptor handed over, no page faulted in
        # again; tests/unit/test_worker_by_value.py counts them).
        self._pid = os.getpid()
        self._mine = {j: [gen, buf, True] for (w, j), (gen, _, buf) in self.mapped.items() if w == worker}

    def acquire(self, worker: int, size: int) -> tuple[BufferRef | None, torch.Tensor]:
        """A buffer of at least ``size`` bytes for this worker's next batch, and its ref.

        The ref is None for a one-off buffer (every buffer of this worker is leased).
        """
        if self._pid != os.getpid():
            self._adopt(worker)
        base = worker * self.depth
        free = self._free
        grow = None
        for j in range(self.depth):
            if not free[base + j]:
                continue
            held = self._mine.get(j)
            if held is not None and held[1].numel() >= size:
                free[base + j] = 0
                ref = BufferRef(self.id, worker, j, held[0], None if held[2] else held[1])
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
        return BufferRef(self.id, worker, grow, gen, buf), buf

    def learn(self, worker: int, index: int, gen: int, buf: torch.Tensor) -> None:
        """Parent: map a buffer a worker sent (called while its batch is unpickled)."""
        self.mapped[(worker, index)] = (gen, buf.numpy().data, buf)

    def release(self, worker: int, index: int) -> None:
        """Parent: the buffer's bytes are copied out (or its batch was dropped)."""
        self._free[worker * self.depth + index] = 1

    def give_back(self, ref: BufferRef | None) -> None:
        """Worker: a buffer acquired for a batch that will not be sent."""
        if ref is None:
            return
        if ref.buf is not None:
            self._mine[ref.index][2] = False  # the parent has not seen it yet
        self._free[ref.worker * self.depth + ref.index] = 1


class BufferRef:
    """A batch's buffer: by name, plus the buffer itself the first time it crosses.

    In the parent it is the buffer's lease: :meth:`release` (or garbage collection)
    hands the buffer back to its worker.
    """

    __slots__ = ("set_id", "worker", "index", "gen", "buf", "_owner", "__weakref__")

    def __init__(self, set_id: int, worker: int, index: int, gen: int, buf: torch.Tensor | None) -> None:
        self.set_id, self.worker, self.index, self.gen, self.buf = set_id, worker, index, gen, buf
        self._owner: SharedBuffers | None = None  # set in the parent only: the lease is held

    def __reduce__(self) -> tuple[Any, ...]:
        return (_received, (self.set_id, self.worker, self.index, self.gen, self.buf))

    def view(self) -> memoryview:
        """Parent: the buffer's bytes."""
        owner = self._owner
        if owner is None:
            raise RuntimeError(f"fastload: batch buffer {self.worker}/{self.index} arrived without its SharedBuffers")
        gen, view, _ = owner.mapped[(self.worker, self.index)]
        if gen != self.gen:
            raise RuntimeError(f"fastload: batch buffer {self.worker}/{self.index} is generation {gen}, not {self.gen}")
        return view

    def release(self) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            owner.release(self.worker, self.index)

    def __del__(self) -> None:
        self.release()


def _received(set_id: int, worker: int, index: int, gen: int, buf: torch.Tensor | None) -> BufferRef:
    ref = BufferRef(set_id, worker, index, gen, None)
    buffers = _PARENT_BUFFERS.get(set_id)
    if buffers is not None:
        if buf is not None:
            buffers.learn(worker, index, gen, buf)
        ref._owner = buffers
    return ref


class Span:
    """Where a packed ``bytes`` was: its (offset, size) in the batch's buffer."""

    __slots__ = ("start", "size")

    def __init__(self, start: int, size: int) -> None:
        self.start, self.size = start, size

    def __reduce__(self) -> tuple[Any, ...]:
        return (Span, (self.start, self.size))


def _rebuilt(obj: Any, fns: dict[type, Callable[[Any], Any]]) -> Any:
    """``obj`` with every leaf whose exact type is in ``fns`` (in its lists, dicts and tuples) replaced by ``fns[type](leaf)``."""
    kind = type(obj)
    fn = fns.get(kind)
    if fn is not None:
        return fn(obj)
    if kind is list:
        return [_rebuilt(x, fns) for x in obj]
    if kind is dict:
        return {k: _rebuilt(v, fns) for k, v in obj.items()}
    if kind is tuple:
        return tuple(_rebuilt(x, fns) for x in obj)
    return obj  # large tensors, str, custom types: travel as torch sends them


class _StorageValue:
    """A tensor storage that crosses by value: its bytes in the pickle."""

    __slots__ = ("storage",)

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.storage = storage

    def __reduce__(self) -> tuple[Any, ...]:
        data = torch.empty(0, dtype=torch.uint8).set_(self.storage).numpy().tobytes()
        return (_storage_of, (data,))


def _storage_of(data: bytes) -> torch.UntypedStorage:
    return torch.UntypedStorage.from_buffer(data, dtype=torch.uint8)


class _TensorValue:
    """A small tensor that crosses by value: its storage, and its view of it, as torch rebuilds one."""

    __slots__ = ("storage", "dtype", "offset", "size", "stride")

    def __init__(self, storage: _StorageValue, t: torch.Tensor) -> None:
        self.storage, self.dtype, self.offset = storage, t.dtype, t.storage_offset()
        self.size, self.stride = tuple(t.size()), t.stride()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_tensor_of, (self.storage, self.dtype, self.offset, self.size, self.stride))


def _tensor_of(
    storage: torch.UntypedStorage, dtype: torch.dtype, offset: int, size: tuple[int, ...], stride: tuple[int, ...]
) -> torch.Tensor:
    return torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)


def _plain(t: torch.Tensor) -> bool:
    # What by value keeps exactly: a dense CPU tensor's values, dtype, shape and strides.
    # Anything torch rebuilds with more (grad, a subclass, names, quantization,
    # conj/neg bits) travels as torch sends it.
    return (
        t.device.type == "cpu"
        and t.layout is torch.strided
        and not t.requires_grad
        and not t.is_quantized
        and not t.is_conj()
        and not t.is_neg()
        and not any(getattr(t, "names", None) or ())  # named tensors: gone from recent torch
    )


class _Packer:
    def __init__(self, pack_bytes: bool = True, known: dict[int, tuple[bytes, Span]] | None = None) -> None:
        self.known = known or {}  # bytes already in the batch's buffer (split_read): their spans
        self.found: list[bytes] = []
        self.spans: list[Span] = []
        self.span_of: dict[int, Span] = {}  # id(bytes) -> its span, so aliases stay one object
        self.size = 0
        self.valued: dict[int, _TensorValue] = {}  # id(tensor) -> its value, so aliases stay one object
        self.storages: dict[tuple[int, int], _StorageValue] = {}  # so views of a storage share it again
        self.pack_bytes = pack_bytes

    def walk(self, obj: Any) -> Any:
        # The bound methods live in this call only: kept on self they would make a cycle, and the
        # bytes the packer holds (found, known) would wait for the cyclic GC, not the batch's end
        # (a fresh worker faulted new memory for its first dozen batches).
        fns: dict[type, Callable[[Any], Any]] = {torch.Tensor: self._tensor}
        if self.pack_bytes:
            fns[bytes] = self._span
        return _rebuilt(obj, fns)

    def _span(self, data: bytes) -> bytes | Span:
        if len(data) < PACK_MIN_BYTES:
            return data
        known = self.known.get(id(data))
        if known is not None and known[0] is data:
            return known[1]
        span = self.span_of.get(id(data))
        if span is None:
            span = self.span_of[id(data)] = Span(self.size, len(data))
            self.found.append(data)
            self.size += len(data)
        return span

    def _tensor(self, t: torch.Tensor) -> torch.Tensor | _TensorValue:
        found = self.valued.get(id(t))
        if found is not None:
            return found
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes > BY_VALUE_MAX_BYTES or not _plain(t):
            return t
        key = (storage.data_ptr(), nbytes)
        value = self.storages.get(key) if nbytes else None  # empty storages all sit at 0
        if value is None:
            value = self.storages[key] = _StorageValue(storage)
        found = self.valued[id(t)] = _TensorValue(value, t)
        return found


def by_value(batch: Any) -> Any:
    """``batch`` with its small tensors (up to BY_VALUE_MAX_BYTES) in its lists, dicts and tuples set to cross by value."""
    return _Packer(pack_bytes=False).walk(batch)


class _Reading:
    """A worker's state: its buffers, and the buffer its latest batch was read into."""

    def __init__(self, buffers: SharedBuffers, worker: int, default_collate: bool) -> None:
        self.buffers, self.worker, self.default_collate = buffers, worker, default_collate
        self.pending: tuple[BufferRef | None, torch.Tensor] | None = None
        # id -> (a bytes split out of the pending buffer, its span there); the bytes are
        # held, so their ids stay theirs until the batch is packed (split_read).
        self.made: dict[int, tuple[bytes, Span]] = {}

    def drop_pending(self) -> None:
        if self.pending is not None:
            self.buffers.give_back(self.pending[0])
            self.pending = None
        self.made = {}


# Set in a worker process: before its first batch where it was forked while the parent's
# _FORKING was set, else by its WorkerCollate (so from its second batch on).
_READING: _Reading | None = None
# The parent's, while a pass forks its workers (set_forking): what each forked worker activates
# at its first read_buffer. Else that batch is read into memory of its own and copied into a
# buffer: 3,170 page faults and a 7 MB copy in each new worker (batch 64 x 110 KB).
_FORKING: tuple[SharedBuffers, bool] | None = None


def set_forking(buffers: SharedBuffers | None, default_collate: bool = False) -> None:
    """Parent: the buffers (and collate) of the workers about to fork, or None once they have."""
    global _FORKING
    _FORKING = None if buffers is None else (buffers, default_collate)


def _collate_spans(batch: list[Span], *, collate_fn_map: Any = None) -> list[Span]:
    return batch  # as torch's default_collate does for bytes and str


def activate(buffers: SharedBuffers, worker: int, default_collate: bool) -> None:
    """Worker: let datasets read batches straight into ``buffers`` (see :func:`read_buffer`)."""
    global _READING
    if _READING is None or _READING.buffers is not buffers:
        if default_collate:
            from torch.utils.data._utils.collate import default_collate_fn_map

            default_collate_fn_map.setdefault(Span, _collate_spans)
        _READING = _Reading(buffers, worker, default_collate)


def read_buffer(size: int, *, spans: bool = True) -> Any:
    """Worker: a leased buffer (a uint8 ndarray of ``size``) to read a batch into, or None.

    Only when this process packs batches into shared buffers. With ``spans``, only
    when it also collates with torch's default_collate: the caller's samples may then
    hold a :class:`Span` (offset, size in this buffer) where they would hold ``bytes``.
    Without, the caller makes its samples' bytes with :func:`split_read`.
    """
    state = _READING
    if state is None and _FORKING is not None:
        info = get_worker_info()
        if info is not None:  # a worker forked while its pass's buffers were set: ready from its first batch
            activate(_FORKING[0], info.id, _FORKING[1])
            state = _READING
    if state is None or (spans and not state.default_collate):
        return None
    state.drop_pending()  # a batch that failed before its collate
    ref, buf = state.buffers.acquire(state.worker, size)
    state.pending = (ref, buf)
    return buf.numpy()[:size]


def split_read(buffer: Any, spans: list[tuple[int, int]]) -> list[bytes]:
    """Worker: :func:`~fastload.cache.gather.split` of the buffer :func:`read_buffer` lent.

    The bytes it makes are remembered: those still in the batch the collate_fn returns
    cross as spans of that buffer (:func:`pack`), not copied into a buffer again.
    """
    made = split(buffer, spans)
    state = _READING
    if state is not None and state.pending is not None:
        for data, (start, size) in zip(made, spans):
            if size >= PACK_MIN_BYTES:  # smaller ones stay in the pickle; b"" is one object
                state.made[id(data)] = (data, Span(start, size))
    return made


def pack(batch: Any, buffers: SharedBuffers, worker: int) -> tuple[Any, BufferRef | torch.Tensor | None]:
    """``batch`` with its large ``bytes`` replaced by spans, and where they went.

    Its small tensors are set to cross by value too (:func:`by_value`). Returns the
    batch unchanged and None when it holds neither; None with no such bytes; else
    the packed batch and a BufferRef (or, when no buffer was free, a one-off
    shared tensor).
    """
    state = _READING
    pending = state.pending if state is not None and state.buffers is buffers else None
    if pending is not None:
        assert state is not None
        state.pending = None
        packer = _Packer(known=state.made)
        state.made = {}
        out = packer.walk(batch)
        if not packer.found:  # the batch's Spans point into the buffer it was read into
            return out, (pending[0] if pending[0] is not None else pending[1])
        # Other large bytes too (a label function's?): make the spans bytes again.
        batch = _Unpacker(pending[1].numpy().data).walk(batch)
        buffers.give_back(pending[0])
    packer = _Packer()
    out = packer.walk(batch)
    if not packer.found:
        return (out if packer.valued else batch), None
    ref, buf = buffers.acquire(worker, packer.size)
    view = buf.numpy().data
    pos = 0
    for data in packer.found:
        view[pos : pos + len(data)] = data
        pos += len(data)
    return out, (ref if ref is not None else buf)


class _Unpacker:
    def __init__(self, view: memoryview) -> None:
        self.view = view

    def walk(self, obj: Any) -> Any:
        spans: dict[int, int] = {}  # start -> size: a bytes packed once however often it appears
        _spans_in(obj, spans)
        made = dict(zip(spans, split(self.view, list(spans.items()))))  # one call: the copies at once
        return _filled(obj, made)


# What _rebuilt walks, for the two walks below. They test each element's type inline, with no
# call per leaf: a FileDataset batch is 64+ Spans beside 64+ URLs, and _rebuilt's call per leaf
# cost the parent about 9 us per sample, two walks per batch.
_WALKED = (list, dict, tuple)


def _spans_in(obj: Any, into: dict[int, int]) -> None:
    """Every Span in ``obj``'s lists, dicts and tuples, as ``into[start] = size``."""
    kind = type(obj)
    if kind is Span:
        into[obj.start] = obj.size
        return
    if kind not in _WALKED:
        return
    for x in obj.values() if kind is dict else obj:
        kind = type(x)
        if kind is Span:
            into[x.start] = x.size
        elif kind in _WALKED:
            _spans_in(x, into)


def _filled(obj: Any, made: dict[int, bytes]) -> Any:
    """``obj`` with each Span replaced by ``made[span.start]`` (as :func:`_rebuilt` does)."""
    kind = type(obj)
    if kind is Span:
        return made[obj.start]
    if kind is list:
        return [made[x.start] if type(x) is Span else _filled(x, made) if type(x) in _WALKED else x for x in obj]
    if kind is dict:
        return {k: made[v.start] if type(v) is Span else _filled(v, made) if type(v) in _WALKED else v
                for k, v in obj.items()}  # fmt: skip
    if kind is tuple:
        return tuple([made[x.start] if type(x) is Span else _filled(x, made) if type(x) in _WALKED else x for x in obj])
    return obj


def unpack(batch: Any, where: BufferRef | torch.Tensor) -> Any:
    """The batch :func:`pack` was given, with equal ``bytes`` copied out of the buffer."""
    if isinstance(where, BufferRef):
        try:
            return _Unpacker(where.view()).walk(batch)
        finally:
            where.release()
    return _Unpacker(where.numpy().data).walk(batch)


class _SizePickler(pickle.Pickler):
    # Tensors cross as shared-memory handles: count them as nothing.
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return (int, ())
        return NotImplemented


def pickled_bytes(batch: Any) -> int:
    """Bytes of ``batch`` (already packed) that torch's queue would copy through its pipe."""
    buf = io.BytesIO()
    _SizePickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(batch)
    return buf.tell()
