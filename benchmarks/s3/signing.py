"""What signing an S3 GET costs: fastload's SigV4 (fastload.source.sigv4) against sending it unsigned.

Two figures from one run, over nginx on the host loopback (unshaped), 2,000 GETs of
110 KB objects through libcurl's engine (fastload._curl), 16 in flight:

* ``sign_us``: fastload's signing of one GET, in microseconds of Python (timeit over a batch);
* ``user_ms_per_get`` / ``sys_ms_per_get``: this process's CPU per GET (the engine's C thread
  included), the batch sent unsigned and then signed, alternating ``--rounds`` times.

libcurl's own ``CURLOPT_AWS_SIGV4``, which fastload used first, cost 0.082-0.090 ms of user
CPU per GET against 0.029-0.033 unsigned in the same run (results.md); fastload's signing
replaced it.

Run: ``python benchmarks/s3/signing.py [--objects 2000 --rounds 2] [--out FILE.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
import timeit
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from fastload import _servers  # noqa: E402
from fastload.source import sigv4  # noqa: E402
from fastload.transport import curl  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--objects", type=int, default=2000)
    p.add_argument("--kb", type=int, default=110)
    p.add_argument("--rounds", type=int, default=2, help="unsigned/signed alternations")
    p.add_argument("--out", type=Path)
    return p.parse_args(argv)


def _cpu() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def main(args: argparse.Namespace) -> dict[str, Any]:
    eng = curl.engine()
    if eng is None:
        raise SystemExit(f"libcurl's engine cannot run here: {curl.unavailable()}")
    with tempfile.TemporaryDirectory(prefix="fastload-sign-") as tmp:
        www = Path(tmp)
        (www / "bucket").mkdir()
        for i in range(args.objects):
            (www / "bucket" / f"{i:06d}.jpg").write_bytes(os.urandom(args.kb * 1000))
        with _servers.NginxServer(www) as server:
            urls = [f"{server.url}/bucket/{i:06d}.jpg" for i in range(args.objects)]
            base = [f"Range: bytes=0-{(1 << 20) - 1}", "Accept-Encoding: identity"]
            amz = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
            batch = [f"x-amz-content-sha256: {sigv4.UNSIGNED}", f"x-amz-date: {amz}"]

            def sign() -> list[str]:
                return sigv4.authorizations(urls, [*base, *batch], "AKIDEXAMPLE", "secret", "us-east-1", amz)

            sign_us = min(timeit.repeat(sign, number=1, repeat=5)) / len(urls) * 1e6
            host = eng.host()
            eng.set_permits(host, 16)
            rows: list[dict[str, Any]] = []
            for _ in range(args.rounds):
                for mode in ("unsigned", "signed"):
                    u0, s0 = _cpu()
                    headers, lines = (base, None) if mode == "unsigned" else ([*base, *batch], sign())
                    transfers = eng.submit(host, urls, 1 << 20, headers, 60.0, None, False, False, lines)
                    eng.wait(transfers, 300.0)
                    u1, s1 = _cpu()
                    ok = sum(t.result()[1] == 206 for t in transfers)
                    eng.outcomes()
                    rows.append({"mode": mode, "ok": ok, "user_ms_per_get": round((u1 - u0) / len(urls) * 1e3, 4),
                                 "sys_ms_per_get": round((s1 - s0) / len(urls) * 1e3, 4)})
            eng.set_permits(host, 0)  # its idle permits would wake the engine's pump thread every few ms
    report = {"objects": args.objects, "kb": args.kb, "sign_us": round(sign_us, 2), "rows": rows,
              "machine": f"{os.cpu_count()} cores"}
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main(parse_args())
