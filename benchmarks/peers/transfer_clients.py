"""CPU per ranged GET of a ~110 KB object, per HTTP client, with the link out of the way.

An nginx on the host loopback (unshaped) serves ``--images`` JPEGs like the
peers benchmark's. Each client GETs every one of them with ``Range: bytes=0-(1 MiB - 1)``
(the first block, as fastload's cold read asks), ``--concurrency`` at a time, and
the benchmark prints GETs/s and user/sys CPU per GET (getrusage of this process;
nginx's own CPU is not counted). Clients, in alternation, ``--repeats`` times:

* ``fsspec``: ``HTTPFileSystem._cat_file`` on fsspec's loop (fastload's sized reads);
* ``aiohttp``: a bare ``session.get`` on fsspec's session (the floor of fastload's path);
* ``fastload``: ``Source.fetch_first_many`` in batches of 64 (slots, retries, sizes);
* ``obstore``: obstore's Rust client (``HTTPStore``), sync ``get`` on a thread pool;
* ``pycurl``: libcurl's multi interface, driven by one thread.

A client whose package is missing is reported as skipped. This is what
results/profile.md's transfer section quotes.

Usage::

    python benchmarks/peers/transfer_clients.py [--images 1500] [--concurrency 32] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import resource
import shutil
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fastload._servers import NginxServer, nginx_available
from fastload.samples import make_image_folder
from fastload.source import RemoteItem, Source

FIRST_BLOCK = 1 << 20
CLIENTS = ("fsspec", "aiohttp", "fastload", "obstore", "pycurl")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=1500)
    p.add_argument("--concurrency", type=int, default=32, help="GETs in flight per client")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--clients", default=",".join(CLIENTS))
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def _clients(base: str, rel: list[str], conc: int) -> dict[str, Callable[[], list[Any]] | str]:
    """Client name -> a function that GETs every object once (or why it is skipped)."""
    import fsspec.asyn

    src = Source(base + "/")
    fs: Any = src.fs
    out: dict[str, Callable[[], list[Any]] | str] = {}

    async def each(one: Callable[[str], Any]) -> list[Any]:
        sem = asyncio.Semaphore(conc)

        async def held(r: str) -> Any:
            async with sem:
                return await one(r)

        return await asyncio.gather(*(held(r) for r in rel))

    async def by_fsspec(r: str) -> bytes:
        return await fs._cat_file(f"{base}/{r}", start=0, end=FIRST_BLOCK)

    async def by_aiohttp(r: str) -> bytes:
        session = await fs.set_session()
        async with session.get(f"{base}/{r}", headers={"Range": f"bytes=0-{FIRST_BLOCK - 1}"}) as resp:
            return await resp.read()

    out["fsspec"] = lambda: fsspec.asyn.sync(fs.loop, each, by_fsspec)
    out["aiohttp"] = lambda: fsspec.asyn.sync(fs.loop, each, by_aiohttp)

    def by_fastload() -> list[Any]:
        items = [RemoteItem(f"{base}/{r}", -1, "") for r in rel]
        return [d for k in range(0, len(items), 64) for _, d in src.fetch_first_many(items[k : k + 64], FIRST_BLOCK)]

    out["fastload"] = by_fastload
    try:
        import obstore
        from obstore.store import HTTPStore
    except ImportError:
        out["obstore"] = "skipped: pip install obstore"
    else:
        store = HTTPStore.from_url(base, client_options={"allow_http": True})
        pool = ThreadPoolExecutor(conc)
        out["obstore"] = lambda: list(pool.map(lambda r: obstore.get(store, r, options={"range": (0, FIRST_BLOCK)}).bytes(), rel))
    try:
        import pycurl
    except ImportError:
        out["pycurl"] = "skipped: pip install pycurl"
    else:
        out["pycurl"] = lambda: _curl_all(pycurl, base, rel, conc)
    return out


def _curl_all(pycurl: Any, base: str, rel: list[str], conc: int) -> list[bytes]:
    multi = pycurl.CurlMulti()
    free = [pycurl.Curl() for _ in range(conc)]
    out: list[bytes] = [b""] * len(rel)
    todo, active, bufs = list(range(len(rel)))[::-1], 0, {}
    while todo or active:
        while todo and free:
            c, i = free.pop(), todo.pop()
            bufs[id(c)] = (i, io.BytesIO())
            c.setopt(pycurl.URL, f"{base}/{rel[i]}")
            c.setopt(pycurl.RANGE, f"0-{FIRST_BLOCK - 1}")
            c.setopt(pycurl.WRITEDATA, bufs[id(c)][1])
            multi.add_handle(c)
            active += 1
        while multi.perform()[0] == pycurl.E_CALL_MULTI_PERFORM:
            pass
        while True:
            queued, ok, failed = multi.info_read()
            for c in ok:
                i, buf = bufs.pop(id(c))
                out[i] = buf.getvalue()
                multi.remove_handle(c)
                free.append(c)
                active -= 1
            if failed:
                raise RuntimeError(f"pycurl: {failed[0][2]}")
            if not queued:
                break
        if active:
            multi.select(1.0)
    return out


def _measure(fn: Callable[[], list[Any]], n: int) -> dict[str, float]:
    import time

    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    got = fn()
    r1, dt = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - t0
    if len(got) != n or not all(len(g) > 0 for g in got):
        raise RuntimeError(f"got {len(got)} bodies of {n}")
    return {"gets_per_s": round(n / dt), "user_ms": round((r1.ru_utime - r0.ru_utime) / n * 1e3, 3),
            "sys_ms": round((r1.ru_stime - r0.ru_stime) / n * 1e3, 3)}


def main(args: argparse.Namespace) -> int:
    if not nginx_available():
        print("nginx is not installed (apt-get install nginx)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="fastload-xfer-"))
    results: dict[str, Any] = {}
    try:
        make_image_folder(work / "www" / "train", n=args.images, quality=92)
        rel = sorted(str(p.relative_to(work / "www")) for p in (work / "www" / "train").rglob("*.jpg"))
        with NginxServer(work / "www") as server:
            clients = _clients(server.url, rel, args.concurrency)
            names = [c for c in args.clients.split(",") if c]
            for name in names:
                fn = clients[name]
                if not callable(fn):
                    results[name] = fn
                else:
                    fn()  # warm: connections open, imports done
                    results[name] = []
            for _ in range(args.repeats):  # alternated, so that a busy moment hits every client
                for name in names:
                    fn = clients[name]
                    if callable(fn):
                        results[name].append(_measure(fn, len(rel)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(results))
    else:
        for name, runs in results.items():
            if isinstance(runs, str):
                print(f"{name:9s} {runs}")
                continue
            cpu = sorted(r["user_ms"] + r["sys_ms"] for r in runs)
            print(f"{name:9s} CPU per GET {cpu[len(cpu) // 2]:.3f} ms (median; runs {', '.join(f'{c:.3f}' for c in cpu)})  "
                  f"{max(r['gets_per_s'] for r in runs):,} GETs/s best")
    return 0


if __name__ == "__main__":
    sys.exit(main(parse_args()))
