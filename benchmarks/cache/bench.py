"""Cache benchmark: cold pre-staging over a slow link vs warm reads vs the local disk.

Measured side by side in one run, so the ratios compare like with like:

1. **Link limit.** A network namespace whose loopback carries
   ``tc qdisc add dev lo root tbf rate 200mbit burst 128kb latency 100ms``, with
   nginx inside serving an ImageNet-like folder of JPEGs (fastload.samples). One
   large file downloaded through the link (by a client inside the namespace)
   gives the bytes/s any client can hope for.
2. **Cold pre-staging.** ``fastload cache URL --json --no-progress`` inside the
   namespace into a fresh cache, for several ``--workers``; MB/s and its share
   of the link limit (target: at least 85 %).
3. **Warm reads.** ``Reader.read`` of every item through the filled cache, from
   the *parent* namespace, where the server is unreachable: the manifest means
   no remote round trip, and the run checks that none happened (target: at
   least 5x the cold rate).
4. **Local-disk ceiling.** The cache's payload files read raw, page cache hot,
   and page cache cold (evicted per file with ``posix_fadvise(DONTNEED)``, or
   with ``--drop-caches`` as root, ``echo 1 > /proc/sys/vm/drop_caches``).
5. **Codec.** Compression ratio and single-thread ``codec.decode`` GB/s on the
   cached payloads of three kinds of data: JPEG photos, uint8 pixel arrays and
   int32 token ids.

Without root, ``ip`` or ``tc`` (or with ``--no-shaping``), the link is an
in-process token-bucket HTTP proxy in front of nginx instead (throttle_proxy.py),
and every output says so.

Usage::

    python benchmarks/cache/bench.py                 # full run -> benchmarks/cache/results/
    python benchmarks/cache/bench.py --quick --no-shaping --out /tmp/bench

JSON goes to stdout and a human table to stderr; ``results.json`` and
``results.md`` (with the machine description) go to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

import fastload
from fastload import _servers, codec
from fastload.cache import Cache
from fastload.config import Settings
from fastload.read.reader import Reader
from fastload.samples import make_image_folder, make_token_file, make_uint8_arrays

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path
from throttle_proxy import ThrottledProxy, TokenBucket  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results"
COLD_TARGET = 0.85  # cold staging must reach this share of the link limit
WARM_TARGET = 5.0  # warm reads must be this many times faster than cold staging

# Runs inside the link's namespace: downloads one URL, prints bytes and seconds.
_DOWNLOAD_CLIENT = """
import json, sys, time, urllib.request
t0 = time.perf_counter(); n = 0
with urllib.request.urlopen(sys.argv[1], timeout=300) as r:
    while chunk := r.read(1 << 20):
        n += len(chunk)
print(json.dumps({"bytes": n, "seconds": time.perf_counter() - t0}))
"""

# Runs inside the namespace: a dry run lists the dataset and HEADs every item.
_LIST_CLIENT = """
import json, sys, time, fastload
from fastload.config import Settings
s = Settings(cache_dir=sys.argv[2], max_requests=int(sys.argv[3]))
t0 = time.perf_counter()
r = fastload.stage(sys.argv[1], settings=s, dry_run=True, progress=False)
print(json.dumps({"seconds": time.perf_counter() - t0, "items": r.items, "remote_bytes": r.remote_bytes}))
"""


# -- arguments ------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parses the benchmark's command line (``argv`` defaults to ``sys.argv[1:]``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny run (seconds) for smoke tests; results are not meaningful")
    p.add_argument("--out", type=Path, help=f"results folder (default {DEFAULT_OUT.relative_to(HERE.parent.parent)}; a --quick run writes none unless given)")
    p.add_argument("--no-shaping", action="store_true", help="skip kernel shaping; use the in-process throttled proxy")
    p.add_argument("--rate", default="200mbit", help="link rate in tc units")
    p.add_argument("--burst", default="128kb", help="tbf burst in tc units")
    p.add_argument("--latency", default="100ms", help="tbf latency (queueing limit)")
    p.add_argument("--images", type=int, help="JPEGs in the dataset (default 600; quick 24)")
    p.add_argument("--quality", type=int, default=92, help="JPEG quality (92 gives ~110 KB files at 500x375)")
    p.add_argument("--big-mb", type=float, help="size of the link-limit file in MB (default 50; quick 4)")
    p.add_argument("--workers", help="comma-separated --max-requests values for cold staging (default 8,16,32; quick 4,8)")
    p.add_argument("--repeats", type=int, help="cold runs per workers value and timed passes elsewhere (default 3; quick 1)")
    p.add_argument("--drop-caches", action="store_true", help="as root, also `echo 1 > /proc/sys/vm/drop_caches` before cold disk reads")
    p.add_argument("--work-dir", type=Path, help="where the dataset and caches go (default: a new temp folder)")
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    q = args.quick
    args.images = args.images if args.images is not None else (24 if q else 600)
    args.big_mb = args.big_mb if args.big_mb is not None else (4.0 if q else 50.0)
    args.repeats = args.repeats if args.repeats is not None else (1 if q else 3)
    try:
        args.workers = [int(w) for w in (args.workers or ("4,8" if q else "8,16,32")).split(",")]
    except ValueError:
        p.error(f"--workers {args.workers!r} must be comma-separated integers, e.g. 8,16,32")
    if min(args.workers) < 1 or args.images < 1 or args.repeats < 1 or args.big_mb <= 0:
        p.error("--workers, --images, --repeats and --big-mb must be positive")
    args.uint8_arrays = 8 if q else 128
    args.tokens = 256 * 1024 if q else 8 * 1024**2
    args.min_time_s = 0.02 if q else 0.3
    args.epochs = 1 if q else 5  # timed warm epochs per pass
    return args


# -- units ------------------------------------------------------------------------

_TC_RATE = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "kibit": 1024 / 8, "mibit": 1024**2 / 8,
            "gibit": 1024**3 / 8, "bps": 1, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "": 1 / 8}
_TC_SIZE = {"": 1, "b": 1, "k": 1024, "kb": 1024, "m": 1024**2, "mb": 1024**2, "g": 1024**3, "gb": 1024**3,
            "kbit": 1024 / 8, "mbit": 1024**2 / 8}


def _tc_value(text: str, table: dict[str, float], what: str) -> float:
    """A tc rate ("200mbit" -> 25e6 bytes/s) or size ("128kb" -> 131072 bytes), as iproute2 reads them."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in table:
        raise ValueError(f"{what} {text!r} is not in tc units; use e.g. {'200mbit' if what == 'rate' else '128kb'}")
    return float(match.group(1)) * table[match.group(2).lower()]


def _mb(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e6 if seconds > 0 else 0.0


def _log(msg: str) -> None:
    print(f"[bench cache] {msg}", file=sys.stderr, flush=True)


# -- the link ---------------------------------------------------------------------


@dataclass
class Link:
    """Where the dataset is served and how a client reaches it."""

    mode: str  # "netns-tbf" or "proxy-token-bucket"
    description: str
    url: str  # base URL, no trailing slash
    nominal_bytes_per_s: float
    prefix: list[str] = field(default_factory=list)  # runs a command on the client side
    fallback_reason: str | None = None
    bucket: TokenBucket | None = None  # the proxy's, in the fallback mode

    def run(self, cmd: list[str], timeout_s: float = 900) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FASTLOAD_")}  # measure the defaults
        done = subprocess.run([*self.prefix, *cmd], capture_output=True, text=True, timeout=timeout_s, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"client {shlex.join(cmd[:6])} ... exited {done.returncode}:\n{done.stderr[-3000:]}")
        return done

    def run_json(self, cmd: list[str]) -> tuple[dict[str, Any], float]:
        t0 = time.perf_counter()
        done = self.run(cmd)
        return json.loads(done.stdout), time.perf_counter() - t0


@contextlib.contextmanager
def open_link(args: argparse.Namespace, root: Path) -> Iterator[Link]:
    """Serves ``root`` over a shaped link; the namespace, nginx and proxy go away on exit, also on error."""
    rate = _tc_value(args.rate, _TC_RATE, "rate")
    burst = _tc_value(args.burst, _TC_SIZE, "burst")
    if not _servers.nginx_available():
        raise RuntimeError("nginx not found; the benchmark serves the dataset with it (apt-get install nginx)")
    reason = "disabled with --no-shaping" if args.no_shaping else _servers.shaping_unavailable_reason()
    with contextlib.ExitStack() as stack:
        if reason is None:
            link = stack.enter_context(_servers.ShapedLink(rate=args.rate, burst=args.burst, latency=args.latency))
            http = stack.enter_context(_servers.NginxServer(root, netns=link.name))
            yield Link(
                "netns-tbf",
                f"network namespace, loopback `tc qdisc add dev lo root tbf rate {args.rate} burst {args.burst} "
                f"latency {args.latency}`; nginx and every client inside it",
                http.url, rate, prefix=link.exec_prefix,
            )
        else:
            _log(f"kernel shaping unavailable ({reason}); FALLBACK: in-process token-bucket proxy")
            http = stack.enter_context(_servers.NginxServer(root))
            proxy = stack.enter_context(ThrottledProxy(http.url, rate, burst))
            yield Link(
                "proxy-token-bucket",
                f"FALLBACK (no kernel shaping: {reason}): in-process HTTP proxy in front of nginx, one token bucket "
                f"of {args.rate} / {args.burst} shared by all response bodies (headers and requests unthrottled)",
                proxy.url, rate, fallback_reason=reason, bucket=proxy.bucket,
            )


# -- data ---------------------------------------------------------------------------


def make_dataset(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    www = work / "www"
    paths = make_image_folder(www / "train", n=args.images, quality=args.quality)
    sizes = [p.stat().st_size for p in paths]
    big = www / "big.bin"
    big.write_bytes(np.random.default_rng(0).bytes(int(args.big_mb * 1e6)))  # incompressible, like JPEG
    return {
        "kind": f"ImageNet-like JPEGs (fastload.samples.make_image_folder, 500x375, quality {args.quality})",
        "root": www,
        "items": len(paths),
        "bytes": sum(sizes),
        "avg_item_bytes": round(sum(sizes) / len(sizes)),
        "min_item_bytes": min(sizes),
        "max_item_bytes": max(sizes),
        "big_file_bytes": big.stat().st_size,
        "generate_s": round(time.perf_counter() - t0, 2),
    }


# -- measurements -----------------------------------------------------------------


def measure_link(link: Link, repeats: int) -> dict[str, Any]:
    runs = [link.run_json([sys.executable, "-c", _DOWNLOAD_CLIENT, f"{link.url}/big.bin"])[0] for _ in range(repeats)]
    rates = [_mb(r["bytes"], r["seconds"]) for r in runs]
    return {
        "what": "one 1-stream download of big.bin through the link, client on the far side",
        "nominal_mb_s": round(link.nominal_bytes_per_s / 1e6, 3),
        "file_bytes": runs[0]["bytes"],
        "runs_mb_s": [round(r, 3) for r in rates],
        "mb_s": round(statistics.median(rates), 3),
        # The fallback proxy's shaping, as it saw it: seconds it held the downloads back.
        **({"bucket_held_s": round(link.bucket.held_s, 3)} if link.bucket is not None else {}),
    }


def measure_listing(link: Link, url: str, cache_dir: Path, workers: int) -> dict[str, Any]:
    data, _ = link.run_json([sys.executable, "-c", _LIST_CLIENT, url, str(cache_dir), str(workers)])
    shutil.rmtree(cache_dir, ignore_errors=True)
    return {"what": "dry run: list + HEAD every item (for reference)", "workers": workers,
            "seconds": round(data["seconds"], 3), "items": data["items"]}


def measure_cold(link: Link, url: str, work: Path, args: argparse.Namespace, link_mb_s: float) -> tuple[list[dict[str, Any]], Path]:
    """Stages into a fresh cache per run; keeps the last cache for the warm and disk measurements."""
    results, kept = [], work / "cache-cold-last"
    for workers in args.workers:
        runs = []
        for rep in range(args.repeats):
            cache = work / f"cache-w{workers}-r{rep}"
            cmd = [sys.executable, "-m", "fastload", "cache", f"{url}/", "--json", "--no-progress",
                   "--cache-dir", str(cache), "--max-requests", str(workers)]
            report, wall = link.run_json(cmd)
            runs.append({
                "seconds": round(report["seconds"], 4),
                "wall_s": round(wall, 4),
                "fetched_bytes": report["fetched_bytes"],
                "mb_s": round(_mb(report["fetched_bytes"], report["seconds"]), 3),
                "wall_mb_s": round(_mb(report["fetched_bytes"], wall), 3),
                "stored_bytes": report["stored_bytes"],
                "ratio": report["ratio"],
                "items": report["items"],
            })
            shutil.rmtree(kept, ignore_errors=True)
            cache.rename(kept)
            _log(f"cold  workers={workers:<3} run {rep + 1}: {runs[-1]['mb_s']:.2f} MB/s ({runs[-1]['mb_s'] / link_mb_s:.1%} of link)")
        mb_s = statistics.median(r["mb_s"] for r in runs)
        results.append({
            "workers": workers,
            "mb_s": round(mb_s, 3),
            "pct_of_link": round(100 * mb_s / link_mb_s, 1),
            "wall_mb_s": round(statistics.median(r["wall_mb_s"] for r in runs), 3),
            "command": shlex.join(["fastload", *cmd[3:]]).replace(str(work), "$WORK"),
            "runs": runs,
        })
    return results, kept


def _payload_files(cache_dir: Path) -> list[Path]:
    data = cache_dir / "data" if (cache_dir / "data").is_dir() else cache_dir
    return sorted(p for p in data.rglob("*") if p.is_file() and "index" not in p.relative_to(cache_dir).parts)


def _evict(paths: list[Path], drop_caches: bool) -> str:
    """Drops ``paths`` from the page cache; returns how."""
    os.sync()  # dirty pages cannot be dropped
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    how = "posix_fadvise(POSIX_FADV_DONTNEED) per file after sync"
    if drop_caches and os.geteuid() == 0:
        try:
            Path("/proc/sys/vm/drop_caches").write_text("1\n")
            how += ", then echo 1 > /proc/sys/vm/drop_caches"
        except OSError as err:
            how += f" (drop_caches refused: {err})"
    return how


def _resident_fraction(paths: list[Path]) -> float | None:
    """Share of ``paths``' bytes in the page cache (util-linux fincore), or None without it."""
    if shutil.which("fincore") is None or not paths:
        return None
    sample = paths[:: max(1, len(paths) // 64)]
    done = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES,SIZE", *map(str, sample)],
                          capture_output=True, text=True, timeout=60)
    pairs = [line.split() for line in done.stdout.splitlines() if len(line.split()) == 2]
    size = sum(int(s) for _, s in pairs)
    return round(sum(int(r) for r, _ in pairs) / size, 4) if size else None


def _index_files(cache_dir: Path) -> list[Path]:
    return [p for p in cache_dir.rglob("*") if p.is_file() and "index" in p.relative_to(cache_dir).parts]


def _warm_pass(cache_dir: Path, url: str, threads: int, epochs: int, warmup: bool = True) -> dict[str, Any]:
    """Reads every item ``epochs`` times with one Reader, as a training job's later epochs would.

    Each thread reads its own contiguous share, as loader workers would (one
    future per item would measure the executor more than the cache). The
    untimed warm-up epoch opens each thread's SQLite connection first.
    """
    reader = Reader(Settings(cache_dir=cache_dir))
    items = reader.list(f"{url}/")  # the manifest: no remote request
    shares = [items[len(items) * k // threads : len(items) * (k + 1) // threads] for k in range(threads)]

    def read_share(share: list[Any]) -> int:
        return sum(len(reader.read(item.url)) for item in share)

    with ThreadPoolExecutor(threads) as pool:
        if warmup:
            sum(pool.map(read_share, shares))
        t0 = time.perf_counter()
        nbytes = sum(sum(pool.map(read_share, shares)) for _ in range(epochs))
        seconds = time.perf_counter() - t0
    reader.cache.close()
    return {"bytes": nbytes // epochs, "items": len(items), "seconds": seconds / epochs, "remote_requests": reader.misses}


def measure_warm(cache_dir: Path, url: str, args: argparse.Namespace, expect_bytes: int) -> dict[str, Any]:
    out: dict[str, Any] = {"what": f"Reader.read of every item via the manifest, after the server has stopped; "
                           f"{args.epochs} epoch(s) per pass after an untimed one"}
    threads = max(2, min(8, os.cpu_count() or 2))
    for key, n in (("threads_1", 1), (f"threads_{threads}", threads)):
        passes = [_warm_pass(cache_dir, url, n, args.epochs) for _ in range(args.repeats)]
        bad = [p for p in passes if p["remote_requests"] or p["bytes"] != expect_bytes]
        if bad:
            raise RuntimeError(f"warm pass read {bad[0]['bytes']} B (expected {expect_bytes}) with {bad[0]['remote_requests']} remote requests")
        rates = [_mb(p["bytes"], p["seconds"]) for p in passes]
        mb_s = statistics.median(rates)
        out[key] = {"threads": n, "mb_s": round(mb_s, 2), "items_per_s": round(passes[0]["items"] * mb_s * 1e6 / expect_bytes),
                    "runs_mb_s": [round(r, 2) for r in rates], "remote_requests": 0}
    files = _payload_files(cache_dir) + _index_files(cache_dir)
    how = _evict(files, args.drop_caches)
    resident = _resident_fraction(_payload_files(cache_dir))
    cold = _warm_pass(cache_dir, url, 1, 1, warmup=False)
    out["threads_1_page_cache_cold"] = {"threads": 1, "mb_s": round(_mb(cold["bytes"], cold["seconds"]), 2),
                                        "eviction": how + " (payloads and index)", "resident_after_eviction": resident}
    return out


def _read_all(paths: list[Path], buf: memoryview) -> int:
    total = 0
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total


def _count_entries(cache_dir: Path) -> int:
    cache = Cache(Settings(cache_dir=cache_dir))
    try:
        return sum(1 for _ in cache.entries())
    finally:
        cache.close()


def measure_disk(cache_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    paths = _payload_files(cache_dir)
    buf = memoryview(bytearray(16 * 1024**2))
    _read_all(paths, buf)
    hot = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        nbytes = _read_all(paths, buf)
        hot.append(_mb(nbytes, time.perf_counter() - t0))
    cold, how, resident = [], "", None
    for _ in range(args.repeats):
        how = _evict(paths, args.drop_caches)
        resident = _resident_fraction(paths)
        t0 = time.perf_counter()
        _read_all(paths, buf)
        cold.append(_mb(nbytes, time.perf_counter() - t0))
    return {
        "what": "the cache's payload files and packs read raw (open + readinto, 1 thread), no decoding or checks",
        "files": len(paths),
        "payloads": _count_entries(cache_dir),
        "bytes": nbytes,
        "page_cache_hot_mb_s": round(statistics.median(hot), 1),
        "page_cache_cold_mb_s": round(statistics.median(cold), 1),
        "cold_runs_mb_s": [round(r, 1) for r in cold],
        "eviction": how,
        "resident_after_eviction": resident,
    }


def _rate(fn: Callable[[], object], nbytes: int, min_s: float) -> float:
    """Bytes/s of ``fn`` (which handles ``nbytes``): median of 3 rounds of at least ``min_s`` each."""
    rates = []
    for _ in range(3):
        reps, t0 = 0, time.perf_counter()
        while True:
            fn()
            reps += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= min_s:
                break
        rates.append(nbytes * reps / elapsed)
    return statistics.median(rates)


def _codec_speeds(payloads: list[bytes], raws: list[bytes], settings: Settings, min_s: float) -> dict[str, float]:
    """Single-thread GB/s (of raw bytes) of codec.decode, with and without the checksum, and of codec.encode."""
    raw_bytes = sum(map(len, raws))

    def decode_all(verify: bool) -> None:
        for payload in payloads:
            codec.decode(payload, verify=verify)

    def encode_all() -> None:
        for raw in raws:
            codec.encode(raw, chunk_bytes=settings.chunk_bytes, level=settings.lz4_level, min_saving=settings.min_saving)

    return {
        "decode_gb_s": round(_rate(lambda: decode_all(True), raw_bytes, min_s) / 1e9, 3),
        "decode_no_verify_gb_s": round(_rate(lambda: decode_all(False), raw_bytes, min_s) / 1e9, 3),
        "encode_gb_s": round(_rate(encode_all, raw_bytes, min_s) / 1e9, 3),
    }


def measure_codec(args: argparse.Namespace, work: Path, images: Path) -> dict[str, Any]:
    kinds = {
        "jpeg": (images, "JPEG photos (the staged dataset)"),
        "uint8": (work / "codec" / "uint8", f"uint8 pixel arrays, {args.uint8_arrays} x 224x224x3 .npy (make_uint8_arrays)"),
        "int32_tokens": (work / "codec" / "tokens", f"int32 token ids, {args.tokens} tokens, Zipf (make_token_file)"),
    }
    make_uint8_arrays(kinds["uint8"][0], args.uint8_arrays)
    make_token_file(kinds["int32_tokens"][0] / "tokens.int32", args.tokens, dtype="int32")
    out: dict[str, Any] = {}
    for name, (src, what) in kinds.items():
        settings = Settings(cache_dir=work / f"cache-codec-{name}")
        report = fastload.stage(str(src), settings=settings, progress=False)
        cache = Cache(settings)  # each stored payload, whether a file of its own or in a pack
        payloads = [p for p in (cache.read_payload(e.key) for e in cache.entries()) if p is not None]
        cache.close()
        infos = [codec.parse_header(p) for p in payloads]
        raw_bytes = sum(i.raw_size for i in infos)
        stored = sum(map(len, payloads))
        raws = [codec.decode(p) for p in payloads]
        mix: dict[str, int] = {}
        for info in infos:
            mix[info.codec_name] = mix.get(info.codec_name, 0) + 1

        out[name] = {
            "what": what,
            "payloads": len(payloads),
            "codecs": mix,
            "raw_bytes": raw_bytes,
            "stored_bytes": stored,
            "ratio": round(raw_bytes / stored, 3),
            "stage_report_ratio": round(report.ratio, 3),
            **_codec_speeds(payloads, raws, settings, args.min_time_s),
        }
        shutil.rmtree(settings.cache_dir, ignore_errors=True)
    return out


# -- machine ------------------------------------------------------------------------


def _cmd_text(cmd: list[str]) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return (done.stdout + done.stderr).strip()


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine_info(work: Path) -> dict[str, Any]:
    lscpu = dict(
        (k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in _cmd_text(["lscpu"]).splitlines()) if v
    )
    meminfo = Path("/proc/meminfo").read_text() if Path("/proc/meminfo").exists() else ""
    mem = re.search(r"MemTotal:\s+(\d+) kB", meminfo)
    os_release = Path("/etc/os-release").read_text() if Path("/etc/os-release").exists() else ""
    pretty = re.search(r'PRETTY_NAME="?([^"\n]+)', os_release)
    nginx = _servers.find_nginx()
    git = _cmd_text(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"])
    dirty = _cmd_text(["git", "-C", str(HERE), "status", "--porcelain", "--", ":/fastload"])
    return {
        "cpu_model": lscpu.get("Model name") or platform.processor(),
        "cpus": os.cpu_count(),
        "cores_per_socket": lscpu.get("Core(s) per socket"),
        "hypervisor": lscpu.get("Hypervisor vendor"),
        "ram_gib": round(int(mem.group(1)) / 1024**2, 1) if mem else None,
        "kernel": platform.release(),
        "os": pretty.group(1) if pretty else platform.platform(),
        "python": platform.python_version(),
        "fastload": f"{fastload.__version__} (git {git or '?'}{', fastload/ modified' if dirty else ''})",
        "nginx": _cmd_text([nginx, "-v"]).replace("nginx version: ", "") if nginx else None,
        "lz4": _version("lz4"),
        "fsspec": _version("fsspec"),
        "aiohttp": _version("aiohttp"),
        "work_fs": _cmd_text(["findmnt", "-n", "-o", "SOURCE,FSTYPE", "-T", str(work)]) or None,
        "loadavg_at_start": " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else None,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
    }


# -- report -------------------------------------------------------------------------


def evaluate(res: dict[str, Any]) -> dict[str, Any]:
    best = max(res["cold"], key=lambda c: c["mb_s"])
    cold_share = best["mb_s"] / res["link"]["mb_s"]
    warm_ratio = res["warm"]["threads_1"]["mb_s"] / best["mb_s"]
    return {
        "cold_vs_link": {"target": COLD_TARGET, "value": round(cold_share, 3), "workers": best["workers"], "pass": cold_share >= COLD_TARGET},
        "warm_vs_cold": {"target": WARM_TARGET, "value": round(warm_ratio, 1), "pass": warm_ratio >= WARM_TARGET,
                         "note": "1-thread warm MB/s over the best cold MB/s"},
    }


def _row(label: str, mb_s: float, note: str = "") -> str:
    return f"{label:<48}{mb_s:>10.2f}  {note:>16}".rstrip()


def table(res: dict[str, Any]) -> str:
    link, ds, warm, disk, t = res["link"], res["dataset"], res["warm"], res["disk"], res["targets"]
    ok = {True: "ok", False: "MISSED"}
    rows = [
        f"link: {link['mode']}" + ("  ** FALLBACK, not kernel shaping **" if link["mode"] != "netns-tbf" else ""),
        f"dataset: {ds['items']} JPEGs, avg {ds['avg_item_bytes'] / 1e3:.1f} KB, {ds['bytes'] / 1e6:.1f} MB",
        "",
        f"{'measurement':<48}{'MB/s':>10}  {'vs':>16}",
        _row(f"link limit (1 stream, {link['file_bytes'] / 1e6:.0f} MB file)", link["mb_s"], f"nominal {link['nominal_mb_s']:.2f}"),
    ]
    best = max(c["mb_s"] for c in res["cold"])
    for c in res["cold"]:
        rows.append(_row(f"cold staging, --workers {c['workers']}", c["mb_s"], f"{c['pct_of_link']:.1f}% of link"))
    w1 = warm["threads_1"]
    wn = next(v for k, v in warm.items() if k.startswith("threads_") and k != "threads_1" and "cold" not in k)
    rows += [
        _row("warm reads, Reader.read, 1 thread", w1["mb_s"], f"{w1['mb_s'] / best:.1f}x cold"),
        _row(f"warm reads, {wn['threads']} threads", wn["mb_s"], f"{wn['mb_s'] / best:.1f}x cold"),
        _row("warm reads, 1 thread, page cache cold", warm["threads_1_page_cache_cold"]["mb_s"]),
        _row("disk ceiling, raw payload read, page cache hot", disk["page_cache_hot_mb_s"]),
        _row("disk ceiling, raw payload read, page cache cold", disk["page_cache_cold_mb_s"]),
        "",
        f"{'codec':<14}{'stored as':<16}{'ratio':>7}{'decode GB/s':>13}{'no verify':>11}{'encode GB/s':>13}",
    ]
    for name, c in res["codec"].items():
        mix = ",".join(f"{k}:{v}" for k, v in sorted(c["codecs"].items()))
        rows.append(f"{name:<14}{mix:<16}{c['ratio']:>7.3f}{c['decode_gb_s']:>13.2f}{c['decode_no_verify_gb_s']:>11.2f}{c['encode_gb_s']:>13.2f}")
    rows += [
        "",
        f"target cold >= {COLD_TARGET:.0%} of link: {t['cold_vs_link']['value']:.1%} (workers {t['cold_vs_link']['workers']}) "
        f"{ok[t['cold_vs_link']['pass']]}",
        f"target warm >= {WARM_TARGET:.0f}x cold: {t['warm_vs_cold']['value']:.1f}x {ok[t['warm_vs_cold']['pass']]}",
    ]
    return "\n".join(rows)


def markdown(res: dict[str, Any]) -> str:
    m, link = res["machine"], res["link"]
    lines = [
        "# Cache benchmark results",
        "",
        f"Command: `{res['command']}` (wall time {res['wall_s']:.0f} s, {res['machine']['date_utc']}).",
        "",
        f"Link: **{link['mode']}**: {link['description']}.",
        "",
        "```",
        table(res),
        "```",
        "",
        "Notes:",
        "- MB/s are 10^6 bytes/s. Cold MB/s = fetched bytes / the `seconds` that `fastload cache --json` reports "
        "(listing, HEADs, fetches, writes; not interpreter start-up; `wall_mb_s` in results.json includes it). "
        f"Each value is the median of {res['repeats']} run(s).",
        f"- Listing alone (dry run: list + HEAD of every item, {res['listing']['workers']} workers) took "
        f"{res['listing']['seconds']:.2f} s for {res['listing']['items']} items.",
        "- Warm reads run after the server and the namespace are gone; every pass checks that it read all "
        "bytes with zero remote requests. The threaded pass shares one Reader.",
        f"- Page cache eviction: {res['disk']['eviction']}; resident share afterwards (fincore): "
        f"{res['disk']['resident_after_eviction']}. On a VM the host may still cache the disk.",
        "- Codec: ratio = raw bytes / stored payload bytes (headers included); decode = `codec.decode` of every "
        "payload, one thread, with (default) and without the xxh3 check; JPEG is stored raw, so its 'decode' is a copy plus checksum.",
        f"- The machine may be shared: load average at the start was {res['machine']['loadavg_at_start']} on "
        f"{res['machine']['cpus']} CPUs. Compare ratios within one run, not absolute numbers across runs.",
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in m.items()),
        "",
    ]
    return "\n".join(lines)


# -- main ---------------------------------------------------------------------------


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    t_start = time.perf_counter()
    _log(f"work folder {work}; generating {args.images} JPEGs")
    dataset = make_dataset(args, work)
    res: dict[str, Any] = {"benchmark": "cache", "quick": args.quick, "repeats": args.repeats,
                           "command": shlex.join(["python", "benchmarks/cache/bench.py", *args.argv])}
    res["machine"] = machine_info(work)
    res["dataset"] = {k: v for k, v in dataset.items() if k != "root"}
    with open_link(args, dataset["root"]) as link:
        url = f"{link.url}/train"
        res["link"] = {"mode": link.mode, "description": link.description, "fallback_reason": link.fallback_reason,
                       **measure_link(link, args.repeats)}
        _log(f"link limit {res['link']['mb_s']:.2f} MB/s ({link.mode})")
        res["listing"] = measure_listing(link, f"{url}/", work / "cache-list", 16)
        res["cold"], cache_dir = measure_cold(link, url, work, args, res["link"]["mb_s"])
    # The server is gone (and was never reachable from here when shaped): warm reads use the cache only.
    _log("warm reads")
    res["warm"] = measure_warm(cache_dir, url, args, dataset["bytes"])
    _log("disk ceiling")
    res["disk"] = measure_disk(cache_dir, args)
    _log("codec")
    res["codec"] = measure_codec(args, work, dataset["root"] / "train")
    res["targets"] = evaluate(res)
    res["wall_s"] = round(time.perf_counter() - t_start, 1)
    return res


def main(args: argparse.Namespace) -> int:
    """Runs the benchmark; prints JSON on stdout and a table on stderr; writes results to ``args.out``."""
    work = Path(tempfile.mkdtemp(prefix="fastload-bench-cache-", dir=args.work_dir))
    previous = None
    if threading.current_thread() is threading.main_thread():
        # SIGTERM unwinds like an exception, so the namespace and nginx are still removed.
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        res = run(args, work)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if args.keep:
            _log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(table(res), file=sys.stderr)
    print(json.dumps(res, indent=2))
    out = args.out if args.out is not None else (None if args.quick else DEFAULT_OUT)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(res, indent=2) + "\n")
        (out / "results.md").write_text(markdown(res))
        _log(f"wrote {out / 'results.json'} and {out / 'results.md'}")
    missed = [k for k, v in res["targets"].items() if not v["pass"]]
    return 1 if (args.strict and missed) else 0


if __name__ == "__main__":
    sys.exit(main(parse_args()))
