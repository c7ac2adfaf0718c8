"""Profile fastload.DataLoader over cached data with py-spy, and summarize the profile as text.

Run a loader for a while (the target of py-spy), then summarize what py-spy saw:

    py-spy record --native -r 100 -f raw -o tokens_native.txt -- \\
        python benchmarks/native/profile.py run tokens native 8 --seconds 20
    python benchmarks/native/profile.py summarize tokens_native.txt

``run CASE PATH READ_THREADS``: CASE is ``tokens`` (a cached 64 MiB TokenDataset,
2,048 int32 tokens per sample) or a file size in bytes (a cached FileDataset of
2,048 such files); PATH is ``before`` (one cache read per sample, the read path
before batch assembly), ``python`` (batch assembly, pure-Python fallback) or
``native`` (batch assembly in fastload._native). Data and cache live in
``--work`` (default: a folder under the system temp dir, reused between runs).

``summarize FILE``: the busy samples (waits on locks and condition variables
left out) of the loader's threads: top self frames and top inclusive frames.
benchmarks/native/results/profiles.md holds the summaries of the runs above.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
IDLE = ("pthread_cond_wait", "pthread_cond_timedwait", "PyThread_acquire_lock_timed", "sem_clockwait", "do_futex")
KEEP = ("fastload/", "gather", "cache/", "reader.py", "dataset.py", "codec.py", "_native.c", "collate", "core.py")


def run(args: argparse.Namespace) -> int:
    import numpy as np

    import fastload
    from fastload.config import Settings

    sys.path.insert(0, str(BENCH))
    import bench  # benchmarks/native/bench.py: tokens_like, PerSample

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    settings = Settings(cache_dir=work / f"cache-{args.case}", cache_limit_bytes=10**12)
    rng = np.random.default_rng(1)
    ds: Any
    if args.case == "tokens":
        path = work / "tokens.bin"
        if not path.exists():
            path.write_bytes(bench.tokens_like(16 * 1024**2 * 4, rng))
        fastload.stage(str(path), settings=settings, progress=False)
        ds = fastload.TokenDataset(str(path), seq_len=2048, dtype="int32", settings=settings)
    else:
        size, root = int(args.case), work / f"files-{args.case}"
        if not root.exists():
            root.mkdir()
            for i in range(2048):
                (root / f"{i:06d}.bin").write_bytes(bench.tokens_like(size, rng))
        fastload.stage(str(root), pattern="*.bin", settings=settings, progress=False)
        ds = fastload.FileDataset(str(root), pattern="*.bin", settings=settings)
    backend = args.path
    if backend == "before":
        ds, backend = bench.PerSample(ds), "python"
    loop(ds, backend, args)
    return 0


def loop(ds: Any, backend: str, args: argparse.Namespace) -> None:
    import fastload
    from fastload.cache import gather

    end = time.perf_counter() + args.seconds
    n, t0 = 0, time.perf_counter()
    with gather.use_backend(backend):
        while time.perf_counter() < end:
            for batch in fastload.DataLoader(ds, batch_size=64, shuffle=True, read_threads=args.read_threads, stats=False):
                n += len(batch["data"])
                if time.perf_counter() > end:
                    break
    rate = n / (time.perf_counter() - t0)
    print(f"{args.case} {args.path} read_threads={args.read_threads}: {rate:.0f} samples/s", file=sys.stderr)


def _frame(f: str) -> str:
    m = re.match(r"(.*) \((.*?)(?::\d+)?\)$", f)
    if not m:
        return f
    name, file = m.group(1), m.group(2).split("/")[-1]
    return f"{'?' if re.match(r'0x[0-9a-f]+$', name) else name} ({file})"


def summarize(args: argparse.Namespace) -> int:
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = idle = 0
    for line in args.file.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not any(k in stack for k in ("loop (profile.py", "Thread._bootstrap ", "pool_main")):
            continue  # start-up and imports
        n = int(count)
        if any(k in stack for k in IDLE):
            idle += n
            continue
        frames = [_frame(f) for f in stack.split(";") if not f.startswith(("process ", "thread "))]
        total += n
        own[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    print(f"busy samples: {total} (waits on locks and condition variables left out: {idle})\n")
    print("top self frames:\n```")
    for f, n in own.most_common(args.top):
        print(f"{100 * n / total:5.1f}%  {f}")
    print("```\ntop inclusive frames (fastload and what it calls):\n```")
    shown = [(f, n) for f, n in incl.most_common() if any(k in f for k in KEEP) or "pread" in f or "LZ4_decompress" in f]
    for f, n in shown[: args.top]:
        print(f"{100 * n / total:5.1f}%  {f}")
    print("```")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run a loader (under py-spy)")
    r.add_argument("case", help="'tokens' or a file size in bytes")
    r.add_argument("path", choices=["before", "python", "native"])
    r.add_argument("read_threads", type=int)
    r.add_argument("--seconds", type=float, default=20.0)
    r.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "fastload-native-profile")
    s = sub.add_parser("summarize", help="summarize a py-spy raw profile")
    s.add_argument("file", type=Path)
    s.add_argument("--top", type=int, default=12)
    return p.parse_args(argv)


def main(args: argparse.Namespace) -> int:
    return run(args) if args.command == "run" else summarize(args)


if __name__ == "__main__":
    sys.exit(main(parse_args()))
