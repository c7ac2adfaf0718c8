"""Differential fuzzer: fastload._native against the pure-Python gather, on hostile payloads.

Each case encodes random data as a cache payload (random codec, chunk size,
metadata), damages it (bit flips, byte writes, header fields and chunk-table
entries set to boundary values, truncation, extension), picks index fields that
agree with it or not, and random copies. The native path (from a file and from
memory) must return the same result kind as the Python path for every job and,
where both succeed, the same output bytes. A crash, an over-read (run under
AddressSanitizer with ``--asan``) or a disagreement fails the run; hypothesis
then shrinks the case and prints it.

    python native/fuzz.py --minutes 10            # the extension fastload imports
    python native/fuzz.py --minutes 10 --asan     # builds an ASan copy and re-runs under it

tests/unit/test_gather.py runs a short version (150 cases) on every test run.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import struct
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__" and "--native-so" in sys.argv:  # load the ASan build before fastload
    so = sys.argv[sys.argv.index("--native-so") + 1]
    spec = importlib.util.spec_from_file_location("fastload._native", so)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["fastload._native"] = module

from fastload import codec  # noqa: E402
from fastload.cache import gather  # noqa: E402

BOUNDARY_U32 = [0, 1, 2, 3, 4, 255, 4095, 4096, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1]
BOUNDARY_U64 = BOUNDARY_U32 + [2**32, 2**63 - 1, 2**63, 2**64 - 1]
# header fields: (offset, struct format)
FIELDS = [(4, "<B"), (5, "<B"), (6, "<H"), (8, "<Q"), (16, "<I"), (20, "<I"), (24, "<Q"), (32, "<I")]
WORK = Path(os.environ.get("FASTLOAD_FUZZ_DIR", "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()))


@dataclass
class Case:
    raw: bytes
    payload: bytes
    disk: bytes
    index: dict[str, Any]
    copies: list[tuple[int, int, int]] = field(default_factory=list)


@st.composite
def _raw(draw: st.DrawFn) -> bytes:
    n = draw(st.integers(0, 70_000))
    rnd = draw(st.randoms(use_true_random=False))
    kind = draw(st.sampled_from(["pattern", "text", "noise"]))
    if kind == "pattern":
        unit = rnd.randbytes(rnd.randint(1, 64))
        return (unit * (n // len(unit) + 1))[:n]
    if kind == "text":
        words = [rnd.randbytes(rnd.randint(1, 8)) for _ in range(50)]
        return b"".join(rnd.choice(words) for _ in range(n // 4 + 1))[:n]
    return rnd.randbytes(n)


def _mutate(draw: st.DrawFn, payload: bytes) -> bytes:
    data = bytearray(payload)
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(["flip", "byte", "field", "table", "truncate", "extend"]))
        if op in ("flip", "byte") and data:
            pos = draw(st.integers(0, len(data) - 1))
            data[pos] = data[pos] ^ (1 << draw(st.integers(0, 7))) if op == "flip" else draw(st.integers(0, 255))
        elif op == "field" and len(data) >= codec.HEADER_BYTES:
            off, fmt = draw(st.sampled_from(FIELDS))
            bits = struct.calcsize(fmt) * 8
            value = draw(st.sampled_from([v for v in BOUNDARY_U64 if v < 2**bits]) | st.integers(0, 2**bits - 1))
            struct.pack_into(fmt, data, off, value)
        elif op == "table" and len(data) >= codec.HEADER_BYTES:
            meta_len = struct.unpack_from("<I", data, 32)[0]
            n = struct.unpack_from("<I", data, 20)[0]
            start = codec.HEADER_BYTES + meta_len
            if n and start + 4 * n <= len(data):
                i = draw(st.integers(0, n - 1))
                struct.pack_into("<I", data, start + 4 * i, draw(st.sampled_from(BOUNDARY_U32) | st.integers(0, 2**32 - 1)))
        elif op == "truncate":
            del data[draw(st.integers(0, len(data))) :]
        elif op == "extend":
            data += draw(st.binary(min_size=1, max_size=64))
    return bytes(data)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """A payload, its damaged copy on disk, index fields and copies."""
    raw = draw(_raw())
    meta = draw(st.sampled_from([None, {}, {"dtype": "int32", "shape": [1, 2]}]))
    chunk = draw(st.sampled_from([1, 7, 64, 1000, 4096, 65536, 1 << 20]))
    payload = codec.encode(
        raw, chunk_bytes=chunk, level=draw(st.sampled_from([0, 0, 3])), min_saving=draw(st.sampled_from([0.0, 0.05, 1.0])), meta=meta
    )
    disk = _mutate(draw, payload) if draw(st.integers(0, 4)) else payload
    if draw(st.booleans()) and len(disk) >= codec.HEADER_BYTES:  # a damaged header may still claim these
        _, _, hcodec, _, hraw, _, _, hsum, _ = struct.unpack_from("<4sBBHQIIQI", disk)
    else:
        info = codec.parse_header(payload)
        hcodec, hraw, hsum = info.codec, info.raw_size, info.checksum
    index = {
        "stored": draw(st.sampled_from([len(disk), len(disk), len(payload), len(disk) + 1, max(0, len(disk) - 1)])),
        "raw": hraw if hraw < 2**40 else len(raw),
        "codec": draw(st.sampled_from([hcodec, hcodec, 1 - hcodec if hcodec < 2 else 0])),
        "checksum": draw(st.sampled_from([hsum, hsum, hsum ^ 1])),
        "stored_checksum": draw(st.sampled_from([codec.checksum(payload), codec.checksum(disk), None, 12345])),
    }
    raw_n = index["raw"]
    copies = []
    for _ in range(draw(st.integers(0, 4))):
        n = draw(st.integers(0, min(raw_n, 1 << 20)))
        src = draw(st.integers(0, raw_n - n))
        copies.append((src, n, draw(st.integers(0, 1 << 16))))
    if raw_n <= 1 << 20 and draw(st.booleans()):
        copies = [(0, raw_n, draw(st.integers(0, 64)))]
    return Case(raw, payload, disk, index, copies)


def check_one(case: Case) -> str:
    """Run the case through both paths; fail on any disagreement. Returns the result kind."""
    size = max([dst + n for _, n, dst in case.copies] + [1])
    fd, path = tempfile.mkstemp(suffix=".flp", dir=WORK)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(case.disk)
        idx = case.index
        job = gather.Job(path, idx["stored"], idx["raw"], idx["codec"], idx["checksum"], idx["stored_checksum"], case.copies)
        outs, results = [], []
        for run in ("python", "native", "memory"):
            out = bytearray(b"\xa5" * size)
            if run == "python":
                res = gather.gather_python([job], out)
            elif run == "native":
                res = gather.gather_native([job], out, threads=1)
            else:
                exact = np.frombuffer(case.disk, dtype=np.uint8).copy()  # no slack after the bytes, for ASan
                res = gather.gather_native([job._replace(path=exact)], out, threads=1, _in_memory=True)  # type: ignore[arg-type]
            outs.append(bytes(out))
            results.append(res[0])
        kinds = ["ok" if r is None else r[0] for r in results]
        vouched = case.disk != case.payload and idx["stored_checksum"] == codec.checksum(case.disk)
        if vouched and kinds[0] == "corrupt" and kinds[1] == kinds[2] == "ok":
            # The index vouches for damaged bytes (in real use: a 64-bit hash collision).
            # The native path then decodes only the wanted prefix of each chunk and may
            # not reach the damage that the fallback's whole-chunk decode trips on.
            assert outs[1] == outs[2], "native output bytes differ between file and memory"
            return "vouched"
        assert kinds[0] == kinds[1] == kinds[2], f"results differ: {results}"
        if kinds[0] == "ok":
            assert outs[0] == outs[1] == outs[2], "output bytes differ"
            if vouched:
                return "ok"  # nothing to compare with: the damaged bytes are the truth
            want = bytearray(b"\xa5" * size)
            for src, n, dst in case.copies:
                want[dst : dst + n] = case.raw[src : src + n]
            assert outs[0] == bytes(want), "both paths copied bytes that differ from what was encoded"
        return kinds[0]
    finally:
        os.unlink(path)


def build_asan(out_dir: Path) -> Path:
    """Compile native/_native.c with AddressSanitizer into ``out_dir``."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    so = out_dir / f"_native{suffix}"
    cmd = [
        "gcc", "-shared", "-fPIC", "-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
        "-std=gnu11", "-pthread", "-DFASTLOAD_EXACT_ALLOC", f"-I{sysconfig.get_paths()['include']}", str(ROOT / "native" / "_native.c"), "-o", str(so),
    ]  # fmt: skip
    subprocess.run(cmd, check=True)
    return so


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0, help="how long to fuzz")
    p.add_argument("--asan", action="store_true", help="build an AddressSanitizer copy and fuzz that")
    p.add_argument("--native-so", default=None, help="(internal) the extension file to load")
    return p.parse_args(argv)


def main(args: argparse.Namespace) -> int:
    if args.asan:
        tmp = Path(tempfile.mkdtemp(prefix="fastload-asan-"))
        so = build_asan(tmp)
        asan = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True).stdout.strip()
        ubsan = subprocess.run(["gcc", "-print-file-name=libubsan.so"], capture_output=True, text=True, check=True).stdout.strip()
        env = {**os.environ, "LD_PRELOAD": f"{asan} {ubsan}", "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
               "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}  # fmt: skip
        cmd = [sys.executable, __file__, "--minutes", str(args.minutes), "--native-so", str(so)]
        return subprocess.run(cmd, env=env).returncode
    if gather.info()["backend"] != "native" and "fastload._native" not in sys.modules:
        print(f"fastload._native unavailable: {gather.info()['reason']}", file=sys.stderr)
        return 2
    if args.native_so:
        gather._STATE["reason"] = ""
        print(f"native extension: {sys.modules['fastload._native'].__file__}")
    print(f"backend: {gather.info()}")
    deadline = time.monotonic() + args.minutes * 60
    kinds: dict[str, int] = {}
    damaged = [0]

    @settings(max_examples=300, deadline=None, database=None, phases=[Phase.generate, Phase.shrink],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=cases())
    def run(case: Case) -> None:
        if time.monotonic() > deadline:
            return
        kind = check_one(case)
        kinds[kind] = kinds.get(kind, 0) + 1
        damaged[0] += case.disk != case.payload

    t0 = time.monotonic()
    while time.monotonic() < deadline:
        run()
    elapsed = time.monotonic() - t0
    total = sum(kinds.values())
    print(f"fuzzed {total} cases in {elapsed / 60:.1f} min ({total / elapsed:.0f}/s), {damaged[0]} with damaged "
          f"payload bytes; results (identical on both paths): {dict(sorted(kinds.items()))}; no crash")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(parse_args()))
