"""Scale benchmark: fastload's listing, staging, rerun, info, disk and warm epoch as N grows.

N objects of 4 KiB each (random, incompressible bytes, 1,000 per folder) are written
to local disk and served by a real nginx on 127.0.0.1 (autoindex on,
``fastload._servers.NginxServer``). For each N in ``--sizes`` (default 10k and 100k)
one run measures, next to its baseline in the same run:

* **listing**: ``fastload.FileDataset(url)`` on an empty cache (it lists the folders
  and opens the cache; no object is read) against ``fsspec.filesystem("http").find(url)``,
  each in a fresh child process with its imports done before the clock starts.
* **staging**: ``python -m fastload cache URL --cache-dir C --json --no-progress`` into an
  empty cache, wall time and peak RSS (``os.wait4``'s ``ru_maxrss`` of that child), against
  a baseline child: ``fsspec find`` then ``--threads`` threads, each GETting its share of the
  URLs over one keep-alive ``http.client`` connection and writing each object to a file of
  its own (a plain mirror; what a user does without fastload).
  RSS per object is (peak RSS at N - peak RSS staging a 1-object dataset) / N.
* **rerun**: the same ``fastload cache`` again on the staged cache (nothing to fetch);
  its wall time and the time its report gives, over the listing's time.
* **info**: ``fastload info`` and ``fastload info --json`` wall times, and what the latter says.
* **disk**: bytes allocated under the cache folder (sum of ``st_blocks * 512``), the
  index's files (``index/*``), against the payload bytes (N x 4 KiB).
* **epoch**: ``fastload.DataLoader`` over ``FileDataset(url)`` on the staged cache (raw
  bytes, no transform) against ``torch.utils.data.DataLoader`` over a Dataset that
  ``open()``s the generated files, both with batch 256, ``shuffle=True`` (seeded) and
  each ``--workers`` value (persistent workers); epoch 1 warms up, the next
  ``--repeats`` are timed (best reported). Flatness: objects/s at N over objects/s at the
  smallest N of the run (1.0: flat).

nginx's access log counts the requests of each phase (a warm epoch must make none).
Speedups are the baseline's time over fastload's (>1: fastload faster); epoch ratios
are fastload's objects/s over torch's.

Usage::

    python benchmarks/scale/bench.py                                  # 10k and 100k
    python benchmarks/scale/bench.py --sizes 10000,100000,1000000 --work /var/tmp/scale
    python benchmarks/scale/bench.py --sizes 2000 --skip epoch --out /tmp/s.json

A table goes to stdout, the JSON to ``--out`` (default benchmarks/scale/results/scale.json;
``--out -`` writes none). Generated trees are reused from ``--work`` when their N matches
and kept there; without ``--work`` everything is in a temp folder removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

OBJECT_BYTES = 4096
PER_FOLDER = 1000
PHASES = ("listing", "staging", "rerun", "info", "epoch")
DEFAULT_OUT = HERE / "results" / "scale.json"
TREE_VERSION = 1  # bump when the generated layout changes, so old trees are rebuilt


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parses the benchmark's command line (``argv`` defaults to ``sys.argv[1:]``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", default="10000,100000", help="comma-separated object counts N")
    p.add_argument("--skip", default="", help=f"comma-separated phases to skip: {','.join(PHASES)}")
    p.add_argument("--work", type=Path, help="folder for the generated trees, kept and reused (default: a temp folder)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON results file ('-': none)")
    p.add_argument("--threads", type=int, default=32, help="threads of the baseline GET pool")
    p.add_argument("--workers", default="0,2", help="comma-separated num_workers for the warm epochs")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=1, help="timed listings and timed warm epochs (best reported)")
    p.add_argument("--timeout-s", type=float, default=3600, help="limit per child process")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args.sizes = sorted({int(s) for s in args.sizes.split(",") if s})
        args.workers = [int(w) for w in args.workers.split(",") if w]
    except ValueError:
        p.error("--sizes and --workers take comma-separated integers, e.g. --sizes 10000,100000")
    args.skip = {s for s in args.skip.split(",") if s}
    if args.skip - set(PHASES):
        p.error(f"--skip takes {', '.join(PHASES)}; got {', '.join(sorted(args.skip - set(PHASES)))}")
    if not args.sizes or min(args.sizes) < 1 or min(args.workers, default=0) < 0 or args.threads < 1 \
            or args.batch_size < 1 or args.repeats < 1:
        p.error("--sizes, --threads, --batch-size and --repeats must be positive, --workers at least 0")
    return args


def _log(msg: str) -> None:
    print(f"[bench scale] {msg}", file=sys.stderr, flush=True)


# -- the generated trees ---------------------------------------------------------------


def _tree_spec(n: int) -> dict[str, Any]:
    return {"n": n, "object_bytes": OBJECT_BYTES, "per_folder": PER_FOLDER, "version": TREE_VERSION}


def make_tree(trees: Path, n: int) -> dict[str, Any]:
    """``trees/n<N>/d<k>/<i>.bin``: N random objects, 1,000 per folder; reused when its marker matches."""
    root, marker = trees / f"n{n}", trees / f"n{n}.json"  # the marker sits outside the served folder
    spec = _tree_spec(n)
    with contextlib.suppress(OSError, ValueError):
        if json.loads(marker.read_text()) == spec:
            return {"root": root, "reused": True, "generate_s": 0.0}
    t0 = time.perf_counter()
    marker.unlink(missing_ok=True)
    shutil.rmtree(root, ignore_errors=True)
    for i in range(n):
        if i % PER_FOLDER == 0:
            folder = root / f"d{i // PER_FOLDER:04d}"
            folder.mkdir(parents=True)
        (folder / f"{i:07d}.bin").write_bytes(os.urandom(OBJECT_BYTES))
    marker.write_text(json.dumps(spec))
    return {"root": root, "reused": False, "generate_s": round(time.perf_counter() - t0, 2)}


def tree_files(root: Path) -> list[str]:
    """The tree's files in listing order (folders, then names, sorted)."""
    return [str(f) for d in sorted(root.iterdir()) for f in sorted(d.iterdir())]


# -- child processes ----------------------------------------------------------------


@dataclass
class Child:
    """What a finished child process left: its stdout, wall time and peak RSS."""

    out: str
    wall_s: float
    peak_rss_bytes: int

    def json(self) -> dict[str, Any]:
        return json.loads(self.out)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTLOAD_")}  # fastload's defaults
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def run_child(cmd: list[str], timeout_s: float) -> Child:
    """Runs ``cmd``; its peak RSS is ``os.wait4``'s ``ru_maxrss`` (KiB on Linux) for this child alone."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=_env(), cwd=ROOT)
        timer = threading.Timer(timeout_s, proc.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:  # e.g. SIGTERM or Ctrl-C here: end the child too, then unwind
            proc.kill()
            proc.wait()
            raise
        finally:
            timer.cancel()
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd[:8])} ... exited {proc.returncode} (limit {timeout_s:.0f} s):\n{stderr[-3000:]}")
    return Child(stdout, wall, usage.ru_maxrss * 1024)


def _self(name: str, **cfg: Any) -> list[str]:
    """A command that runs ``CHILDREN[name](cfg)`` of this file in a fresh interpreter; it prints JSON."""
    return [sys.executable, str(Path(__file__).resolve()), "_child", name, json.dumps(cfg)]


def _fastload(*argv: str) -> list[str]:
    return [sys.executable, "-m", "fastload", *argv]


def _child_list_fastload(cfg: dict[str, Any]) -> dict[str, Any]:
    import fastload
    from fastload.config import Settings

    dataset_cls = fastload.FileDataset  # imports torch and the datasets before the clock starts
    runs, n = [], 0
    for k in range(cfg["repeats"]):
        t0 = time.perf_counter()
        ds = dataset_cls(cfg["url"], settings=Settings(cache_dir=Path(cfg["cache_dir"]) / f"list{k}"))
        runs.append(time.perf_counter() - t0)
        n = len(ds)
    return {"seconds": min(runs), "runs": runs, "objects": n}


def _child_list_fsspec(cfg: dict[str, Any]) -> dict[str, Any]:
    import fsspec

    runs, n = [], 0
    for _ in range(cfg["repeats"]):
        t0 = time.perf_counter()
        found = fsspec.filesystem("http", skip_instance_cache=True).find(cfg["url"])
        runs.append(time.perf_counter() - t0)
        n = len(found)
    return {"seconds": min(runs), "runs": runs, "objects": n}


def _child_fetch_baseline(cfg: dict[str, Any]) -> dict[str, Any]:
    """fsspec find, then threads that each GET their share over one keep-alive connection
    and write each object to a file of its own under ``dest``."""
    import http.client
    from urllib.parse import urlsplit

    import fsspec

    t0 = time.perf_counter()
    urls = fsspec.filesystem("http", skip_instance_cache=True).find(cfg["url"])
    t_list = time.perf_counter() - t0
    base = urlsplit(cfg["url"])
    prefix, dest = base.path, Path(cfg["dest"])
    rels = [urlsplit(u).path[len(prefix):] for u in urls]
    for folder in sorted({os.path.dirname(r) for r in rels}):
        (dest / folder).mkdir(parents=True, exist_ok=True)
    threads = cfg["threads"]
    got, errors = [0] * threads, []

    def run(k: int) -> None:
        try:
            conn = http.client.HTTPConnection(base.hostname, base.port, timeout=60)
            for rel in rels[k::threads]:
                conn.request("GET", prefix + rel)
                resp = conn.getresponse()
                body = resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"GET {prefix + rel}: HTTP {resp.status}")
                with open(dest / rel, "wb") as f:
                    f.write(body)
                got[k] += len(body)
            conn.close()
        except BaseException as err:  # re-raised below, in the main thread
            errors.append(err)

    t1 = time.perf_counter()
    pool = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    if errors:
        raise errors[0]
    end = time.perf_counter()
    return {"seconds": end - t0, "list_s": t_list, "fetch_s": end - t1, "objects": len(urls), "bytes": sum(got)}


class LocalFiles:
    """torch's side of the warm epoch: ``open()`` and read each local file, no cache, no checks."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        with open(self.paths[i], "rb") as f:
            return {"data": f.read(), "url": self.paths[i]}


def _child_epoch(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    if cfg["loader"] == "fastload":
        import fastload
        from fastload.config import Settings

        ds: Any = fastload.FileDataset(cfg["url"], settings=Settings(cache_dir=cfg["cache_dir"]))
        loader_cls: Any = fastload.DataLoader
    else:
        ds, loader_cls = LocalFiles(tree_files(Path(cfg["root"]))), torch.utils.data.DataLoader
    w = cfg["workers"]
    loader = loader_cls(ds, batch_size=cfg["batch_size"], shuffle=True, num_workers=w,
                        persistent_workers=w > 0, generator=torch.Generator().manual_seed(0))
    epochs = []
    for _ in range(1 + cfg["repeats"]):  # the first epoch warms up (and starts the workers)
        t0 = time.perf_counter()
        n = nbytes = 0
        for batch in loader:
            n += len(batch["data"])
            nbytes += sum(len(d) for d in batch["data"])
        epochs.append({"seconds": time.perf_counter() - t0, "objects": n, "bytes": nbytes})
    timed = min(epochs[1:], key=lambda e: e["seconds"])
    return {"objects_per_s": timed["objects"] / timed["seconds"], "epochs": epochs, "objects": timed["objects"],
            "bytes": timed["bytes"]}


CHILDREN = {"list_fastload": _child_list_fastload, "list_fsspec": _child_list_fsspec,
            "fetch_baseline": _child_fetch_baseline, "epoch": _child_epoch}


# -- measurements ---------------------------------------------------------------------


class Requests:
    """Counts requests in nginx's access log (one line each) between two points."""

    def __init__(self, log: Path) -> None:
        self.log = log

    def count(self) -> int:
        try:
            with open(self.log, "rb") as f:
                return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
        except FileNotFoundError:
            return 0

    @contextlib.contextmanager
    def during(self, into: dict[str, Any], key: str = "requests") -> Iterator[None]:
        before = self.count()
        yield
        into[key] = self.count() - before


def _allocated(folder: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(folder):
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def measure_listing(url: str, n: int, scratch: Path, args: argparse.Namespace, reqs: Requests) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with reqs.during(out, "fastload_requests"):
        fl = run_child(_self("list_fastload", url=url, cache_dir=str(scratch / "list"), repeats=args.repeats),
                       args.timeout_s)
    with reqs.during(out, "fsspec_requests"):
        fs = run_child(_self("list_fsspec", url=url, repeats=args.repeats), args.timeout_s)
    shutil.rmtree(scratch / "list", ignore_errors=True)
    a, b = fl.json(), fs.json()
    if a["objects"] != n or b["objects"] != n:
        raise RuntimeError(f"listing found {a['objects']} (fastload) and {b['objects']} (fsspec) objects, not {n}")
    return {
        **{k: v // args.repeats for k, v in out.items()},  # requests per listing
        "fastload_s": a["seconds"], "fsspec_s": b["seconds"],
        "fastload_us_per_object": a["seconds"] / n * 1e6, "fsspec_us_per_object": b["seconds"] / n * 1e6,
        "speedup_vs_fsspec": b["seconds"] / a["seconds"],
        "fastload_peak_rss_bytes": fl.peak_rss_bytes, "fsspec_peak_rss_bytes": fs.peak_rss_bytes,
    }


def _stage(url: str, cache: Path, args: argparse.Namespace) -> tuple[Child, dict[str, Any]]:
    child = run_child(_fastload("cache", url, "--cache-dir", str(cache), "--json", "--no-progress"), args.timeout_s)
    return child, child.json()


def measure_at_rest(url: str, scratch: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Peak RSS of staging (and of the baseline) over a 1-object dataset: the fixed part of RSS."""
    fl, _ = _stage(url, scratch / "rest-cache", args)
    base = run_child(_self("fetch_baseline", url=url, dest=str(scratch / "rest-mirror"), threads=args.threads),
                     args.timeout_s)
    shutil.rmtree(scratch / "rest-cache", ignore_errors=True)
    shutil.rmtree(scratch / "rest-mirror", ignore_errors=True)
    return {"fastload_peak_rss_bytes": fl.peak_rss_bytes, "baseline_peak_rss_bytes": base.peak_rss_bytes}


def measure_staging(url: str, n: int, cache: Path, scratch: Path, args: argparse.Namespace, reqs: Requests,
                    rest: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with reqs.during(out, "fastload_requests"):
        fl, report = _stage(url, cache, args)
    mirror = scratch / "mirror"
    with reqs.during(out, "baseline_requests"):
        base = run_child(_self("fetch_baseline", url=url, dest=str(mirror), threads=args.threads), args.timeout_s)
    b = base.json()
    shutil.rmtree(mirror, ignore_errors=True)
    if report["items"] != n or report["fetched_bytes"] != n * OBJECT_BYTES or b["bytes"] != n * OBJECT_BYTES:
        raise RuntimeError(f"staging moved {report['items']} items / {report['fetched_bytes']} B, the baseline "
                           f"{b['bytes']} B; expected {n} / {n * OBJECT_BYTES}")
    return {
        **out,
        "fastload_wall_s": fl.wall_s, "fastload_report_s": report["seconds"],
        "baseline_wall_s": base.wall_s, "baseline_s": b["seconds"], "baseline_list_s": b["list_s"],
        "baseline_fetch_s": b["fetch_s"], "baseline_threads": args.threads,
        "fastload_us_per_object": fl.wall_s / n * 1e6, "baseline_us_per_object": base.wall_s / n * 1e6,
        "speedup_vs_baseline": base.wall_s / fl.wall_s,
        "fastload_peak_rss_bytes": fl.peak_rss_bytes, "baseline_peak_rss_bytes": base.peak_rss_bytes,
        "fastload_rss_bytes_per_object": (fl.peak_rss_bytes - rest["fastload_peak_rss_bytes"]) / n,
        "baseline_rss_bytes_per_object": (base.peak_rss_bytes - rest["baseline_peak_rss_bytes"]) / n,
        "concurrency": report.get("concurrency"),
    }


def measure_rerun(url: str, n: int, cache: Path, args: argparse.Namespace, reqs: Requests,
                  listing_s: float | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with reqs.during(out):
        child, report = _stage(url, cache, args)
    if report["fetched_bytes"] != 0 or report["skipped_blocks"] != n:
        raise RuntimeError(f"the rerun fetched {report['fetched_bytes']} B and skipped {report['skipped_blocks']} "
                           f"blocks of {n}; a staged cache should need nothing")
    out |= {"wall_s": child.wall_s, "report_s": report["seconds"], "us_per_object": child.wall_s / n * 1e6,
            "peak_rss_bytes": child.peak_rss_bytes}
    if listing_s:
        out["report_s_over_listing"] = report["seconds"] / listing_s
        out["wall_s_over_listing"] = child.wall_s / listing_s
    return out


def measure_info(cache: Path, args: argparse.Namespace) -> dict[str, Any]:
    human = run_child(_fastload("info", "--cache-dir", str(cache)), args.timeout_s)
    js = run_child(_fastload("info", "--cache-dir", str(cache), "--json"), args.timeout_s)
    info = js.json()
    return {"wall_s": human.wall_s, "json_wall_s": js.wall_s, "peak_rss_bytes": human.peak_rss_bytes,
            "entries": info["entries"], "raw_bytes": info["raw_bytes"], "stored_bytes": info["stored_bytes"],
            "datasets": [{k: d.get(k) for k in ("url", "items", "cached_items", "remote_bytes", "stored_bytes")}
                         for d in info.get("datasets", [])]}


def measure_disk(cache: Path, n: int) -> dict[str, Any]:
    payload = n * OBJECT_BYTES
    allocated = _allocated(cache)
    index_files = {p.name: p.stat().st_size for p in sorted((cache / "index").iterdir()) if p.is_file()}
    index_bytes = sum(index_files.values())
    return {"payload_bytes": payload, "allocated_bytes": allocated, "allocated_over_payload": allocated / payload,
            "index_bytes": index_bytes, "index_files": index_files, "index_bytes_per_object": index_bytes / n,
            "data_allocated_bytes": _allocated(cache / "data"),
            "allocated_bytes_per_object": allocated / n}


def measure_epoch(url: str, n: int, cache: Path, tree: Path, args: argparse.Namespace,
                  reqs: Requests) -> dict[str, Any]:
    out: dict[str, Any] = {"batch_size": args.batch_size}
    for w in args.workers:
        row: dict[str, Any] = {}
        common = {"batch_size": args.batch_size, "workers": w, "repeats": args.repeats}
        with reqs.during(row, "fastload_requests"):
            fl = run_child(_self("epoch", loader="fastload", url=url, cache_dir=str(cache), **common), args.timeout_s)
        th = run_child(_self("epoch", loader="torch", root=str(tree), **common), args.timeout_s)
        a, b = fl.json(), th.json()
        for who, got in (("fastload", a), ("torch", b)):
            if got["objects"] != n or got["bytes"] != n * OBJECT_BYTES:
                raise RuntimeError(f"{who} epoch read {got['objects']} objects / {got['bytes']} B, not {n}")
        row |= {"fastload_objects_per_s": a["objects_per_s"], "torch_objects_per_s": b["objects_per_s"],
                "fastload_us_per_object": 1e6 / a["objects_per_s"], "torch_us_per_object": 1e6 / b["objects_per_s"],
                "fastload_over_torch": a["objects_per_s"] / b["objects_per_s"],
                "fastload_peak_rss_bytes": fl.peak_rss_bytes, "torch_peak_rss_bytes": th.peak_rss_bytes}
        out[f"workers{w}"] = row
    return out


def flatness(rows: list[dict[str, Any]]) -> None:
    """Adds each warm epoch's objects/s over the smallest N's (1.0: as fast per object at any N)."""
    have = [r for r in rows if "epoch" in r]
    if not have:
        return
    first = have[0]["epoch"]
    for r in have:
        for key, row in r["epoch"].items():
            if key.startswith("workers"):
                for who in ("fastload", "torch"):
                    row[f"{who}_vs_smallest_n"] = row[f"{who}_objects_per_s"] / first[key][f"{who}_objects_per_s"]


# -- machine ----------------------------------------------------------------------------


def _source_digest() -> str:
    """sha256 of fastload/'s Python sources (path and bytes): which code ran, without git."""
    h = hashlib.sha256()
    for path in sorted((ROOT / "fastload").rglob("*.py")):
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def machine_info(work: Path) -> dict[str, Any]:
    """The cache bench's machine facts (benchmarks/cache/bench.py: CPU, RAM, OS, versions, the work
    folder's file system, load), plus torch's version and a digest of the sources that ran."""
    spec = importlib.util.spec_from_file_location("fastload_bench_cache_for_scale", HERE.parent / "cache" / "bench.py")
    if spec is None or spec.loader is None:
        raise ImportError("cannot load benchmarks/cache/bench.py")
    cache_bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = cache_bench
    spec.loader.exec_module(cache_bench)
    return {**cache_bench.machine_info(work), "torch": cache_bench._version("torch"),
            "fastload_sources_sha256": _source_digest()}


# -- report ----------------------------------------------------------------------------


def _f(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _mb(nbytes: Any) -> Any:
    return None if nbytes is None else nbytes / 1e6


def table(res: dict[str, Any]) -> str:
    """The results as plain-text tables, one row per N."""
    rows, out = res["rows"], []

    def section(title: str, head: list[tuple[str, int]], cells: list[list[str]]) -> None:
        out.extend(["", title, "".join(f"{h:>{w}}" for h, w in head)])
        out.extend("".join(f"{c:>{w}}" for c, (_, w) in zip(line, head)) for line in cells)

    if any("listing" in r for r in rows):
        section("listing (empty cache): fastload.FileDataset(url) vs fsspec find", [
            ("N", 9), ("fastload s", 12), ("us/obj", 9), ("fsspec s", 11), ("us/obj", 9), ("speedup", 9),
            ("fl reqs", 9), ("fs reqs", 9)],
            [[str(r["n"]), _f(g["fastload_s"], ".3f"), _f(g["fastload_us_per_object"], ".1f"), _f(g["fsspec_s"], ".3f"),
              _f(g["fsspec_us_per_object"], ".1f"), _f(g["speedup_vs_fsspec"], ".2f") + "x", str(g["fastload_requests"]),
              str(g["fsspec_requests"])] for r in rows if (g := r.get("listing"))])
    if any("staging" in r for r in rows):
        section(f"staging: fastload cache vs fsspec find + {res['threads']} threads of keep-alive GETs to files "
                "(wall s; RSS MB; RSS/obj = (peak - 1-object peak) / N)", [
            ("N", 9), ("fastload s", 12), ("us/obj", 9), ("base s", 9), ("us/obj", 9), ("speedup", 9),
            ("fl RSS", 9), ("B/obj", 8), ("base RSS", 10), ("B/obj", 8)],
            [[str(r["n"]), _f(g["fastload_wall_s"], ".2f"), _f(g["fastload_us_per_object"], ".1f"),
              _f(g["baseline_wall_s"], ".2f"), _f(g["baseline_us_per_object"], ".1f"),
              _f(g["speedup_vs_baseline"], ".2f") + "x", _f(_mb(g["fastload_peak_rss_bytes"]), ".0f"),
              _f(g["fastload_rss_bytes_per_object"], ".0f"), _f(_mb(g["baseline_peak_rss_bytes"]), ".0f"),
              _f(g["baseline_rss_bytes_per_object"], ".0f")] for r in rows if (g := r.get("staging"))])
    if any("rerun" in r or "info" in r for r in rows):
        section("rerun on the staged cache (nothing fetched) and fastload info", [
            ("N", 9), ("rerun s", 10), ("report s", 10), ("/listing", 10), ("requests", 10), ("info s", 9),
            ("--json s", 10), ("entries", 9)],
            [[str(r["n"]), _f(r.get("rerun", {}).get("wall_s"), ".2f"), _f(r.get("rerun", {}).get("report_s"), ".2f"),
              _f(r.get("rerun", {}).get("report_s_over_listing"), ".1f") + "x",
              _f(r.get("rerun", {}).get("requests"), "d"), _f(r.get("info", {}).get("wall_s"), ".2f"),
              _f(r.get("info", {}).get("json_wall_s"), ".2f"), _f(r.get("info", {}).get("entries"), "d")]
             for r in rows if "rerun" in r or "info" in r])
    if any("disk" in r for r in rows):
        section("disk: allocated under the cache folder vs payload (N x 4 KiB)", [
            ("N", 9), ("payload MB", 12), ("alloc MB", 10), ("alloc/payload", 15), ("index MB", 10),
            ("index B/obj", 13), ("info stored/raw", 17)],
            [[str(r["n"]), _f(_mb(d["payload_bytes"]), ".1f"), _f(_mb(d["allocated_bytes"]), ".1f"),
              _f(d["allocated_over_payload"], ".2f"), _f(_mb(d["index_bytes"]), ".1f"), _f(d["index_bytes_per_object"], ".0f"),
              _f(r["info"]["stored_bytes"] / r["info"]["raw_bytes"] if "info" in r else None, ".3f")]
             for r in rows if (d := r.get("disk"))])
    if any("epoch" in r for r in rows):
        for w in res["workers"]:
            key = f"workers{w}"
            section(f"warm epoch, batch {res['batch_size']}, num_workers={w}: fastload.DataLoader(FileDataset) vs "
                    "torch DataLoader over open() of local files (objects/s; flat = vs the smallest N)", [
                ("N", 9), ("fastload/s", 12), ("us/obj", 9), ("torch/s", 10), ("us/obj", 9), ("fl/torch", 10),
                ("fl flat", 9), ("torch flat", 12), ("requests", 10)],
                [[str(r["n"]), _f(e["fastload_objects_per_s"], ",.0f"), _f(e["fastload_us_per_object"], ".1f"),
                  _f(e["torch_objects_per_s"], ",.0f"), _f(e["torch_us_per_object"], ".1f"),
                  _f(e["fastload_over_torch"], ".2f") + "x", _f(e.get("fastload_vs_smallest_n"), ".2f"),
                  _f(e.get("torch_vs_smallest_n"), ".2f"), str(e["fastload_requests"])]
                 for r in rows if (e := r.get("epoch", {}).get(key))])
    return "\n".join(out).lstrip("\n")


def markdown(res: dict[str, Any]) -> str:
    m = res["machine"]
    return "\n".join([
        "# Scale benchmark results", "",
        f"Command: `{res['command']}` (wall time {res['wall_s']:.0f} s, {m['date_utc']}).", "",
        f"{OBJECT_BYTES}-byte random objects, {PER_FOLDER} per folder, nginx {m['nginx']} on 127.0.0.1 "
        "(autoindex, unshaped); what each figure measures is in benchmarks/scale/bench.py's docstring.", "",
        "```", table(res), "```", "",
        "Notes:",
        "- Speedups are the baseline's time over fastload's (>1: fastload faster); `fl/torch` is fastload's "
        "objects/s over torch's. Staging times are the child's wall time (interpreter start included, both sides); "
        "`report s` is the time `fastload cache --json` reports, `/listing` that over the listing's time.",
        *(["- RSS is each child's peak (`os.wait4` ru_maxrss); RSS B/obj = (peak at N - peak staging a 1-object "
           f"dataset: fastload {res['at_rest']['fastload_peak_rss_bytes'] / 1e6:.0f} MB, baseline "
           f"{res['at_rest']['baseline_peak_rss_bytes'] / 1e6:.0f} MB) / N."] if res["at_rest"] else []),
        "- `requests` are lines of nginx's access log during the phase; a warm epoch must send none.",
        f"- Load average {m['loadavg_at_start']} at the start and {m.get('loadavg_at_end')} at the end on "
        f"{m['cpus']} CPUs (a shared machine): compare within one run, not across runs."
        + ("" if m.get("fastload_sources_sha256_at_end") in (None, m["fastload_sources_sha256"])
           else " **fastload/'s sources changed during the run** (sha256 at start and end differ)."),
        "",
        "## Machine", "", "| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in m.items()), "",
    ])


# -- main --------------------------------------------------------------------------------


def run(args: argparse.Namespace, work: Path, scratch: Path) -> dict[str, Any]:
    from fastload import _servers

    t_start = time.perf_counter()
    res: dict[str, Any] = {"benchmark": "scale", "command": shlex.join(["python", "benchmarks/scale/bench.py", *args.argv]),
                           "object_bytes": OBJECT_BYTES, "per_folder": PER_FOLDER, "threads": args.threads,
                           "workers": args.workers, "batch_size": args.batch_size, "repeats": args.repeats,
                           "skipped": sorted(args.skip), "machine": machine_info(work), "rows": []}
    trees = work / "trees"
    trees.mkdir(parents=True, exist_ok=True)
    made = {n: make_tree(trees, n) for n in sorted({1, *args.sizes})}
    for n in args.sizes:
        _log(f"tree n{n}: " + ("reused" if made[n]["reused"] else f"generated in {made[n]['generate_s']} s"))
    with _servers.NginxServer(trees) as server:
        reqs = Requests(Path(str(server.workdir)) / "access.log")
        rest = measure_at_rest(f"{server.url}/n1/", scratch, args) if "staging" not in args.skip else {}
        for n in args.sizes:
            url, cache = f"{server.url}/n{n}/", scratch / f"cache-n{n}"
            row: dict[str, Any] = {"n": n, "tree_reused": made[n]["reused"], "generate_s": made[n]["generate_s"]}
            res["rows"].append(row)
            if "listing" not in args.skip:
                _log(f"N={n}: listing")
                row["listing"] = measure_listing(url, n, scratch, args, reqs)
            needs_cache = {"rerun", "info", "epoch"} - args.skip
            if "staging" not in args.skip:
                _log(f"N={n}: staging")
                row["staging"] = measure_staging(url, n, cache, scratch, args, reqs, rest)
            elif needs_cache:
                _log(f"N={n}: staging (not measured: --skip staging)")
                _stage(url, cache, args)
            if "rerun" not in args.skip:
                _log(f"N={n}: rerun")
                row["rerun"] = measure_rerun(url, n, cache, args, reqs, row.get("listing", {}).get("fastload_s"))
            if "info" not in args.skip:
                _log(f"N={n}: info and disk")
                row["info"] = measure_info(cache, args)
                row["disk"] = measure_disk(cache, n)
            if "epoch" not in args.skip:
                _log(f"N={n}: warm epochs")
                row["epoch"] = measure_epoch(url, n, cache, trees / f"n{n}", args, reqs)
            shutil.rmtree(cache, ignore_errors=True)
    flatness(res["rows"])
    res["at_rest"] = rest
    res["machine"]["loadavg_at_end"] = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    res["machine"]["fastload_sources_sha256_at_end"] = _source_digest()  # differs: fastload/ was edited mid-run
    res["wall_s"] = round(time.perf_counter() - t_start, 1)
    return res


def main(args: argparse.Namespace) -> int:
    """Runs the benchmark; prints the table on stdout and writes the JSON (and a .md beside it) to ``args.out``."""
    from fastload import _servers

    if not _servers.nginx_available():
        _log("nginx not found; the benchmark serves the objects with it (apt-get install nginx)")
        return 2
    own_work = args.work is None
    work = Path(tempfile.mkdtemp(prefix="fastload-bench-scale-")) if own_work else args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="run-", dir=work))  # caches and mirrors: always removed
    previous = None
    if threading.current_thread() is threading.main_thread():
        # SIGTERM unwinds like an exception, so nginx is stopped and the folders removed.
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        res = run(args, work, scratch)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(scratch, ignore_errors=True)
        if own_work:
            shutil.rmtree(work, ignore_errors=True)
    print(table(res))
    if args.out != "-":
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=2) + "\n")
        out.with_suffix(".md").write_text(markdown(res))
        _log(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_child":  # a measurement in a fresh interpreter (run_child)
        print(json.dumps(CHILDREN[sys.argv[2]](json.loads(sys.argv[3]))))
        sys.exit(0)
    sys.exit(main(parse_args()))
