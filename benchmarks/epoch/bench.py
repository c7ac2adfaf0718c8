"""An epoch over a cached fastload dataset vs torch's DataLoader reading the same files.

Both loaders use the same worker count and batch size over the same JPEGs (real
photos from fastload.samples) served by a real nginx on loopback:

* torch: ``torch.utils.data.DataLoader`` over a Dataset that reads each file with
  ``fsspec`` from the HTTP server (the naive baseline every epoch);
* torch-local: the same, reading the files from local disk (the ceiling a user
  gets by copying the data by hand; not compressed, not checked);
* fastload: ``fastload.DataLoader`` over ``fastload.FileDataset``, warm cache
  (staged once before timing), with the same ``num_workers``, and with
  ``num_workers=0`` plus its ``read_batch`` threads.

Prints JSON and writes results/ (results.json, results.md with the machine).
Usage: ``python benchmarks/epoch/bench.py [--n 600] [--workers 2] [--epochs 3]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import fsspec
import torch

import fastload
from fastload import _servers
from fastload.config import Settings
from fastload.samples import make_image_folder


class HTTPFiles(torch.utils.data.Dataset):
    """The naive baseline: every sample is an HTTP GET through fsspec."""

    def __init__(self, urls: list[str], labels: list[int]) -> None:
        self.urls, self.labels = urls, labels

    def __len__(self) -> int:
        return len(self.urls)

    def __getitem__(self, i: int) -> dict[str, Any]:
        with fsspec.open(self.urls[i], "rb") as f:
            return {"data": f.read(), "label": self.labels[i], "url": self.urls[i]}


class LocalFiles(HTTPFiles):
    """Plain local reads (open + read), no cache, no checks."""

    def __getitem__(self, i: int) -> dict[str, Any]:
        with open(self.urls[i], "rb") as f:
            return {"data": f.read(), "label": self.labels[i], "url": self.urls[i]}


def epoch_rate(loader: Any) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = nbytes = 0
    for batch in loader:
        n += len(batch["data"])
        nbytes += sum(len(d) for d in batch["data"])
    dt = time.perf_counter() - t0
    return n / dt, nbytes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=600, help="JPEGs in the dataset")
    p.add_argument("--workers", type=int, default=2, help="num_workers for both loaders")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=3, help="timed epochs per loader (median reported)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    return p.parse_args(argv)


def main(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="fastload-epoch-"))
    files = make_image_folder(work / "www" / "train", n=args.n)
    classes = sorted({p.parent.name for p in files})
    labels = [classes.index(p.parent.name) for p in files]
    results: dict[str, Any] = {"n": args.n, "workers": args.workers, "batch_size": args.batch_size,
                               "avg_bytes": sum(p.stat().st_size for p in files) / len(files)}
    rates: dict[str, list[float]] = {}
    with _servers.NginxServer(work / "www") as server:
        urls = [f"{server.url}/train/{p.relative_to(work / 'www' / 'train').as_posix()}" for p in files]
        settings = Settings(cache_dir=work / "cache")
        fastload.stage(server.url + "/train/", pattern="**/*.jpg", settings=settings, progress=False)
        ds = fastload.FileDataset(server.url + "/train/", pattern="**/*.jpg", label="parent", settings=settings)
        loaders = {
            "torch_http": lambda: torch.utils.data.DataLoader(HTTPFiles(urls, labels), batch_size=args.batch_size, num_workers=args.workers),
            "torch_local": lambda: torch.utils.data.DataLoader(LocalFiles([str(p) for p in files], labels), batch_size=args.batch_size, num_workers=args.workers),
            "fastload_workers": lambda: fastload.DataLoader(ds, batch_size=args.batch_size, num_workers=args.workers),
            "fastload_threads": lambda: fastload.DataLoader(ds, batch_size=args.batch_size, num_workers=0, read_threads=4),
        }
        for _ in range(args.epochs):  # interleave loaders so machine noise hits all alike
            for name, make in loaders.items():
                rate, _ = epoch_rate(make())
                rates.setdefault(name, []).append(rate)
    results["samples_per_s"] = {k: round(statistics.median(v), 1) for k, v in rates.items()}
    base = results["samples_per_s"]["torch_http"]
    results["ratio_vs_torch_http"] = {k: round(v / base, 2) for k, v in results["samples_per_s"].items()}
    results["machine"] = {"python": platform.python_version(), "torch": torch.__version__, "cpus": str(__import__("os").cpu_count()),
                          "platform": platform.platform(), "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    print(json.dumps(results, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    rows = "\n".join(f"| {k} | {v} | {results['ratio_vs_torch_http'][k]}x |" for k, v in results["samples_per_s"].items())
    (args.out / "results.md").write_text(
        f"# Epoch over cached data vs torch DataLoader\n\nCommand: `python benchmarks/epoch/bench.py --n {args.n} "
        f"--workers {args.workers} --epochs {args.epochs}`\n\n{args.n} JPEGs (avg {results['avg_bytes'] / 1e3:.0f} KB), "
        f"batch {args.batch_size}, num_workers={args.workers} for torch and fastload_workers; nginx on loopback (unshaped).\n\n"
        f"| loader | samples/s (median of {args.epochs}) | vs torch_http |\n|---|---|---|\n{rows}\n\n"
        f"Machine: {results['machine']}\n"
    )
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(parse_args()))
