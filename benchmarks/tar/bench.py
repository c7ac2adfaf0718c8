"""Tar shards: fastload.TarDataset (cold and warm) vs webdataset streaming, one nginx, one run.

The shards are WebDataset's usual layout: ``--shards`` tar files of ``--samples``
samples, each a ``--member-bytes`` "JPEG" (random bytes: what JPEG is to LZ4) and a
``.cls`` label, served by a real nginx on 127.0.0.1 (unshaped loopback). Rows:

* link: the shards' bytes fetched whole with ``curl``, one after another (the link's speed).
* webdataset: ``webdataset.WebDataset(brace pattern)`` streaming from that nginx through
  ``torch.utils.data.DataLoader`` (its own shard order, no shuffle).
* fastload_cold: ``fastload.TarDataset(brace pattern)`` built on an empty cache (its
  shards indexed: fetched, stored, kept) plus one shuffled epoch through
  ``fastload.DataLoader``, timed together.
* fastload_cold_indexed (bytes/s only): a shuffled epoch on an empty cache holding only the
  shards' recorded indexes (a second node's, or an evicted cache): every byte moved by the
  epoch's reads and the blocks fetched ahead of them (fastload/read/ahead.py).
* fastload_warm: the same, cache filled; its variants pick the read design: ``kept``
  (decoded blocks kept in memory, the default), ``kept_quarter`` (a store of 32 MiB, a
  quarter of the shards: most blocks a shuffled batch touches are not kept), ``batch`` (kept_bytes=0: each batch reads
  its blocks once), ``batch_1mib`` (kept_bytes=0, 1 MiB cache blocks), and ``per_member``
  (kept_bytes=0, ``ds[i]`` one by one: one block read per member, as before issue 35).

Rounds interleave the rows so machine noise hits all alike; medians are reported.
Prints JSON and writes results/ (results.json, results.md with the machine and load).
Usage: ``python benchmarks/tar/bench.py [--shards 8] [--samples 500] [--rounds 3]``.
Needs ``pip install -r benchmarks/tar/requirements.txt`` (webdataset).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import fastload
from fastload import _servers
from fastload.cache import Cache, keys
from fastload.config import Settings


def make_shards(root: Path, shards: int, samples: int, member_bytes: int) -> int:
    """Write the shards; their total size in bytes."""
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for s in range(shards):
        with tarfile.open(root / f"shard-{s:06d}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            for k in range(samples):
                key = f"{s:06d}{k:05d}"
                for ext, data in (("jpg", rng.randbytes(member_bytes)), ("cls", str(k % 1000).encode())):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size, info.mtime = len(data), 0
                    tar.addfile(info, io.BytesIO(data))
    return sum(p.stat().st_size for p in root.iterdir())


def run_epoch(loader: Any) -> tuple[float, int]:
    """Samples per second of one pass, and the samples seen."""
    t0 = time.perf_counter()
    n = 0
    for batch in loader:
        n += len(batch["__key__"])
    return n / (time.perf_counter() - t0), n


def link_rate(urls: list[str]) -> float:
    """Bytes per second of the shards fetched whole with curl, one after another."""
    t0 = time.perf_counter()
    total = 0
    for url in urls:
        out = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{size_download}", url],
                             capture_output=True, text=True, check=True)
        total += int(out.stdout)
    return total / (time.perf_counter() - t0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--samples", type=int, default=500, help="samples per shard")
    p.add_argument("--member-bytes", type=int, default=20_000, help="bytes of each .jpg member")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=0, help="num_workers of both loaders")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every row (median reported)")
    p.add_argument("--per-member-samples", type=int, default=400, help="samples read one by one (the slow row)")
    p.add_argument("--rate", default=None, help="shape the loopback with tc tbf at this rate, e.g. 400mbit "
                   "(needs root: the whole run then happens inside a ShapedLink namespace); default unshaped")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("--shaped-inside", default=None, help=argparse.SUPPRESS)  # set by the --rate re-run
    return p.parse_args(argv)


def shaped(args: argparse.Namespace) -> int:
    """The run again, inside a namespace whose loopback carries ``tc tbf rate`` (nginx and
    clients both in it, so every byte crosses the shaped link; fastload._servers.netns)."""
    if not _servers.shaping_available():
        print(f"--rate needs root and tc: {_servers.shaping_unavailable_reason()}", file=sys.stderr)
        return 2
    argv = [a for a in sys.argv[1:]]
    with _servers.ShapedLink(rate=args.rate, burst="1mb") as link:
        return link.run_in([sys.executable, __file__, *argv, "--shaped-inside", args.rate]).returncode


def main(args: argparse.Namespace) -> int:
    if args.rate and not args.shaped_inside:
        return shaped(args)
    import webdataset as wds  # the peer: benchmarks/tar/requirements.txt

    work = Path(tempfile.mkdtemp(prefix="fastload-tar-"))
    nbytes = make_shards(work / "www", args.shards, args.samples, args.member_bytes)
    n = args.shards * args.samples
    pattern = f"shard-{{000000..{args.shards - 1:06d}}}.tar"
    rates: dict[str, list[float]] = {}
    kept: dict[str, Any] = {}
    load_before = os.getloadavg()

    def add(name: str, rate: float) -> None:
        rates.setdefault(name, []).append(rate)

    try:
        with _servers.NginxServer(work / "www") as server:
            url = f"{server.url}/{pattern}"
            urls = [f"{server.url}/shard-{s:06d}.tar" for s in range(args.shards)]

            def fastload_loader(ds: Any) -> Any:
                return fastload.DataLoader(ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers)

            def warm_dataset(name: str, **kw: Any) -> Any:
                settings = Settings(cache_dir=work / f"cache-{name}", **kw.pop("settings", {}))
                ds = fastload.TarDataset(url, settings=settings, **kw)
                run_epoch(fastload_loader(ds))  # fills the cache (and, with kept blocks, the store)
                return ds

            warm = {
                "fastload_warm_kept": warm_dataset("kept"),
                # A store of 4 blocks, a quarter of the dataset's 16: shuffled batches over more
                # data than is kept read most of their blocks again.
                "fastload_warm_kept_quarter": warm_dataset("quarter", kept_bytes=4 * 8 * 1024**2),
                "fastload_warm_batch": warm_dataset("batch", kept_bytes=0),
                "fastload_warm_batch_1mib": warm_dataset("batch1m", kept_bytes=0, settings={"block_bytes": 1024**2}),
            }
            per_member = warm_dataset("member", kept_bytes=0)
            for r in range(args.rounds):
                add("link_bytes_per_s", link_rate(urls))
                wds_ds = wds.WebDataset(url, shardshuffle=False, empty_check=False)
                add("webdataset", run_epoch(torch.utils.data.DataLoader(wds_ds, batch_size=args.batch_size,
                                                                        num_workers=args.workers))[0])
                # Cold: from an empty cache, the dataset built (each shard's headers read: its
                # blocks fetched, stored and kept) and one shuffled epoch, timed together.
                t0 = time.perf_counter()
                cold = fastload.TarDataset(url, settings=Settings(cache_dir=work / f"cache-cold-{r}"))
                _, seen = run_epoch(fastload_loader(cold))
                cold_s = time.perf_counter() - t0
                add("fastload_cold", seen / cold_s)
                add("fastload_cold_bytes_per_s", nbytes / cold_s)
                assert seen == n, (seen, n)
                # Cold with the shards' indexes recorded (a second node's cache, or blocks evicted):
                # no block is fetched to index, so the epoch's reads and their fetch ahead move every byte.
                indexed = Settings(cache_dir=work / f"cache-indexed-{r}")
                cache = Cache(indexed)
                for item in cold.items:
                    name = keys.tar_index(item.url, item.size, item.version)
                    cache.index.set(name, cold.reader.cache.index.get(name))
                cache.close()
                t0 = time.perf_counter()
                _, seen = run_epoch(fastload_loader(fastload.TarDataset(url, settings=indexed)))
                add("fastload_cold_indexed_bytes_per_s", nbytes / (time.perf_counter() - t0))
                assert seen == n, (seen, n)
                shutil.rmtree(work / f"cache-cold-{r}", ignore_errors=True)
                shutil.rmtree(work / f"cache-indexed-{r}", ignore_errors=True)
                for name, ds in warm.items():
                    add(name, run_epoch(fastload_loader(ds))[0])
                order = random.Random(r).sample(range(n), min(n, args.per_member_samples))
                t0 = time.perf_counter()
                for i in order:
                    per_member[i]
                add("fastload_warm_per_member", len(order) / (time.perf_counter() - t0))
            kept = warm["fastload_warm_kept"].kept.stats()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    samples = {k: round(v, 1) for k, v in med.items() if not k.endswith("bytes_per_s")}
    base = med["webdataset"]
    results: dict[str, Any] = {
        "shards": args.shards, "samples_per_shard": args.samples, "member_bytes": args.member_bytes,
        "shard_bytes_total": nbytes, "batch_size": args.batch_size, "workers": args.workers, "rounds": args.rounds,
        "samples_per_s": samples,
        "ratio_vs_webdataset": {k: round(v / base, 2) for k, v in samples.items()},
        "link_mb_s": round(med["link_bytes_per_s"] / 1e6, 1),
        "cold_mb_s": round(med["fastload_cold_bytes_per_s"] / 1e6, 1),
        "cold_vs_link": round(med["fastload_cold_bytes_per_s"] / med["link_bytes_per_s"], 2),
        "cold_indexed_vs_link": round(med["fastload_cold_indexed_bytes_per_s"] / med["link_bytes_per_s"], 2),
        "link_shaping": f"tc tbf rate {args.rate} in a network namespace" if args.rate else "unshaped loopback",
        "all_rounds": {k: [round(x, 1) for x in v] for k, v in rates.items()},
        "kept_store": kept,
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                    "platform": platform.platform(), "load_avg_before": [round(x, 2) for x in load_before],
                    "load_avg_after": [round(x, 2) for x in os.getloadavg()],
                    "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())},
    }
    print(json.dumps(results, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"results-{args.rate}" if args.rate else "results"
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    rows = "\n".join(f"| {k} | {v} | {results['ratio_vs_webdataset'][k]}x |" for k, v in samples.items())
    (args.out / f"{stem}.md").write_text(
        f"# Tar shards: fastload.TarDataset vs webdataset streaming\n\nCommand: `python benchmarks/tar/bench.py "
        f"--shards {args.shards} --samples {args.samples} --workers {args.workers} --rounds {args.rounds}"
        f"{' --rate ' + args.rate if args.rate else ''}`\n\n"
        f"{args.shards} shards x {args.samples} samples ({args.member_bytes} B random-bytes .jpg + .cls), "
        f"{nbytes / 1e6:.1f} MB, nginx on 127.0.0.1 ({results['link_shaping']}), batch {args.batch_size}, "
        f"num_workers={args.workers}; fastload shuffled, webdataset in shard order.\n\n"
        f"| row | samples/s (median of {args.rounds}) | vs webdataset |\n|---|---|---|\n{rows}\n\n"
        f"Link (curl, whole shards one after another): {results['link_mb_s']} MB/s; fastload cold: "
        f"{results['cold_mb_s']} MB/s = {results['cold_vs_link']} of the link; cold with the indexes recorded "
        f"(no indexing fetch): {results['cold_indexed_vs_link']} of the link.\n\n"
        f"Kept-block store after the run: {kept}\n\nMachine: {results['machine']}\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(parse_args()))
