"""Cold epochs over s3:// from a key list, side by side in one run, on a shaped link.

The S3 endpoint is nginx serving ``/<bucket>/<key>`` path-style (GET with Range,
ETag) inside a network namespace whose loopback carries ``tc tbf`` (1 Gbit by
default); with ``--delay-ms`` a per-request latency proxy
(benchmarks/peers/servers.py) adds a time to first byte, as S3's (~20 ms). nginx
checks no signature, so it stands for S3's transfer, not its authentication
(tests/integration/test_s3_signed.py checks the signatures against moto). Its
access log counts the requests each client sent. moto's own server cannot carry
1 Gbit of small objects on 2 cores, which is why nginx stands in.

Clients, each a fresh process inside the namespace, each reading every object once:

* ``fastload_s3``: ``fastload.FileDataset([s3://...])`` + ``fastload.DataLoader``, defaults
  (first blocks signed on libcurl, fastload.source.s3);
* ``fastload_s3_listed``: ``fastload.FileDataset("s3://bench/train/")``: listed first (ListObjectsV2
  pages that nginx answers from files), then read; the listing is reported as setup;
* ``fastload_s3fs``: the same through s3fs (``FASTLOAD_HTTP_CLIENT=aiohttp``: the road before);
* ``fastload_http``: the same objects as http:// URLs (the HTTP road, for reference);
* ``engine``: fastload's client alone: libcurl's engine with the requests signed as
  fastload.source.s3 signs them, every object's first-block GET handed over at once, the
  host limit's adaptive number in flight, no cache: the row to weigh against obstore's;
* ``obstore``: obstore's ``get_async`` (Rust, object_store), 32 in flight, no cache: the
  library the client choice was weighed against (``--peers-python``, needs obstore);
* ``s3torchconnector``: AWS's ``S3MapDataset.from_objects`` + torch DataLoader with 2 workers,
  no cache (``--peers-python``, needs s3torchconnector).

Each row: seconds, MB/s, share of the link (one large GET through the same link
in the same run), CPU seconds per object (the client process and its children,
setup excluded), and requests per object from nginx's log.

Run as root: ``python benchmarks/s3/bench.py [--objects 2000 --kb 110 --rate 1gbit --delay-ms 0,20]
[--peers-python /path/to/python] [--out benchmarks/s3/results/results.json]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from fastload import _servers  # noqa: E402

BUCKET = "bench"
SERVERS_PY = ROOT / "benchmarks" / "peers" / "servers.py"

# Each client prints {"seconds", "cpu_s", "bytes", "n"}: the epoch only, its setup excluded.
_FASTLOAD = r"""
import json, os, resource, sys, time
import fastload
from fastload.config import Settings
endpoint, what, cache = sys.argv[1], sys.argv[2], sys.argv[3]
urls = what if what.startswith("s3://") else open(what).read().split()  # a prefix to list, or a key list
options = {"key": "bench", "secret": "bench", "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
def cpu():
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime
c_setup, t_setup = cpu(), time.perf_counter()
ds = fastload.FileDataset(urls, storage_options=options if what.startswith("s3") or urls[0].startswith("s3") else None,
                          settings=Settings.from_env(cache_dir=cache))  # FASTLOAD_HTTP_CLIENT read here
c0, t0 = cpu(), time.perf_counter()
n = 0
for batch in fastload.DataLoader(ds, batch_size=64):
    n += sum(len(d) for d in batch["data"])
print(json.dumps({"seconds": time.perf_counter() - t0, "cpu_s": cpu() - c0, "bytes": n, "n": len(ds),
                  "setup_s": t0 - t_setup, "setup_cpu_s": c0 - c_setup}))
"""

_OBSTORE = r"""
import asyncio, json, resource, sys, time
import obstore
from obstore.store import S3Store
endpoint, urls_file = sys.argv[1], sys.argv[2]
keys = [u.split("/", 3)[3] for u in open(urls_file).read().split()]
store = S3Store("bench", endpoint=endpoint, access_key_id="bench", secret_access_key="bench", region="us-east-1",
                client_options={"allow_http": True})
def cpu():
    s = resource.getrusage(resource.RUSAGE_SELF)
    return s.ru_utime + s.ru_stime
async def main():
    gate = asyncio.Semaphore(32)
    async def one(key):
        async with gate:
            r = await obstore.get_async(store, key, options={"range": (0, 1 << 20)})
            return len(await r.bytes_async())
    return sum(await asyncio.gather(*(one(k) for k in keys)))
c0, t0 = cpu(), time.perf_counter()
n = asyncio.run(main())
print(json.dumps({"seconds": time.perf_counter() - t0, "cpu_s": cpu() - c0, "bytes": n, "n": len(keys)}))
"""

# fastload's client alone (libcurl's engine, signed by fastload.source.s3), as obstore's row: every
# object's first-block GET handed over at once, its answer read (size, version, bytes); no cache.
_ENGINE = r"""
import json, resource, sys, time
from fastload.transport import curl
from fastload.transport.hostlimit import limit_for
from fastload.source import s3
endpoint, urls_file = sys.argv[1], sys.argv[2]
urls = open(urls_file).read().split()
options = {"key": "bench", "secret": "bench", "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
route, why = s3.route_for(urls[0], options, "auto")
assert route is not None, why
limit = limit_for(endpoint, 32)
def cpu():
    s = resource.getrusage(resource.RUSAGE_SELF)
    return s.ru_utime + s.ru_stime
import threading
stop = threading.Event()
c0, t0 = cpu(), time.perf_counter()
pending = route.start(urls, 1 << 20, 60.0, limit, stop)
curl.settle(pending, stop, 600.0)
n = sum(len(p.result(0)[1]) for p in pending)
print(json.dumps({"seconds": time.perf_counter() - t0, "cpu_s": cpu() - c0, "bytes": n, "n": len(urls)}))
"""

_S3TC = r"""
import json, os, resource, sys, time
import torch
from s3torchconnector import S3ClientConfig, S3MapDataset
endpoint, urls_file = sys.argv[1], sys.argv[2]
urls = open(urls_file).read().split()
os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench")
ds = S3MapDataset.from_objects(urls, region="us-east-1", endpoint=endpoint,
                               s3client_config=S3ClientConfig(force_path_style=True), transform=lambda o: o.read())
def cpu():
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime
c0, t0 = cpu(), time.perf_counter()
n = 0
for batch in torch.utils.data.DataLoader(ds, batch_size=64, num_workers=2, collate_fn=list):
    n += sum(len(d) for d in batch)
print(json.dumps({"seconds": time.perf_counter() - t0, "cpu_s": cpu() - c0, "bytes": n, "n": len(urls)}))
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--objects", type=int, default=2000, help="objects in the dataset")
    p.add_argument("--kb", type=int, default=110, help="size of each object in KB")
    p.add_argument("--rate", default="1gbit", help="link rate in tc units")
    p.add_argument("--delay-ms", default="0,20", help="comma-separated times to first byte (a run per value)")
    p.add_argument("--clients", default="fastload_s3,fastload_s3_listed,fastload_s3fs,fastload_http,engine,obstore,"
                                        "s3torchconnector")
    p.add_argument("--peers-python", default="", help="an interpreter with obstore, s3torchconnector and torch")
    p.add_argument("--no-shaping", action="store_true", help="plain loopback, no namespace")
    p.add_argument("--timeout-s", type=float, default=300, help="limit per client run")
    p.add_argument("--out", type=Path, help="also write the JSON to this file")
    args = p.parse_args(argv)
    args.delays = [float(d) for d in args.delay_ms.split(",") if d]
    args.clients = [c for c in args.clients.split(",") if c]
    return args


def _make_data(root: Path, n: int, kb: int) -> list[str]:
    folder = root / BUCKET / "train"
    folder.mkdir(parents=True)
    keys = []
    for i in range(n):
        (folder / f"{i:06d}.jpg").write_bytes(os.urandom(kb * 1000))  # incompressible, as JPEG
        keys.append(f"train/{i:06d}.jpg")
    (root / "big.bin").write_bytes(os.urandom(64 << 20))
    # ListObjectsV2 answers of "train/", 1000 keys a page, as files (_LISTING routes the queries to them).
    pages = [keys[i:i + 1000] for i in range(0, len(keys), 1000)]
    for k, page in enumerate(pages):
        more = k + 1 < len(pages)
        body = "".join(f"<Contents><Key>{key}</Key><Size>{kb * 1000}</Size><ETag>&quot;{_etag(folder.parent / key)}"
                       f"&quot;</ETag></Contents>" for key in page)
        (root / f"list-{k}.xml").write_text(
            f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"<Name>{BUCKET}</Name><Prefix>train/</Prefix><KeyCount>{len(page)}</KeyCount><MaxKeys>1000</MaxKeys>"
            f"<Delimiter>/</Delimiter><IsTruncated>{'true' if more else 'false'}</IsTruncated>"
            + (f"<NextContinuationToken>page{k + 1}</NextContinuationToken>" if more else "") + body + "</ListBucketResult>")
    return keys


def _etag(path: Path) -> str:
    st = path.stat()  # nginx's own ETag: mtime and size in hex; each GET's is compared with the listed one
    return f"{int(st.st_mtime):x}-{st.st_size:x}"


# nginx answers a ListObjectsV2 of the bucket from the files _make_data wrote.
_LISTING = """
        location = /bench {
            types { } default_type application/xml;
            set $page /list-0.xml;
            if ($args ~ "continuation-token=page([0-9]+)") { set $page /list-$1.xml; }
            rewrite ^ $page break;
        }
"""


@contextlib.contextmanager
def _link(args: argparse.Namespace, www: Path, delay_ms: float) -> Iterator[tuple[list[str], str, Path, str]]:
    with contextlib.ExitStack() as stack:
        prefix: list[str] = []
        netns = None
        how = "host loopback, NOT shaped"
        if not args.no_shaping:
            reason = _servers.shaping_unavailable_reason()
            if reason is None:
                link = stack.enter_context(_servers.ShapedLink(rate=args.rate, burst="1mb", latency="100ms"))
                prefix, netns = link.exec_prefix, link.name
                how = f"network namespace, loopback tbf rate {args.rate} burst 1mb"
            else:
                how = f"host loopback, NOT shaped ({reason})"
        nginx = stack.enter_context(_servers.NginxServer(www, netns=netns, unix_socket=True, locations=_LISTING))
        endpoint = nginx.url
        if delay_ms:
            proc = subprocess.Popen([*prefix, sys.executable, str(SERVERS_PY), "proxy", "--upstream",
                                     f"unix:{nginx.unix_socket_path}", "--delay-ms", str(delay_ms)],
                                    stdout=subprocess.PIPE, text=True, start_new_session=True)
            stack.callback(lambda: (proc.terminate(), proc.wait(15)))
            line = proc.stdout.readline() if proc.stdout else ""
            endpoint = f"http://127.0.0.1:{json.loads(line)['port']}"
            how += f"; a latency proxy adds {delay_ms:g} ms before each request"
        yield prefix, endpoint, Path(str(nginx.workdir)) / "access.log", how


def _run(prefix: list[str], python: str, code: str, argv: list[str], env: dict[str, str], timeout_s: float,
         log: Path, keys_prefix: str) -> dict[str, Any]:
    before = _count(log, keys_prefix)
    try:
        done = subprocess.run([*prefix, python, "-c", code, *argv], capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, **env})
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout_s:g} s"}
    if done.returncode != 0:
        return {"error": " | ".join(done.stderr.strip().splitlines()[-3:]) or f"exit {done.returncode}"}
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["requests"] = _count(log, keys_prefix) - before
    return out


def _count(log: Path, keys_prefix: str) -> int:
    return sum(f" {keys_prefix}" in line for line in log.read_text(errors="replace").splitlines()) if log.exists() else 0


def main(args: argparse.Namespace) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    links: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="fastload-s3-bench-") as tmp:
        work = Path(tmp)
        www = work / "www"
        keys = _make_data(www, args.objects, args.kb)
        for delay in args.delays:
            with _link(args, www, delay) as (prefix, endpoint, log, how):
                link = subprocess.run([*prefix, "curl", "-s", "-o", "/dev/null", "-w", "%{speed_download}",
                                       f"{endpoint}/big.bin"], capture_output=True, text=True, timeout=120)
                link_mb_s = float(link.stdout or 0) / 1e6
                links.append({"delay_ms": delay, "link_mb_s": round(link_mb_s, 1), "how": how})
                s3_urls, http_urls = work / "s3.txt", work / "http.txt"
                s3_urls.write_text("\n".join(f"s3://{BUCKET}/{k}" for k in keys))
                http_urls.write_text("\n".join(f"{endpoint}/{BUCKET}/{k}" for k in keys))
                plan = {
                    "fastload_s3": (sys.executable, _FASTLOAD, [str(s3_urls)], {}),
                    "fastload_s3_listed": (sys.executable, _FASTLOAD, [f"s3://{BUCKET}/train/"], {}),
                    "fastload_s3fs": (sys.executable, _FASTLOAD, [str(s3_urls)], {"FASTLOAD_HTTP_CLIENT": "aiohttp"}),
                    "fastload_http": (sys.executable, _FASTLOAD, [str(http_urls)], {}),
                    "engine": (sys.executable, _ENGINE, [str(s3_urls)], {}),
                    "obstore": (args.peers_python, _OBSTORE, [str(s3_urls)], {}),
                    "s3torchconnector": (args.peers_python, _S3TC, [str(s3_urls)], {}),
                }
                for k, name in enumerate(args.clients):
                    python, code, extra, env = plan[name]
                    if not python:
                        rows.append({"client": name, "delay_ms": delay, "error": "not run: no --peers-python"})
                        continue
                    cache = work / f"cache-{delay:g}-{k}"
                    res = _run(prefix, python, code, [endpoint, *extra, str(cache)], env, args.timeout_s, log,
                               f"/{BUCKET}/train/")
                    row: dict[str, Any] = {"client": name, "delay_ms": delay, **res}
                    if "error" not in res:
                        mb_s = res["bytes"] / res["seconds"] / 1e6
                        with_setup = res["bytes"] / (res["seconds"] + res.get("setup_s", 0)) / 1e6
                        row.update(mb_s=round(mb_s, 1), of_link=round(mb_s / link_mb_s, 3) if link_mb_s else None,
                                   of_link_with_setup=round(with_setup / link_mb_s, 3) if link_mb_s else None,
                                   cpu_ms_per_object=round(1000 * res["cpu_s"] / res["n"], 3),
                                   requests_per_object=round(res["requests"] / res["n"], 3))
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
    report = {"objects": args.objects, "kb": args.kb, "rate": args.rate, "links": links, "rows": rows,
              "machine": f"{os.cpu_count()} cores, {os.uname().sysname} {os.uname().release}"}
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main(parse_args())
