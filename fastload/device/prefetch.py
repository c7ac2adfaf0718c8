"""Pinned, double-buffered host-to-device transfer (the ``device=`` of the loader).

:class:`DevicePrefetcher` moves each batch (any nesting of dict / list / tuple /
namedtuple with tensor and non-tensor leaves) to a device through a *ring* of
host slots. This module is the ring's order: acquire a slot, copy, deliver. The
slots themselves and the backends that allocate, copy and release them (pinned
memory, the side stream, CUDA events, and the pitfalls they avoid) are in
:mod:`fastload.device.slots`.

Vocabulary: **prefetch** is only this host-to-device copy; a **slot** is one host
buffer of the **ring**; **depth** is how many batches are pulled from the source
beyond the one being returned; a **pass** is one iteration over a source (a new
one ends the previous, the ring being shared).

1. The batch's CPU tensors are copied into one slot, each at an aligned offset of
   a single flat ``uint8`` buffer (pinned when the device is CUDA), so all leaves
   of a batch cross in one DMA, not one per leaf.
2. One copy of the used part of the slot is issued with ``non_blocking=True`` on
   ONE long-lived side CUDA stream, into a device buffer allocated *on that side
   stream*; the batch's tensors are views into that buffer. The side stream waits
   for nothing on the consumer's stream, so batch N+1 copies while step N computes,
   at every ``depth`` (0 included).
3. When the batch is handed out, the consumer's stream waits on the copy's CUDA
   event (the host never blocks) and ``record_stream(consumer)`` tells the caching
   allocator that the consumer uses the buffer from then on.
4. A slot is reused only after the event of its last copy has completed. A slot
   too small for a batch drops its buffer, has the backend empty torch's host cache,
   then grows (:func:`~fastload.device.slots.slot_size`).

Consequence of step 3: use the batch on the stream that was current when
``next()`` returned it; another stream ``s`` must first wait for that one
(``s.wait_stream(...)``: only it waited for the copy) and needs
``batch.record_stream(s)``.

Stats: each copy is recorded as ``h2d`` (bytes, seconds between its CUDA events)
when its event is first seen complete: at hand-over, at the slot's reuse, at the
end of the pass (which waits for every copy still pending; without a collector
it does not wait), or when a pass ends early (closed or dropped: the copies
complete by then; one still in flight is recorded at its slot's reuse or at the
end of the next pass).

On a CPU device the same code runs (flatten, slot ring, growth, unflatten) with
plain, non-pinned slots and synchronous copies, so CI exercises the bookkeeping.
Without ``device=`` the loader does not use a prefetcher at all.

Ordering: with ``depth=D`` up to D batches beyond the one being returned are
pulled from the source. A source that raises is re-raised, with its original
traceback, at the position where its batch would have arrived.
"""

from __future__ import annotations

import collections
import time
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, Generic, TypeVar, cast

import torch

from fastload.config import deprecated
from fastload.device.batch_tree import collect_tensors, rebuild
from fastload.device.slots import ALIGN, CudaBackend, HostBackend, Slot, round_up, slot_size
from fastload.errors import ConfigError, LoaderError
from fastload.stats import StatsCollector

__all__ = ["DevicePrefetcher"]

T = TypeVar("T")

_DEPTH = "the batches the device copy pulls ahead of the one it returns"


def _depth(depth: int | None, lookahead: int | None) -> int | None:
    """``depth``, or ``lookahead`` (its old name) with a FutureWarning once."""
    if lookahead is None:
        return depth
    if depth is not None:
        raise ConfigError(f"depth={depth} and lookahead={lookahead}: pass depth only (lookahead is its old name)")
    deprecated("lookahead", "depth", _DEPTH)
    return lookahead


class _Copied:
    __slots__ = ("batch", "slot", "error", "buffer")

    def __init__(
        self,
        batch: Any,
        slot: Slot | None,
        error: BaseException | None = None,
        buffer: torch.Tensor | None = None,
    ) -> None:
        self.batch = batch
        self.slot = slot
        self.error = error
        self.buffer = buffer  # the device buffer the batch's ringed tensors view


class DevicePrefetcher(Generic[T]):
    """Move batches to ``device`` through a reused ring of (pinned) host slots.

    Use it on any iterable of batches, or let ``fastload.DataLoader(device=...)`` do it::

        for images, labels in DevicePrefetcher(torch_loader, "cuda"):
            loss = model(images).loss(labels)

    The prefetcher is driven from the consumer's thread only (it starts no thread),
    so a num_workers=0 loader still calls ``__getitem__`` in the calling thread.

    Args:
        source: Iterable of batches used by ``iter(prefetcher)``; optional when
            :meth:`iterate` is called instead.
        device: Target device: ``"cuda"``, ``"cuda:1"``, a ``torch.device``, or
            ``"cpu"`` (runs the same ring with plain memory).
        slots: Host slots in the ring (>= 2): how many batches can be in transit.
        depth: Batches pulled from the source beyond the one being returned
            (0 to ``slots - 1``; default ``slots - 1``). 0 keeps the source's calls at
            exactly the moments a plain loop would make them. ``lookahead=`` is its old
            name, still taken (with a FutureWarning, once).
        max_slot_bytes: Cap on one slot's size. A batch larger than the cap bypasses
            the ring (a direct copy, not through a slot), warns once and counts
            ``oversize_batch``. None means no cap. Slots are powers of two below
            the cap; a cap that is not one is pinned rounded up to one by torch.
        timeout: Seconds to wait for a slot's previous copy before raising LoaderError.
        collector: Where ``pin`` and ``h2d`` are recorded (None: not recorded).

    Raises:
        ConfigError: Bad ``slots``/``depth``/``max_slot_bytes``, a CUDA device
            without CUDA, or an unsupported device type.
    """

    def __init__(
        self,
        source: Iterable[T] | None = None,
        device: str | torch.device = "cuda",
        *,
        slots: int = 2,
        depth: int | None = None,
        max_slot_bytes: int | None = 2 * 1024**3,
        timeout: float = 60.0,
        collector: StatsCollector | None = None,
        lookahead: int | None = None,
    ) -> None:
        if slots < 2:
            raise ConfigError(f"slots={slots} must be >= 2 (one copying while one is in use)")
        if max_slot_bytes is not None and max_slot_bytes <= 0:
            raise ConfigError(f"max_slot_bytes={max_slot_bytes} must be > 0 or None")
        if timeout <= 0:
            raise ConfigError(f"timeout={timeout} must be > 0 seconds")
        self.device = torch.device(device)
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError(
                    f"device={str(device)!r} but torch.cuda.is_available() is False; "
                    "pass device='cpu' or device=None"
                )
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            self._backend: HostBackend = CudaBackend(self.device)
        elif self.device.type == "cpu":
            self._backend = HostBackend(self.device)
        else:
            raise ConfigError(
                f"device={str(device)!r}: only 'cuda' and 'cpu' are supported; pass device=None "
                "and move batches yourself"
            )
        self.source = source
        self.slots = slots
        self.depth = self._check_depth(_depth(depth, lookahead))
        self.max_slot_bytes = max_slot_bytes
        self.timeout = timeout
        self.collector = collector
        self._ring = [Slot() for _ in range(slots)]
        for slot in self._ring:
            self._backend.init_events(slot)
        self._next_slot = 0
        self._pass = 0
        self._warned_oversize = False
        #: Host slot buffers allocated so far (first use and every growth).
        self.slot_allocations = 0
        #: Batches copied through the ring.
        self.copies = 0
        #: Batches too large for ``max_slot_bytes`` that bypassed the ring.
        self.oversize_batches = 0

    def _check_depth(self, depth: int | None) -> int:
        if depth is None:
            return self.slots - 1
        if not 0 <= depth <= self.slots - 1:
            raise ConfigError(f"depth={depth} must be in [0, slots - 1 = {self.slots - 1}]")
        return depth

    @property
    def lookahead(self) -> int:
        """:attr:`depth`'s old name (a FutureWarning, once)."""
        deprecated("lookahead", "depth", _DEPTH)
        return self.depth

    @property
    def pinned(self) -> bool:
        """Whether the slots are pinned host memory (True for CUDA devices)."""
        return self._backend.pinned

    @property
    def slot_capacities(self) -> list[int]:
        """Current size in bytes of each slot (0 before first use)."""
        return [s.capacity for s in self._ring]

    def __iter__(self) -> Iterator[T]:
        if self.source is None:
            raise ConfigError("DevicePrefetcher(source=None): call iterate(batches) instead")
        return self.iterate(self.source)

    def iterate(self, source: Iterable[T], depth: int | None = None, *, lookahead: int | None = None) -> Iterator[T]:
        """Return an iterator over ``source``'s batches, on the device.

        ``depth`` (default: the prefetcher's) as in the class; ``lookahead=`` is its old
        name. Starting a new pass ends the previous one (the ring is shared): the old
        iterator then raises LoaderError.
        """
        depth = _depth(depth, lookahead)
        la = self.depth if depth is None else self._check_depth(depth)
        self._pass += 1
        for slot in self._ring:
            slot.busy = False  # a superseded pass's batches are dropped; events still guard reuse
        return _Pass(self, iter(source), la, self._pass)

    # -- the copy --------------------------------------------------------------------

    def _acquire(self, need: int) -> Slot:
        slot = self._ring[self._next_slot]
        if slot.busy:  # internal invariant: depth < slots keeps one slot free
            raise LoaderError("DevicePrefetcher ring overrun (a bug in fastload)")
        self._next_slot = (self._next_slot + 1) % self.slots
        self._wait_done(slot)
        self._record_copy(slot)
        if slot.capacity < need:
            if slot.buf is not None:
                # Drop the old buffer and empty the host cache before allocating, so
                # the old size is not kept pinned next to the new one.
                slot.buf = None
                self._backend.release_cached(self.timeout)
            slot.buf = self._backend.alloc(slot_size(need, self.max_slot_bytes))
            self.slot_allocations += 1
        return slot

    def _wait_done(self, slot: Slot) -> None:
        # Released by its copy's event; poll so the wait is bounded (Event.synchronize
        # has no timeout). With >= 2 slots the copy is almost always complete already.
        if self._backend.is_done(slot):
            return
        deadline = time.monotonic() + self.timeout
        pause = 1e-5
        while not self._backend.is_done(slot):
            if time.monotonic() > deadline:
                raise LoaderError(
                    f"a host-to-device copy did not complete within timeout={self.timeout} s; "
                    "the device may be hung or saturated. Raise DevicePrefetcher(timeout=...)"
                )
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def _flush(self) -> None:
        """End of a pass: record every copy not recorded yet (waits for it, bounded).

        Without a collector there is nothing to record, so the host does not wait.
        """
        if self.collector is None:
            return
        for slot in self._ring:
            if slot.timed_bytes:
                self._wait_done(slot)
                self._record_copy(slot)

    def _record_complete(self) -> None:
        """Record every pending copy that has completed; never waits."""
        for slot in self._ring:
            if slot.timed_bytes and self._backend.is_done(slot):
                self._record_copy(slot)

    def _record_copy(self, slot: Slot) -> None:
        if slot.timed_bytes and self.collector is not None:
            self.collector.add(
                "h2d", items=1, bytes=slot.timed_bytes, seconds=self._backend.copy_seconds(slot)
            )
        slot.timed_bytes = 0

    def _copy(self, batch: Any) -> _Copied:
        tensors: list[torch.Tensor] = []
        collect_tensors(batch, tensors)
        if not tensors:
            return _Copied(batch, None)
        t0 = time.perf_counter()
        offsets: list[int] = []
        used = 0
        ringable = []
        for t in tensors:
            ok = t.device.type == "cpu" and t.layout == torch.strided and not t.is_quantized
            ringable.append(ok)
            if ok:
                offsets.append(used)
                used = round_up(used + t.numel() * t.element_size(), ALIGN)
            else:
                offsets.append(-1)
        if self.max_slot_bytes is not None and used > self.max_slot_bytes:
            return self._oversize(batch, tensors, used)
        if used == 0:  # only device / sparse tensors
            moved = [self._backend.move(t) for t in tensors]
            return _Copied(rebuild(batch, iter(moved)), None)
        slot = self._acquire(used)
        buf = cast(torch.Tensor, slot.buf)  # _acquire always leaves a buffer
        with torch.no_grad():
            for t, off, ok in zip(tensors, offsets, ringable):
                if ok:
                    n = t.numel() * t.element_size()
                    buf[off : off + n].view(t.dtype).view(t.shape).copy_(t)
            if self.collector is not None:
                self.collector.add("pin", items=1, bytes=used, seconds=time.perf_counter() - t0)
            out = self._backend.transfer(slot, used)
            views = []
            for t, off, ok in zip(tensors, offsets, ringable):
                if ok:
                    n = t.numel() * t.element_size()
                    views.append(out[off : off + n].view(t.dtype).view(t.shape))
                else:
                    views.append(self._backend.move(t))
        slot.busy = True
        self.copies += 1
        return _Copied(rebuild(batch, iter(views)), slot, buffer=out)

    def _oversize(self, batch: Any, tensors: list[torch.Tensor], used: int) -> _Copied:
        self.oversize_batches += 1
        if self.collector is not None:
            self.collector.count("oversize_batch")
        if not self._warned_oversize:
            self._warned_oversize = True
            warnings.warn(
                f"a batch needs {used} slot bytes, more than max_slot_bytes="
                f"{self.max_slot_bytes}; such batches bypass the pinned ring (slower, "
                "synchronous copies). Raise max_slot_bytes or lower the batch size",
                RuntimeWarning,
                stacklevel=4,
            )
        moved = [self._backend.move(t) for t in tensors]
        return _Copied(rebuild(batch, iter(moved)), None)

    def _deliver(self, copied: _Copied) -> Any:
        slot = copied.slot
        if slot is not None:
            self._backend.hand_over(slot, cast(torch.Tensor, copied.buffer))  # copied with its slot
            slot.busy = False
            if self._backend.is_done(slot):  # a query, never a wait
                self._record_copy(slot)
        return copied.batch


class _Pass(Iterator[T]):
    """One pass of a DevicePrefetcher over a source iterator."""

    def __init__(
        self, owner: DevicePrefetcher[T], source: Iterator[T], depth: int, pass_id: int
    ):
        self._owner = owner
        self._source = source
        self._depth = depth
        self._id = pass_id
        self._queue: collections.deque[_Copied] = collections.deque()
        self._exhausted = False

    def __iter__(self) -> _Pass[T]:
        return self

    def close(self) -> None:
        """End this pass early (a loop that breaks, ``--batches``): drop the batches
        copied ahead, and record the copies already complete, without waiting."""
        self._exhausted = True
        self._queue.clear()
        if self._owner._pass == self._id:
            self._owner._record_complete()

    def __del__(self) -> None:
        try:
            self.close()
        except (AttributeError, RuntimeError, TypeError):  # interpreter shutdown: torch half torn down
            return

    def __next__(self) -> T:
        owner = self._owner
        if owner._pass != self._id:
            raise LoaderError(
                "this DevicePrefetcher started a newer pass, which ended this one "
                "(its ring of slots is shared); iterate one pass at a time"
            )
        queue = self._queue
        while not self._exhausted and len(queue) <= self._depth:
            try:
                batch = next(self._source)
            except StopIteration:
                self._exhausted = True
                break
            except Exception as err:  # re-raised in order, traceback intact
                queue.append(_Copied(None, None, err))
                self._exhausted = True
                break
            queue.append(owner._copy(batch))
        if not queue:
            owner._flush()
            raise StopIteration
        copied = queue.popleft()
        if copied.error is not None:
            failure, copied.error = copied.error, None
            raise failure
        return owner._deliver(copied)  # type: ignore[no-any-return]
