"""Cold epochs over gs:// against a GCS emulator: fastload's two roads side by side in one run.

The store is gcp-storage-emulator (a Python server, fastload._servers.GcsEmulator),
on plain loopback: it, not the link, bounds the transfer rate, so seconds here say
little about real GCS. What carries over is the client's side, measured per object:
CPU seconds (the reading process and its threads, setup excluded) and requests,
counted in the emulator's own log.

Clients, each a fresh process reading every object once, as users read:

* ``engine``: ``fastload.FileDataset([gs://...])`` + ``fastload.DataLoader``, defaults (first
  blocks on libcurl, fastload.source.gcs);
* ``engine_listed``: the same from ``FileDataset("gs://bench/train/")`` (listed by gcsfs first);
* ``gcsfs``: the key list through gcsfs (``FASTLOAD_HTTP_CLIENT=aiohttp``: the road before);
* ``gcsfs_listed``: the listed prefix through gcsfs.

Run: ``python benchmarks/gcs/bench.py [--objects 400 --kb 110] [--out benchmarks/gcs/results/results.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from fastload import _servers  # noqa: E402

BUCKET = "bench"
CLIENTS = ("engine", "engine_listed", "gcsfs", "gcsfs_listed")

# Prints {"seconds", "cpu_s", "bytes", "n"}: the epoch only, the dataset's setup (and listing) excluded.
_CLIENT = r"""
import json, os, sys, time
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
import fastload
from fastload.config import Settings
endpoint, what, cache = sys.argv[1], sys.argv[2], sys.argv[3]
urls = what if what.startswith("gs://") else open(what).read().split()
options = {"endpoint_url": endpoint, "token": "anon", "project": "bench"}
ds = fastload.FileDataset(urls, storage_options=options, settings=Settings.from_env(cache_dir=cache))
c0, t0 = time.process_time(), time.perf_counter()
n = 0
for batch in fastload.DataLoader(ds, batch_size=64):
    n += sum(len(d) for d in batch["data"])
print(json.dumps({"seconds": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, "bytes": n, "n": len(ds)}))
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--objects", type=int, default=400, help="objects in the dataset")
    p.add_argument("--kb", type=int, default=110, help="size of each object in KB")
    p.add_argument("--clients", default=",".join(CLIENTS))
    p.add_argument("--timeout-s", type=float, default=600, help="limit per client run")
    p.add_argument("--out", type=Path, help="also write the JSON to this file")
    args = p.parse_args(argv)
    args.clients = [c for c in args.clients.split(",") if c]
    return args


def _requests(emulator: _servers.GcsEmulator) -> dict[str, int]:
    return {"get": emulator.requests("GET", f"/download/storage/v1/b/{BUCKET}/o/"),
            "metadata": sum(emulator.requests("GET", f"/storage/v1/b/{BUCKET}/o/train{sep}") for sep in ("/", "%2F")),
            "listing": emulator.requests("GET", f"/storage/v1/b/{BUCKET}/o?")}


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="fastload-gcs-bench-") as tmp, \
            _servers.GcsEmulator(Path(tmp) / "requests.log") as emulator:
        emulator.create_bucket(BUCKET)
        urls = []
        for i in range(args.objects):
            emulator.upload(BUCKET, f"train/{i:06d}.jpg", os.urandom(args.kb * 1000))  # incompressible, as JPEG
            urls.append(f"gs://{BUCKET}/train/{i:06d}.jpg")
        url_file = Path(tmp) / "urls.txt"
        url_file.write_text("\n".join(urls))
        for client in args.clients:
            what = f"gs://{BUCKET}/train/" if client.endswith("_listed") else str(url_file)
            env = dict(os.environ, PYTHONPATH=str(ROOT), FASTLOAD_HTTP_CLIENT="aiohttp" if client.startswith("gcsfs") else "auto")
            before = _requests(emulator)
            out = subprocess.run([sys.executable, "-c", _CLIENT, emulator.endpoint_url, what, str(Path(tmp) / client)],
                                 env=env, capture_output=True, text=True, timeout=args.timeout_s, check=False)
            if out.returncode != 0:
                raise SystemExit(f"{client} failed: {out.stderr[-2000:]}")
            res = json.loads(out.stdout.strip().splitlines()[-1])
            after = _requests(emulator)
            n = res["n"]
            rows.append({"client": client, "seconds": round(res["seconds"], 3), "mb_s": round(res["bytes"] / 1e6 / res["seconds"], 1),
                         "cpu_ms_per_object": round(1000 * res["cpu_s"] / n, 3),
                         **{f"{k}_per_object": round((after[k] - before[k]) / n, 3) for k in after}})
    return {"objects": args.objects, "kb": args.kb, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    print(f"{'client':<14} {'s':>7} {'MB/s':>7} {'CPU ms/obj':>11} {'GET/obj':>8} {'meta/obj':>9} {'list/obj':>9}")
    for r in result["rows"]:
        print(f"{r['client']:<14} {r['seconds']:>7} {r['mb_s']:>7} {r['cpu_ms_per_object']:>11} {r['get_per_object']:>8} "
              f"{r['metadata_per_object']:>9} {r['listing_per_object']:>9}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
