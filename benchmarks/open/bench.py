"""Warm ``fastload.open`` against plain ``open()`` of the same files, in one run.

Serves ``--files`` files of ``--size`` bytes from nginx (fastload/_servers), stages
them into a fresh cache, then reads every file with ``--threads`` threads three
ways: plain ``open()`` of the served files (the page cache), ``fastload.open(url)``
and ``fsspec.open("fastload::url")``, both warm (no request reaches the server).
Prints one JSON object: MB/s of each, each fastload path's ratio to plain, and the
requests nginx logged during the warm reads (0: they never left the cache).

    python benchmarks/open/bench.py --files 300 --size 110000 --threads 8

``--chunk N`` reads each file in pieces of N bytes instead of one ``read()`` (large
files read back block by block, issue 35: ``--files 1 --size 2000000000 --chunk 8388608
--threads 1``); ``--size`` is then written in pieces too, so a 2 GB file needs no 2 GB buffer.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import fsspec

import fastload
from fastload import _servers
from fastload.config import Settings


def rates(ways: dict[str, tuple[list[str], Callable[[str], int]]], threads: int, rounds: int) -> dict[str, float]:
    """Best MB/s of each way over ``rounds`` passes, every file read with ``threads`` threads.

    The ways take turns within each round, so a neighbour's load on a shared machine
    weighs on all of them alike.
    """
    best = dict.fromkeys(ways, 0.0)
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(rounds):
            for name, (targets, read) in ways.items():
                t0 = time.perf_counter()
                nbytes = sum(pool.map(read, targets))
                best[name] = max(best[name], nbytes / (time.perf_counter() - t0) / 1e6)
    return best


def _drain(f: Any, chunk: int) -> int:
    if not chunk:
        return len(f.read())
    n = 0
    while piece := f.read(chunk):
        n += len(piece)
    return n


def plain(path: str, chunk: int = 0) -> int:
    with open(path, "rb") as f:
        return _drain(f, chunk)


def via_open(url: str, chunk: int = 0) -> int:
    with fastload.open(url) as f:
        return _drain(f, chunk)


def via_fsspec(url: str, chunk: int = 0) -> int:
    with fsspec.open("fastload::" + url, "rb") as f:
        return _drain(f, chunk)


def main(argv: list[str] | None = None) -> dict[str, float | int]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=300)
    p.add_argument("--size", type=int, default=110_000)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--chunk", type=int, default=0, help="read in pieces of this many bytes (0: one read)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        www = Path(tmp) / "www"
        www.mkdir()
        names = [f"{i:05d}.jpg" for i in range(args.files)]
        for name in names:
            with open(www / name, "wb") as f:
                for start in range(0, args.size, 64 << 20):
                    f.write(os.urandom(min(64 << 20, args.size - start)))
        # fsspec.open("fastload::...") takes its cache from the environment; put it back after.
        saved = os.environ.get("FASTLOAD_CACHE_DIR")
        os.environ["FASTLOAD_CACHE_DIR"] = str(Path(tmp) / "cache")
        try:
            with _servers.NginxServer(www) as server:
                fastload.stage(server.url + "/", settings=Settings.from_env(), progress=False)
                urls = [f"{server.url}/{n}" for n in names]
                paths = [str(www / n) for n in names]
                chunk = args.chunk
                ways = {"plain_open_mb_s": (paths, functools.partial(plain, chunk=chunk)),
                        "fastload_open_mb_s": (urls, functools.partial(via_open, chunk=chunk)),
                        "fsspec_fastload_mb_s": (urls, functools.partial(via_fsspec, chunk=chunk))}
                out: dict[str, float | int] = {"files": args.files, "bytes": args.size, "threads": args.threads,
                                               "chunk": chunk}
                log = server.workdir / "access.log" if server.workdir else None
                before = _lines(log)
                out |= rates(ways, args.threads, args.rounds)
                out["requests_while_warm"] = _lines(log) - before
        finally:
            if saved is None:
                os.environ.pop("FASTLOAD_CACHE_DIR")
            else:
                os.environ["FASTLOAD_CACHE_DIR"] = saved
    out["open_ratio"] = round(out["fastload_open_mb_s"] / out["plain_open_mb_s"], 3)
    out["fsspec_ratio"] = round(out["fsspec_fastload_mb_s"] / out["plain_open_mb_s"], 3)
    shown = {k: round(v, 1) if isinstance(v, float) and not k.endswith("ratio") else v for k, v in out.items()}
    print(json.dumps(shown))
    return shown


def _lines(log: Path | None) -> int:
    """Requests nginx has logged so far (warm reads must add none)."""
    return len(log.read_text().splitlines()) if log is not None and log.exists() else 0


if __name__ == "__main__":
    main()
    sys.exit(0)
