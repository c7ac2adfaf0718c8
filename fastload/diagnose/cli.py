"""The ``diagnose`` and ``bench`` subcommands: their arguments and their commands.

:func:`add_parsers` only touches argparse, so ``fastload --help`` stays fast;
the commands import their probes on first use.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastload.config import default_read_threads

__all__ = ["add_parsers", "bench_command", "diagnose_command"]

EXIT_OK, EXIT_FAIL = 0, 1


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from err
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from err
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def _read_threads_default() -> str:
    # diagnose and bench assume the DataLoader's own default (fastload.config), read
    # on this machine when the parser is built.
    return f"default {default_read_threads()}: this process's CPUs, 2 to 8, as fastload.DataLoader"


def add_parsers(sub: Any, common: argparse.ArgumentParser, *, size_arg: Callable[[str], int],
                json_arg: Callable[[str], dict[str, Any]]) -> None:
    """Add ``diagnose`` and ``bench`` to the ``fastload`` subparsers ``sub``."""
    d = sub.add_parser("diagnose", parents=[common], help="measure every op and name the bottleneck",
                       description="Measure the environment, the GPU and its link, the storage behind URL, the "
                       "cache disk and decode speeds; then name the limiting op and what to change.")
    d.add_argument("url", nargs="?", help="dataset URL to probe (any fsspec URL); without it storage is skipped")
    d.add_argument("--storage-options", type=json_arg, default={}, help="JSON fsspec options (credentials, endpoint)")
    d.add_argument("--pattern", help="glob relative to URL, e.g. '**/*.jpg'")
    speed = d.add_mutually_exclusive_group()
    speed.add_argument("--quick", dest="mode", action="store_const", const="quick", help="the shortest probes (a few seconds; for scripts and CI)")
    speed.add_argument("--thorough", dest="mode", action="store_const", const="thorough",
                       help="longer probes, more connections and objects (a few minutes)")
    d.set_defaults(mode="default")
    d.add_argument("--sample-bytes", type=size_arg, help="average sample size, e.g. 110KB (default: the URL's average)")
    d.add_argument("--image-size", type=_positive_int, default=224, help="training image side in pixels (default 224)")
    d.add_argument("--link-payload", choices=("fp32", "fp16", "uint8", "jpeg"), default="fp32",
                   help="what crosses the GPU link today (default fp32: normalised on the CPU)")
    d.add_argument("--decode-on", choices=("auto", "cpu", "gpu", "none"), default="auto",
                   help="where samples are decoded today; none: not at all (arrays, tokens); auto (default): none "
                        "where the URL's data is not images (told by its first bytes), else cpu")
    d.add_argument("--no-cache", dest="use_cache", action="store_false", help="your loader does not cache locally")
    d.add_argument("--read-threads", type=_positive_int, default=default_read_threads(),
                   help=f"your loader's read threads ({_read_threads_default()})")
    d.add_argument("--step-ms", type=_nonneg_float, help="your training step time in ms (with --batch-size)")
    d.add_argument("--batch-size", type=_positive_int, help="your batch size (with --step-ms)")
    d.add_argument("--no-gpu", dest="gpu", action="store_false", help="skip every GPU probe")
    d.add_argument("--plot", type=Path, metavar="FILE.png", help="also draw the op table (needs matplotlib)")

    b = sub.add_parser("bench", parents=[common], help="run the real DataLoader over a dataset, epoch by epoch",
                       description="Run fastload.DataLoader (and torch's with --compare) over DATASET_OR_URL: "
                       "per-op throughput, cold vs warm epochs, data stall under a simulated step, peak RSS.")
    b.add_argument("dataset", nargs="?", metavar="DATASET_OR_URL", help="folder or URL of files (one per sample)")
    b.add_argument("--sample", action="store_true", help="use built-in sample JPEGs instead of DATASET_OR_URL")
    b.add_argument("--sample-images", type=_positive_int, default=128, help="images for --sample (default 128)")
    b.add_argument("--pattern", help="glob relative to the dataset, e.g. '**/*.jpg'")
    b.add_argument("--storage-options", type=json_arg, default={}, help="JSON fsspec options")
    b.add_argument("--epochs", type=_positive_int, default=2, help="epochs (default 2: one cold, one warm)")
    b.add_argument("--batches", type=_positive_int, help="stop each epoch after this many batches")
    b.add_argument("--batch-size", type=_positive_int, default=32, help="batch size (default 32)")
    b.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes (default 0)")
    b.add_argument("--read-threads", type=int, help=f"fastload read threads ({_read_threads_default()})")
    b.add_argument("--decode", choices=("auto", "cpu", "none"), default="auto",
                   help="decode JPEGs on the CPU to uint8 tensors (auto: when the files are JPEG)")
    b.add_argument("--image-size", type=_positive_int, default=224, help="decoded image side (default 224)")
    b.add_argument("--step-ms", type=_nonneg_float, default=0.0, help="simulated training step per batch, ms")
    b.add_argument("--compare", action="store_true", help="also run torch.utils.data.DataLoader the same way")
    b.add_argument("--device", help="deliver batches to this device, e.g. cuda")
    b.add_argument("--plot", type=Path, metavar="FILE.png", help="draw op throughput and consumer wait")


def _plot_ready(args: argparse.Namespace) -> bool:
    if args.plot is None:
        return True
    from fastload.diagnose._util import MissingOptional
    from fastload.diagnose.plot import require_matplotlib

    try:
        require_matplotlib()
    except MissingOptional as err:
        print(f"fastload {args.command}: error: --plot needs matplotlib: {err}", file=sys.stderr)
        if args.json:
            print(json.dumps({"error": "MissingOptional", "message": str(err)}))
        return False
    return True


def _settings(args: argparse.Namespace) -> Any:
    from fastload.config import Settings

    return Settings.from_env(cache_dir=args.cache_dir, cache_limit_bytes=args.cache_limit)


def _print(args: argparse.Namespace, data: dict[str, Any], text: str) -> None:
    print(json.dumps(data, indent=2, sort_keys=True, default=str) if args.json else text)


def diagnose_command(args: argparse.Namespace) -> int:
    """``fastload diagnose``; 1 when the storage of a given URL could not be measured."""
    if (args.step_ms is None) != (args.batch_size is None):
        print("fastload diagnose: error: --step-ms and --batch-size go together (the model's img/s is "
              "batch-size x 1000 / step-ms)", file=sys.stderr)
        return 2
    if not _plot_ready(args):
        return EXIT_FAIL
    from fastload.diagnose.report import render
    from fastload.diagnose.run import Options, run_diagnose

    opts = Options(
        url=args.url, storage_options=args.storage_options, pattern=args.pattern, mode=args.mode,
        settings=_settings(args), sample_bytes=args.sample_bytes, image_size=args.image_size,
        link_payload=args.link_payload, decode_on=args.decode_on, cache=args.use_cache,
        read_threads=args.read_threads, step_ms=args.step_ms, batch_size=args.batch_size, gpu=args.gpu,
    )
    progress = None
    if not args.json and sys.stderr.isatty():
        def progress(step: str) -> None:
            print(f"\rfastload diagnose: {step}...".ljust(60), end="", file=sys.stderr, flush=True)
    report = run_diagnose(opts, progress=progress)
    if progress is not None:
        print("\r".ljust(61) + "\r", end="", file=sys.stderr, flush=True)
    if args.plot is not None:
        from fastload.diagnose.plot import plot_verdict

        report["plot"] = str(plot_verdict(report["verdict"], args.plot))
    _print(args, report, render(report) + (f"\n\nplot: {report['plot']}" if "plot" in report else ""))
    failed = args.url and report["storage"].get("status") != "ok"
    return EXIT_FAIL if failed else EXIT_OK


def bench_command(args: argparse.Namespace) -> int:
    """``fastload bench``."""
    if not args.sample and not args.dataset:
        print("fastload bench: error: give DATASET_OR_URL or --sample", file=sys.stderr)
        return 2
    if not _plot_ready(args):
        return EXIT_FAIL
    from fastload.diagnose.bench import BenchOptions, render_bench, run_bench

    opts = BenchOptions(
        dataset=args.dataset, sample=args.sample, sample_images=args.sample_images, pattern=args.pattern,
        storage_options=args.storage_options, epochs=args.epochs, batches=args.batches, batch_size=args.batch_size,
        num_workers=args.num_workers, read_threads=args.read_threads, decode=args.decode,
        image_size=args.image_size, step_ms=args.step_ms, compare=args.compare, device=args.device,
        cache_dir=_settings(args).cache_dir if args.cache_dir else None,
    )
    report = run_bench(opts)
    if args.plot is not None:
        from fastload.diagnose.plot import plot_bench

        report["plot"] = str(plot_bench(report, args.plot))
    text = render_bench(report) + (f"\nplot: {report['plot']}" if "plot" in report else "")
    if args.json:
        # The per-batch wait list is for the plot; JSON keeps it too (it is small).
        _print(args, report, text)
    else:
        print(text)
    return EXIT_OK
