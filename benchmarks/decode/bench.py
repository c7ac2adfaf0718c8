"""Decode benchmarks: decode+augment img/s per backend and placement, and bytes across the link.

Cases (``--cases``, comma-separated):

* ``decode``: ``fastload.pipelines.ImageClassification`` (val and train transforms,
  224x224 float16 out) on ImageNet-like JPEGs made from real photos
  (``fastload.samples.make_image_folder``: 500x375, quality 90), per backend
  (``dali``, ``torch``), placement (``cpu``; ``gpu`` where CUDA is present) and
  CPU thread count. ``img_s`` is wall-clock; ``img_s_per_core`` is images per
  CPU-second of this process (all its threads, DALI's included), which is what
  one fully busy core delivers and stays meaningful on a shared, loaded machine
  (the load average is recorded with the machine). Each variant runs
  ``--repeats`` times, interleaved; the medians are reported.
* ``link``: bytes per sample that cross the host-to-GPU link for each
  representation (JPEG, LZ4-compressed uint8 crop, uint8, fp16, fp32), measured
  on the same photos, and the img/s cap each gives on a ``--link-gbps`` link.

Output: CSV (default), JSON or Markdown on stdout, and in ``--out``, headed by
the machine description.

    python benchmarks/decode/bench.py --out benchmarks/decode/results/cpu-2core.csv
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

if importlib.util.find_spec("fastload") is None:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fastload import codec  # noqa: E402
from fastload.pipelines import ImageClassification, available  # noqa: E402
from fastload.samples import make_image_folder  # noqa: E402

FIELDS = [
    "case", "variant", "placement", "mode", "threads", "img_s", "img_s_per_core",
    "bytes_per_sample", "link_cap_img_s", "note",
]  # fmt: skip


def _row(case: str, variant: str, **kw: Any) -> dict[str, Any]:
    row = {k: "" for k in FIELDS}
    row.update(case=case, variant=variant, **kw)
    return row


def _epoch(pipe: ImageClassification, samples: list[dict[str, Any]], batch_size: int) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) for one pass over ``samples``."""
    c0, t0 = time.process_time(), time.perf_counter()
    for i in range(0, len(samples), batch_size):
        out = pipe(samples[i : i + batch_size])["image"]
    if out.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, time.process_time() - c0


def bench_decode(samples: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """img/s of decode + transforms + normalize, per backend, placement, mode and threads."""
    placements = ["cpu"] + (["gpu"] if torch.cuda.is_available() else [])
    variants: dict[tuple[str, str, str, int], ImageClassification] = {}
    for backend in args.backends:
        if backend == "dali" and not available("dali"):
            continue
        for placement in placements:
            for mode in args.modes:
                for threads in args.threads:
                    pipe = ImageClassification(
                        train=mode == "train",
                        size=args.size,
                        dtype="float16",
                        device="cuda" if placement == "gpu" else "cpu",
                        backend=backend,
                        threads=threads,
                        seed=0,
                    )
                    pipe(samples[: args.batch_size])  # warm-up: builds the pipeline, starts threads
                    variants[(backend, placement, mode, threads)] = pipe
    runs: dict[tuple[str, str, str, int], list[tuple[float, float]]] = {k: [] for k in variants}
    for _ in range(args.repeats):
        for key, pipe in variants.items():
            runs[key].append(_epoch(pipe, samples, args.batch_size))
    rows = []
    for (backend, placement, mode, threads), times in runs.items():
        rate = len(samples) / statistics.median(t[0] for t in times)
        per_cpu_s = len(samples) / statistics.median(t[1] for t in times)
        pipe = variants[(backend, placement, mode, threads)]
        where = pipe._torch.where if pipe._torch is not None else f"DALI {'mixed' if placement == 'gpu' else 'cpu'}"
        rows.append(
            _row(
                "decode", backend, placement=placement, mode=mode, threads=threads,
                img_s=round(rate, 1), img_s_per_core=round(per_cpu_s, 1), note=where,
            )
        )  # fmt: skip
        pipe.close()
    return rows


def bench_link(samples: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Bytes per sample across the link for each representation, and the img/s cap they give."""
    link = args.link_gbps * 1e9
    crops = ImageClassification(train=False, size=args.size, dtype="uint8", layout="HWC", device="cpu", backend="torch")
    u8 = crops(samples)["image"].numpy()
    lz4 = [len(codec.encode(img.tobytes())) for img in u8]
    n = args.size * args.size * 3
    reps = [
        ("jpeg", float(np.mean([len(s["data"]) for s in samples])), "the files as stored (500x375 q90)"),
        ("lz4_uint8", float(np.mean(lz4)), f"{args.size}^2 uint8 crop as a cached LZ4 payload"),
        ("uint8", float(n), f"{args.size}^2 uint8 crop"),
        ("fp16", float(2 * n), f"{args.size}^2 float16"),
        ("fp32", float(4 * n), f"{args.size}^2 float32"),
    ]
    note = f"cap on a {args.link_gbps} GB/s link"
    return [
        _row("link", name, bytes_per_sample=round(b), link_cap_img_s=round(link / b), note=f"{what}; {note}")
        for name, b, what in reps
    ]


def machine() -> dict[str, str]:
    """Describe where the numbers were measured."""
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": str(os.cpu_count()),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
        "load average (1/5/15 min, at the end)": " ".join(f"{x:.1f}" for x in os.getloadavg()),
    }
    if available("dali"):
        info["dali"] = str(getattr(__import__("nvidia.dali").dali, "__version__", "?"))
    if available("PIL.Image"):
        import PIL

        info["pillow"] = PIL.__version__
    info["torchvision"] = "importable" if available("torchvision.io") else "not importable"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("Architecture", "Model name", "Thread(s) per core", "Core(s) per socket"):
            info[f"lscpu {key.strip()}"] = value.strip()
    return info


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse command-line options (see the module docstring)."""

    def ints(s: str) -> list[int]:
        return [int(x) for x in s.split(",") if x]

    def names(s: str) -> list[str]:
        return [x.strip() for x in s.split(",") if x.strip()]

    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--cases", type=names, default=["decode", "link"])
    p.add_argument("--images", type=int, default=256, help="JPEGs to make and decode")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--threads", type=ints, default=sorted({1, len(os.sched_getaffinity(0))}))
    p.add_argument("--backends", type=names, default=["dali", "torch"])
    p.add_argument("--modes", type=names, default=["val", "train"])
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--link-gbps", type=float, default=2.7, help="host-to-GPU link, GB/s (TB3 eGPU: ~2.7)")
    p.add_argument("--format", choices=["csv", "json", "md"], default="csv")
    p.add_argument("--out", type=Path, default=None, help="also write the results here")
    return p.parse_args(argv)


def _render(rows: list[dict[str, Any]], info: dict[str, str], fmt: str, command: str) -> str:
    if fmt == "json":
        return json.dumps({"machine": info, "command": command, "results": rows}, indent=2) + "\n"
    if fmt == "md":
        lines = ["# Decode benchmark results", "", f"Command: `{command}`", "", "Machine:", ""]
        lines += [f"- {k}: {v}" for k, v in info.items()]
        for case, cols in (
            ("decode", ["variant", "placement", "mode", "threads", "img_s", "img_s_per_core", "note"]),
            ("link", ["variant", "bytes_per_sample", "link_cap_img_s", "note"]),
        ):
            picked = [r for r in rows if r["case"] == case]
            if picked:
                lines += ["", f"## {case}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
                lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in picked]
        return "\n".join(lines) + "\n"
    buf = io.StringIO()
    for k, v in info.items():
        buf.write(f"# {k}: {v}\n")
    buf.write(f"# command: {command}\n")
    writer = csv.DictWriter(buf, fieldnames=FIELDS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def main(args: argparse.Namespace) -> int:
    """Run the selected cases; print (and optionally write) the results. Returns 0, or 2 on bad cases."""
    unknown = set(args.cases) - {"decode", "link"}
    if unknown:
        print(f"unknown case(s): {sorted(unknown)}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="fastload-decode-bench-") as tmp:
        paths = make_image_folder(Path(tmp) / "photos", n=args.images, classes=10)
        samples = [{"data": p.read_bytes(), "label": i % 10, "url": str(p)} for i, p in enumerate(paths)]
    rows: list[dict[str, Any]] = []
    if "decode" in args.cases:
        rows += bench_decode(samples, args)
    if "link" in args.cases:
        rows += bench_link(samples, args)
    command = "python benchmarks/decode/bench.py " + " ".join(sys.argv[1:]) if sys.argv[0].endswith("bench.py") else "main()"
    text = _render(rows, machine(), args.format, command.strip())
    sys.stdout.write(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(parse_args()))
