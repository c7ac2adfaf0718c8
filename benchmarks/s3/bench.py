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
and scheme in the same run, best of two), the same with the setup counted, and against
the tc rate itself (``of_rate_with_setup``: the one large GET is slowed too on a busy
machine), CPU seconds per object (the client process and its children, setup excluded),
and requests per object from nginx's log.

Schemes (``--schemes http,https``): every client runs over http:// and over https://.
For https:// a private CA is made (benchmarks/peers/tls.py, as tests/integration/_tls.py
makes one) and nginx listens with ``ssl`` on a second port, serving the same layout; with
a delay, nginx's TLS front passes each request to the same latency proxy (on a Unix
socket), which forwards to nginx's plain socket. Over https:// each client is told the CA
the way it takes one: fastload and obstore by ``SSL_CERT_FILE``, s3fs by
``client_kwargs={"verify": ca}``, s3torchconnector by ``SSL_CERT_FILE`` (AWS's CRT does not
read ``AWS_CA_BUNDLE``).

``--done-when``: issue 34's rows instead of the clients. 5,000 keys of 110 KB by default,
``fastload.FileDataset(key list)`` + ``fastload.DataLoader`` defaults, one cold epoch, the
dataset's set-up counted in the time and the CPU (fastload's own lazy imports in it; torch's
import not: a training script has it already, and it is reported apart, ``torch_import_s``); every byte checked
against the CRC32 it was written with (the check's own CPU subtracted); ``--batch-size N``
replaces the DataLoader's default batch_size (1) to show what the per-sample loop costs.
Configurations (``--configs`` picks some):

* ``http_options``: http://, endpoint in ``client_kwargs`` (the baseline);
* ``https_ssl_cert_file``: https://, the CA named by ``SSL_CERT_FILE``;
* ``https_verify``: https://, ``client_kwargs={"verify": ca}``;
* ``https_aws_ca_bundle``: https://, ``AWS_CA_BUNDLE=ca``;
* ``http_env_endpoint``: http://, the endpoint only in ``AWS_ENDPOINT_URL``.

Each client runs with no AWS_*, SSL_CERT_FILE, REQUESTS_CA_BUNDLE or CURL_CA_BUNDLE of
the caller's environment: only what its row sets.

Run as root: ``python benchmarks/s3/bench.py [--objects 2000 --kb 110 --rate 1gbit --delay-ms 0,20]
[--schemes http,https] [--peers-python /path/to/python] [--out benchmarks/s3/results/results.json]``;
issue 34's rows: ``python benchmarks/s3/bench.py --done-when --out benchmarks/s3/results/done_when.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import signal
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
TLS_PY = ROOT / "benchmarks" / "peers" / "tls.py"
SCHEMES = ("http", "https")
# Issue 34's done-when rows: (scheme, where the endpoint is given, how the CA is named).
CONFIGS = {
    "http_options": ("http", "options", None),
    "https_ssl_cert_file": ("https", "options", "SSL_CERT_FILE"),
    "https_verify": ("https", "options", "verify"),
    "https_aws_ca_bundle": ("https", "options", "AWS_CA_BUNDLE"),
    "http_env_endpoint": ("http", "env", None),
}
# The caller's settings that would change what a client does: each row sets its own.
_SCRUB = ("SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")


@functools.cache
def _load_tls() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("fastload_bench_tls", TLS_PY)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {TLS_PY}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

# Each client prints {"seconds", "cpu_s", "bytes", "n"}: the epoch only, its setup excluded.
# fastload's also takes a JSON of how it is configured: {"endpoint": "options" | "env", "verify":
# a CA path or None, "check": a file of "key crc32" lines or "", "batch_size": 0 for the
# DataLoader's default}; with "check", every sample's bytes are compared (their CRC's CPU,
# measured on this thread, is taken off cpu_s), and DataLoader defaults are kept (batch_size=1,
# as torch's) unless "batch_size" says otherwise.
_FASTLOAD = r"""
import json, os, resource, sys, time, zlib
import fastload
from fastload.config import Settings
endpoint, what, cache = sys.argv[1], sys.argv[2], sys.argv[3]
how = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
urls = what if what.startswith("s3://") else open(what).read().split()  # a prefix to list, or a key list
client = {"region_name": "us-east-1"}
if how.get("endpoint", "options") == "options":
    client["endpoint_url"] = endpoint
if how.get("verify"):
    client["verify"] = how["verify"]
options = {"key": "bench", "secret": "bench", "client_kwargs": client}
expected = dict(line.split() for line in open(how["check"])) if how.get("check") else None
def cpu():
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime
c_torch, t_torch = cpu(), time.perf_counter()
import torch  # noqa: E402,F401 - a training script imports it before it builds a dataset: not fastload's set-up
torch_s, torch_cpu_s = time.perf_counter() - t_torch, cpu() - c_torch
c_setup, t_setup = cpu(), time.perf_counter()
ds = fastload.FileDataset(urls, storage_options=options if what.startswith("s3") or urls[0].startswith("s3") else None,
                          settings=Settings.from_env(cache_dir=cache))  # FASTLOAD_HTTP_CLIENT read here
c0, t0 = cpu(), time.perf_counter()
n = wrong = seen = 0
check_cpu = 0.0
batch_size = how.get("batch_size", 0 if expected is not None else 64)  # 0: DataLoader's default (1, as torch's)
loader = fastload.DataLoader(ds, batch_size=batch_size) if batch_size else fastload.DataLoader(ds)
for batch in loader:
    n += sum(len(d) for d in batch["data"])
    if expected is not None:
        k0 = time.thread_time()
        for d, url in zip(batch["data"], batch["url"]):
            seen += 1
            wrong += expected.get(url.split("/", 3)[3]) != str(zlib.crc32(bytes(d)))
        check_cpu += time.thread_time() - k0
out = {"seconds": time.perf_counter() - t0, "cpu_s": cpu() - c0 - check_cpu, "bytes": n, "n": len(ds),
       "setup_s": t0 - t_setup, "setup_cpu_s": c0 - c_setup, "torch_import_s": torch_s, "torch_import_cpu_s": torch_cpu_s}
if expected is not None:
    out.update(wrong=wrong + len(expected) - seen, check_cpu_s=check_cpu)
print(json.dumps(out))
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
    p.add_argument("--objects", type=int, help="objects in the dataset (default 2000; --done-when 5000)")
    p.add_argument("--kb", type=int, default=110, help="size of each object in KB")
    p.add_argument("--rate", default="1gbit", help="link rate in tc units")
    p.add_argument("--delay-ms", default="0,20", help="comma-separated times to first byte (a run per value)")
    p.add_argument("--schemes", default="http,https", help="http and/or https: each client runs over each")
    p.add_argument("--clients", default="fastload_s3,fastload_s3_listed,fastload_s3fs,fastload_http,engine,obstore,"
                                        "s3torchconnector")
    p.add_argument("--done-when", action="store_true", help="issue 34's configurations instead of --clients")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"with --done-when: some of {','.join(CONFIGS)}")
    p.add_argument("--batch-size", type=int, default=0, help="with --done-when: the DataLoader's batch_size "
                   "(0: its default, 1, as torch's; the issue's rows)")
    p.add_argument("--peers-python", default="", help="an interpreter with obstore, s3torchconnector and torch")
    p.add_argument("--no-shaping", action="store_true", help="plain loopback, no namespace")
    p.add_argument("--timeout-s", type=float, default=300, help="limit per client run")
    p.add_argument("--out", type=Path, help="also write the JSON to this file")
    args = p.parse_args(argv)
    args.delays = [float(d) for d in args.delay_ms.split(",") if d]
    args.clients = [c for c in args.clients.split(",") if c]
    args.schemes = [c for c in args.schemes.split(",") if c]
    args.configs = [c for c in args.configs.split(",") if c]
    if args.objects is None:
        args.objects = 5000 if args.done_when else 2000
    for name in args.configs:
        if name not in CONFIGS:
            p.error(f"--configs: {name!r} is not one of {','.join(CONFIGS)}")
    for scheme in args.schemes:
        if scheme not in SCHEMES:
            p.error(f"--schemes: {scheme!r} is not http or https")
    return args


def _make_data(root: Path, n: int, kb: int) -> list[str]:
    import zlib

    folder = root / BUCKET / "train"
    folder.mkdir(parents=True)
    keys = []
    crcs = []
    for i in range(n):
        body = os.urandom(kb * 1000)  # incompressible, as JPEG
        (folder / f"{i:06d}.jpg").write_bytes(body)
        keys.append(f"train/{i:06d}.jpg")
        crcs.append(f"train/{i:06d}.jpg {zlib.crc32(body)}")
    (root.parent / "crc.txt").write_text("\n".join(crcs) + "\n")  # outside the served root
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
def _link(args: argparse.Namespace, www: Path, delay_ms: float, tls: tuple[Path, Path, Path] | None,
          work: Path) -> Iterator[tuple[list[str], dict[str, str], Path, str]]:
    """The shaped link, nginx in it, and the endpoints: {"http": url, "https": url (with ``tls``)}."""
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
        front = work / f"tls-proxy-{delay_ms:g}.sock"  # the TLS front's latency proxy listens here
        if tls is None:
            nginx = stack.enter_context(_servers.NginxServer(www, netns=netns, unix_socket=True, locations=_LISTING))
        else:
            nginx = stack.enter_context(_load_tls().TlsNginx(www, cert=tls[1], key=tls[2], netns=netns, unix_socket=True,
                                                             locations=_LISTING, via_unix=front if delay_ms else None))
        endpoints = {"http": nginx.url}
        if tls is not None:
            endpoints["https"] = nginx.tls_url
            how += "; https: nginx ssl on a second port (TLS 1.3, HTTP/1.1)"
        if delay_ms:
            upstream = f"unix:{nginx.unix_socket_path}"
            proc = subprocess.Popen([*prefix, sys.executable, str(SERVERS_PY), "proxy", "--upstream", upstream,
                                     "--delay-ms", str(delay_ms)], stdout=subprocess.PIPE, text=True, start_new_session=True)
            stack.callback(lambda: (proc.terminate(), proc.wait(15)))
            line = proc.stdout.readline() if proc.stdout else ""
            endpoints["http"] = f"http://127.0.0.1:{json.loads(line)['port']}"
            if tls is not None:
                tproc = subprocess.Popen([*prefix, sys.executable, str(SERVERS_PY), "proxy", "--upstream", upstream,
                                          "--listen-unix", str(front), "--delay-ms", str(delay_ms)],
                                         stdout=subprocess.PIPE, text=True, start_new_session=True)
                stack.callback(lambda: (tproc.terminate(), tproc.wait(15)))
                json.loads(tproc.stdout.readline() if tproc.stdout else "")
            how += f"; a latency proxy adds {delay_ms:g} ms before each request (https: behind nginx's TLS front)"
        yield prefix, endpoints, Path(str(nginx.workdir)) / "access.log", how


def _run(prefix: list[str], python: str, code: str, argv: list[str], env: dict[str, str], timeout_s: float,
         log: Path, keys_prefix: str) -> dict[str, Any]:
    before = _count(log, keys_prefix)
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k not in _SCRUB}
    proc = subprocess.Popen([*prefix, python, "-c", code, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**base, **env}, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own process group: the client and its DataLoader workers
        proc.communicate()
        return {"error": f"over {timeout_s:g} s", "requests": _count(log, keys_prefix) - before}
    if proc.returncode != 0:
        return {"error": " | ".join(stderr.strip().splitlines()[-3:]) or f"exit {proc.returncode}"}
    out = json.loads(stdout.strip().splitlines()[-1])
    out["requests"] = _count(log, keys_prefix) - before
    return out


def _count(log: Path, keys_prefix: str) -> int:
    return sum(f" {keys_prefix}" in line for line in log.read_text(errors="replace").splitlines()) if log.exists() else 0


def _link_mb_s(prefix: list[str], url: str, ca: Path | None) -> float:
    """One large GET through the link, best of two (a busy machine slows one, never speeds it)."""
    cmd = [*prefix, "curl", "-s", "-o", "/dev/null", "-w", "%{speed_download}", *(["--cacert", str(ca)] if ca else []), url]
    return max(float(subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout or 0) / 1e6
               for _ in range(2))


def _rate_mb_s(rate: str) -> float | None:
    """The tc rate in MB/s ("1gbit" -> 125.0), or None where it does not parse."""
    units = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "bit": 1 / 8, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9}
    for unit, scale in units.items():
        if rate.endswith(unit):
            try:
                return float(rate[: -len(unit)]) * scale / 1e6
            except ValueError:
                return None
    return None


def _plan(name: str, scheme: str, args: argparse.Namespace, files: dict[str, Path], ca: Path | None
          ) -> tuple[str, str, list[str], dict[str, str]]:
    """(python, code, argv after endpoint, env) of client ``name`` over ``scheme``."""
    s3_urls, http_urls = str(files["s3"]), str(files["http"])
    tls = {"SSL_CERT_FILE": str(ca)} if scheme == "https" and ca else {}
    s3fs_how = json.dumps({"verify": str(ca)}) if scheme == "https" and ca else "{}"
    plan = {
        "fastload_s3": (sys.executable, _FASTLOAD, [s3_urls, "CACHE"], tls),
        "fastload_s3_listed": (sys.executable, _FASTLOAD, [f"s3://{BUCKET}/train/", "CACHE"], tls),
        "fastload_s3fs": (sys.executable, _FASTLOAD, [s3_urls, "CACHE", s3fs_how], {"FASTLOAD_HTTP_CLIENT": "aiohttp"}),
        "fastload_http": (sys.executable, _FASTLOAD, [http_urls, "CACHE"], tls),
        "engine": (sys.executable, _ENGINE, [s3_urls], tls),
        "obstore": (args.peers_python, _OBSTORE, [s3_urls], tls),
        # AWS's CRT takes SSL_CERT_FILE (or SSL_CERT_DIR), not AWS_CA_BUNDLE: with only that, or no CA,
        # its GETs hang (retried, no error) past 60 s (results/results.md, 2026-12-03).
        "s3torchconnector": (args.peers_python, _S3TC, [s3_urls], tls),
    }
    return plan[name]


def _config_plan(name: str, endpoint: str, files: dict[str, Path], ca: Path | None,
                 batch_size: int) -> tuple[list[str], dict[str, str]]:
    """argv after the endpoint, and env, of issue 34's configuration ``name`` (CONFIGS)."""
    _scheme, where, ca_form = CONFIGS[name]
    how: dict[str, Any] = {"endpoint": where, "check": str(files["crc"]), "batch_size": batch_size}
    env: dict[str, str] = {}
    if where == "env":
        env["AWS_ENDPOINT_URL"] = endpoint
    if ca_form == "verify":
        how["verify"] = str(ca)
    elif ca_form:
        env[ca_form] = str(ca)
    return [str(files["s3"]), "CACHE", json.dumps(how)], env


def _row(res: dict[str, Any], link_mb_s: float, setup_in: bool, rate_mb_s: float | None, kb: int) -> dict[str, Any]:
    """A client's figures: shares of the link (measured) and of the rate (``rate_mb_s``; None unshaped)."""
    row: dict[str, Any] = {}
    if "error" in res:
        return row
    n = res["n"]
    mb_s = res["bytes"] / res["seconds"] / 1e6
    with_setup = res["bytes"] / (res["seconds"] + res.get("setup_s", 0)) / 1e6
    row.update(mb_s=round(mb_s, 1), of_link=round(mb_s / link_mb_s, 3) if link_mb_s else None,
               of_link_with_setup=round(with_setup / link_mb_s, 3) if link_mb_s else None,
               # against the tc rate itself: the one large GET is itself slowed on a busy machine
               of_rate_with_setup=round(with_setup / rate_mb_s, 3) if rate_mb_s else None,
               cpu_ms_per_object=round(1000 * res["cpu_s"] / n, 3),
               requests_per_object=round(res["requests"] / n, 3))
    if setup_in:
        row["cpu_ms_per_object_with_setup"] = round(1000 * (res["cpu_s"] + res.get("setup_cpu_s", 0)) / n, 3)
    if "wrong" in res:
        row["bytes_right"] = res["wrong"] == 0 and res["bytes"] == n * kb * 1000
    return row




def main(args: argparse.Namespace) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    links: list[dict[str, Any]] = []
    shaped = not args.no_shaping and _servers.shaping_unavailable_reason() is None
    rate_mb_s = _rate_mb_s(args.rate) if shaped else None
    schemes = sorted({CONFIGS[c][0] for c in args.configs}, key=SCHEMES.index) if args.done_when else args.schemes
    with tempfile.TemporaryDirectory(prefix="fastload-s3-bench-") as tmp:
        work = Path(tmp)
        www = work / "www"
        keys = _make_data(www, args.objects, args.kb)
        tls = _load_tls().make_ca(work / "tls") if "https" in schemes else None
        ca = tls[0] if tls else None
        files = {"s3": work / "s3.txt", "http": work / "http.txt", "crc": work / "crc.txt"}
        files["s3"].write_text("\n".join(f"s3://{BUCKET}/{k}" for k in keys))
        run_no = 0
        for delay in args.delays:
            with _link(args, www, delay, tls, work) as (prefix, endpoints, log, how):
                link_mb = {}
                for scheme in schemes:
                    link_mb[scheme] = _link_mb_s(prefix, f"{endpoints[scheme]}/big.bin", ca)
                    links.append({"delay_ms": delay, "scheme": scheme, "link_mb_s": round(link_mb[scheme], 1), "how": how})
                todo: list[tuple[str, str]] = (
                    [(CONFIGS[c][0], c) for c in args.configs] if args.done_when
                    else [(scheme, c) for scheme in schemes for c in args.clients])
                for scheme, name in todo:
                    endpoint = endpoints[scheme]
                    files["http"].write_text("\n".join(f"{endpoint}/{BUCKET}/{k}" for k in keys))
                    if args.done_when:
                        python, code = sys.executable, _FASTLOAD
                        extra, env = _config_plan(name, endpoint, files, ca, args.batch_size)
                    else:
                        python, code, extra, env = _plan(name, scheme, args, files, ca)
                    key = "config" if args.done_when else "client"
                    if not python:
                        rows.append({key: name, "scheme": scheme, "delay_ms": delay,
                                     "error": "not run: no --peers-python"})
                        continue
                    run_no += 1
                    cache = str(work / f"cache-{run_no}")
                    argv = [endpoint, *(cache if a == "CACHE" else a for a in extra)]
                    res = _run(prefix, python, code, argv, env, args.timeout_s, log, f"/{BUCKET}/train/")
                    row: dict[str, Any] = {key: name, "scheme": scheme, "delay_ms": delay, **res,
                                           **_row(res, link_mb[scheme], args.done_when, rate_mb_s, args.kb)}
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
    report = {"objects": args.objects, "kb": args.kb, "rate": args.rate, "links": links, "rows": rows,
              "done_when": args.done_when, "batch_size": args.batch_size if args.done_when else 64,
              "machine": f"{os.cpu_count()} cores, {os.uname().sysname} {os.uname().release}",
              "load_avg": [round(x, 2) for x in os.getloadavg()]}
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main(parse_args())
