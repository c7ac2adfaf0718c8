"""`make demo`: the main job end to end on built-in sample data.

1. Build ImageNet-like JPEGs from real photos (fastload.samples).
2. Where it can (root, ip and tc), build a slow link: a network namespace whose
   loopback the kernel shapes to ``--rate`` (200 Mbit), and run the rest inside it.
   Elsewhere the link is this machine's unshaped loopback, and the demo says so.
3. Serve the JPEGs over HTTP with a real nginx (Python's http.server if nginx is absent).
4. Pre-stage them into a fresh LZ4 cache (the cold epoch: every byte crosses the link once).
5. Stop the server and read every image again through the cache (the warm epoch).
6. Train-loop style: a fastload.DataLoader epoch over the cache with a simulated
   training step, so its data-stall figure says how much the loop waited for data.

Prints the link limit beside the cold and warm rates.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import fastload
from fastload import _servers
from fastload.config import Settings, format_size
from fastload.samples import make_image_folder

#: tc's rate units, in bits per second.
_TC_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def link_limit_mb_s(rate: str) -> float:
    """A tc rate ("200mbit") in MB/s (25.0)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?bit)", rate.strip().lower())
    if match is None:
        raise ValueError(f"rate {rate!r} is not a tc rate such as '200mbit' or '1gbit'")
    return float(match[1]) * _TC_UNITS[match[2]] / 8 / 1e6


class FallbackHTTP:
    """The server when nginx is not installed: Python's ThreadingHTTPServer.

    Two settings keep it from crawling under fastload's parallel fetches. A listen
    backlog of 128 instead of http.server's 5: with 5, the kernel drops the SYNs of
    a burst of connections and each dropped one waits a 1 s retransmit (the old
    demo staged at 1.0 MB/s). And HTTP/1.1, so a connection serves many requests
    instead of one (tests/integration/test_demo.py).
    """

    backlog = 128

    def __init__(self, root: Path) -> None:
        handler = functools.partial(_QuietHandler, directory=str(root))
        server_class = type("_Server", (http.server.ThreadingHTTPServer,), {"request_queue_size": self.backlog})
        self.httpd = server_class(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive (http.server's default, HTTP/1.0, closes each time)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve(root: Path) -> tuple[Any, str]:
    """Starts nginx over ``root``, or the fallback server; returns it and its description."""
    if _servers.nginx_available():
        return _servers.NginxServer(root).start(), "nginx"
    return FallbackHTTP(root), "Python's http.server (no nginx here; install it for Range requests)"


def shaping_problem() -> str | None:
    """Why the demo cannot shape a link here (cheap checks only), or None."""
    if os.geteuid() != 0:
        return "not root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    return f"no {' or '.join(missing)} (apt-get install iproute2)" if missing else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=300, help="sample JPEGs (default 300)")
    p.add_argument("--rate", default="200mbit", help="shaped link rate in tc units (default 200mbit)")
    p.add_argument("--no-shape", action="store_true", help="use the unshaped loopback even where shaping works")
    p.add_argument("--netns-prefix", default="fastload-demo", help="name prefix of the shaped namespace")
    p.add_argument("--step-ms", type=float, default=10.0, help="simulated training step per batch (default 10 ms)")
    p.add_argument("--keep", action="store_true", help="keep the demo's files")
    p.add_argument("--inside", type=Path, help=argparse.SUPPRESS)  # the run inside the shaped namespace
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.inside is not None:
        return run_epochs(args.inside, args, shaped=True)
    work = Path(tempfile.mkdtemp(prefix="fastload-demo-"))
    try:
        data = work / "www" / "train"
        t0 = time.perf_counter()
        paths = make_image_folder(data, n=args.images)
        total = sum(p.stat().st_size for p in paths)
        print(f"sample data: {len(paths)} JPEGs, {format_size(total)} "
              f"({time.perf_counter() - t0:.1f} s to generate) in {data}")
        problem = "--no-shape" if args.no_shape else shaping_problem()
        if problem is None:
            try:
                return _run_shaped(work, args)
            except _servers.ServerError as err:
                problem = f"cannot build a shaped network namespace here: {err}"
        print(f"link: unshaped loopback ({problem}), so the cold epoch below is as fast as this "
              f"machine's loopback, not a slow link; as root with tc the demo shapes it to {args.rate}")
        return run_epochs(work, args, shaped=False)
    finally:
        if args.keep:
            print(f"\ndemo files kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def _run_shaped(work: Path, args: argparse.Namespace) -> int:
    # A shaped namespace's 127.0.0.1 is its own: the server and the client (this
    # script again, with --inside) both run in it, so every byte crosses the shaped loopback.
    with _servers.ShapedLink(name_prefix=args.netns_prefix, rate=args.rate) as link:
        print(f"link: {args.rate} ({link_limit_mb_s(args.rate):.1f} MB/s), shaped with tc tbf "
              f"on the loopback of network namespace {link.name}", flush=True)
        here = Path(fastload.__file__).resolve().parents[1]  # so the child imports this fastload
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(here), os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--inside", str(work), "--rate", args.rate,
               "--step-ms", str(args.step_ms)]
        return link.run_in(cmd, env=env, timeout=600).returncode


def run_epochs(work: Path, args: argparse.Namespace, *, shaped: bool) -> int:
    """Serve, stage (cold), read back (warm) and run a DataLoader epoch over ``work``."""
    server, kind = serve(work / "www")
    url = f"{server.url}/train/"
    print(f"serving over HTTP with {kind} at {url}")
    settings = Settings(cache_dir=work / "cache")
    try:
        report = fastload.stage(url, pattern="**/*.jpg", settings=settings, progress=True)
    finally:
        server.stop()
    print("\ncold epoch (pre-staging over HTTP):")
    print(report)

    print("\nserver stopped; warm epoch reads the cache only")
    reader = fastload.Reader(settings)
    items = reader.list(url, "**/*.jpg")
    t0 = time.perf_counter()
    nbytes = sum(len(reader.read(item)) for item in items)
    warm_s = time.perf_counter() - t0
    cold_rate = report.fetched_bytes / report.seconds / 1e6
    warm_rate = nbytes / warm_s / 1e6
    print(f"warm epoch:  {len(items)} items, {format_size(nbytes)} in {warm_s:.2f} s = {warm_rate:.1f} MB/s "
          f"({len(items) / warm_s:.0f} items/s), remote requests: {reader.misses}")
    if shaped:
        limit = link_limit_mb_s(args.rate)
        link_text = f"link limit {limit:.1f} MB/s ({args.rate}, shaped)"
        cold_text = f"cold {cold_rate:.1f} MB/s ({cold_rate / limit:.0%} of the link)"
    else:
        link_text = "link unshaped (loopback)"
        cold_text = f"cold {cold_rate:.1f} MB/s"
    print(f"summary:     {link_text}  |  {cold_text}  |  warm {warm_rate:.1f} MB/s "
          f"(warm/cold = {warm_rate / cold_rate:.1f}x)")

    with fastload.open(items[0].url, settings=settings) as f:
        head = f.read(4)
    print(f"fastload.open({items[0].url.rsplit('/', 1)[-1]!r}) -> JPEG magic {head[:3].hex()} (served from cache)")
    loader_epoch(url, settings, step_s=args.step_ms / 1000)
    return 0


def loader_epoch(url: str, settings: Settings, *, step_s: float) -> Any:
    """One DataLoader epoch over the cache with a ``step_s`` training step per batch;
    returns the loader (its stats), or None without torch."""
    try:
        import torch  # noqa: F401

        from fastload.dataset import FileDataset
    except ImportError as err:
        print(f"(skipping the DataLoader epoch: {err})")
        return None
    ds = FileDataset(url, pattern="**/*.jpg", label="parent", settings=settings)
    loader = fastload.DataLoader(ds, batch_size=32, shuffle=True, collate_fn=_as_list)
    t0 = time.perf_counter()
    n = 0
    for batch in loader:
        n += len(batch)
        time.sleep(step_s)  # the training step: the GPU's time per batch, here a sleep
    dt = time.perf_counter() - t0
    print(f"\nDataLoader epoch over the cache, with a simulated {step_s * 1000:.0f} ms training step per batch: "
          f"{n} samples in {dt:.2f} s = {n / dt:.0f} samples/s, {len(ds.classes)} classes")
    print(loader.stats())
    return loader


def _as_list(batch: list[Any]) -> list[Any]:
    return batch


if __name__ == "__main__":
    raise SystemExit(main())
