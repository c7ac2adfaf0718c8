"""Where a cold epoch's time goes: a timeline of fastload's defaults on one shaped link.

The peers benchmark reports one number per cold epoch (samples/s, its share of
the link). This tool runs the same epoch (``FileDataset`` + ``DataLoader``
defaults, batch 64, an empty cache, nginx in a shaped namespace, the same
timed window: listing included, imports not) and records, inside the epoch's
process, when each thing happened:

* the listing (start, end, each page's request), the first GET, its answer,
  every batch, the last answer, the end of the epoch;
* bytes on the namespace's loopback every 5 ms (``/proc/net/dev``), requests in
  flight and the host limit, each cache store's duration.

From those it splits the time the epoch took beyond ``bytes / link``: the
setup before the first GET, the ramp (bytes behind the link at 16 MB, less
that setup), stalls mid-epoch (0.25 s windows below 0.9 of the link) and the
tail (last answer to last batch), and reports the epoch's CPU per object (this
process's rusage, the sampler included). ``--pythonpath A,B`` alternates checkouts in
one link session, so before/after runs see the same link and load.

The instruments wrap fastload internals by name (``Source._http_list``,
``listing.start_pages`` and ``page_of``, ``aio.http_get_first``, ``HostLimit._release`` and ``account``, ``Fetcher._store``); one
that no longer exists is reported as missing, not guessed. They cost the epoch
a little CPU (the byte sampler runs every 5 ms), so compare runs of this tool
with each other, not with bench.py's figures.

Usage::

    python benchmarks/peers/timeline.py --link 1gbit+20ms --repeats 3 [--pythonpath /a,/b] [--out FILE.json]
    python benchmarks/peers/timeline.py --link none --images 50     # smoke, unshaped
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
BATCH = 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--link", default="1gbit+20ms", help="RATE[+DELAYms] in tc units, or none[+DELAYms] (unshaped)")
    p.add_argument("--images", type=int, default=3000, help="JPEGs in the dataset")
    p.add_argument("--repeats", type=int, default=1, help="epochs per checkout, alternated")
    p.add_argument("--pythonpath", default=str(ROOT), help="comma-separated fastload checkouts to alternate")
    p.add_argument("--netns-prefix", default="fl", help="prefix of the network namespace's name")
    p.add_argument("--work-dir", type=Path, help="where data and caches go (default: a new temp folder, removed)")
    p.add_argument("--out", type=Path, help="also write every run's summary and series as JSON here")
    p.add_argument("--child", nargs=2, metavar=("SPEC_JSON", "OUT_JSON"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- the epoch's own process ---------------------------------------------------------------------


def _child(spec: dict[str, Any], out: Path) -> None:
    """One cold epoch, instrumented; writes its events and series to ``out``."""
    import importlib

    for name in ["numpy", "PIL.Image", "torch", "fsspec", "fastload"]:  # before the clock, as peers.py does
        importlib.import_module(name)
    import fastload
    from fastload.config import Settings

    clock = time.perf_counter
    events: dict[str, float] = {}
    requests: list[tuple[float, float, int]] = []  # start, end, body bytes (-1: a listing page)
    limits: list[tuple[float, float, int]] = []  # time, limit, in flight
    stores: list[tuple[float, float, int]] = []  # start, end, blocks
    missing = _instrument(events, requests, limits, stores, clock)
    wire: list[tuple[float, int]] = []
    done = threading.Event()

    def sample() -> None:  # bytes through this namespace's loopback (both directions; answers dominate)
        while not done.is_set():
            with open("/proc/net/dev") as f:
                for line in f:
                    if line.strip().startswith("lo:"):
                        wire.append((clock(), int(line.split(":", 1)[1].split()[8])))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    cpu0 = _cpu_s()
    t0 = clock()
    ds = fastload.FileDataset(spec["url"], pattern="**/*.jpg", label="parent", settings=Settings(cache_dir=Path(spec["cache_dir"])))
    events["dataset"] = clock()
    loader = fastload.DataLoader(ds, batch_size=BATCH, collate_fn=lambda s: s)
    events["loader"] = clock()
    batches = []
    samples = nbytes = 0
    for batch in loader:
        samples += len(batch)
        nbytes += sum(len(s["data"]) for s in batch)
        batches.append(clock())
    events["epoch_end"] = clock()
    cpu_s = _cpu_s() - cpu0
    done.set()
    sampler.join()
    rel = {k: v - t0 for k, v in events.items()}
    out.write_text(json.dumps({
        "events": rel, "samples": samples, "bytes": nbytes, "missing_instruments": missing, "cpu_s": cpu_s,
        "batches": [t - t0 for t in batches], "requests": sorted((a - t0, b - t0, n) for a, b, n in requests),
        "limits": [(t - t0, lim, n) for t, lim, n in limits], "stores": [(a - t0, b - t0, n) for a, b, n in stores],
        "wire": [(t - t0, b) for t, b in wire],
    }))


def _cpu_s() -> float:
    """User + system CPU seconds of this process (the byte sampler's share included: ~5%)."""
    import resource

    me = resource.getrusage(resource.RUSAGE_SELF)
    return me.ru_utime + me.ru_stime


def _instrument(events: dict[str, float], requests: list[Any], limits: list[Any], stores: list[Any], clock: Any) -> list[str]:
    import fastload.fetch as fetch
    import fastload.source.aio as aio
    import fastload.source.listing as listing_mod
    import fastload.transport.curl as curl
    import fastload.transport.hostlimit as hostlimit

    missing = []

    def wrap(owner: Any, name: str, make: Any) -> None:
        inner = getattr(owner, name, None)
        if inner is None:
            missing.append(f"{getattr(owner, '__name__', owner)}.{name}")
        else:
            setattr(owner, name, make(inner))

    def listing(inner: Any) -> Any:
        def run(self: Any, pattern: Any) -> Any:
            events.setdefault("list_start", clock())
            try:
                return inner(self, pattern)
            finally:
                events["list_end"] = clock()
        return run

    def timed(inner: Any) -> Any:
        async def run(*args: Any, **kwargs: Any) -> Any:
            t = clock()
            res = await inner(*args, **kwargs)
            requests.append((t, clock(), len(res[1])))
            return res
        return run

    def release(inner: Any) -> Any:
        def run(self: Any, outcome: Any) -> None:
            inner(self, outcome)
            limits.append((clock(), self.limit, self.in_flight))
        return run

    def accounted(inner: Any) -> Any:
        # GETs on libcurl's thread (fastload.transport.curl) reach Python only as outcomes, at most
        # ~PUMP_S after their answer: each is placed by its latency, ending when it was taken.
        # Those taken before the listing ended are its pages (timed by `pages`).
        def run(self: Any, results: Any) -> None:
            inner(self, results)
            now = clock()
            if "list_end" in events:
                requests.extend((now - latency, now, nbytes) for latency, nbytes, _, ok in results if ok)
            limits.append((now, self.limit, self.in_flight))
        return run

    started: dict[int, float] = {}  # a folder page's GET (by id) -> when it went out

    def pages(inner: Any) -> Any:
        # Folder pages go out as the pages linking them are read (listing.crawl): each is
        # timed from its start to when the crawl takes its answer (page_of).
        def run(self: Any, urls: Any, *args: Any, **kwargs: Any) -> Any:
            t = clock()
            out = inner(self, urls, *args, **kwargs)
            started.update((id(f), t) for f in out)
            return out
        return run

    def page_taken(inner: Any) -> Any:
        def run(got: Any) -> Any:
            t = started.pop(id(got), None)
            try:
                return inner(got)
            finally:
                if t is not None:
                    requests.append((t, clock(), -1))
        return run

    def handed(inner: Any) -> Any:  # first blocks handed to libcurl: when the first batch of them was
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            events.setdefault("first_handed", clock())
            return inner(self, *args, **kwargs)
        return run

    def store(inner: Any) -> Any:
        def run(self: Any, fetched: Any, *args: Any, **kwargs: Any) -> Any:
            t = clock()
            try:
                return inner(self, fetched, *args, **kwargs)
            finally:
                stores.append((t, clock(), len(fetched)))
        return run

    wrap(listing_mod, "http_find", listing)
    wrap(listing_mod, "start_pages", pages)
    wrap(listing_mod, "page_of", page_taken)
    wrap(curl.CurlRoute, "start", handed)
    wrap(aio, "http_get_first", timed)
    wrap(hostlimit.HostLimit, "_release", release)
    wrap(hostlimit.HostLimit, "account", accounted)
    wrap(fetch.Fetcher, "_store", store)
    return missing


# -- the driver ---------------------------------------------------------------------------------


def summarize(run: dict[str, Any], link_bytes_s: float, total: int) -> dict[str, Any]:
    """The epoch's seconds beyond ``total / link``, split into setup, ramp, stalls and tail."""
    e, end = run["events"], run["events"]["epoch_end"]
    gets = [r for r in run["requests"] if r[2] >= 0]
    wire = run["wire"]
    times, base = [t for t, _ in wire], wire[0][1] if wire else 0

    def sent(t: float) -> int:
        k = bisect.bisect_right(times, t) - 1
        return wire[max(0, k)][1] - base if wire else 0

    first_get = gets[0][0] if gets else None
    last_answer = max((r[1] for r in gets), default=None)
    mark = 16e6 if total > 64e6 else total / 4
    at_mark = next((t for t, b in wire if b - base >= mark * 1.02), None)  # ~2% of lo's bytes are headers, both ways
    windows = [(sent(t + 0.25) - sent(t)) / 0.25 / link_bytes_s for t in [k * 0.25 for k in range(int(end / 0.25))]]
    mid = windows[2:-2]
    out = {
        "seconds": round(end, 3), "ideal_s": round(total / link_bytes_s, 3), "share": round(total / link_bytes_s / end, 3),
        "setup_s": round(first_get, 3) if first_get is not None else None,
        "cpu_ms_per_object": round(run["cpu_s"] / run["samples"] * 1e3, 3) if run.get("samples") else None,
        "listing_s": round(e["list_end"] - e["list_start"], 3) if "list_end" in e else None,
        "before_listing_s": round(e["list_start"], 3) if "list_start" in e else None,
        "ramp_s": round(at_mark - mark / link_bytes_s - first_get, 3) if at_mark is not None and first_get is not None else None,
        "stall_s": round(sum((1 - w) * 0.25 for w in mid if w < 0.9), 3),
        "tail_s": round(run["batches"][-1] - last_answer, 3) if last_answer is not None and run["batches"] else None,
        "long_stores": [(round(a, 2), round((b - a) * 1e3)) for a, b, _ in run["stores"] if b - a > 0.04],
        "wire_share_per_quarter_s": [round(w, 2) for w in windows],
    }
    if run.get("missing_instruments"):
        out["missing_instruments"] = run["missing_instruments"]
    return out


def _bench() -> Any:
    """benchmarks/peers/bench.py, for its links and servers (loaded by path: every benchmark is a bench.py)."""
    import importlib.util

    name = "fastload_timeline_peers_bench"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / "bench.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def main(args: argparse.Namespace) -> int:
    if args.child:
        _child(json.loads(args.child[0]), Path(args.child[1]))
        return 0
    bench = _bench()
    from fastload.samples import make_image_folder

    bench.NETNS_PREFIX[0] = args.netns_prefix
    work = Path(tempfile.mkdtemp(prefix="fastload-timeline-", dir=args.work_dir))
    results: list[dict[str, Any]] = []
    try:
        www = work / "www"
        files = make_image_folder(www / "train", n=args.images, quality=92)
        total = sum(f.stat().st_size for f in files)
        (www / "big.bin").write_bytes(os.urandom(100_000_000 if args.images >= 1000 else 8_000_000))
        with bench.open_link(bench._link_spec(args.link), work, False) as link:
            limit = bench.measure_link(link)["mb_s"] * 1e6
            print(f"link {args.link}: {limit / 1e6:.1f} MB/s; {len(files)} JPEGs, {total / 1e6:.1f} MB", file=sys.stderr)
            for k in range(args.repeats):
                for path in args.pythonpath.split(","):
                    cache = work / "cache"
                    shutil.rmtree(cache, ignore_errors=True)
                    cache.mkdir()
                    spec = {"url": link.http_url + "/train/", "cache_dir": str(cache)}
                    env = {n: v for n, v in os.environ.items() if not n.startswith("FASTLOAD_")} | {"PYTHONPATH": path}
                    raw = work / "run.json"
                    subprocess.run([*link.prefix, sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec), str(raw)],
                                   check=True, env=env, cwd=str(work), timeout=600)
                    run = json.loads(raw.read_text())
                    row = {"pythonpath": path, "repeat": k + 1, **summarize(run, limit, total)}
                    results.append(row | {"series": run})
                    print(json.dumps({n: v for n, v in row.items() if n != "wire_share_per_quarter_s"}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.out is not None:
        args.out.write_text(json.dumps({"link": args.link, "images": args.images, "runs": results}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(parse_args()))
