"""`make demo`: the main job end to end on built-in sample data.

1. Build 300 ImageNet-like JPEGs from real photos (fastload.samples).
2. Serve them over HTTP with a real nginx (Python's http.server if nginx is absent).
3. Pre-stage them into a fresh LZ4 cache (the cold epoch: every byte crosses the link once).
4. Stop the server and read every image again through the cache (the warm epoch).
5. Train-loop style: iterate a fastload.DataLoader over the cached dataset, if torch is here.
Prints cold vs warm throughput.
"""

from __future__ import annotations

import functools
import http.server
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import fastload
from fastload import _servers
from fastload.config import Settings, format_size
from fastload.samples import make_image_folder


class _PythonHTTP:
    """Fallback server when nginx is not installed (no Range support; fine for whole files)."""

    def __init__(self, root: Path) -> None:
        handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
        http.server.SimpleHTTPRequestHandler.log_message = lambda *a: None  # type: ignore[method-assign]
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="fastload-demo-"))
    data = work / "www" / "train"
    t0 = time.perf_counter()
    paths = make_image_folder(data, n=300)
    total = sum(p.stat().st_size for p in paths)
    print(f"sample data: {len(paths)} JPEGs, {format_size(total)} ({time.perf_counter() - t0:.1f} s to generate) in {data}")

    if _servers.nginx_available():
        server = _servers.NginxServer(work / "www").start()
        kind = "nginx"
    else:
        server = _PythonHTTP(work / "www")  # type: ignore[assignment]
        kind = "python http.server (install nginx for Range requests)"
    url = f"{server.url}/train/"
    print(f"serving over HTTP with {kind} at {url}")

    settings = Settings(cache_dir=work / "cache", workers=8)
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
    print(f"cold epoch:  {cold_rate:.1f} MB/s  ->  warm/cold = {warm_rate / cold_rate:.1f}x")

    with fastload.open(items[0].url, settings=settings) as f:
        head = f.read(4)
    print(f"fastload.open({items[0].url.rsplit('/', 1)[-1]!r}) -> JPEG magic {head[:3].hex()} (served from cache)")
    _loader_epoch(url, settings)
    if "--keep" in sys.argv:
        print(f"\ndemo files kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _loader_epoch(url: str, settings: Settings) -> None:
    try:
        import torch  # noqa: F401

        from fastload.dataset import FileDataset
    except ImportError as err:
        print(f"(skipping the DataLoader epoch: {err})")
        return
    ds = FileDataset(url, pattern="**/*.jpg", label="parent", settings=settings)
    loader = fastload.DataLoader(ds, batch_size=32, shuffle=True, collate_fn=lambda batch: batch)
    t0 = time.perf_counter()
    n = sum(len(batch) for batch in loader)
    dt = time.perf_counter() - t0
    print(f"\nDataLoader epoch over the cache: {n} samples in {dt:.2f} s = {n / dt:.0f} samples/s, "
          f"{len(ds.classes)} classes")
    print(loader.stats())


if __name__ == "__main__":
    raise SystemExit(main())
