"""CPU per object of fastload's cold and warm epochs, with the link out of the way.

An nginx on the host loopback (unshaped) serves ``--images`` JPEGs like the
peers benchmark's; a fresh cache per run. For the cold (read-through) epoch
and a warm one it prints objects/s, user and sys CPU per object and context
switches per object (getrusage of this process, plus its reaped children: with
``--num-workers`` the workers are not persistent, so each epoch's workers have
exited and been reaped, and their CPU counts, before the epoch's figures are read). This is what the profile in
results/profile.md quotes; run it under ``py-spy`` or ``perf record -g`` for
the breakdown.

Usage::

    python benchmarks/peers/cpu_per_object.py [--images 1500] [--read-threads 2] [--num-workers 2] [--json]
    python benchmarks/peers/cpu_per_object.py --store s3   # the same objects as s3:// keys (nginx path-style)

``--store s3`` reads the same JPEGs as a list of s3:// keys from nginx serving them
path-style (``/bucket/train/...``): each first block is a GET signed on libcurl
(fastload.source.s3); nginx checks no signature.
"""

from __future__ import annotations

import argparse
import importlib
import json
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import fastload
from fastload._servers import NginxServer, nginx_available
from fastload.config import Settings
from fastload.samples import make_image_folder


def _as_list(batch: list[Any]) -> list[Any]:
    return batch


class _Usage:
    """getrusage of this process plus its reaped children, summed field by field."""

    def __init__(self) -> None:
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        self.ru_utime = me.ru_utime + kids.ru_utime
        self.ru_stime = me.ru_stime + kids.ru_stime
        self.ru_nvcsw = me.ru_nvcsw + kids.ru_nvcsw
        self.ru_nivcsw = me.ru_nivcsw + kids.ru_nivcsw


def _epoch(loader: Any) -> dict[str, float]:
    r0, t0 = _Usage(), time.perf_counter()
    n = 0
    it = iter(loader)
    for batch in it:
        n += len(batch)
    del it  # non-persistent workers: shut down and reaped here, so their CPU is counted
    r1, dt = _Usage(), time.perf_counter() - t0
    return {
        "objects": n,
        "objects_per_s": round(n / dt),
        "user_ms_per_object": round((r1.ru_utime - r0.ru_utime) / n * 1e3, 3),
        "sys_ms_per_object": round((r1.ru_stime - r0.ru_stime) / n * 1e3, 3),
        "switches_per_object": round((r1.ru_nvcsw - r0.ru_nvcsw + r1.ru_nivcsw - r0.ru_nivcsw) / n, 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=1500)
    p.add_argument("--read-threads", type=int, default=None, help="DataLoader read_threads (default: fastload's)")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader num_workers (their CPU counts)")
    p.add_argument("--store", choices=("http", "s3"), default="http", help="the objects as http:// (listed) or s3:// keys")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not nginx_available():
        print("nginx is not installed (apt-get install nginx)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="fastload-cpu-"))
    try:
        make_image_folder(work / "www" / "bucket" / "train", n=args.images, quality=92)
        with NginxServer(work / "www") as server:
            if args.store == "s3":
                keys = sorted(p.relative_to(work / "www").as_posix() for p in (work / "www").rglob("*.jpg"))
                options = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": server.url, "region_name": "us-east-1"}}
                ds = fastload.FileDataset([f"s3://{k}" for k in keys], storage_options=options,
                                          settings=Settings(cache_dir=work / "cache"))
            else:
                ds = fastload.FileDataset(server.url + "/bucket/train/", pattern="**/*.jpg", label="parent",
                                          settings=Settings(cache_dir=work / "cache"))
            loader = fastload.DataLoader(ds, batch_size=64, collate_fn=_as_list, read_threads=args.read_threads,
                                         num_workers=args.num_workers)
            # The dataset's setup stays out of the epochs, aiohttp's import included: it runs on a
            # thread of fastload's (source.warm_http), and this import waits for it to finish.
            importlib.import_module("fsspec.implementations.http")
            out = {"cold": _epoch(loader), "warm": _epoch(loader), "read_threads": loader.read_threads,
                   "num_workers": args.num_workers, "store": args.store}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(out))
    else:
        for name in ("cold", "warm"):
            r = out[name]
            print(f"{name:5s} {r['objects_per_s']:>7,} objects/s  user {r['user_ms_per_object']:.2f} ms  "
                  f"sys {r['sys_ms_per_object']:.2f} ms per object  {r['switches_per_object']:.1f} switches per object")
    return 0


if __name__ == "__main__":
    sys.exit(main())
