"""Cold MB/s, objects/s and CPU per object of each client on one core: client on core 0, nginx on core 1.

Issue 36, item 1. Where the link is not the limit the client's CPU is, so every client
runs pinned with ``taskset -c 0`` and nginx (one worker) with ``taskset -c 1``, over the
host loopback, unshaped. Two data sets, each read once per client from a fresh start:

* ``small``: ``--objects`` (3,000) objects of ``--kb`` (110) KB, random bytes (as JPEGs);
* ``large``: ``--large`` (8) objects of ``--large-mb`` (256) MB (unet3d's files, shards).

Clients (each a fresh process; ``SPEAKS`` says over which of http:// and path-style s3://):

* ``dataloader``: ``fastload.FileDataset(url list)`` + ``fastload.DataLoader``, defaults, a
  fresh cache dir (benchmarks/s3/bench.py's client, batch_size ``--batch-size``; 1 for large);
* ``cache``: ``fastload cache --url-list FILE`` (fastload.cli.main in the process), fresh cache;
* ``engine``: libcurl's engine alone (fastload.transport.curl), no cache: every object's GET
  handed over at once through the route fastload's Source uses (signed for s3://), at most
  ``--requests`` in flight under the host's adaptive limit; the "C limit" every row is weighed by;
* ``s3torchconnector``: AWS's ``S3MapDataset.from_objects`` + torch DataLoader, 2 workers, no
  cache (``--peers-python``: an interpreter with s3torchconnector and torch);
* ``urllib3``: a ``ThreadPoolExecutor`` of ``--requests`` threads, one urllib3 GET per object;
* ``write``: no network: the data set's bytes written into new files beside the caches, in
  ``write()`` calls of at most 8 MiB from one buffer (objects of at most 1 MiB appended to one
  file, as fastload's packs hold them): what putting them in the page cache costs this core,
  the ceiling of any client that keeps what it fetches (``x_write_mb_s``). On a VM whose host
  hands memory out lazily (Firecracker here) it is far below memcpy speed and moves from run
  to run, so it runs in the same rounds as the rest.

The engine's GETs of a large object are one ranged GET per object whose body lands in the
bytes it returns (``start_ranges``, as fastload's own ranged GETs do); a small object's is the
first-block GET fastload sends for it (``start``).

Vocabulary: a *row* is one client over one scheme on one data set in one round; *epoch CPU*
is user + system of the client process and its reaped children between its clock's start and
stop (what the client prints); *setup CPU* is the rest of the process's CPU (interpreter
start, imports, the dataset's set-up, exit), from the benchmark's RUSAGE_CHILDREN around the
run, reported apart. Ratios (``x_engine_*``) are against the engine row of the same data set
and scheme in the same round; ``x_write_mb_s`` against the write row of the same data set.
nginx's access log counts each row's requests.

Run as root (pinning nginx's processes): ``python benchmarks/percore/bench.py
[--objects 3000 --kb 110 --large 8 --large-mb 256] [--peers-python PY] [--out FILE.json]``.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from fastload import _servers  # noqa: E402

CLIENTS = ("dataloader", "cache", "engine", "s3torchconnector", "urllib3", "write")
SCHEMES = ("http", "s3")
SIZES = ("small", "large")
SPEAKS = {"dataloader": SCHEMES, "cache": SCHEMES, "engine": SCHEMES, "s3torchconnector": ("s3",),
          "urllib3": ("http",), "write": ("http",)}  # write: no network; listed once
CLIENT_CORE, SERVER_CORE = 0, 1
_PREFIX = ["taskset", "-c", str(CLIENT_CORE)]  # every client process (its threads and workers inherit it)
PEERS_VENV_PYTHON = ROOT / "benchmarks" / "peers" / ".venv-peers" / "bin" / "python"
OPTIONS = {"key": "bench", "secret": "bench", "client_kwargs": {"region_name": "us-east-1"}}  # + endpoint_url

# Each client prints one JSON line last: {"seconds", "cpu_s", "bytes", "n"} of its epoch only.
_CPU = r"""
import json, resource, sys, time
def cpu():
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime
"""

# `fastload cache --url-list` in this process (its report read from --json), so that the epoch's
# CPU is the command's own and the interpreter's start is set-up.
_CACHE = _CPU + r"""
import contextlib, io
from fastload.cli import main
endpoint, urls_file, cache = sys.argv[1:4]
argv = ["cache", "--url-list", urls_file, "--cache-dir", cache, "--json"]
if open(urls_file).read(5) == "s3://":
    options = {"key": "bench", "secret": "bench", "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    argv += ["--storage-options", json.dumps(options)]
out = io.StringIO()
c0, t0 = cpu(), time.perf_counter()
with contextlib.redirect_stdout(out):
    rc = main(argv)
seconds, cpu_s = time.perf_counter() - t0, cpu() - c0
report = json.loads(out.getvalue())
assert rc == 0, report
print(json.dumps({"seconds": seconds, "cpu_s": cpu_s, "bytes": report["fetched_bytes"], "n": report["items"]}))
"""

# libcurl's engine alone, through the route a Source takes (fastload.source.s3 signs for s3://):
# every GET handed over at once, each answer taken (size, version, body), nothing cached.
_ENGINE = _CPU + r"""
import threading
from fastload.transport import curl
from fastload.transport.hostlimit import limit_for
from fastload.source import s3
endpoint, urls_file, nbytes, requests = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
urls = open(urls_file).read().split()
if urls[0].startswith("s3://"):
    options = {"key": "bench", "secret": "bench", "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    route, why = s3.route_for(urls[0], options, "auto")
else:
    route, why = curl.route_for({}, "auto", lambda u: u), "no engine"
assert route is not None, why
limit = limit_for(endpoint, requests)
stop = threading.Event()
c0, t0 = cpu(), time.perf_counter()
if sys.argv[5] == "large":  # one ranged GET per object, its body written into the bytes returned
    pending = route.start_ranges([(u, 0, nbytes) for u in urls], 600.0, limit, stop)
else:
    pending = route.start(urls, nbytes, 600.0, limit, stop)
curl.settle(pending, stop, 600.0)
n = sum(len(p.result(0)[1]) for p in pending)
print(json.dumps({"seconds": time.perf_counter() - t0, "cpu_s": cpu() - c0, "bytes": n, "n": len(urls)}))
"""

# benchmarks/s3/bench.py's s3torchconnector client, with the batch size given (8 large objects
# in one batch of 64 would leave one of the two workers idle).
_S3TC = _CPU + r"""
import os
import torch
from s3torchconnector import S3ClientConfig, S3MapDataset
endpoint, urls_file, batch_size = sys.argv[1], sys.argv[2], int(sys.argv[3])
urls = open(urls_file).read().split()
os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench")
ds = S3MapDataset.from_objects(urls, region="us-east-1", endpoint=endpoint,
                               s3client_config=S3ClientConfig(force_path_style=True), transform=lambda o: o.read())
c0, t0 = cpu(), time.perf_counter()
n = 0
for batch in torch.utils.data.DataLoader(ds, batch_size=batch_size, num_workers=2, collate_fn=list):
    n += sum(len(d) for d in batch)
print(json.dumps({"seconds": time.perf_counter() - t0, "cpu_s": cpu() - c0, "bytes": n, "n": len(urls)}))
"""

_URLLIB3 = _CPU + r"""
from concurrent.futures import ThreadPoolExecutor
import urllib3
urls_file, threads = sys.argv[1], int(sys.argv[2])
urls = open(urls_file).read().split()
threads = min(threads, len(urls))
pool = urllib3.PoolManager(maxsize=threads, retries=False)
def get(url):
    r = pool.request("GET", url)
    assert r.status == 200, (url, r.status)
    return len(r.data)
c0, t0 = cpu(), time.perf_counter()
with ThreadPoolExecutor(threads) as ex:
    n = sum(ex.map(get, urls))
print(json.dumps({"seconds": time.perf_counter() - t0, "cpu_s": cpu() - c0, "bytes": n, "n": len(urls)}))
"""

# The page-cache ceiling: the data set's bytes written to new files, at most 8 MiB per write();
# objects of at most 1 MiB appended to one file, as fastload packs them (FASTLOAD_PACK_MAX).
_WRITE = _CPU + r"""
import os
folder, count, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.makedirs(folder, exist_ok=True)
piece = memoryview(os.urandom(min(nbytes, 8 << 20)))
def put(f):
    left = nbytes
    while left:
        left -= f.write(piece[:min(left, len(piece))])
c0, t0 = cpu(), time.perf_counter()
if nbytes <= (1 << 20):
    with open(os.path.join(folder, "pack.bin"), "wb", buffering=0) as f:
        for _ in range(count):
            put(f)
else:
    for k in range(count):
        with open(os.path.join(folder, f"{k}.bin"), "wb", buffering=0) as f:
            put(f)
print(json.dumps({"seconds": time.perf_counter() - t0, "cpu_s": cpu() - c0, "bytes": count * nbytes, "n": count}))
"""


@functools.cache
def s3_bench() -> ModuleType:
    """benchmarks/s3/bench.py (not a package): its data, its DataLoader client and its runner."""
    path = ROOT / "benchmarks" / "s3" / "bench.py"
    spec = importlib.util.spec_from_file_location("fastload_bench_s3", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--objects", type=int, default=3000, help="small objects")
    p.add_argument("--kb", type=int, default=110, help="size of a small object in KB")
    p.add_argument("--large", type=int, default=8, help="large objects")
    p.add_argument("--large-mb", type=int, default=256, help="size of a large object in MB")
    p.add_argument("--sizes", default=",".join(SIZES))
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--clients", default=",".join(CLIENTS))
    p.add_argument("--batch-size", type=int, default=64, help="batch size of the small set's DataLoaders (large: 1)")
    p.add_argument("--requests", type=int, default=32, help="engine's cap of GETs in flight; urllib3's threads")
    p.add_argument("--rounds", type=int, default=1, help="every row this many times, alternated; the median reported")
    p.add_argument("--peers-python", default=str(PEERS_VENV_PYTHON) if PEERS_VENV_PYTHON.exists() else "",
                   help="an interpreter with s3torchconnector and torch (default: benchmarks/peers/.venv-peers)")
    p.add_argument("--timeout-s", type=float, default=600, help="limit per client run")
    p.add_argument("--out", type=Path, help="also write the JSON report here")
    args = p.parse_args(argv)
    for name, allowed in (("sizes", SIZES), ("schemes", SCHEMES), ("clients", CLIENTS)):
        chosen = [c for c in getattr(args, name).split(",") if c]
        for c in chosen:
            if c not in allowed:
                p.error(f"--{name}: {c!r} is not one of {','.join(allowed)}")
        setattr(args, name, chosen)
    return args


def unavailable() -> str:
    """Why this benchmark cannot run here ("" when it can)."""
    if not _servers.nginx_available():
        return "nginx is not installed (apt-get install nginx)"
    if shutil.which("taskset") is None:
        return "taskset is not installed (apt-get install util-linux)"
    try:
        if not {CLIENT_CORE, SERVER_CORE} <= os.sched_getaffinity(0):
            return f"cores {CLIENT_CORE} and {SERVER_CORE} are not both allowed here"
    except AttributeError:
        return "no sched_getaffinity on this platform"
    return ""


def _pin(pid: int, core: int) -> list[int]:
    """Pin ``pid``, its threads and its children (nginx's workers) to ``core``; the pids pinned."""
    pinned = []
    todo = [pid]
    while todo:
        p = todo.pop()
        subprocess.run(["taskset", "-a", "-p", "-c", str(core), str(p)], check=True, capture_output=True)
        pinned.append(p)
        for task in Path(f"/proc/{p}/task").iterdir():
            todo += [int(c) for c in (task / "children").read_text().split()]
    return pinned


def client_affinity() -> list[int]:
    """The cores a client started under the benchmark's prefix may run on (checked, not assumed)."""
    code = "import os; print(sorted(os.sched_getaffinity(0)))"
    done = subprocess.run([*_PREFIX, sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return [int(c) for c in json.loads(done.stdout)]


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _plan(client: str, scheme: str, size: str, args: argparse.Namespace, endpoint: str, urls: Path, cache: Path,
          nbytes: int) -> tuple[str, str, list[str]]:
    """(python, code, argv) of one row."""
    batch = args.batch_size if size == "small" else 1
    if client == "dataloader":
        return sys.executable, s3_bench()._FASTLOAD, [endpoint, str(urls), str(cache), json.dumps({"batch_size": batch})]
    if client == "cache":
        return sys.executable, _CACHE, [endpoint, str(urls), str(cache)]
    if client == "engine":
        return sys.executable, _ENGINE, [endpoint, str(urls), str(nbytes), str(args.requests), size]
    if client == "s3torchconnector":
        return args.peers_python, _S3TC, [endpoint, str(urls), str(batch)]
    if client == "write":
        count = args.objects if size == "small" else args.large
        return sys.executable, _WRITE, [str(cache), str(count), str(nbytes)]
    return sys.executable, _URLLIB3, [str(urls), str(args.requests)]


def _measure(row: dict[str, Any], res: dict[str, Any], process_cpu_s: float) -> dict[str, Any]:
    if "error" in res:
        return {**row, **res}
    n, seconds = res["n"], res["seconds"]
    return {**row, "n": n, "bytes": res["bytes"], "seconds": round(seconds, 3),
            "mb_s": round(res["bytes"] / seconds / 1e6, 1), "objects_per_s": round(n / seconds, 1),
            "cpu_ms_per_object": round(1000 * res["cpu_s"] / n, 4),
            "setup_cpu_s": round(process_cpu_s - res["cpu_s"], 3),
            "requests_per_object": round(res["requests"] / n, 3)}


def _run_size(size: str, args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """Every row of one data set: its files made, nginx pinned, each client in turn."""
    s3b = s3_bench()
    count, kb = (args.objects, args.kb) if size == "small" else (args.large, args.large_mb * 1000)
    www = work / size / "www"
    keys = s3b._make_data(www, count, kb)
    nbytes = kb * 1000
    rows: list[dict[str, Any]] = []
    with _servers.NginxServer(www, workers=1) as nginx:
        assert nginx.pid is not None and nginx.workdir is not None
        pinned = _pin(nginx.pid, SERVER_CORE)
        affinity = sorted({c for p in pinned for c in os.sched_getaffinity(p)})
        if affinity != [SERVER_CORE]:
            raise RuntimeError(f"nginx's processes {pinned} run on cores {affinity}, not {SERVER_CORE} alone")
        log = nginx.workdir / "access.log"
        files = {"http": work / size / "http.txt", "s3": work / size / "s3.txt"}
        files["http"].write_text("\n".join(f"{nginx.url}/{s3b.BUCKET}/{k}" for k in keys) + "\n")
        files["s3"].write_text("\n".join(f"s3://{s3b.BUCKET}/{k}" for k in keys) + "\n")
        todo = [(c, s) for s in args.schemes for c in args.clients if s in SPEAKS[c]]
        for rnd in range(args.rounds):  # alternated, so that a busy moment of the machine hits every client
            for client, scheme in todo:
                row: dict[str, Any] = {"size": size, "scheme": scheme, "client": client, "round": rnd}
                python, code, argv = _plan(client, scheme, size, args, nginx.url, files[scheme],
                                           work / f"cache-{size}-{client}-{scheme}-{rnd}", nbytes)
                if not python:
                    rows.append({**row, "error": "not run: no --peers-python with s3torchconnector"})
                    continue
                c0, t0 = _children_cpu(), time.perf_counter()
                res = s3b._run(_PREFIX, python, code, argv, {}, args.timeout_s, log,
                               f"/{s3b.BUCKET}/train/")
                rows.append({**_measure(row, res, _children_cpu() - c0), "wall_s": round(time.perf_counter() - t0, 2)})
                shutil.rmtree(work / f"cache-{size}-{client}-{scheme}-{rnd}", ignore_errors=True)
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    shutil.rmtree(work / size, ignore_errors=True)
    return rows


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per (size, scheme, client): medians over rounds, and ratios to that set's engine row."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["size"], r["scheme"], r["client"]), []).append(r)
    out = []
    for (size, scheme, client), runs in groups.items():
        good = [r for r in runs if "error" not in r]
        line: dict[str, Any] = {"size": size, "scheme": scheme, "client": client, "rounds": len(good)}
        if not good:
            out.append({**line, "error": runs[0]["error"]})
            continue
        for key in ("mb_s", "objects_per_s", "cpu_ms_per_object", "setup_cpu_s", "requests_per_object"):
            line[key] = round(statistics.median(r[key] for r in good), 4)
        out.append(line)
    for line in out:
        base = next((e for e in out if (e["size"], e["scheme"], e["client"]) == (line["size"], line["scheme"], "engine")
                     and "error" not in e), None)
        if base is not None and "error" not in line:
            line["x_engine_objects_per_s"] = round(line["objects_per_s"] / base["objects_per_s"], 3)
            line["x_engine_cpu"] = round(line["cpu_ms_per_object"] / base["cpu_ms_per_object"], 3)
        ceiling = next((e for e in out if (e["size"], e["client"]) == (line["size"], "write") and "error" not in e), None)
        if ceiling is not None and "error" not in line:
            line["x_write_mb_s"] = round(line["mb_s"] / ceiling["mb_s"], 3)
    return out


def table(summary: list[dict[str, Any]]) -> str:
    """The summary as a Markdown table."""
    head = ("| set | scheme | client | MB/s | objects/s | CPU ms/object | setup CPU s | x engine objects/s "
            "| x engine CPU/object | x write MB/s | requests/object |\n|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for s in summary:
        if "error" in s:
            lines.append(f"| {s['size']} | {s['scheme']} | {s['client']} | {s['error']} | | | | | | | |")
            continue
        lines.append(f"| {s['size']} | {s['scheme']} | {s['client']} | {s['mb_s']:,.1f} | {s['objects_per_s']:,.1f} | "
                     f"{s['cpu_ms_per_object']:.4g} | {s['setup_cpu_s']:.2f} | {s.get('x_engine_objects_per_s', '')} | "
                     f"{s.get('x_engine_cpu', '')} | {s.get('x_write_mb_s', '')} | {s['requests_per_object']} |")
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    nginx = _servers.find_nginx()
    version = subprocess.run([nginx, "-v"], capture_output=True, text=True).stderr.strip() if nginx else ""
    return {"cores": os.cpu_count(), "kernel": f"{os.uname().sysname} {os.uname().release}", "nginx": version,
            "python": sys.version.split()[0], "load_avg": [round(x, 2) for x in os.getloadavg()],
            "pinning": f"client taskset -c {CLIENT_CORE}; nginx (1 worker) taskset -c {SERVER_CORE}; loopback unshaped"}


def main(args: argparse.Namespace) -> dict[str, Any]:
    why = unavailable()
    if why:
        raise SystemExit(f"percore benchmark cannot run here: {why}")
    t0 = time.time()
    pinned = client_affinity()
    if pinned != [CLIENT_CORE]:
        raise RuntimeError(f"a client under {' '.join(_PREFIX)} may run on cores {pinned}, not {CLIENT_CORE} alone")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="fastload-percore-") as tmp:
        for size in args.sizes:
            rows += _run_size(size, args, Path(tmp))
    summary = summarize(rows)
    report = {"objects": args.objects, "kb": args.kb, "large": args.large, "large_mb": args.large_mb,
              "batch_size": args.batch_size, "requests": args.requests, "rounds": args.rounds,
              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t0)),
              "wall_s": round(time.time() - t0, 1), "machine": machine(),
              "client_cores": pinned, "nginx_cores": [SERVER_CORE],  # both checked before any row ran
              "summary": summary, "rows": rows}
    print(table(summary))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main(parse_args())
