"""Staging large objects: ``fastload cache`` against ``curl`` on the same link, in one run.

Serves one large file (``--big``, 2 GB) and ``--parts`` files of ``--part-size`` (4 x 256 MB)
from nginx on loopback (fastload._servers), and for each set, in turns, times:

* ``curl``: ``curl -o /dev/null`` of each file (the files of a set in parallel), and the
  same with each file cut in ``--curl-parts`` ranged GETs at once (the better is the bar);
* ``curl_to_disk``: as ``curl`` but written to files beside the cache (the same disk);
* ``fastload``: ``fastload cache URL --json`` into a fresh cache folder, each run;
* ``fastload_aiohttp``: the same with ``FASTLOAD_HTTP_CLIENT=aiohttp`` (no libcurl at all).

Each way runs ``--rounds`` times in turns (a neighbour's load weighs on all alike); the best
MB/s of each is kept, with the peak RSS of its process (``os.wait4``). Prints one JSON
object: MB/s, RSS and fastload's ratio to the best curl. Data, caches and curl's output
lie under ``--dir`` (/var/tmp) and are deleted after.

    python benchmarks/large/bench.py [--big 2GB --parts 4 --part-size 256MB --rounds 2] [--rate 2gbit] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from fastload import _servers  # noqa: E402
from fastload.config import parse_size  # noqa: E402

CHUNK = 64 << 20  # random bytes written once and repeated (LZ4's 64 KB window sees no repeat)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--big", default="2GB", help="the one large file's size (0: none)")
    p.add_argument("--parts", type=int, default=4, help="files of --part-size (0: none)")
    p.add_argument("--part-size", default="256MB")
    p.add_argument("--curl-parts", type=int, default=8, help="ranged GETs per file in curl's parallel row")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dir", default="/var/tmp", help="where data, caches and curl's files go (deleted after)")
    p.add_argument("--caches", help="where fastload's caches and curl_to_disk's files go (default: --dir); /dev/shm "
                   "measures the client without the disk")
    p.add_argument("--ways", default="curl,curl_to_disk,fastload,fastload_aiohttp")
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--rate", default=None, help="shape the loopback with tc tbf at this rate, e.g. 2gbit (needs root: "
                   "the whole run then happens inside a ShapedLink namespace, curl too); default unshaped")
    p.add_argument("--shaped-inside", default=None, help=argparse.SUPPRESS)  # set by the --rate re-run
    return p.parse_args(argv)


def _write(path: Path, size: int, pool: bytes) -> None:
    with path.open("wb") as f:
        for start in range(0, size, len(pool)):
            f.write(pool[: min(len(pool), size - start)])


def _timed(cmd: list[str], rss_file: Path) -> list[str]:
    """``cmd`` under /usr/bin/time, which writes its peak RSS (KiB) to ``rss_file``. A process forked from
    this one would count this one's RSS as its own peak (Linux keeps the larger across exec)."""
    return ["/usr/bin/time", "-f", "%M", "-o", str(rss_file), *cmd]


def _rss(files: list[Path]) -> int:
    """The largest peak RSS (bytes) the files of :func:`_timed` name."""
    return max(int(f.read_text().split()[-1]) * 1024 for f in files)


def _curls(urls: list[str], sizes: list[int], parts: int, out_dir: Path | None, work: Path) -> tuple[float, int]:
    """Seconds for every URL fetched by curl processes at once (``parts`` ranged GETs per file), and their
    largest peak RSS."""
    cmds = []
    for n, (url, size) in enumerate(zip(urls, sizes)):
        step = -(-size // parts)
        for k in range(parts):
            start, end = k * step, min(size, (k + 1) * step) - 1
            target = "/dev/null" if out_dir is None else str(out_dir / f"{n}.{k}")
            cmds.append(["curl", "-sf", "-o", target, *(["-r", f"{start}-{end}"] if parts > 1 else []), url])
    rss_files = [work / f"rss-curl-{k}" for k in range(len(cmds))]
    t0 = time.perf_counter()
    procs = [subprocess.Popen(_timed(c, f)) for c, f in zip(cmds, rss_files)]
    for proc in procs:
        if proc.wait():
            raise RuntimeError(f"curl exited {proc.returncode}")
    return time.perf_counter() - t0, _rss(rss_files)


def _peak(cmd: list[str], env: dict[str, str], work: Path) -> tuple[float, int, str]:
    """Seconds, peak RSS (bytes) and stdout of ``cmd``."""
    rss_file = work / "rss-fastload"
    t0 = time.perf_counter()
    done = subprocess.run(_timed(cmd, rss_file), capture_output=True, env=env)
    elapsed = time.perf_counter() - t0
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd[:4])}... exited {done.returncode}: {done.stderr.decode(errors='replace')[-2000:]}")
    return elapsed, _rss([rss_file]), done.stdout.decode()


def _fastload(url: str, cache: Path, client: str, work: Path) -> tuple[float, int, dict[str, Any]]:
    env = {**os.environ, "FASTLOAD_HTTP_CLIENT": client}
    env.pop("FASTLOAD_CACHE_DIR", None)
    cmd = [sys.executable, "-m", "fastload", "cache", url, "--cache-dir", str(cache), "--cache-limit", "100GB",
           "--json", "--no-progress"]
    try:
        elapsed, rss, out = _peak(cmd, env, work)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return elapsed, rss, json.loads(out)


def measure(name: str, www: Path, url: str, files: list[str], args: argparse.Namespace, work: Path,
            caches: Path) -> dict[str, Any]:
    sizes = [(www / f).stat().st_size for f in files]
    total = sum(sizes)
    urls = [f"{url}/{f}" for f in files]
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    best: dict[str, dict[str, float]] = {}

    def keep(way: str, seconds: float, rss: int, staged_mb_s: float | None = None) -> None:
        mb_s = total / seconds / 1e6
        if mb_s > best.get(way, {}).get("mb_s", 0.0):
            best[way] = {"mb_s": round(mb_s, 1), "seconds": round(seconds, 3), "peak_rss_mb": round(rss / 1e6, 1)}
            if staged_mb_s is not None:  # the report's own rate: interpreter start and listing left out
                best[way]["staging_mb_s"] = round(staged_mb_s, 1)

    for _ in range(args.rounds):
        if "curl" in ways:
            keep("curl", *_curls(urls, sizes, 1, None, work))
            keep(f"curl_{args.curl_parts}_parts", *_curls(urls, sizes, args.curl_parts, None, work))
        if "curl_to_disk" in ways:
            out_dir = Path(tempfile.mkdtemp(dir=caches, prefix="curl-"))
            try:
                keep("curl_to_disk", *_curls(urls, sizes, 1, out_dir, work))
            finally:
                shutil.rmtree(out_dir)
        for way, client in (("fastload", "auto"), ("fastload_aiohttp", "aiohttp")):
            if way in ways:
                target = urls[0] if len(urls) == 1 else url + "/"
                seconds, rss, report = _fastload(target, caches / f"cache-{way}", client, work)
                if report.get("fetched_bytes", total) < total:
                    raise RuntimeError(f"{way} fetched {report.get('fetched_bytes')} B of {total}: {report}")
                keep(way, seconds, rss, report["mb_per_s"])
    out: dict[str, Any] = {"set": name, "files": len(files), "bytes": total, **best}
    curl_best = max((v["mb_s"] for k, v in best.items() if k.startswith("curl") and k != "curl_to_disk"), default=0.0)
    for way in ("fastload", "fastload_aiohttp"):
        if way in best and curl_best:
            out[f"{way}_to_curl"] = round(best[way]["mb_s"] / curl_best, 3)
    if "fastload" in best and "curl_to_disk" in best:
        out["fastload_to_curl_to_disk"] = round(best["fastload"]["mb_s"] / best["curl_to_disk"]["mb_s"], 3)
    return out


def shaped(args: argparse.Namespace) -> int:
    """The run again inside a namespace whose loopback carries ``tc tbf rate``: nginx, curl and fastload all
    in it, so each way's bytes cross the same shaped link (issue 35: staging against curl *on the same link*)."""
    if not _servers.shaping_available():
        print(f"--rate needs root and tc: {_servers.shaping_unavailable_reason()}", file=sys.stderr)
        return 2
    with _servers.ShapedLink(rate=args.rate, burst="1mb") as link:
        return link.run_in([sys.executable, __file__, *sys.argv[1:], "--shaped-inside", args.rate]).returncode


def main(args: argparse.Namespace) -> dict[str, Any]:
    if args.rate and not args.shaped_inside:
        sys.exit(shaped(args))
    work = Path(tempfile.mkdtemp(dir=args.dir, prefix="fastload-bench-large-"))
    caches = Path(tempfile.mkdtemp(dir=args.caches, prefix="fastload-bench-large-")) if args.caches else work
    results: dict[str, Any] = {"machine": f"{os.cpu_count()} cores, {os.uname().release}", "caches": args.caches or args.dir,
                               "link": f"tc tbf rate {args.rate} in a network namespace" if args.rate else "unshaped loopback",
                               "sets": []}
    try:
        pool = os.urandom(CHUNK)
        big, part = parse_size(args.big), parse_size(args.part_size)
        sets: list[tuple[str, list[str]]] = []
        www = work / "www"
        if big:
            (www / "big").mkdir(parents=True)
            _write(www / "big" / "big.bin", big, pool)
            sets.append(("big", ["big.bin"]))
        if args.parts:
            (www / "parts").mkdir(parents=True)
            for k in range(args.parts):
                _write(www / "parts" / f"part-{k}.bin", part, pool[k * 4096:] + pool[: k * 4096])
            sets.append(("parts", [f"part-{k}.bin" for k in range(args.parts)]))
        with _servers.NginxServer(www) as server:
            for name, files in sets:
                results["sets"].append(measure(name, www / name, f"{server.url}/{name}", files, args, work, caches))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(caches, ignore_errors=True)
    print(json.dumps(results, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main(parse_args())
