"""HTTP/1.1 against HTTP/2 over TLS for many small GETs in flight, side by side in one run.

Real GCS answers HTTP/2 over TLS; its emulator (benchmarks/gcs/bench.py) HTTP/1.1 in
clear, so the GCS bench cannot say which one fastload's libcurl engine should ask for.
This one can: nginx with ``ssl http2`` (one port; ALPN picks the version) serving
``--objects`` files of ``--kb`` KB, inside a network namespace whose loopback carries
``tc tbf`` (1 Gbit by default), with a private CA (benchmarks/peers/tls.py); with
``--delay-ms`` nginx's TLS front passes each request to the latency proxy
(benchmarks/peers/servers.py) for a time to first byte, as a store's.

Clients, each a fresh process inside the namespace, every object fetched once (its first
MiB, a ranged GET as a Source's first block), alternated ``--repeats`` times:

* ``engine_h1`` / ``engine_h2``: fastload's engine (fastload.transport.curl) through a
  ``CurlRoute`` with ``http2=False`` / ``True``, every GET handed over at once, the host
  limit's adaptive number in flight under a cap of ``--inflight`` (each value a row);
* ``curl_h1`` / ``curl_h2``: the curl tool, ``--parallel --parallel-max N --http1.1`` /
  ``--http2`` (libcurl's own multiplexing, for reference).

Each row: seconds, MB/s, share of the link (one large GET through the same link in the
same run), CPU ms per object (the client process and its children, user + system), and
from nginx's log: requests per object, the HTTP version that answered, and how many
connections carried the requests.

Run as root: ``python benchmarks/gcs/http2.py [--objects 3000 --kb 110 --rate 1gbit --delay-ms 0,20
--inflight 64 --repeats 2] [--out benchmarks/gcs/results/http2.json]``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from fastload import _servers  # noqa: E402

SERVERS_PY = ROOT / "benchmarks" / "peers" / "servers.py"
CLIENTS = ("engine_h1", "engine_h2", "curl_h1", "curl_h2")

# Prints {"seconds", "cpu_s", "bytes", "n"}: fastload's engine through a CurlRoute.
_ENGINE = r"""
import dataclasses, json, resource, sys, threading, time
from fastload.transport import curl
from fastload.transport.hostlimit import limit_for
base, urls_file, http2, inflight, ca = sys.argv[1], sys.argv[2], sys.argv[3] == "1", int(sys.argv[4]), sys.argv[5]
urls = open(urls_file).read().split()
route = curl.route_for({}, "auto", str)
assert route is not None, curl.unavailable()
route = dataclasses.replace(route, http2=http2, cainfo=ca)  # the route's own CA bundle, as a Source names one
limit = limit_for(base, inflight)
def cpu():
    s = resource.getrusage(resource.RUSAGE_SELF)
    return s.ru_utime + s.ru_stime
stop = threading.Event()
c0, t0 = cpu(), time.perf_counter()
pending = route.start(urls, 1 << 20, 120.0, limit, stop)
curl.settle(pending, stop, 600.0)
n = sum(len(p.result(0)[1]) for p in pending)
print(json.dumps({"seconds": time.perf_counter() - t0, "cpu_s": cpu() - c0, "bytes": n, "n": len(urls)}))
"""

# Prints the same for the curl tool in parallel mode (its CPU: this process's children).
_CURL = r"""
import json, resource, subprocess, sys, time
urls_file, version, inflight, ca = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
urls = open(urls_file).read().split()
config = urls_file + ".curl"
with open(config, "w") as f:
    for u in urls:
        f.write(f'url = "{u}"\noutput = "/dev/null"\n')
t0 = time.perf_counter()
done = subprocess.run(["curl", "-s", "--fail", "--parallel", "--parallel-max", inflight, version, "--cacert", ca,
                       "-r", "0-1048575", "-w", "%{size_download}\n", "-K", config], capture_output=True, text=True)
seconds = time.perf_counter() - t0
if done.returncode != 0:
    sys.exit(f"curl exited {done.returncode}: {done.stderr[-500:]}")
c = resource.getrusage(resource.RUSAGE_CHILDREN)
n = sum(int(x) for x in done.stdout.split())
print(json.dumps({"seconds": seconds, "cpu_s": c.ru_utime + c.ru_stime, "bytes": n, "n": len(urls)}))
"""


@functools.cache
def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--objects", type=int, default=3000, help="objects fetched per run")
    p.add_argument("--kb", type=int, default=110, help="size of each object in KB")
    p.add_argument("--rate", default="1gbit", help="link rate in tc units")
    p.add_argument("--delay-ms", default="0,20", help="comma-separated times to first byte (a link per value)")
    p.add_argument("--inflight", default="64", help="comma-separated caps on GETs in flight (a row per value)")
    p.add_argument("--clients", default=",".join(CLIENTS))
    p.add_argument("--repeats", type=int, default=2, help="runs of each row, alternated")
    p.add_argument("--no-shaping", action="store_true", help="plain loopback, no namespace")
    p.add_argument("--timeout-s", type=float, default=300, help="limit per client run")
    p.add_argument("--out", type=Path, help="also write the JSON to this file")
    args = p.parse_args(argv)
    args.delays = [float(d) for d in args.delay_ms.split(",") if d]
    args.inflight = [int(n) for n in args.inflight.split(",") if n]
    args.clients = [c for c in args.clients.split(",") if c]
    unknown = sorted(set(args.clients) - set(CLIENTS))
    if unknown:
        p.error(f"--clients: {unknown} not in {','.join(CLIENTS)}")
    return args


@contextlib.contextmanager
def _link(args: argparse.Namespace, www: Path, tls: tuple[Path, Path, Path], delay_ms: float,
          work: Path) -> Iterator[tuple[list[str], str, Path, str]]:
    tls_mod = _load("fastload_bench_tls_h2", ROOT / "benchmarks" / "peers" / "tls.py")
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
        front = work / f"h2-front-{delay_ms:g}.sock"
        nginx = stack.enter_context(tls_mod.TlsNginx(www, cert=tls[1], key=tls[2], http2=True, conn_log=True,
                                                     netns=netns, unix_socket=True, via_unix=front if delay_ms else None))
        how += "; nginx ssl http2 (TLS 1.3; ALPN h2 or http/1.1)"
        if delay_ms:
            proc = subprocess.Popen([*prefix, sys.executable, str(SERVERS_PY), "proxy", "--upstream",
                                     f"unix:{nginx.unix_socket_path}", "--listen-unix", str(front),
                                     "--delay-ms", str(delay_ms)], stdout=subprocess.PIPE, text=True,
                                    start_new_session=True)
            stack.callback(lambda: (proc.terminate(), proc.wait(15)))
            json.loads(proc.stdout.readline() if proc.stdout else "")
            how += f"; a latency proxy behind nginx's TLS front adds {delay_ms:g} ms before each request"
        yield prefix, nginx.tls_url, Path(str(nginx.workdir)) / "tls_access.log", how


def _log_lines(log: Path) -> list[list[str]]:
    if not log.exists():
        return []
    return [line.split() for line in log.read_text(errors="replace").splitlines() if " /train/" in line]


def _run(prefix: list[str], argv: list[str], env: dict[str, str], timeout_s: float, log: Path) -> dict[str, Any]:
    before = len(_log_lines(log))
    try:
        done = subprocess.run([*prefix, *argv], capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, **env})
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout_s:g} s"}
    if done.returncode != 0:
        return {"error": " | ".join(done.stderr.strip().splitlines()[-3:]) or f"exit {done.returncode}"}
    out = json.loads(done.stdout.strip().splitlines()[-1])
    lines = _log_lines(log)[before:]
    out["requests"] = len(lines)
    out["connections"] = len({fields[0] for fields in lines})
    out["protocols"] = sorted({fields[1] for fields in lines})
    return out


def main(args: argparse.Namespace) -> dict[str, Any]:
    tls_mod = _load("fastload_bench_tls_h2", ROOT / "benchmarks" / "peers" / "tls.py")
    rows: list[dict[str, Any]] = []
    links: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="fastload-h2-bench-") as tmp:
        work = Path(tmp)
        www = work / "www"
        (www / "train").mkdir(parents=True)
        for i in range(args.objects):
            (www / "train" / f"{i:06d}.jpg").write_bytes(os.urandom(args.kb * 1000))  # incompressible, as JPEG
        (www / "big.bin").write_bytes(os.urandom(64 << 20))
        tls = tls_mod.make_ca(work / "tls")
        ca = str(tls[0])
        env = {"SSL_CERT_FILE": ca}
        urls_file = work / "urls.txt"
        for delay in args.delays:
            with _link(args, www, tls, delay, work) as (prefix, base, log, how):
                urls_file.write_text("\n".join(f"{base}/train/{i:06d}.jpg" for i in range(args.objects)))
                link_mb = {}
                for version in ("--http1.1", "--http2"):
                    done = subprocess.run([*prefix, "curl", "-s", "-o", "/dev/null", "-w", "%{speed_download}",
                                           "--cacert", ca, version, f"{base}/big.bin"],
                                          capture_output=True, text=True, timeout=120)
                    link_mb[version] = float(done.stdout or 0) / 1e6
                link_mb_s = max(link_mb.values())
                links.append({"delay_ms": delay, "link_mb_s": round(link_mb_s, 1), "how": how,
                              "one_get_mb_s": {k.lstrip("-"): round(v, 1) for k, v in link_mb.items()}})
                plan = [(c, n) for n in args.inflight for c in args.clients]
                for repeat in range(1, args.repeats + 1):
                    for client, inflight in plan:
                        h2 = client.endswith("h2")
                        if client.startswith("engine"):
                            argv = [sys.executable, "-c", _ENGINE, base, str(urls_file), "1" if h2 else "0", str(inflight),
                                    ca]
                        else:
                            argv = [sys.executable, "-c", _CURL, str(urls_file), "--http2" if h2 else "--http1.1",
                                    str(inflight), ca]
                        res = _run(prefix, argv, env, args.timeout_s, log)
                        row: dict[str, Any] = {"client": client, "inflight": inflight, "delay_ms": delay,
                                               "repeat": repeat, **res}
                        if "error" not in res:
                            mb_s = res["bytes"] / res["seconds"] / 1e6
                            row.update(mb_s=round(mb_s, 1), of_link=round(mb_s / link_mb_s, 3) if link_mb_s else None,
                                       cpu_ms_per_object=round(1000 * res["cpu_s"] / res["n"], 3),
                                       requests_per_object=round(res["requests"] / res["n"], 3),
                                       bytes_right=res["bytes"] == res["n"] * args.kb * 1000)
                        rows.append(row)
                        print(json.dumps(row), file=sys.stderr, flush=True)
    report = {"objects": args.objects, "kb": args.kb, "rate": args.rate, "links": links, "rows": rows,
              "machine": f"{os.cpu_count()} cores, {os.uname().sysname} {os.uname().release}",
              "load_avg_at_end": [round(x, 2) for x in os.getloadavg()]}
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main(parse_args())
