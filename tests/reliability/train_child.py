"""A training process for the reliability suite: epochs over a FileDataset, every sample checked.

Run as ``python train_child.py --url URL --cache-dir DIR --size BYTES [...]``. Each
sample's bytes are compared with :func:`helpers.content` (the bytes the test
wrote), so a wrong byte anywhere fails the run. After each epoch one JSON line
goes to stdout: epoch, samples, bad samples, RSS, open fds, cache payload bytes.
Exit status 0 only when every sample of every epoch was right.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil  # noqa: E402
from helpers import content, noise, payload_bytes, tree_bytes  # noqa: E402

import fastload  # noqa: E402
from fastload.config import Settings  # noqa: E402


def as_list(batch: list[Any]) -> list[Any]:
    return batch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--size", type=int, required=True, help="bytes of every file")
    p.add_argument("--limit", default="1GB")
    p.add_argument("--block", default="1MiB")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--noise", action="store_true", help="files hold helpers.noise(), not helpers.content()")
    p.add_argument("--ready", help="touch this file once the dataset is listed")
    return p.parse_args(argv)


def main(args: argparse.Namespace) -> int:
    settings = Settings(
        cache_dir=Path(args.cache_dir), retries=5, backoff_s=0.05, request_timeout_s=10,
    ).replace(cache_limit_bytes=args.limit, block_bytes=args.block)  # fmt: skip
    ds = fastload.FileDataset(args.url, settings=settings)
    root = ds.reader.manifest_root(args.url) + "/"
    if args.ready:
        Path(args.ready).touch()
    loader = fastload.DataLoader(
        ds, batch_size=args.batch, shuffle=True, num_workers=args.workers, collate_fn=as_list,
        timeout=args.timeout if args.workers else 0, seed=args.seed,
    )  # fmt: skip
    expect = noise if args.noise else content
    me = psutil.Process()
    ok = True
    for epoch in range(args.epochs):
        t0 = time.monotonic()
        samples = bad = 0
        for batch in loader:
            for sample in batch:
                samples += 1
                if sample["data"] != expect(sample["url"][len(root) :], args.size):
                    bad += 1
        ok = ok and bad == 0 and samples == len(ds)
        line = {
            "epoch": epoch, "samples": samples, "bad": bad, "seconds": round(time.monotonic() - t0, 3),
            "rss": me.memory_info().rss, "fds": me.num_fds(),
            "payload_bytes": payload_bytes(settings.cache_dir), "cache_dir_bytes": tree_bytes(settings.cache_dir),
            "corrupt": ds.reader.cache.corrupt_count(),
        }  # fmt: skip
        print(json.dumps(line), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(parse_args()))
