"""Where a cold DataLoader epoch's CPU goes on one core: py-spy samples, split into parts.

Issue 36, item 2 (the profile). The same row as bench.py's small http:// ``dataloader``
(the client on core 0, nginx on core 1, loopback unshaped, a fresh cache) runs under
``py-spy record --native -f raw`` (py-spy itself on core 1, beside nginx). py-spy sees
Python threads only, so each thread's own CPU is also read from ``/proc/self/task`` when the
epoch ends: a thread that Python does not know is C's (libcurl's engine is started just before
its pump thread).

Vocabulary: an *epoch sample* is a py-spy sample of a Python thread taken while the epoch
ran (the main thread's set-up, torch's import and the dataset's construction, is left out
by its line in the client's code); a *part* is where a sample is charged: the innermost
frame that matches one of ``PARTS``' rules, else "other". The C engine thread's CPU is its
own part; the Python threads' CPU (the epoch's minus the C thread's) is split by the share
of epoch samples.

Run as root: ``python benchmarks/percore/profile_cold.py [--objects 3000 --kb 110 --rate 250]
[--keep DIR]`` (DIR keeps the raw stacks and the per-thread CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (benchmarks/percore/bench.py: the data, the pinning, the client)

# Each thread's CPU when the epoch has ended, with the names Python gives its own threads.
_THREADS = r"""
import os, threading
names = {t.native_id: t.name for t in threading.enumerate()}
tick, rows = os.sysconf("SC_CLK_TCK"), []
for tid in os.listdir("/proc/self/task"):
    stat = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
    rows.append({"tid": int(tid), "name": names.get(int(tid), ""),
                 "user_s": int(stat[11]) / tick, "sys_s": int(stat[12]) / tick})
with open(os.environ["PERCORE_THREADS"], "w") as f:
    json.dump({"threads": rows, "epoch": out}, f)
"""

# (part, regex on a frame): a sample is charged to the innermost frame that matches a rule, the
# rules tried in this order on each frame. Native frames are C function names (--native).
PARTS: list[tuple[str, str]] = [
    ("checksums", r"xxh|XXH|checksum|crc32"),
    ("Python object churn (alloc, free, GC)",
     r"^(_?PyObject_Malloc|_?PyObject_Free|PyObject_Malloc|PyObject_Free|_PyObject_GC_\w+|gc_collect\w*|"
     r"subtype_dealloc|_Py_Dealloc|\w+_dealloc|_PyMem_\w+|pymalloc\w*|malloc|free|cfree|realloc|"
     r"_int_malloc|_int_free|PyBytes_FromStringAndSize|_PyBytes_Resize|list_resize|dict_resize|"
     r"_PyDict_NewPresized|new_keys_object|visit_\w+|deduce_unreachable\w*) "),
    ("SQLite index", r"sqlite|cache/index\.py|index\.py"),
    ("pack writes (pwritev, packs)", r"pwrite|cache/packs\.py|packs\.py"),
    ("cache write (encode, publish)", r"cache/writes\.py|writes\.py|codec\.py|lz4|LZ4"),
    ("curl engine / pump (Python side)", r"transport/curl\.py|curl\.py|fastload-curl-pump|_curl"),
    ("fetch bookkeeping (fetcher, source)", r"fetch/\w+\.py|source/\w+\.py|hostlimit\.py"),
    ("loader / collate", r"loader/\w+\.py|torch/utils/data|collate|dataset\.py|pipelines/"),
]
# A leaf frame that blocks with the GIL released: a wait, not CPU.
_WAIT = re.compile(r"^(Condition\.wait|Event\.wait|Future\.result|_worker \(concurrent/futures/thread\.py:81\)|"
                   r"_watch \(fastload/transport/curl\.py:\d+\)|wait \(fastload/transport/curl\.py|\w*\.?acquire|"
                   r"select|sleep)(?: |$)")
_COMPILED = [(name, re.compile(rule)) for name, rule in PARTS]
C_ENGINE = "curl engine (C thread: libcurl, recv)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--objects", type=int, default=3000)
    p.add_argument("--kb", type=int, default=110)
    p.add_argument("--scheme", choices=("http", "s3"), default="http", help="the objects' URLs: http:// or path-style s3://")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    p.add_argument("--native", action="store_true", help="py-spy --native (C frames; its idle filter then lets waits in)")
    p.add_argument("--keep", type=Path, help="keep the raw stacks (stacks.txt) and threads.json here")
    return p.parse_args(argv)


def epoch_lines(code: str) -> range:
    """The lines of the client's ``<module>`` that are its epoch (the loop, to the report)."""
    lines = code.split("\n")
    first = next(i for i, line in enumerate(lines, 1) if line.startswith("for batch in loader"))
    last = next(i for i, line in enumerate(lines, 1) if line.startswith("out = {"))
    return range(first, last)


def part_of(frames: list[str]) -> str:
    """The part a stack (root first) is charged to: its innermost frame that a rule matches."""
    for frame in reversed(frames):
        for name, rule in _COMPILED:
            if rule.search(frame):
                return name
    return "other"


def split(stacks: str, loop: range, main_tid: int) -> tuple[Counter[str], int, int]:
    """Epoch samples per part, from py-spy's raw output (``thread (tid)...;frame;...;frame count``),
    the samples left out as set-up, and those left out as waits."""
    parts: Counter[str] = Counter()
    setup = waits = 0
    for line in stacks.splitlines():
        body, _, count = line.rpartition(" ")
        if not body:
            continue
        frames = body.split(";")
        module = next((f for f in frames if f.startswith("<module> (<string>:")), None)
        if frames[0].startswith(f"thread ({main_tid})") and (
                module is None or int(module.rsplit(":", 1)[1].rstrip(")")) not in loop):
            setup += int(count)  # the main thread off the clock: torch's import, the set-up, the exit
            continue
        if _WAIT.search(frames[-1]):
            waits += int(count)  # py-spy's idle filter lets these through here: blocked, GIL released
            continue
        if "fastload-import" in frames[0]:  # the import thread of trees before 2026-12-04: aiohttp's import, under the clock
            parts["aiohttp import (a thread, source.warm_http)"] += int(count)
            continue
        parts[part_of(frames)] += int(count)
    return parts, setup, waits


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    s3b = bench.s3_bench()
    www = work / "www"
    keys = s3b._make_data(www, args.objects, args.kb)
    code = s3b._FASTLOAD + _THREADS
    stacks, threads = work / "stacks.txt", work / "threads.json"
    with bench._servers.NginxServer(www, workers=1) as nginx:
        assert nginx.pid is not None
        bench._pin(nginx.pid, bench.SERVER_CORE)
        urls = work / f"{args.scheme}.txt"
        base = nginx.url if args.scheme == "http" else "s3:/"
        urls.write_text("\n".join(f"{base}/{s3b.BUCKET}/{k}" for k in keys) + "\n")
        spy = [str(Path(sys.executable).with_name("py-spy")), "record", *(["--native"] if args.native else []), "--threads", "-f", "raw",
               "-r", str(args.rate), "-o", str(stacks), "--"]
        cmd = ["taskset", "-c", str(bench.SERVER_CORE), *spy, *bench._PREFIX, sys.executable, "-c", code,
               nginx.url, str(urls), str(work / "cache"), json.dumps({"batch_size": args.batch_size})]
        env = {**os.environ, "PERCORE_THREADS": str(threads)}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"py-spy or the client failed: {done.stderr[-2000:]}")
    got = json.loads(threads.read_text())
    epoch, rows = got["epoch"], got["threads"]
    # libcurl's thread is started by Engine() just before the pump thread (curl.engine): the C thread
    # with the highest id below the pump's.
    pump_tid = next(t["tid"] for t in rows if t["name"] == "fastload-curl-pump")
    # A C thread is one py-spy never sampled: a Python thread on its way out (a pool's, after its
    # executor shut down) is no longer in threading.enumerate(), so it has no name either.
    seen = {int(m) for m in re.findall(r"^thread \((\d+)\)", stacks.read_text(), re.M)}
    c_rows = [t for t in rows if not t["name"] and t["tid"] not in seen]
    engine_tid = max((t["tid"] for t in c_rows if t["tid"] < pump_tid), default=-1)
    c_engine = [t for t in c_rows if t["tid"] == engine_tid]
    c_other = [t for t in c_rows if t["tid"] != engine_tid]
    c_engine_s = sum(t["user_s"] + t["sys_s"] for t in c_engine)
    c_other_s = sum(t["user_s"] + t["sys_s"] for t in c_other)
    main_tid = next(t["tid"] for t in rows if t["name"] == "MainThread")
    parts, setup, waits = split(stacks.read_text(), epoch_lines(s3b._FASTLOAD), main_tid)
    python_s = max(0.0, epoch["cpu_s"] - c_engine_s - c_other_s)
    sampled = sum(parts.values())
    shares = {C_ENGINE: c_engine_s}
    if c_other_s:
        shares["other C threads"] = c_other_s
    for name, count in parts.most_common():
        shares[name] = python_s * count / sampled
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        shutil.copy(stacks, args.keep / "stacks.txt")
        shutil.copy(threads, args.keep / "threads.json")
    return {"objects": args.objects, "kb": args.kb, "rate": args.rate, "epoch": epoch, "threads": rows,
            "epoch_samples": sampled, "setup_samples": setup, "wait_samples": waits, "samples": dict(parts),
            "cpu_s": {k: round(v, 4) for k, v in shares.items()},
            "command": " ".join(cmd[:-6] + ["-c", "<benchmarks/s3/bench.py _FASTLOAD + threads>", *cmd[-4:]])}


def table(report: dict[str, Any]) -> str:
    n, total = report["objects"], report["epoch"]["cpu_s"]
    lines = ["| part | share of epoch CPU | ms per object | py-spy samples |", "|---|---:|---:|---:|"]
    for name, secs in sorted(report["cpu_s"].items(), key=lambda kv: -kv[1]):
        samples = report["samples"].get(name, "(/proc)")
        lines.append(f"| {name} | {secs / total:.1%} | {1000 * secs / n:.3f} | {samples} |")
    lines.append(f"| **whole epoch** | 100% | {1000 * total / n:.3f} | {report['epoch_samples']} |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> dict[str, Any]:
    why = bench.unavailable()
    if why:
        raise SystemExit(f"cannot profile here: {why}")
    with tempfile.TemporaryDirectory(prefix="fastload-percore-prof-") as tmp:
        report = run(args, Path(tmp))
    print(json.dumps({k: v for k, v in report.items() if k != "threads"}, indent=1))
    print(table(report))
    return report


if __name__ == "__main__":
    main(parse_args())
