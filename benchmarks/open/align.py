"""How fast a large copy runs by where its source and destination lie within a 64-byte line.

Why: the kernel copies a read out of the page cache with `rep movsb`, and glibc's memcpy
uses the same instruction for large copies. On the benchmark machine (AMD EPYC, FSRM) it
runs at a fifth of its speed or less when the destination's place in its line is 1-31
bytes past the source's. native/_native.c (slow_copy) steers fastload's own copies around
those cells; this script draws the grid so that the rule can be checked on another CPU.

Prints two grids of GB/s, rows the source's place in its line, columns the destination's:
``read`` (``os.preadv`` of a page-cache file into an anonymous mapping) and ``memmove``
(``ctypes.memmove`` between two mappings, 256 KiB from the CPU's cache); then, for each,
the median GB/s of the cells the rule calls slow and of the others.

    python benchmarks/open/align.py [--step 8] [--file PATH]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable

LINE = 64
READ_BYTES = 1 << 20
COPY_BYTES = 256 << 10


def slow_by_rule(src: int, dst: int) -> bool:
    """native/_native.c slow_copy, on places within a line."""
    return dst > src and dst - src < LINE // 2


def best_rate(copy: Callable[[], None], nbytes: int, rounds: int = 5) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        copy()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def grid(step: int, cell: Callable[[int, int], float]) -> dict[tuple[int, int], float]:
    return {(s, d): cell(s, d) for s in range(0, LINE, step) for d in range(0, LINE, step)}


def show(name: str, step: int, rates: dict[tuple[int, int], float]) -> None:
    print(f"{name}: GB/s, rows: source's place in its line, columns: destination's")
    print("      " + "".join(f"{d:5d}" for d in range(0, LINE, step)))
    for s in range(0, LINE, step):
        print(f"{s:5d} " + "".join(f"{rates[s, d]:5.1f}" for d in range(0, LINE, step)))
    slow = [r for (s, d), r in rates.items() if slow_by_rule(s, d)]
    fast = [r for (s, d), r in rates.items() if not slow_by_rule(s, d)]
    print(f"{name}: cells the rule calls slow: median {statistics.median(slow):.1f} GB/s; "
          f"the others: median {statistics.median(fast):.1f} GB/s\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--step", type=int, default=8, help="bytes between the places tried")
    ap.add_argument("--file", help="a file of 16 MiB or more to read (default: one written in /var/tmp)")
    args = ap.parse_args()
    reads = 16
    path = args.file
    if path is None:
        fd, path = tempfile.mkstemp(dir="/var/tmp", prefix="fl-align-")
        os.write(fd, os.urandom(reads * READ_BYTES + 2 * LINE))
        os.close(fd)
    try:
        fd = os.open(path, os.O_RDONLY)
        out = mmap.mmap(-1, READ_BYTES + 2 * LINE)
        view = memoryview(out)

        def read_cell(s: int, d: int) -> float:
            into = view[d : d + READ_BYTES]
            return best_rate(lambda: [os.preadv(fd, [into], k * READ_BYTES + s) for k in range(reads)] and None,
                             reads * READ_BYTES)

        src_map, dst_map = mmap.mmap(-1, COPY_BYTES + LINE), mmap.mmap(-1, 16 * COPY_BYTES + LINE)
        src_at = ctypes.addressof(ctypes.c_char.from_buffer(src_map))
        dst_at = ctypes.addressof(ctypes.c_char.from_buffer(dst_map))

        def copy_cell(s: int, d: int) -> float:
            def copy() -> None:
                for k in range(16):
                    ctypes.memmove(dst_at + k * COPY_BYTES + d, src_at + s, COPY_BYTES)
            return best_rate(copy, 16 * COPY_BYTES)

        show("read", args.step, grid(args.step, read_cell))
        show("memmove", args.step, grid(args.step, copy_cell))
        os.close(fd)
    finally:
        if args.file is None:
            os.unlink(path)


if __name__ == "__main__":
    main()
