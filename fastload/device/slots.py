"""The ring's slots and the copy backends: where a batch's bytes live on the host and
how they reach the device.

:class:`~fastload.device.prefetch.DevicePrefetcher` drives the ring (which slot is
next, when a batch is copied and handed out); this module holds what it drives.

Vocabulary (the device prefetcher's words; "prefetch" itself is only the
host-to-device copy):

* **slot**: one host buffer of the ring, a flat ``uint8`` tensor (pinned when the
  device is CUDA) holding one batch's CPU tensors, each at a multiple of
  :data:`ALIGN`. Its size is :func:`slot_size`: allocated once, grown only when a
  batch outgrows it.
* **backend**: how one kind of device allocates slots and moves them:
  :class:`HostBackend` (CPU: plain memory, synchronous copies, events always
  complete) and :class:`CudaBackend` (pinned memory, ONE side stream, CUDA events).
  A backend **transfers** a slot (one copy of its used part into a new device
  buffer), says whether that copy is **done** (the slot may be reused) and how long
  it took, and **hands over** the device buffer to the consumer's stream.

Pitfalls avoided (numbers without a repository are pytorch/pytorch's):

* **Per-batch pinned allocation.** torch's ``pin_memory=True`` path pins every
  batch anew in the ``pt_data_pin`` thread through the CachingHostAllocator
  (``cudaHostAlloc`` stalls at step 2000+, pytorch#97432 / #124456, and up to
  2x host memory, #95823). Here slots are allocated once, grow only when a batch
  outgrows them (bounded by ``max_slot_bytes``) and are then reused:
  :attr:`DevicePrefetcher.slot_allocations` counts every allocation.
* **Pinned memory held twice.** The CachingHostAllocator rounds every request up
  to a power of two and keeps freed blocks cached (pinned) until its cache is
  emptied (#171662, #275). So slots grow in powers of two themselves (what is asked for is what
  is pinned), and a slot that grows empties torch's host cache after dropping its
  old buffer: peak pinned memory is the ring, not the ring plus every size it
  outgrew (``tests/unit/test_prefetch.py::test_slots_grow_in_powers_of_two_and_release_the_old_block``).
* **A copy into memory that was given away.** A device buffer allocated on one
  stream and filled on another needs ``record_stream`` or the caching allocator may
  hand its block to a new allocation while the copy is still in flight (NaNs,
  torchrec#4231). Allocating on the side stream keeps the block in the side
  stream's pool: a batch that is copied but never handed out (a loop that
  breaks, a new pass) frees its block there, and only a later copy, queued
  after the first one, can reuse it. ``record_stream`` is called once, at hand-over,
  for the consumer stream only (its cost is the allocator's event poll on free,
  pytorch#112526).
* **A new stream per copy.** Cached blocks are not shared across streams
  (Fuser#5767), so there is one side stream per backend (one per prefetcher),
  created once.
"""

from __future__ import annotations

import time
from typing import Any, cast

import torch

from fastload.device.torch_compat import empty_host_cache

__all__ = ["ALIGN", "MIN_SLOT_BYTES", "CudaBackend", "HostBackend", "Slot", "round_up", "slot_size"]

ALIGN = 256  # bytes; every leaf starts at a multiple (any dtype view; vectorised kernels)
MIN_SLOT_BYTES = 64 * 1024  # the smallest slot; larger ones are powers of two


def round_up(n: int, k: int) -> int:
    """``n`` rounded up to a multiple of ``k``."""
    return (n + k - 1) // k * k


def slot_size(need: int, max_slot_bytes: int | None) -> int:
    """Bytes to allocate for a slot that must hold ``need``: the next power of two.

    torch's pinned allocator rounds every request up to a power of two anyway, so
    asking for exactly that keeps what a slot can hold equal to what it pins.
    ``max_slot_bytes`` caps the request (never below ``need``).

    >>> slot_size(1, None), slot_size(65537, None), slot_size(3 * 2**20, 2**21 + 2**20)
    (65536, 131072, 3145728)
    """
    size = max(MIN_SLOT_BYTES, 1 << max(need - 1, 0).bit_length())
    if max_slot_bytes is not None:
        size = max(min(size, max_slot_bytes), need)
    return size


class Slot:
    """One host buffer of the ring."""

    __slots__ = ("buf", "busy", "done", "start", "timed_bytes", "timed_s")

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.busy = False  # holds a copied batch not yet handed to the consumer
        self.done: Any = None  # event: the slot's last copy has completed
        self.start: Any = None
        self.timed_bytes = 0  # a copy whose duration is not yet recorded
        self.timed_s = 0.0

    @property
    def capacity(self) -> int:
        return 0 if self.buf is None else int(self.buf.numel())


class HostBackend:
    """CPU device: plain slots and synchronous copies; events are always complete.

    The seam of the ring: a backend allocates slots, issues one slot's copy
    (``transfer``), says whether it has completed (``is_done``) and how long it
    took, and hands the copied buffer to the consumer (``hand_over``).
    """

    pinned = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def release_cached(self, timeout: float) -> None:
        """Called after a slot dropped its buffer to grow: nothing is cached on the CPU."""
        return None

    def init_events(self, slot: Slot) -> None:
        slot.done = None

    def is_done(self, slot: Slot) -> bool:
        return True

    def transfer(self, slot: Slot, used: int) -> torch.Tensor:
        buf = cast(torch.Tensor, slot.buf)  # acquired slots always hold a buffer
        t0 = time.perf_counter()
        out = torch.empty(used, dtype=torch.uint8)
        out.copy_(buf[:used])
        slot.timed_bytes, slot.timed_s = used, time.perf_counter() - t0
        return out

    def copy_seconds(self, slot: Slot) -> float:
        return slot.timed_s

    def hand_over(self, slot: Slot, out: torch.Tensor) -> None:
        return None

    def move(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone() if t.device == self.device else t.to(self.device)


class CudaBackend(HostBackend):
    """CUDA device: pinned slots, one side stream, event-released slots."""

    pinned = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.stream = torch.cuda.Stream(device=device)  # ONE long-lived side stream

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def release_cached(self, timeout: float) -> None:
        # The dropped slot's block stays cached, still pinned, and no grown slot fits
        # it. It is freed only once an event recorded on the side stream at free time
        # completes, so poll a mark recorded after it (a bounded wait). Emptying the
        # cache ends in cudaFreeHost: a whole-device sync that frees every unused cached
        # pinned block of the process, once per slot growth (docs/loader.md).
        mark = torch.cuda.Event()
        mark.record(self.stream)
        deadline = time.monotonic() + timeout
        while not mark.query():
            if time.monotonic() > deadline:
                return  # the block stays cached: more memory held, nothing wrong
            time.sleep(1e-4)
        empty_host_cache()

    def init_events(self, slot: Slot) -> None:
        slot.done = torch.cuda.Event(enable_timing=True)
        slot.start = torch.cuda.Event(enable_timing=True)

    def is_done(self, slot: Slot) -> bool:
        return bool(slot.done.query())

    def transfer(self, slot: Slot, used: int) -> torch.Tensor:
        buf = cast(torch.Tensor, slot.buf)  # acquired slots always hold a buffer
        with torch.cuda.stream(self.stream):
            # Allocated on the side stream, so until hand-over its block is freed and
            # reused in side-stream order only: a dropped batch's block can go only
            # to a later copy, queued behind this one. Nothing here waits for the
            # consumer stream, so this copy overlaps the step running there.
            out = torch.empty(used, dtype=torch.uint8, device=self.device)
            slot.start.record(self.stream)
            out.copy_(buf[:used], non_blocking=True)
            slot.done.record(self.stream)
        slot.timed_bytes = used
        return out

    def copy_seconds(self, slot: Slot) -> float:
        # Only called once slot.done has completed, so this never blocks.
        return float(slot.start.elapsed_time(slot.done)) / 1e3

    def hand_over(self, slot: Slot, out: torch.Tensor) -> None:
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(slot.done)
        # From here the consumer uses the block: freeing it waits for the consumer's
        # work queued by then (tests/gpu/test_prefetch_gpu.py::test_dropped_batch_*).
        out.record_stream(consumer)

    def move(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True)

