"""Native batch assembly (fastload._native) against its pure-Python fallback, in one run.

Cases (``--cases``, comma-separated):

* ``assemble``: batches of ``--batch-size`` cached samples of each ``--sizes``
  (default 8 KB and 110 KB), LZ4 (token-like int32, compressible) and raw
  (random bytes), assembled into one buffer by :func:`fastload.cache.gather.gather`
  with the index records already in hand: ``python`` (the fallback), ``native``
  on one thread, and ``native`` with its default threads. Also ``cache_*``:
  :meth:`Cache.read_into`, which adds the index lookups and LRU touches that
  both paths share. ``ratio`` = the python variant's seconds / this variant's.
* ``loader``: whole-loader throughput of ``fastload.DataLoader`` over a cached
  ``TokenDataset`` (``--seq-len`` int32 tokens per sample, shuffled, batch
  ``--batch-size``), for each ``--read-threads``: the fallback, native, and
  ``per_sample`` (the read path before batch assembly: ``[ds[i] for i in idx]``).
  ``ratio`` = the fallback's seconds at the same read_threads / this variant's;
  the summary row ``best_vs_best`` compares each path at its best read_threads.
* ``files``: the same loader comparison over a cached ``FileDataset`` of
  ``--sizes`` files (collation of a list of bytes included).

Each variant runs ``--repeats`` times, interleaved with the others (the machine
may be shared), and the median is reported. Output is CSV on stdout, and in
``--out`` with the machine description.

    python benchmarks/native/bench.py --out benchmarks/native/results/cpu-2core.csv
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import io
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

if importlib.util.find_spec("fastload") is None:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import fastload  # noqa: E402
from fastload.cache import (
    Cache,  # noqa: E402
    gather,  # noqa: E402
)
from fastload.config import Settings  # noqa: E402

FIELDS = ["case", "variant", "size", "codec", "read_threads", "seconds", "items_per_s", "us_per_item", "ratio", "note"]


def tokens_like(n_bytes: int, rng: np.random.Generator) -> bytes:
    """int32 token ids from a Zipf law below 50257: LZ4 saves about 35% on them, as on real text."""
    n = -(-n_bytes // 4)
    return np.minimum(rng.zipf(1.2, n), 50256).astype(np.int32).tobytes()[:n_bytes]


def _median_runs(variants: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    runs: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            runs[name].append(run())
    return {k: statistics.median(v) for k, v in runs.items()}


def _row(case: str, variant: str, size: Any, codec: str, threads: Any, seconds: float, items: int,
         ratio: float | None, note: str = "") -> dict[str, Any]:  # fmt: skip
    return {
        "case": case, "variant": variant, "size": size, "codec": codec, "read_threads": threads,
        "seconds": round(seconds, 6), "items_per_s": round(items / seconds, 1) if seconds > 0 else 0.0,
        "us_per_item": round(seconds / items * 1e6, 2) if items else 0.0,
        "ratio": "" if ratio is None else round(ratio, 3), "note": note,
    }  # fmt: skip


# -- assemble ------------------------------------------------------------------------


def bench_assemble(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    rng = np.random.default_rng(0)
    for size in args.sizes:
        for codec_name in ("lz4", "raw"):
            rows += _assemble_one(args, work, rng, size, codec_name)
    return rows


def _assemble_one(args: argparse.Namespace, work: Path, rng: np.random.Generator, size: int, codec_name: str) -> list[dict[str, Any]]:
    bs = args.batch_size
    cache = Cache(Settings(cache_dir=work / f"assemble-{size}-{codec_name}", cache_limit_bytes=10**12))
    keys = [f"k{i}" for i in range(args.samples)]
    for i, key in enumerate(keys):
        cache.put(key, tokens_like(size, rng) if codec_name == "lz4" else rng.bytes(size), url=f"bench://{i}")
    entries = [cache.entry(k) for k in keys]
    want = fastload.codec.LZ4 if codec_name == "lz4" else fastload.codec.RAW
    share = sum(e is not None and e.codec == want for e in entries) / len(entries)
    order = [rng.permutation(args.samples)[:bs].tolist() for _ in range(args.batches)]
    out = np.empty(bs * size, dtype=np.uint8)
    batches = []
    for idx in order:
        jobs = []
        for k, i in enumerate(idx):
            e = entries[i]
            assert e is not None
            path = str(cache.data_dir / e.path)
            jobs.append(gather.Job(path, e.stored, e.raw, e.codec, e.checksum, e.stored_checksum, [(0, e.raw, k * size)]))
        batches.append(jobs)

    def timed(fn: Callable[[list[gather.Job]], Any]) -> Callable[[], float]:
        def run() -> float:
            t0 = time.perf_counter()
            for jobs in batches:
                fn(jobs)
            return time.perf_counter() - t0

        return run

    def via_cache(backend: str) -> Callable[[], float]:
        def run() -> float:
            with gather.use_backend(backend):
                t0 = time.perf_counter()
                for idx in order:
                    cache.read_into([(keys[i], [(0, size, k * size)]) for k, i in enumerate(idx)], out)
                return time.perf_counter() - t0

        return run

    variants: dict[str, Callable[[], float]] = {"python": timed(lambda j: gather.gather_python(j, out))}
    if gather.backend() == "native":
        variants["native_1thread"] = timed(lambda j: gather.gather_native(j, out, threads=1))
        variants["native"] = timed(lambda j: gather.gather_native(j, out))
        variants["cache_python"] = via_cache("python")
        variants["cache_native"] = via_cache("native")
    m = _median_runs(variants, args.repeats)
    cache.close()
    n = bs * args.batches
    note = f"{share:.0%} of payloads stored {codec_name}; batch {bs}; entries in hand"
    rows = []
    for name, sec in m.items():
        base = m["cache_python"] if name.startswith("cache_") else m["python"]
        extra = "; with index lookups + LRU touches" if name.startswith("cache_") else ""
        rows.append(_row("assemble", name, size, codec_name, "", sec, n, base / sec, note + extra))
    return rows


# -- loader ----------------------------------------------------------------------------


class PerSample:
    """The read path before batch assembly: one cache read (of a whole block) per sample."""

    def __init__(self, ds: Any) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> Any:
        return self.ds[i]

    def read_batch(self, indices: list[int]) -> list[Any]:
        return [self.ds[i] for i in indices]


def _loader_seconds(ds: Any, backend: str, args: argparse.Namespace, threads: int) -> tuple[float, int]:
    import torch

    with gather.use_backend(backend):
        loader = fastload.DataLoader(ds, batch_size=args.batch_size, shuffle=True, read_threads=threads,
                                     generator=torch.Generator().manual_seed(0), stats=False)  # fmt: skip
        n = 0
        t0 = time.perf_counter()
        for k, batch in enumerate(loader):
            n += len(batch["data"])
            if k + 1 >= args.loader_batches:
                break
        return time.perf_counter() - t0, n


def _loader_rows(case: str, ds: Any, size: Any, codec: str, args: argparse.Namespace, note: str) -> list[dict[str, Any]]:
    variants: dict[str, Callable[[], float]] = {}
    counts: dict[str, int] = {}
    backends = ["python", "native"] if gather.backend() == "native" else ["python"]
    for threads in args.read_threads:
        for name, target, backend in [("per_sample", PerSample(ds), "python")] + [(b, ds, b) for b in backends]:
            key = f"{name}@{threads}"

            def run(target: Any = target, backend: str = backend, threads: int = threads, key: str = key) -> float:
                sec, counts[key] = _loader_seconds(target, backend, args, threads)
                return sec

            variants[key] = run
    m = _median_runs(variants, args.repeats)
    rows = []
    for key, sec in m.items():
        name, threads = key.split("@")
        base = m[f"python@{threads}"]
        rows.append(_row(case, name, size, codec, threads, sec, counts[key], base / sec, note))
    best = {b: min((m[f"{b}@{t}"], t) for t in args.read_threads) for b in backends}
    if "native" in best:
        (ns, nt), (ps, pt) = best["native"], best["python"]
        rows.append(_row(case, "best_vs_best", size, codec, f"{nt} vs {pt}", ns, counts[f"native@{nt}"], ps / ns,
                         f"native at read_threads={nt} against python at read_threads={pt}"))  # fmt: skip
    return rows


def bench_loader(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    path = work / "tokens.bin"
    path.write_bytes(tokens_like(args.tokens * 4, np.random.default_rng(1)))
    settings = Settings(cache_dir=work / "loader-cache", cache_limit_bytes=10**12)
    fastload.stage(str(path), settings=settings, progress=False)
    ds = fastload.TokenDataset(str(path), seq_len=args.seq_len, dtype="int32", settings=settings)
    entries = list(Cache(settings).entries())
    stored = sum(e.stored for e in entries) / max(1, sum(e.raw for e in entries))
    note = (f"{args.tokens * 4 / 2**20:.0f} MiB token file in {len(entries)} blocks of "
            f"{settings.block_bytes / 2**20:.0f} MiB, stored at {stored:.0%}; batch {args.batch_size}, "
            f"{args.loader_batches} batches")  # fmt: skip
    return _loader_rows("loader", ds, args.seq_len * 4, "lz4", args, note)


def bench_files(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    rows = []
    rng = np.random.default_rng(2)
    for size in args.sizes:
        root = work / f"files-{size}"
        root.mkdir()
        for i in range(args.samples):
            (root / f"{i:06d}.bin").write_bytes(tokens_like(size, rng))
        settings = Settings(cache_dir=work / f"files-cache-{size}", cache_limit_bytes=10**12)
        fastload.stage(str(root), pattern="*.bin", settings=settings, progress=False)
        ds = fastload.FileDataset(str(root), pattern="*.bin", settings=settings)
        note = f"{args.samples} files; batch {args.batch_size}, {args.loader_batches} batches"
        rows += _loader_rows("files", ds, size, "lz4", args, note)
    return rows


# -- driver --------------------------------------------------------------------------------


def machine(load_at_start: tuple[float, ...]) -> dict[str, str]:
    """Describe where the numbers were measured (and how busy the machine was)."""
    import torch

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": str(os.cpu_count()),
        "native": str(gather.info()),
        "loadavg_1_5_15min_at_start": " ".join(f"{x:.2f}" for x in load_at_start),
        "loadavg_1_5_15min_at_end": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("Model name", "CPU(s)", "L2 cache", "L3 cache"):
            info[f"lscpu {key.strip()}"] = value.strip()
    return info


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="assemble,loader", help="comma-separated: assemble, loader, files")
    p.add_argument("--sizes", type=_ints, default=[8192, 112640], help="sample sizes in bytes")
    p.add_argument("--samples", type=int, default=2048, help="cached samples per size")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--batches", type=int, default=40, help="timed batches per repeat (assemble)")
    p.add_argument("--tokens", type=int, default=16 * 1024**2, help="tokens in the token file (loader)")
    p.add_argument("--seq-len", type=int, default=2048, help="int32 tokens per sample (loader)")
    p.add_argument("--loader-batches", type=int, default=48, help="timed batches per loader run")
    p.add_argument("--read-threads", type=_ints, default=[8, 1], help="DataLoader read_threads to try")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None, help="also write the CSV (with the machine) here")
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    return args


def main(args: argparse.Namespace) -> int:
    cases = {"assemble": bench_assemble, "loader": bench_loader, "files": bench_files}
    chosen = [c for c in args.cases.split(",") if c]
    unknown = [c for c in chosen if c not in cases]
    if unknown:
        print(f"unknown case(s) {unknown}; choose from {sorted(cases)}", file=sys.stderr)
        return 2
    load = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="fastload-native-bench-"))
    try:
        rows = []
        for case in chosen:
            rows += cases[case](args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=FIELDS)
    writer.writeheader()
    writer.writerows(rows)
    print(buf.getvalue(), end="")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        info = machine(load)
        info["command"] = "python benchmarks/native/bench.py " + " ".join(args.argv)
        header = "".join(f"# {k}: {v}\n" for k, v in info.items())
        args.out.write_text(header + buf.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main(parse_args()))
