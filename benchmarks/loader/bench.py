"""Loader benchmarks: fastload.DataLoader against torch.utils.data.DataLoader.

Cases (``--cases``, comma-separated):

* ``overhead``: an in-memory dataset of small tensors, ``num_workers=0``; fastload
  with stats off and on against torch. ``ratio`` is seconds / torch's seconds
  (target <= 1.0 with stats off; the stats cost is the ``stats`` case).
* ``stats``: stats on / stats off over the same in-memory dataset (target < 1.02).
  A 2% difference is below the epoch-to-epoch noise of a shared machine, so two
  loaders, one with stats and one without, run side by side: ``--stats-pairs``
  pairs of chunks of about ``--stats-chunk-ms`` each, alternating which goes
  first, each chunk continuing its own loader's epoch. ``ratio`` is the median of
  the per-pair ratios; the note gives their interquartile range.
* ``read_batch``: a dataset with per-item read latency (time.sleep, which releases
  the GIL like network I/O) and a ``read_batch`` method: torch ``num_workers=0``
  against fastload's read_batch thread pool. Any factory returning
  ``(fastload_dataset, torch_dataset)`` can replace it: ``--dataset module:factory``
  (called with ``n``); e.g. a cached fastload dataset against torch reading files.
* ``device`` (CUDA only): ``device='cuda'`` against torch ``pin_memory=True`` plus
  ``.to(non_blocking=True)``, with a compute step per batch.
* ``workers``: an epoch over a ``FileDataset`` of ``--workers-samples`` random files
  of ``--workers-bytes`` (incompressible, like JPEGs) served by a real nginx on
  loopback (``file://`` where nginx is absent), with ``num_workers=0`` (fastload's
  read threads) and ``--workers`` worker processes, side by side: cold (a fresh
  cache each epoch, every file fetched) and warm (all cached). Workers start
  anew each epoch, as in a script without ``persistent_workers``, except in
  ``warm_workers<N>_persistent`` (median over repeats; only the first epoch
  starts them). ``warm_workers<N>`` builds a new loader each epoch;
  ``warm_workers<N>_reiterated`` iterates one loader again, as a training
  script's epoch loop does (its workers still start anew each epoch).
  ``ratio`` is the worker epoch's samples/s over the ``num_workers=0`` epoch's.

Each variant runs ``--repeats`` times, interleaved with the others to spread drift;
the median is reported. Output is CSV (default) or JSON on stdout, and in ``--out``
with the machine description.

    python benchmarks/loader/bench.py --out benchmarks/loader/results/cpu.csv
"""

from __future__ import annotations

import argparse
import csv
import functools
import importlib
import importlib.util
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.utils.data as tud

if importlib.util.find_spec("fastload") is None:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fastload.loader.dataloader import DataLoader  # noqa: E402

FIELDS = ["case", "variant", "batch_size", "seconds", "items_per_s", "ratio", "note"]


class SmallTensors(tud.Dataset):
    """In-memory samples: a float32 vector and an int64 label."""

    def __init__(self, n: int, dim: int) -> None:
        self.x = torch.randn(n, dim)
        self.y = torch.arange(n)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class LatencyDataset(tud.Dataset):
    """Each item costs ``latency_s`` of waiting (remote storage), then ``nbytes`` of data."""

    def __init__(self, n: int, latency_s: float, nbytes: int = 4096) -> None:
        self.n = n
        self.latency_s = latency_s
        self.nbytes = nbytes

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.latency_s)
        return torch.full((self.nbytes,), i % 251, dtype=torch.uint8)

    def read_batch(self, indices: list[int]) -> list[torch.Tensor]:
        return [self[i] for i in indices]


def latency_factory(n: int, latency_s: float) -> tuple[Any, Any]:
    """The default read_batch case: the same dataset on both sides."""
    ds = LatencyDataset(n, latency_s)
    return ds, ds


def _epoch_seconds(make: Callable[[], Any], step: Callable[[Any], None] | None = None) -> float:
    loader = make()
    t0 = time.perf_counter()
    for batch in loader:
        if step is not None:
            step(batch)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _measure(variants: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    runs: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            runs[name].append(run())
    return {name: statistics.median(v) for name, v in runs.items()}


def _row(
    case: str,
    variant: str,
    bs: Any,
    seconds: float,
    items: int,
    ratio: float | None,
    note: str = "",
) -> dict[str, Any]:
    return {
        "case": case,
        "variant": variant,
        "batch_size": bs,
        "seconds": round(seconds, 6),
        "items_per_s": round(items / seconds, 1) if seconds > 0 else 0.0,
        "ratio": "" if ratio is None else round(ratio, 4),
        "note": note,
    }


class _Stream:
    """Batches from back-to-back epochs of ``make()``'s loader, timed in chunks."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make
        self.it = iter(make())

    def run(self, batches: int) -> float:
        """Seconds to take the next ``batches`` batches."""
        it = self.it
        t0 = time.perf_counter()
        for _ in range(batches):
            try:
                next(it)
            except StopIteration:
                self.it = it = iter(self.make())
                next(it)
        return time.perf_counter() - t0


def bench_stats(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Stats on / off, in interleaved pairs of short chunks (see the module docstring)."""
    rows = []
    for bs in args.batch_sizes:
        n = max(args.samples, args.min_batches * bs)
        ds = SmallTensors(n, args.dim)
        on = _Stream(functools.partial(DataLoader, ds, batch_size=bs))
        off = _Stream(functools.partial(DataLoader, ds, batch_size=bs, stats=False))
        per_batch = min(on.run(20), off.run(20)) / 20  # also warms both up
        chunk = max(1, round(args.stats_chunk_ms / 1e3 / max(per_batch, 1e-9)))
        pairs = []
        for i in range(args.stats_pairs):
            if i % 2:
                b = off.run(chunk)
                a = on.run(chunk)
            else:
                a = on.run(chunk)
                b = off.run(chunk)
            pairs.append((a, b))
        ratios = sorted(a / b for a, b in pairs)
        q1, q3 = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
        note = (
            f"ratio = stats on / stats off: median of {len(pairs)} interleaved pairs of "
            f"{chunk}-batch chunks (IQR {q1:.4f}..{q3:.4f})"
        )
        on_s = statistics.median(a for a, _ in pairs)
        rows.append(
            _row("stats", "on_vs_off", bs, on_s, chunk * bs, statistics.median(ratios), note)
        )
    return rows


def _overhead_variants(ds: Any, bs: int) -> dict[str, Callable[[], float]]:
    return {
        "torch": lambda: _epoch_seconds(lambda: tud.DataLoader(ds, batch_size=bs)),
        "fastload_stats_off": lambda: _epoch_seconds(
            lambda: DataLoader(ds, batch_size=bs, stats=False)
        ),
        "fastload_stats_on": lambda: _epoch_seconds(lambda: DataLoader(ds, batch_size=bs)),
    }


def bench_overhead(args: argparse.Namespace) -> list[dict[str, Any]]:
    """fastload (stats off / on) against torch over in-memory small tensors."""
    rows = []
    for bs in args.batch_sizes:
        # Enough batches per epoch that per-batch costs, not timer noise, decide the ratio.
        n = max(args.samples, args.min_batches * bs)
        ds = SmallTensors(n, args.dim)
        m = _measure(_overhead_variants(ds, bs), args.repeats)
        note = "ratio = seconds / torch"
        rows += [_row("overhead", k, bs, v, n, v / m["torch"], note) for k, v in m.items()]
    return rows


def bench_read_batch(
    fl_dataset: Any,
    torch_dataset: Any,
    *,
    batch_size: int,
    read_threads: int,
    repeats: int,
    label: str,
) -> list[dict[str, Any]]:
    """torch num_workers=0 over ``torch_dataset`` against fastload's read_batch path."""
    n = len(torch_dataset)
    m = _measure(
        {
            "torch_workers0": lambda: _epoch_seconds(
                lambda: tud.DataLoader(torch_dataset, batch_size=batch_size)
            ),
            f"fastload_read_threads{read_threads}": lambda: _epoch_seconds(
                lambda: DataLoader(fl_dataset, batch_size=batch_size, read_threads=read_threads)
            ),
        },
        repeats,
    )
    base = m["torch_workers0"]
    return [
        _row("read_batch", name, batch_size, sec, n, sec / base, label) for name, sec in m.items()
    ]


def bench_device(args: argparse.Namespace) -> list[dict[str, Any]]:
    """device='cuda' against torch pin_memory=True + .to(non_blocking=True), with compute."""
    n, shape = args.device_batches * args.device_batch_size, (3, 224, 224)
    ds = tud.TensorDataset(torch.randint(0, 255, (n, *shape), dtype=torch.uint8), torch.arange(n))
    w = torch.randn(2048, 2048, device="cuda")

    def step(batch: Any) -> None:
        x, _ = batch
        x = x.to("cuda", non_blocking=True)  # a no-op for fastload's batches
        for _ in range(args.device_compute):
            torch.mm(w, w)
        x.float().mean()

    bs = args.device_batch_size
    m = _measure(
        {
            "torch_pin_memory": lambda: _epoch_seconds(
                lambda: tud.DataLoader(ds, batch_size=bs, pin_memory=True), step
            ),
            "fastload_device": lambda: _epoch_seconds(
                lambda: DataLoader(ds, batch_size=bs, device="cuda"), step
            ),
        },
        args.repeats,
    )
    note = f"uint8 {bs}x3x224x224 batches + {args.device_compute} 2048^2 matmuls per step"
    return [_row("device", k, bs, v, n, v / m["torch_pin_memory"], note) for k, v in m.items()]


def _files_epoch(make: Callable[[], Any]) -> float:
    loader = make()
    t0 = time.perf_counter()
    for batch in loader:
        len(batch["data"])
    return time.perf_counter() - t0


def bench_workers(args: argparse.Namespace) -> list[dict[str, Any]]:
    """FileDataset epochs, cold and warm, with num_workers=0 against worker processes."""
    import contextlib
    import shutil
    import tempfile

    import numpy as np

    import fastload
    from fastload import _servers
    from fastload.config import Settings

    work = Path(tempfile.mkdtemp(prefix="fastload-bench-workers-"))
    rng = np.random.default_rng(0)
    for i in range(args.workers_samples):
        d = work / "www" / f"c{i % 4}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:06d}.bin").write_bytes(rng.integers(0, 256, args.workers_bytes, np.uint8).tobytes())
    server: Any = _servers.NginxServer(work / "www") if _servers.nginx_available() else None
    bs, nw = args.workers_batch_size, args.workers
    try:
        with server if server is not None else contextlib.nullcontext():
            url = server.url + "/" if server is not None else f"file://{work / 'www'}"
            fresh = iter(range(1_000_000))

            def dataset(cache: Path) -> Any:
                settings = Settings(cache_dir=cache)
                return fastload.FileDataset(url, "**/*.bin", label="parent", settings=settings)

            def cold(workers: int) -> float:
                ds = dataset(work / f"cold{next(fresh)}")  # listed here, not timed
                seconds = _files_epoch(lambda: DataLoader(ds, batch_size=bs, num_workers=workers))
                shutil.rmtree(ds.reader.cache.root, ignore_errors=True)
                return seconds

            warm_ds = dataset(work / "warm")
            fastload.stage(url, pattern="**/*.bin", settings=warm_ds.reader.cache.settings, progress=False)
            kept = DataLoader(warm_ds, batch_size=bs, num_workers=nw, persistent_workers=True)
            again = DataLoader(warm_ds, batch_size=bs, num_workers=nw)
            m = _measure(
                {
                    "cold_workers0": lambda: cold(0),
                    f"cold_workers{nw}": lambda: cold(nw),
                    "warm_workers0": lambda: _files_epoch(lambda: DataLoader(warm_ds, batch_size=bs)),
                    f"warm_workers{nw}": lambda: _files_epoch(
                        lambda: DataLoader(warm_ds, batch_size=bs, num_workers=nw)
                    ),
                    f"warm_workers{nw}_reiterated": lambda: _files_epoch(lambda: again),
                    # The same workers every epoch: no start-up in the epochs after the first.
                    f"warm_workers{nw}_persistent": lambda: _files_epoch(lambda: kept),
                },
                args.repeats,
            )
            if kept._iterator is not None:
                kept._iterator._shutdown_workers()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    where = "nginx on loopback" if server is not None else "file:// (no nginx)"
    n = args.workers_samples
    note = f"{n} files of {args.workers_bytes} B from {where}; ratio = samples/s over num_workers=0's"
    rows = []
    for name, sec in m.items():
        regime = name.split("_")[0]
        base = m[f"{regime}_workers0"]
        rows.append(_row("workers", name, bs, sec, n, base / sec, note))
    return rows


def machine() -> dict[str, str]:
    """Describe where the numbers were measured."""
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": str(os.cpu_count()),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
    }
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    keep = (
        "Architecture",
        "CPU(s)",
        "Model name",
        "Thread(s) per core",
        "Core(s) per socket",
        "L2 cache",
        "L3 cache",
    )
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in keep:
            info[f"lscpu {key.strip()}"] = value.strip()
    return info


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--cases", default="overhead,stats,read_batch,device,workers", help="comma-separated cases"
    )
    p.add_argument("--samples", type=int, default=20000, help="items in the in-memory dataset")
    p.add_argument("--dim", type=int, default=16, help="floats per in-memory sample")
    p.add_argument(
        "--min-batches", type=int, default=1000, help="at least this many batches per epoch"
    )
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--stats-pairs", type=int, default=1500, help="on/off chunk pairs (stats)")
    p.add_argument("--stats-chunk-ms", type=float, default=4.0, help="about this long per chunk")
    p.add_argument("--read-samples", type=int, default=512)
    p.add_argument("--read-latency-ms", type=float, default=2.0)
    p.add_argument("--read-batch-size", type=int, default=32)
    p.add_argument("--read-threads", type=int, default=8)
    p.add_argument("--dataset", default=None, help="module:factory(n) -> (fastload_ds, torch_ds)")
    p.add_argument("--device-batches", type=int, default=30)
    p.add_argument("--device-batch-size", type=int, default=128)
    p.add_argument("--device-compute", type=int, default=40, help="matmuls per step")
    p.add_argument("--workers", type=int, default=2, help="num_workers of the workers case")
    p.add_argument("--workers-samples", type=int, default=3000)
    p.add_argument("--workers-bytes", type=int, default=112_000, help="bytes per file")
    p.add_argument("--workers-batch-size", type=int, default=64)
    p.add_argument("--format", choices=["csv", "json"], default="csv")
    p.add_argument("--out", type=Path, default=None, help="also write the results here")
    return p.parse_args(argv)


def _render(rows: list[dict[str, Any]], info: dict[str, str], fmt: str) -> str:
    if fmt == "json":
        return json.dumps({"machine": info, "results": rows}, indent=2) + "\n"
    buf = io.StringIO()
    for k, v in info.items():
        buf.write(f"# {k}: {v}\n")
    writer = csv.DictWriter(buf, fieldnames=FIELDS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def main(args: argparse.Namespace) -> int:
    """Run the selected cases; print (and optionally write) the results. Returns 0."""
    cases = {c.strip() for c in args.cases.split(",") if c.strip()}
    unknown = cases - {"overhead", "stats", "read_batch", "device", "workers"}
    if unknown:
        print(f"unknown case(s): {sorted(unknown)}", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as torch's worker processes do; keeps runs comparable
    try:
        rows = _run(cases, args)
    finally:
        torch.set_num_threads(threads)
    text = _render(rows, machine(), args.format)
    sys.stdout.write(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


def _run(cases: set[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    if "overhead" in cases:
        rows += bench_overhead(args)
    if "stats" in cases:
        rows += bench_stats(args)
    if "read_batch" in cases:
        if args.dataset:
            module, _, attr = args.dataset.partition(":")
            fl_ds, torch_ds = getattr(importlib.import_module(module), attr)(args.read_samples)
            label = args.dataset
        else:
            latency = args.read_latency_ms / 1e3
            fl_ds, torch_ds = latency_factory(args.read_samples, latency)
            label = f"{args.read_latency_ms} ms per item (sleep)"
        rows += bench_read_batch(
            fl_ds,
            torch_ds,
            batch_size=args.read_batch_size,
            read_threads=args.read_threads,
            repeats=args.repeats,
            label=label,
        )
    if "workers" in cases:
        rows += bench_workers(args)
    if "device" in cases:
        if torch.cuda.is_available():
            rows += bench_device(args)
        else:
            rows.append(_row("device", "skipped", "", 0.0, 0, None, "no CUDA on this machine"))
    return rows


if __name__ == "__main__":
    sys.exit(main(parse_args()))
