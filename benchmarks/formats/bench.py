"""MDS and LitData shards through fastload.DataLoader against each library's own loader, in one run.

Writes ``--samples`` samples (``--size`` random bytes, as a 20 KB JPEG would weigh: MDS
``bytes``, LitData a uint8 array; and an int label) with each library's own writer (``streaming.MDSWriter``, ``litdata.optimize``),
serves the folders with nginx (fastload/_servers), and times one pass after another:

* fastload: ``MDSDataset`` / ``LitDataset`` over ``http://`` through ``fastload.DataLoader``
  (``num_workers=0``, batch ``--batch``), cold (a fresh cache: every byte over the link) then warm.
* the library: ``streaming.StreamingDataset`` / ``litdata.StreamingDataset`` through torch's
  DataLoader (same batch, ``num_workers=0``), over the local folder: neither reads ``http://``
  (streaming has no HTTP downloader, litdata refuses the scheme), so theirs is the best case:
  no link at all, files in the page cache. First pass, then second.
* the link: every shard fetched whole from nginx with one urllib GET each (MB/s), the rate the
  cold pass is measured against (``cold_of_link``). Unshaped loopback by default; ``--rate 400mbit``
  shapes it with tc (needs root: the whole run happens in a ShapedLink namespace, as benchmarks/tar's).

Prints one JSON object per format (samples/s of each pass, ratios); ``--out`` appends them.
A library that is not installed is reported as skipped.

    python benchmarks/formats/bench.py --samples 4000 --size 20000 --out benchmarks/formats/results/x.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import types
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import fastload
from fastload import _servers
from fastload.config import Settings

_PAYLOAD: dict[str, int] = {}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--samples", type=int, default=4000)
    p.add_argument("--size", type=int, default=20_000, help="bytes per sample's payload")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--shard-mb", type=float, default=8.0, help="shard size limit (MDS size_limit, LitData chunk_bytes)")
    p.add_argument("--formats", default="mds,litdata")
    p.add_argument("--out", default=None, help="append the JSON lines to this file")
    p.add_argument("--rate", default=None, help="shape the loopback with tc tbf at this rate, e.g. 400mbit "
                   "(needs root: the whole run then happens inside a ShapedLink namespace); default unshaped")
    p.add_argument("--shaped-inside", default=None, help=argparse.SUPPRESS)  # set by the --rate re-run
    p.add_argument("--write-litdata", default=None, help=argparse.SUPPRESS)  # _write_litdata's child
    return p.parse_args(argv)


def lit_sample(job: tuple[int, int]) -> dict[str, Any]:
    """One LitData sample (module level: optimize's spawned workers import it)."""
    # The payload as a uint8 array: a dict of only bytes and ints is stored by litdata (pyarrow installed)
    # as an Arrow footer, which fastload.LitDataset does not read.
    import numpy as np

    i, size = job
    return {"image": np.frombuffer(os.urandom(size), np.uint8), "label": i % 1000}


def _pass(batches: Iterable[list[Any]]) -> tuple[int, float]:
    t0 = time.perf_counter()
    n = sum(len(b) for b in batches)
    return n, time.perf_counter() - t0


def _link_mb_s(urls: list[str]) -> float:
    t0, nbytes = time.perf_counter(), 0
    for url in urls:
        with urllib.request.urlopen(url) as answer:
            nbytes += len(answer.read())
    return nbytes / (time.perf_counter() - t0) / 1e6


def _streaming() -> Any:
    try:
        import torchvision  # noqa: F401
    except Exception:  # streaming imports its vision datasets (torchvision) on import; MDS needs none of them
        vision = types.ModuleType("streaming.vision")
        vision.__path__ = []  # type: ignore[attr-defined]
        sys.modules.setdefault("streaming.vision", vision)
    import streaming

    return streaming


def _write_mds(folder: Path, args: argparse.Namespace) -> Callable[[], Any]:
    streaming = _streaming()
    with streaming.MDSWriter(out=str(folder), columns={"image": "bytes", "label": "int"},
                             size_limit=int(args.shard_mb * 2**20)) as writer:
        for i in range(args.samples):
            writer.write({"image": os.urandom(args.size), "label": i % 1000})
    streaming.base.util.clean_stale_shared_memory()
    return lambda: streaming.StreamingDataset(local=str(folder), shuffle=False, batch_size=args.batch)


def _write_litdata(folder: Path, args: argparse.Namespace) -> Callable[[], Any]:
    import litdata

    # In a process of its own, this file its __main__: optimize's spawned workers import lit_sample
    # from it by name (a copy loaded under another name, as the smoke test loads it, is not importable),
    # and optimize sets the start method to spawn for its whole process.
    cmd = [sys.executable, __file__, "--write-litdata", str(folder), "--samples", str(args.samples),
           "--size", str(args.size), "--shard-mb", str(args.shard_mb)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return lambda: litdata.StreamingDataset(str(folder))


def _optimize(args: argparse.Namespace) -> None:
    import litdata

    litdata.optimize(fn=lit_sample, inputs=[(i, args.size) for i in range(args.samples)], output_dir=args.write_litdata,
                     chunk_bytes=int(args.shard_mb * 2**20), num_workers=1)


def run_format(name: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import torch.utils.data

    www = tmp / "www"
    folder = www / name
    try:
        own = (_write_mds if name == "mds" else _write_litdata)(folder, args)
    except ImportError as err:
        return {"format": name, "skipped": f"{type(err).__name__}: {err}"}
    shards = sorted(p.name for p in folder.iterdir() if p.name != "index.json")
    total = sum((folder / s).stat().st_size for s in shards)
    cls = fastload.MDSDataset if name == "mds" else fastload.LitDataset
    out: dict[str, Any] = {"format": name, "samples": args.samples, "payload_bytes": args.size, "batch": args.batch,
                           "shards": len(shards), "shard_bytes": total}
    with _servers.NginxServer(www) as server:
        out["link_mb_s"] = round(_link_mb_s([f"{server.url}/{name}/{s}" for s in shards]), 1)
        settings = Settings(cache_dir=tmp / f"cache-{name}")
        ds = cls(f"{server.url}/{name}", settings=settings)
        loader = fastload.DataLoader(ds, batch_size=args.batch, num_workers=0, collate_fn=list)
        for regime in ("cold", "warm"):
            n, seconds = _pass(loader)
            assert n == args.samples, (n, args.samples)
            out[f"fastload_{regime}_samples_s"] = round(n / seconds, 1)
            if regime == "cold":
                out["fastload_cold_mb_s"] = round(total / seconds / 1e6, 1)
    theirs = own()
    torch_loader = torch.utils.data.DataLoader(theirs, batch_size=args.batch, num_workers=0, collate_fn=list)
    for regime in ("first", "second"):
        n, seconds = _pass(torch_loader)
        assert n == args.samples, (n, args.samples)
        out[f"own_local_{regime}_samples_s"] = round(n / seconds, 1)
    out["cold_of_link"] = round(out["fastload_cold_mb_s"] / out["link_mb_s"], 3)
    out["warm_vs_own_second"] = round(out["fastload_warm_samples_s"] / out["own_local_second_samples_s"], 3)
    return out


def shaped(args: argparse.Namespace) -> int:
    """The run again, inside a namespace whose loopback carries ``tc tbf rate`` (nginx and the
    clients both in it, so every byte crosses the shaped link; fastload._servers.netns)."""
    if not _servers.shaping_available():
        print(f"--rate needs root and tc: {_servers.shaping_unavailable_reason()}", file=sys.stderr)
        return 2
    with _servers.ShapedLink(rate=args.rate, burst="1mb") as link:
        return link.run_in([sys.executable, __file__, *sys.argv[1:], "--shaped-inside", args.rate]).returncode


def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    link = f"tc tbf rate {args.rate} in a network namespace" if args.rate else "unshaped"
    machine = f"{platform.machine()} {os.cpu_count()} cores, {platform.python_version()}, nginx on loopback ({link})"
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.formats.split(","):
            result = run_format(name, args, Path(tmp)) | {"machine": machine}
            print(json.dumps(result), flush=True)
            results.append(result)
    if args.out:
        with open(args.out, "a") as f:
            for result in results:
                f.write(json.dumps(result) + "\n")
    return results


if __name__ == "__main__":
    parsed = parse_args()
    if parsed.write_litdata:
        _optimize(parsed)
    elif parsed.rate and not parsed.shaped_inside:
        sys.exit(shaped(parsed))
    else:
        main(parsed)
    sys.exit(0)
