"""Freed batches kept by glibc (fastload.read.heap) against glibc's defaults, side by side.

Each round runs two child processes, one with ``FASTLOAD_KEEP_FREED=0`` (glibc as it
is) and one without (the loader sets the thresholds), in alternating order. Each child:

* ``copy``: copies 64 samples of ``--bytes`` out of one buffer into new bytes objects
  (``fastload.cache.gather.split``, what a batch's samples are), drops them, again
  ``--copies`` times; us per sample and minor page faults per sample;
* warm epochs of ``fastload.DataLoader`` over a staged ``FileDataset`` (``file://``,
  ``--samples`` random files): ``num_workers=0``, ``num_workers=2`` iterated again
  (workers start each pass) and ``num_workers=2`` with persistent workers; samples/s,
  median of ``--epochs`` epochs after one that warms up.

Reported: medians over rounds, and each figure kept over its default (>1: faster).

    python benchmarks/loader/heap.py --rounds 3 --out benchmarks/loader/results/heap.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CASES = ("workers0", "reiterated", "persistent")


def child(args: argparse.Namespace) -> dict[str, Any]:
    import resource

    import numpy as np

    import fastload
    from fastload.cache.gather import split
    from fastload.config import Settings
    from fastload.read import heap

    settings = Settings(cache_dir=Path(args.work) / "cache")
    ds = fastload.FileDataset(f"file://{Path(args.work) / 'src'}", settings=settings)
    loaders = {
        "workers0": fastload.DataLoader(ds, batch_size=args.batch_size),
        "reiterated": fastload.DataLoader(ds, batch_size=args.batch_size, num_workers=2),
        "persistent": fastload.DataLoader(ds, batch_size=args.batch_size, num_workers=2, persistent_workers=True),
    }
    out: dict[str, Any] = {"allocator": heap.keep_freed()}
    buf = np.random.default_rng(0).integers(0, 256, 64 * args.bytes, dtype=np.uint8)
    spans = [(i * args.bytes, args.bytes) for i in range(64)]
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    for _ in range(args.copies):
        got = split(buf, spans)
        del got
    seconds = time.perf_counter() - t0
    n = 64 * args.copies
    out["copy_us"] = seconds / n * 1e6
    out["copy_faults"] = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / n
    for name, loader in loaders.items():
        rates = []
        for epoch in range(1 + args.epochs):
            t0 = time.perf_counter()
            count = sum(len(b["data"]) for b in loader)
            if epoch:
                rates.append(count / (time.perf_counter() - t0))
        out[name] = statistics.median(rates)
        if name == "persistent" and loader._iterator is not None:
            loader._iterator._shutdown_workers()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--samples", type=int, default=3000)
    p.add_argument("--bytes", type=int, default=112_000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--copies", type=int, default=50)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--work", help="folder of the files and the cache (default: a temp folder)")
    p.add_argument("--out", help="Markdown results file")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    work = Path(args.work or tempfile.mkdtemp(prefix="fastload-bench-heap-"))
    args.work = str(work)
    _stage(work, args)
    rows: dict[str, list[dict[str, Any]]] = {"default": [], "kept": []}
    for r in range(args.rounds):
        for mode in (("default", "kept") if r % 2 == 0 else ("kept", "default")):
            env = dict(os.environ, FASTLOAD_KEEP_FREED="0" if mode == "default" else "1")
            cmd = [sys.executable, __file__, "--child", *_passed(args)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=False)
            if proc.returncode != 0:
                sys.exit(f"child ({mode}) failed:\n{proc.stderr[-3000:]}")
            rows[mode].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(_report(rows, args))
    if args.out:
        Path(args.out).write_text(_report(rows, args) + "\n")


def _passed(args: argparse.Namespace) -> list[str]:
    return [f"--samples={args.samples}", f"--bytes={args.bytes}", f"--batch-size={args.batch_size}",
            f"--epochs={args.epochs}", f"--copies={args.copies}", f"--work={args.work}"]


def _stage(work: Path, args: argparse.Namespace) -> None:
    import numpy as np

    import fastload
    from fastload.config import Settings

    src = work / "src"
    if not src.exists() or len(list(src.iterdir())) != args.samples:
        src.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(0)
        for i in range(args.samples):
            (src / f"{i:06d}.bin").write_bytes(rng.integers(0, 256, args.bytes, np.uint8).tobytes())
    ds = fastload.FileDataset(f"file://{src}", settings=Settings(cache_dir=work / "cache"))
    for _ in fastload.DataLoader(ds, batch_size=args.batch_size):
        pass


def _report(rows: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> str:
    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[mode])

    lines = [
        f"{args.samples} files of {args.bytes} B, batch {args.batch_size}, {args.rounds} rounds "
        f"(load average {os.getloadavg()[0]:.2f} at the end); medians over rounds",
        f"allocator: default: {rows['default'][0]['allocator']}; kept: {rows['kept'][0]['allocator']}",
        "",
        "| figure | glibc default | kept (fastload) | kept / default |",
        "|---|---|---|---|",
        f"| copy, us per sample | {med('default', 'copy_us'):.1f} | {med('kept', 'copy_us'):.1f} | "
        f"{med('default', 'copy_us') / med('kept', 'copy_us'):.2f}x faster |",
        f"| copy, page faults per sample | {med('default', 'copy_faults'):.1f} | {med('kept', 'copy_faults'):.1f} | |",
    ]
    for case in CASES:
        d, k = med("default", case), med("kept", case)
        lines.append(f"| warm {case}, samples/s | {d:,.0f} | {k:,.0f} | {k / d:.2f} |")
    for mode in ("default", "kept"):
        w0 = med(mode, "workers0")
        lines.append(f"| {mode}: reiterated / workers0, persistent / workers0 | "
                     f"{med(mode, 'reiterated') / w0:.2f}, {med(mode, 'persistent') / w0:.2f} | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
