"""``fastload bench``: the real :class:`fastload.DataLoader` over a dataset, epoch by epoch.

It builds a :class:`fastload.FileDataset` over ``DATASET_OR_URL`` (or over
built-in sample JPEGs with ``--sample``), decodes each JPEG on the CPU to a
``uint8`` 3 x S x S tensor (Pillow; recorded as the ``decode`` op), and
iterates ``--epochs`` epochs with a simulated training step of ``--step-ms``
(a sleep, which like a GPU step leaves the CPU to the loader's threads).

Per epoch it reports samples/s, the data-stall fraction (the share of the loop's
wall time spent waiting in ``next()``), the cache hit rate, peak RSS, and the
per-op table of ``loader.stats()``. Each epoch's regime is
:func:`fastload.stats.regime` of its cache hit rate. Unless ``--cache-dir`` is
given, the cache is a fresh temporary folder, removed afterwards, so epoch 1
fetches everything (cold) and later epochs read the cache (warm). ``--compare`` runs torch's
own DataLoader over the same files (through its own fresh cache) the same way;
its dataset's ops (fetch, cache_read, decode) are recorded too, one thread.

Order is sequential (no shuffle) so that with ``--batches`` a warm epoch reads
exactly what the cold epoch cached.

Op capacity. ``loader.stats()`` gives busy seconds per op summed over
threads; ``capacity_per_s`` multiplies the per-thread rate by the threads that
run the op (``read_threads`` for fetch / cache_read / decode / assemble, 1 for
collate / pin / h2d; ``num_workers`` for the first group when workers read,
their ops reaching the parent with their batches: :mod:`fastload.loader.worker_stats`).
"""

from __future__ import annotations

import contextlib
import io
import os
import resource
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastload.config import Settings, format_size
from fastload.diagnose._util import fmt_rate, optional
from fastload.stats import StatsCollector, current_collector, regime, use_collector

__all__ = ["BenchOptions", "DecodeJpeg", "render_bench", "run_bench"]

THREAD_OPS = ("fetch", "cache_read", "decode", "assemble")
SUB_OPS = ("fetch", "cache_read", "decode", "collate", "pin", "h2d")


class DecodeJpeg:
    """Transform: JPEG bytes -> ``uint8`` tensor (3, size, size); records the ``decode`` op.

    A plain class (not a lambda) so that it pickles into DataLoader workers.
    """

    def __init__(self, size: int = 224) -> None:
        self.size = size

    def __call__(self, data: bytes) -> Any:
        import numpy as np
        import torch

        image = optional("PIL")
        t0 = time.perf_counter()
        im = image.open(io.BytesIO(data)).convert("RGB").resize((self.size, self.size), image.Resampling.BILINEAR)
        out = torch.from_numpy(np.array(im)).permute(2, 0, 1).contiguous()
        current_collector().add("decode", items=1, bytes=out.numel(), seconds=time.perf_counter() - t0)
        return out


@dataclass(frozen=True)
class BenchOptions:
    """What ``fastload bench`` runs."""

    dataset: str | None = None
    sample: bool = False
    sample_images: int = 128
    pattern: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    epochs: int = 2
    batches: int | None = None
    batch_size: int = 32
    num_workers: int = 0
    read_threads: int | None = None
    decode: str = "auto"  # auto, cpu, none
    image_size: int = 224
    step_ms: float = 0.0
    compare: bool = False
    device: str | None = None
    cache_dir: Path | None = None


def _rss_bytes() -> int | None:
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def _maxrss(who: int) -> int:
    # ru_maxrss is KiB on Linux and bytes on macOS.
    value = resource.getrusage(who).ru_maxrss
    return value if os.uname().sysname == "Darwin" else value * 1024


def _batch_len(batch: Any, fallback: int) -> int:
    if isinstance(batch, dict):
        for key in ("url", "data"):
            if key in batch:
                return len(batch[key])
    return fallback


def _epoch(loader: Any, opts: BenchOptions) -> dict[str, Any]:
    waits: list[float] = []
    samples = batches = 0
    peak = _rss_bytes() or 0
    limit = opts.batches if opts.batches else None
    t0 = time.perf_counter()
    it = iter(loader)
    try:
        while limit is None or batches < limit:
            tw = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            waits.append(time.perf_counter() - tw)
            samples += _batch_len(batch, opts.batch_size)
            batches += 1
            if opts.step_ms > 0:
                time.sleep(opts.step_ms / 1000)
            peak = max(peak, _rss_bytes() or 0)
    finally:
        # Stop reading ahead past --batches and wait for this loader's reads already
        # running, or their records would land in the next epoch's stats. torch's
        # iterator has no close(); dropping it is enough.
        close = getattr(it, "close", None)
        if close is not None:
            close(timeout=60)
        del it
    wall = time.perf_counter() - t0
    wait = sum(waits)
    return {
        "batches": batches,
        "samples": samples,
        "seconds": wall,
        "samples_per_s": samples / wall if wall > 0 else None,
        "wait_seconds": wait,
        "data_stall_fraction": wait / wall if wall > 0 else None,
        "peak_rss_bytes": peak or None,
        "wait_ms_per_batch": [round(w * 1e3, 3) for w in waits],
    }


def _op_rows(stats: Any, threads: int) -> dict[str, dict[str, Any]]:
    rows = {}
    for name, s in stats.ops.items():
        par = threads if name in THREAD_OPS else 1
        rows[name] = {
            "items": s.items,
            "bytes": s.bytes,
            "busy_seconds": s.seconds,
            "items_per_busy_s": s.items_per_s,
            "threads": par,
            "capacity_per_s": s.items_per_s * par if s.items_per_s else None,
        }
    return rows


def _limit(ops: dict[str, dict[str, Any]]) -> str | None:
    subs = {n: r for n, r in ops.items() if n in SUB_OPS and r["capacity_per_s"]}
    pool = subs or {n: r for n, r in ops.items() if r["capacity_per_s"]}
    return min(pool, key=lambda n: pool[n]["capacity_per_s"]) if pool else None


def _dataset(opts: BenchOptions, url: str, cache_dir: Path) -> Any:
    from fastload.dataset import FileDataset

    settings = Settings.from_env(cache_dir=cache_dir)
    return FileDataset(url, opts.pattern, storage_options=opts.storage_options, settings=settings)


def _avg_size(ds: Any) -> float:
    # Items an HTTP listing left sizeless are pinned by the epochs' reads (any process).
    sizes = [i.size for i in ds.reader.identity.pinned(ds.items) if i.size >= 0]
    return sum(sizes) / len(sizes) if sizes else 0.0


def _wants_decode(opts: BenchOptions, ds: Any) -> bool:
    if opts.decode != "auto":
        return opts.decode == "cpu"
    item = ds.items[0]
    # Straight from the source, not through the cache: epoch 1 must stay cold.
    head = ds.reader.sources.of(item.url).fetch(item.url, 0, 16 if item.size < 0 else min(item.size, 16))
    return head[:3] == b"\xff\xd8\xff"


def run_bench(opts: BenchOptions) -> dict[str, Any]:
    """Run the benchmark described by ``opts``; returns the JSON-ready report."""
    import torch

    from fastload.loader.chain import DEFAULT_READ_THREADS
    from fastload.loader.dataloader import DataLoader
    from fastload.loader.torch_surface import (
        TORCH_DATALOADER,  # torch's own, even under patch_torch()
    )

    t_start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if opts.sample:
            from fastload.samples import make_image_folder

            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fastload-bench-data-")))
            make_image_folder(root / "train", n=opts.sample_images)
            url = str(root / "train")
            what = f"{opts.sample_images} built-in sample JPEGs (fastload.samples, 500x375 q90)"
        elif opts.dataset:
            url, what = opts.dataset, opts.dataset
        else:
            raise ValueError("give DATASET_OR_URL or --sample")

        def fresh_cache(tag: str) -> Path:
            if opts.cache_dir is not None:
                return opts.cache_dir / tag if tag != "fastload" else opts.cache_dir
            return Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"fastload-bench-{tag}-")))

        ds = _dataset(opts, url, fresh_cache("fastload"))
        decode = _wants_decode(opts, ds)
        if decode:
            ds.transform = DecodeJpeg(opts.image_size)
        threads = opts.read_threads if opts.read_threads is not None else DEFAULT_READ_THREADS
        loader = DataLoader(ds, batch_size=opts.batch_size, num_workers=opts.num_workers,
                            read_threads=opts.read_threads, device=opts.device)
        runs = []
        for epoch in range(1, opts.epochs + 1):
            loader.reset_stats()
            run = _epoch(loader, opts)
            stats = loader.stats()
            ops = _op_rows(stats, threads if opts.num_workers == 0 else opts.num_workers)
            hits = stats.cache_hit_rate
            runs.append({
                "loader": "fastload", "epoch": epoch,
                # No cache counters at all (nothing read through the cache): the fresh cache decides.
                "regime": regime(hits, fresh=epoch == 1),
                "cache_hit_rate": hits, "ops": ops, "limit": _limit(ops),
                "loader_stats": stats.as_dict(), "table": str(stats), **run,
            })
        if opts.compare:
            tds = _dataset(opts, url, fresh_cache("torch"))
            tds.transform = ds.transform
            gen = torch.Generator().manual_seed(0)
            tloader = TORCH_DATALOADER(tds, batch_size=opts.batch_size, num_workers=opts.num_workers, generator=gen)
            tcol = StatsCollector()
            for epoch in range(1, opts.epochs + 1):
                # torch's loader has no collector of its own; the dataset records into this
                # one (not the process-wide default) while torch calls __getitem__.
                tcol.reset()
                with use_collector(tcol):
                    run = _epoch(tloader, opts)
                stats = tcol.snapshot()
                ops = _op_rows(stats, 1) if opts.num_workers == 0 else {}
                runs.append({"loader": "torch", "epoch": epoch, "regime": regime(stats.cache_hit_rate, fresh=epoch == 1),
                             "cache_hit_rate": stats.cache_hit_rate, "ops": ops, "limit": _limit(ops),
                             **run})
    consumer = opts.batch_size * 1000.0 / opts.step_ms if opts.step_ms > 0 else None
    for run in runs:
        run["consumer_per_s"] = consumer
    for run in runs:
        if run["loader"] == "torch":
            mine = next(r for r in runs if r["loader"] == "fastload" and r["epoch"] == run["epoch"])
            if run["samples_per_s"] and mine["samples_per_s"]:
                mine["vs_torch"] = mine["samples_per_s"] / run["samples_per_s"]
    return {
        "fastload_bench": 1,
        "dataset": what,
        "url": url if not opts.sample else None,
        "items": len(ds),
        "avg_item_bytes": _avg_size(ds),
        "batch_size": opts.batch_size,
        "num_workers": opts.num_workers,
        "read_threads": threads,
        "decode": f"cpu, Pillow, to uint8 3x{opts.image_size}x{opts.image_size}" if decode else "none (raw bytes)",
        "step_ms": opts.step_ms,
        "device": opts.device,
        "runs": runs,
        # The kernel's high-water mark can trail a sample of VmRSS taken mid-epoch
        # (it was 100 KB lower in one CI run); the lifetime peak is at least both.
        "ru_maxrss_bytes": max([_maxrss(resource.RUSAGE_SELF), *(run["peak_rss_bytes"] or 0 for run in runs)]),
        "children_maxrss_bytes": _maxrss(resource.RUSAGE_CHILDREN) if opts.num_workers else None,
        "seconds": round(time.perf_counter() - t_start, 2),
    }


def render_bench(r: dict[str, Any]) -> str:
    """The bench report as text."""
    lines = [
        f"fastload bench: {r['dataset']} ({r['items']} items, avg {format_size(r['avg_item_bytes'])})",
        f"batch {r['batch_size']}, num_workers {r['num_workers']}, read_threads {r['read_threads']}, "
        f"decode {r['decode']}, step {r['step_ms']:g} ms, device {r['device'] or 'none'}",
        "",
    ]
    head = ("loader", "epoch", "regime", "batches", "samples/s", "stall", "hit rate", "peak RSS", "vs torch")
    rows = [head]
    for run in r["runs"]:
        hit = run.get("cache_hit_rate")
        vs = run.get("vs_torch")
        rows.append((run["loader"], str(run["epoch"]), run["regime"], str(run["batches"]),
                     fmt_rate(run["samples_per_s"]), f"{(run['data_stall_fraction'] or 0):.0%}",
                     "-" if hit is None else f"{hit:.0%}", format_size(run["peak_rss_bytes"]),
                     "-" if vs is None else f"{vs:.2f}x"))
    w = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines += ["  ".join(c.ljust(w[i]) if i < 3 else c.rjust(w[i]) for i, c in enumerate(row)) for row in rows]
    for run in r["runs"]:
        if run["loader"] != "fastload":
            continue
        lines += ["", f"fastload epoch {run['epoch']} ({run['regime']}): loader.stats()", run["table"]]
        lim = run.get("limit")
        if lim:
            st = run["ops"][lim]
            demand = run.get("consumer_per_s")
            vs = f"; the simulated step consumes {fmt_rate(demand)}/s" if demand else ""
            lines.append(f"slowest op: {lim}, about {fmt_rate(st['capacity_per_s'])} items/s over "
                         f"{st['threads']} thread(s){vs}")
    lines.append("")
    lines.append(f"peak RSS (process lifetime) {format_size(r['ru_maxrss_bytes'])}"
                 + (f", workers {format_size(r['children_maxrss_bytes'])}" if r.get("children_maxrss_bytes") else "")
                 + f"; {r['seconds']:.1f} s in all")
    return "\n".join(lines)
