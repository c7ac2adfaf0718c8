"""glibc's allocator told to keep the memory of freed batches for the next ones.

The DataLoader sets it when constructed. Staging does not: there it measured no faster
(``benchmarks/percore``, cold, within the noise), and the memory it keeps would count
against staging's bound on memory (a 256 MB object streamed from a server without
ranges peaked at 268 MB of RSS with it, under 224 without; tests/integration/test_rangeless_stream.py).

Why: a batch's samples are new ``bytes`` objects of tens to hundreds of KB. glibc
serves them from its heaps and, once the batch is dropped, hands the free memory at a
heap's top back to the kernel as soon as it exceeds the trim threshold (128 KiB; at
most 64 MiB as glibc adapts it, but only after it has freed a mapped chunk that large).
So every batch faulted its pages in again: about 25 faults per 112 KB sample, and
the copy of a sample out of its read buffer took 95-110 us instead of 5-8 on the
benchmark machine (``benchmarks/loader/heap.py``).

:func:`keep_freed` sets the two thresholds once per process, where they are glibc's
and nobody set them: allocations up to 32 MiB (glibc's own ceiling for the adaptive
threshold) come from the heaps, and up to :data:`TRIM_BYTES` of free memory stays in
each heap. Set ``FASTLOAD_KEEP_FREED=0`` to leave the allocator as it is.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading

log = logging.getLogger(__name__)

# mallopt(3) parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_BYTES = 32 * 1024**2
#: Free memory a heap keeps: a few batches of large samples (256 x 110 KB is 28 MB).
TRIM_BYTES = 128 * 1024**2

_lock = threading.Lock()
_done: dict[int, str] = {}  # pid -> what keep_freed did there


def keep_freed() -> str:
    """Set glibc's thresholds in this process (once); returns what was done, for logs and tests."""
    pid = os.getpid()
    with _lock:
        if pid not in _done:
            _done[pid] = _apply()
            log.debug("allocator: %s", _done[pid])
        return _done[pid]


def _apply() -> str:
    if os.environ.get("FASTLOAD_KEEP_FREED", "") == "0":
        return "left as it is: FASTLOAD_KEEP_FREED=0"
    if platform.libc_ver()[0] != "glibc":
        return "left as it is: not glibc"
    if os.environ.get("MALLOC_TRIM_THRESHOLD_") or os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return "left as it is: MALLOC_TRIM_THRESHOLD_ or MALLOC_MMAP_THRESHOLD_ is set"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError) as err:
        return f"left as it is: no mallopt ({err})"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, MMAP_BYTES) != 1 or mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES) != 1:
        return "left as it is: mallopt refused"
    return f"set: mmap threshold {MMAP_BYTES >> 20} MiB, trim threshold {TRIM_BYTES >> 20} MiB"
