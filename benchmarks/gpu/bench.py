"""Device benchmarks for a CUDA machine: pinned prefetch, torch GPU decode, LZ4 GPU inflate.

Cases (``--cases``, comma-separated); every ratio is measured side by side in one run:

* ``prefetch``: host-to-device GB/s of ``DevicePrefetcher`` (pageable batches ->
  pinned slot -> one copy on the side stream) against a plain ``copy_`` from one
  pinned buffer, and against torch's ``pin_memory()`` + ``.to(non_blocking=True)``,
  on the same bytes. Then overlap at ``depth`` 0 and 1: the compute per step
  is sized to the copy time just measured, and
  ``overlap = (t_copy + t_compute - t_both) / min(t_copy, t_compute)``:
  1.0 = the shorter side fully hidden, 0.0 = copy and compute in series.
* ``decode``: ``ImageClassification(backend="torch")`` on CUDA (nvJPEG with
  torchvision, else Pillow then the GPU): img/s, and host syncs per batch counted
  under ``torch.cuda.set_sync_debug_mode("warn")``.
* ``inflate`` (DALI only): ``ArrayPipeline(backend="dali")`` on CUDA at several
  ``chunk_bytes`` (nvCOMP favours ~64 KiB chunks; fastload's default is 1 MiB):
  raw GB/s, bit-exactness against the arrays, and what a corrupted chunk gives.

Without CUDA every case says so and :func:`main` returns 0; ``--device cpu``
runs the same code on the CPU at tiny sizes (the smoke test does), where the
numbers mean nothing. Output is JSON on stdout, and in ``--out``, with the
machine description.

    python benchmarks/gpu/bench.py --out benchmarks/gpu/results/<gpu>.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a checkout, installed or not

from fastload import codec  # noqa: E402
from fastload.device.prefetch import DevicePrefetcher  # noqa: E402
from fastload.pipelines import ArrayPipeline, ImageClassification, Payload, available  # noqa: E402

CASES = ("prefetch", "decode", "inflate")
NO_CUDA = "no CUDA device: torch.cuda.is_available() is False"


def machine() -> dict[str, str]:
    """Describe where the numbers were measured."""
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": str(torch.version.cuda),
        "platform": platform.platform(),
        "cpus": str(os.cpu_count()),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
    }
    if available("dali"):
        import nvidia.dali

        info["dali"] = nvidia.dali.__version__
    return info


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _wall(fn: Callable[[], Any]) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


# -- prefetch ----------------------------------------------------------------------


def _drain(pf: DevicePrefetcher[Any], batches: list[torch.Tensor], depth: int,
           step: Callable[[torch.Tensor], None] | None = None) -> None:
    for x in pf.iterate(batches, depth=depth):
        if step is not None:
            step(x)


def _matmul_step(seconds: float, device: torch.device, size: int) -> Callable[[torch.Tensor], None]:
    """A step of about ``seconds`` device time: repeated bf16 matmuls, then one use of the batch."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    one = _wall(lambda: [torch.mm(a, a) for _ in range(20)]) / 20
    reps = max(1, round(seconds / one))

    def step(x: torch.Tensor) -> None:
        for _ in range(reps):
            torch.mm(a, a)
        x.add_(1)

    return step


def bench_prefetch(args: argparse.Namespace) -> dict[str, Any]:
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    nbytes, n = int(args.batch_mb * 2**20), args.batches
    batches = [torch.empty(nbytes, dtype=torch.uint8).random_() for _ in range(n)]
    total = n * nbytes

    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    pinned.copy_(batches[0])
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)

    def plain() -> None:
        for _ in range(n):
            dst.copy_(pinned, non_blocking=True)

    def pin_then_copy() -> None:
        for b in batches:
            (b.pin_memory() if cuda else b).to(dev, non_blocking=True)

    pf: DevicePrefetcher[Any] = DevicePrefetcher(None, dev, slots=3)
    _drain(pf, batches[:3], 2)  # warm-up: slots allocated, clocks up
    plain()
    pin_then_copy()
    seconds: dict[str, list[float]] = {"plain_pinned_copy": [], "pin_memory_then_to": [], "fastload_prefetcher": []}
    for _ in range(args.repeats):  # interleaved, so drift hits every variant alike
        seconds["plain_pinned_copy"].append(_wall(plain))
        seconds["pin_memory_then_to"].append(_wall(pin_then_copy))
        seconds["fastload_prefetcher"].append(_wall(lambda: _drain(pf, batches, 2)))
    gbps = {k: total / float(np.median(v)) / 1e9 for k, v in seconds.items()}
    out: dict[str, Any] = {
        "status": "ok",
        "batch_bytes": nbytes,
        "batches": n,
        "h2d_gb_per_s": gbps,
        "fastload_vs_plain_pinned": gbps["fastload_prefetcher"] / gbps["plain_pinned_copy"],
        "overlap": {},
    }
    for depth in (0, 1):
        ring: DevicePrefetcher[Any] = DevicePrefetcher(None, dev, slots=2)
        _drain(ring, batches[:2], depth)
        t_copy = _wall(lambda: _drain(ring, batches, depth))  # noqa: B023 (called at once)
        step = _matmul_step(t_copy / n, dev, args.matmul)
        resident = batches[0].to(dev)
        t_compute = _wall(lambda: [step(resident) for _ in range(n)])  # noqa: B023
        t_both = _wall(lambda: _drain(ring, batches, depth, step))  # noqa: B023
        shorter = min(t_copy, t_compute)
        out["overlap"][f"depth_{depth}"] = {
            "copy_s": t_copy,
            "compute_s": t_compute,
            "both_s": t_both,
            "overlap": (t_copy + t_compute - t_both) / shorter if shorter > 0 else None,
        }
    return out


# -- torch GPU decode ----------------------------------------------------------------


def synthetic_jpegs(n: int, hw: tuple[int, int] = (375, 500)) -> tuple[list[bytes], str]:
    """``n`` JPEGs of smooth synthetic images, by Pillow or else torchvision (no photos needed)."""
    rng = np.random.default_rng(0)
    h, w = hw
    yy, xx = np.mgrid[0:h, 0:w]
    images = []
    for _ in range(n):
        f = rng.uniform(0.005, 0.05, 3)
        img = np.stack([127 + 120 * np.sin(f[c] * (xx + yy * (c + 1))) for c in range(3)], axis=-1)
        images.append(np.clip(img + rng.normal(0, 4, img.shape), 0, 255).astype(np.uint8))
    try:
        from PIL import Image

        def enc(a: np.ndarray) -> bytes:
            import io

            buf = io.BytesIO()
            Image.fromarray(a).save(buf, format="JPEG", quality=90)
            return buf.getvalue()

        return [enc(a) for a in images], "Pillow"
    except ImportError:
        pass
    if available("torchvision.io"):
        import torchvision.io as tvio

        return [tvio.encode_jpeg(torch.from_numpy(a).permute(2, 0, 1).contiguous(), quality=90).numpy().tobytes()
                for a in images], "torchvision"
    raise ImportError("no JPEG encoder: install Pillow or torchvision")


def sync_warnings(messages: list[str]) -> int:
    """How many of ``messages`` report a host sync ("called a synchronizing CUDA operation").

    Not the notice that ``set_sync_debug_mode`` itself gives once per process
    ("... does not yet detect all synchronizing operations"), which is no sync.
    """
    return sum("called a synchronizing" in m for m in messages)


def _count_syncs(fn: Callable[[], Any]) -> int | None:
    if not torch.cuda.is_available():
        fn()
        return None
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sync_warnings([str(w.message) for w in seen])


def bench_decode(args: argparse.Namespace) -> dict[str, Any]:
    if not (available("torchvision.io") or available("PIL.Image")):
        return {"status": "skipped", "reason": "neither torchvision nor Pillow imports: no decoder for the torch backend"}
    try:
        jpegs, encoder = synthetic_jpegs(args.decode_batch)
    except ImportError as err:
        return {"status": "skipped", "reason": str(err)}
    samples = [{"data": j, "label": i % 10} for i, j in enumerate(jpegs)]
    pipe = ImageClassification(train=True, device=args.device, backend="torch", seed=0)
    first = pipe(samples)  # warm-up: decoder, ring, kernels
    syncs = _count_syncs(lambda: pipe(samples))
    seconds = _wall(lambda: [pipe(samples) for _ in range(args.decode_batches)])
    return {
        "status": "ok",
        "path": pipe._torch.where if pipe._torch is not None else "?",
        "jpegs_made_by": encoder,
        "batch": args.decode_batch,
        "img_per_s": args.decode_batch * args.decode_batches / seconds,
        "host_syncs_per_batch": syncs,
        "output": f"{tuple(first['image'].shape)} {first['image'].dtype} on {first['image'].device}",
    }


# -- LZ4 GPU inflate -----------------------------------------------------------------


def tiled_arrays(n: int, shape: tuple[int, ...]) -> list[np.ndarray]:
    """Compressible uint8 arrays: 8x8 tiles of random colour with a little noise (LZ4 ~2-4x)."""
    rng = np.random.default_rng(1)
    out = []
    for _ in range(n):
        tiles = rng.integers(0, 256, (-(-shape[0] // 8), -(-shape[1] // 8), *shape[2:]), dtype=np.uint8)
        a = np.repeat(np.repeat(tiles, 8, 0), 8, 1)[: shape[0], : shape[1]]
        noise = rng.random(a.shape) < 0.02
        a[noise] = rng.integers(0, 256, int(noise.sum()), dtype=np.uint8)
        out.append(np.ascontiguousarray(a))
    return out


def _payloads(arrays: list[np.ndarray], chunk: int) -> list[dict[str, Any]]:
    return [
        {"payload": Payload(f"mem://{i}", codec.encode(a.tobytes(), chunk_bytes=chunk, min_saving=0.0),
                            a.dtype.str, tuple(a.shape)), "index": i}
        for i, a in enumerate(arrays)
    ]


def _corrupt_chunk_result(pipe: ArrayPipeline, samples: list[dict[str, Any]], want: np.ndarray) -> dict[str, Any]:
    """Flip one byte inside an LZ4 chunk of sample 0 and say what inflate made of it."""
    p = samples[0]["payload"]
    info = codec.parse_header(p.data)
    damaged = bytearray(p.data)
    damaged[info.chunk_offsets()[0] + info.chunk_sizes[0] // 2] ^= 0xFF
    bad = [{"payload": Payload(p.url, bytes(damaged), p.dtype, p.shape), "index": 0}, *samples[1:]]
    try:
        out = pipe(bad)["data"].cpu().numpy()
    except Exception as err:  # what we would like nvCOMP to do
        return {"raised": True, "error": f"{type(err).__name__}: {str(err)[:200]}"}
    return {"raised": False, "sample_0_correct": bool(np.array_equal(out[0], want[0])),
            "others_correct": bool(np.array_equal(out[1:], want[1:]))}


def bench_inflate(args: argparse.Namespace) -> dict[str, Any]:
    if not available("dali"):
        return {"status": "skipped", "reason": "nvidia-dali is not installed (pip install 'fastload[dali]')"}
    device = args.device
    results: dict[str, Any] = {"status": "ok", "shapes": {}}
    for shape in args.inflate_shapes:
        arrays = tiled_arrays(args.inflate_batch, shape)
        want = np.stack(arrays)
        raw = want.nbytes
        per_chunk: dict[str, Any] = {}
        for chunk in args.chunk_bytes:
            samples = _payloads(arrays, chunk)
            pipe = ArrayPipeline(device=device, backend="dali")
            got = pipe(samples)["data"]  # warm-up (builds the DALI pipeline)
            exact = bool(np.array_equal(got.cpu().numpy(), want))
            seconds = _wall(lambda: [pipe(samples) for _ in range(args.inflate_runs)])  # noqa: B023
            stored = sum(len(s["payload"].data) for s in samples)
            per_chunk[str(chunk)] = {
                "raw_gb_per_s": raw * args.inflate_runs / seconds / 1e9,
                "ratio": raw / stored,
                "chunks_per_sample": len(codec.parse_header(samples[0]["payload"].data).chunk_sizes),
                "bit_exact": exact,
            }
        best = max(per_chunk, key=lambda c: per_chunk[c]["raw_gb_per_s"])
        results["shapes"]["x".join(map(str, shape))] = {"per_chunk_bytes": per_chunk, "fastest_chunk_bytes": int(best)}
    arrays = tiled_arrays(4, args.inflate_shapes[0])
    results["corrupt_chunk"] = _corrupt_chunk_result(
        ArrayPipeline(device=device, backend="dali"), _payloads(arrays, args.chunk_bytes[0]), np.stack(arrays)
    )
    return results


# -- driver --------------------------------------------------------------------------


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("x"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    p.add_argument("--device", default="cuda", help="cuda (cuda:N), or cpu for a smoke run")
    p.add_argument("--batch-mb", type=float, default=64, help="prefetch: MiB per batch")
    p.add_argument("--matmul", type=int, default=4096, help="prefetch: matrix size of the compute step")
    p.add_argument("--batches", type=int, default=12, help="prefetch: batches per pass")
    p.add_argument("--repeats", type=int, default=3, help="prefetch: interleaved repeats (median)")
    p.add_argument("--decode-batch", type=int, default=64)
    p.add_argument("--decode-batches", type=int, default=5)
    p.add_argument("--inflate-batch", type=int, default=128)
    p.add_argument("--inflate-runs", type=int, default=10)
    p.add_argument("--inflate-shapes", type=lambda s: [_shape(x) for x in s.split(",")],
                   default=[(224, 224, 3), (1024, 1024, 3)], help="e.g. 224x224x3,1024x1024x3")
    p.add_argument("--chunk-bytes", type=lambda s: [int(x) for x in s.split(",")],
                   default=[64 * 1024, 256 * 1024, 1024**2], help="inflate: chunk sizes to compare")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    return p.parse_args(argv)


BENCHES: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "prefetch": bench_prefetch,
    "decode": bench_decode,
    "inflate": bench_inflate,
}


def main(args: argparse.Namespace) -> int:
    """Run the selected cases; print (and optionally write) JSON. 0, or 2 for an unknown case."""
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = set(cases) - set(CASES)
    if unknown:
        print(f"unknown case(s): {sorted(unknown)}; choose from {', '.join(CASES)}", file=sys.stderr)
        return 2
    results: dict[str, Any] = {}
    runs = torch.device(args.device).type == "cpu" or torch.cuda.is_available()
    for case in cases:
        results[case] = BENCHES[case](args) if runs else {"status": "skipped", "reason": NO_CUDA}
    text = json.dumps({"machine": machine(), "results": results}, indent=2) + "\n"
    sys.stdout.write(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(parse_args()))
