"""The ``fastload`` command line: ``cache``, ``info``/``ls``, ``clear``, ``evict``, ``diagnose``, ``bench``.

Exit codes: 0 success, 1 failure (a :class:`FastloadError`, or bad entries that
could not be repaired), 2 usage error (argparse), 130 interrupted (Ctrl-C), 141 stdout
closed early (``fastload info | head -4``: quiet, as a command killed by SIGPIPE). ``--json`` prints one JSON
document on stdout for machines; humans get tables, and progress bars on stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from fastload.config import Settings, deprecated, format_size, parse_size
from fastload.errors import ConfigError, FastloadError

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_PIPE = 0, 1, 2, 130, 141


def _json_arg(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"--storage-options is not valid JSON ({err}); e.g. '{{\"anon\": true}}'") from err
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--storage-options must be a JSON object")
    return value


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for docs and tests)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache-dir", help="cache folder (default $FASTLOAD_CACHE_DIR or ~/.cache/fastload)")
    common.add_argument("--cache-limit", type=_size_arg, help="cache size limit, e.g. 200GB (default $FASTLOAD_CACHE_LIMIT or 50GB)")
    common.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    common.add_argument("-v", "--verbose", action="store_true", help="log details to stderr")

    parser = argparse.ArgumentParser(prog="fastload", description="Keep GPUs fed: cache remote datasets locally, find the bottleneck.")
    sub = parser.add_subparsers(dest="command", required=True)

    cache = sub.add_parser("cache", parents=[common], help="pre-stage a remote dataset into the local cache")
    cache.add_argument("url", nargs="?", help="any fsspec URL: s3://bucket/prefix/, https://host/dir/, /local/dir ...")
    cache.add_argument("--url-list", metavar="FILE", help="stage the objects listed in FILE (one URL per line) instead of URL")
    cache.add_argument("--pattern", help="glob relative to URL, e.g. '**/*.jpg' (default: everything)")
    cache.add_argument("--storage-options", type=_json_arg, default={}, help="JSON fsspec options (credentials, endpoint)")
    cache.add_argument("--max-requests", type=int, dest="max_requests",
                       help="most requests in flight to one host (default 64; an adaptive limit runs under it)")
    cache.add_argument("--workers", type=int, dest="workers", help=argparse.SUPPRESS)  # --max-requests' old name
    cache.add_argument("--level", type=int, choices=range(0, 13), metavar="0..12", help="0 = fast LZ4 (default), 1..12 = LZ4-HC")
    cache.add_argument("--block-size", type=_size_arg, help="cache large files in blocks of this size (default 8MiB)")
    cache.add_argument("--dry-run", action="store_true", help="list and report the size against the cache limit; fetch nothing (an HTTP listing whose "
                       "pages show no exact sizes, as python -m http.server's, costs a HEAD per object)")
    cache.add_argument("--verify", action="store_true", help="re-check every entry's checksum; refetch bad ones")
    cache.add_argument("--refresh", action="store_true", help="re-list the remote instead of trusting the recorded manifest")
    cache.add_argument("--nodes", type=int, help="stage one node's part (partition='node') of a job on this many nodes; "
                       "default with --node-rank: from torchrun's or Slurm's environment")
    cache.add_argument("--node-rank", type=int, help="this node, in [0, nodes); default with --nodes: from the environment")
    cache.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    cache.add_argument("--progress", action="store_true", help="show the progress bar even when stderr is not a terminal")

    sub.add_parser("info", parents=[common], help="show what is cached, per dataset")

    clear = sub.add_parser("clear", parents=[common], help="delete cached data (everything, or one dataset)")
    clear.add_argument("url", nargs="?", help="only this dataset (as staged); default: everything")

    evict = sub.add_parser("evict", parents=[common], help="evict least-recently-used entries")
    evict.add_argument("--to", type=_size_arg, required=True, dest="to_bytes", help="target size, e.g. 10GB")

    from fastload.diagnose.cli import add_parsers  # argparse only; the probes load on use

    add_parsers(sub, common, size_arg=_size_arg, json_arg=_json_arg)
    return parser


def _max_requests(args: argparse.Namespace) -> int | None:
    """--max-requests, or its old name --workers (a warning once)."""
    old = getattr(args, "workers", None)
    if old is not None and getattr(args, "max_requests", None) is None:
        deprecated("--workers", "--max-requests")
        return int(old)
    return getattr(args, "max_requests", None)


def _settings(args: argparse.Namespace) -> Settings:
    return Settings.from_env(
        cache_dir=args.cache_dir,
        cache_limit_bytes=args.cache_limit,
        max_requests=_max_requests(args),
        lz4_level=getattr(args, "level", None),
        block_bytes=getattr(args, "block_size", None),
    )


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(data, indent=2, sort_keys=True) if args.json else text)


def cmd_cache(args: argparse.Namespace) -> int:
    from fastload.stage import stage

    progress = False if args.no_progress or args.json else (True if args.progress else None)
    target: str | list[str] = args.url if args.url is not None else _read_url_list(args.url_list)
    report = stage(
        target,
        pattern=args.pattern,
        storage_options=args.storage_options,
        settings=_settings(args),
        refresh=args.refresh,
        dry_run=args.dry_run,
        verify=args.verify,
        progress=progress,
        nodes=args.nodes,
        node_rank=args.node_rank,
    )
    _emit(args, report.to_dict(), str(report))
    return EXIT_OK if (report.fits or not report.dry_run) else EXIT_FAIL


def _read_url_list(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
    except OSError as err:
        raise ConfigError(f"--url-list {path!r} cannot be read ({err}); fix: give a text file with one URL per line") from err


def dataset_summaries(settings: Settings) -> dict[str, Any]:
    """Cache totals, its real disk use, and per recorded dataset how much of it is cached
    (under any block size).

    From the index's totals and each dataset's recorded summary: no scan of the cache, so
    it takes about as long at a million entries as at ten (it took 10 s at 100k with one).
    A dataset's figures are counted again only when something was published or dropped
    since they were counted (`Identity.summarise`), at a cost that grows with its items.
    """
    from fastload.cache import keys
    from fastload.read.reader import Reader

    reader = Reader(settings)
    cache = reader.cache
    totals = cache.totals()
    summaries = reader.identity.summaries()
    sizes = reader.identity.block_sizes(summaries)
    datasets = []
    for s in summaries:
        if not reader.identity.current(s, sizes):
            s = reader.identity.summarise(s["root"], s["pattern"], None, sizes)
        datasets.append({"url": s["root"], "pattern": s["pattern"], "items": s["items"], "cached_items": s["cached_items"],
                         "remote_bytes": s["remote_bytes"], "stored_bytes": s["stored_bytes"]})
    disk = cache.disk_use()
    return {
        "cache_dir": str(settings.cache_dir),
        "cache_limit_bytes": settings.cache_limit_bytes,
        "limit_in_force_bytes": cache.limit_bytes(),
        "writable": cache.unwritable is None,
        "unwritable_reason": cache.unwritable,
        "entries": totals[keys.ENTRIES],
        "stored_bytes": totals[keys.STORED],
        "raw_bytes": totals[keys.RAW],
        "disk_bytes": disk["payload"],
        "index_bytes": disk["index"],
        "corrupt_detected": cache.corrupt_count(),
        "datasets": sorted(datasets, key=lambda d: (d["url"], d["pattern"] or "")),
    }


def cmd_info(args: argparse.Namespace) -> int:
    info = dataset_summaries(_settings(args))
    lines = [
        f"cache dir   {info['cache_dir']}",
        f"limit       {format_size(info['cache_limit_bytes'])}"
        + (f" ({format_size(info['limit_in_force_bytes'])} in force: the disk's free space less its reserve)"
           if info["limit_in_force_bytes"] < info["cache_limit_bytes"] else ""),
        f"entries     {info['entries']}: {format_size(info['stored_bytes'])} stored "
        f"({format_size(info['raw_bytes'])} raw)",
        f"disk        {format_size(info['disk_bytes'])} of payload files (blocks allocated), "
        f"{format_size(info['index_bytes'])} of index",
        f"corrupt     {info['corrupt_detected']} detected and dropped so far",
    ]
    if not info["writable"]:
        lines.append(f"writable    no: the disk is {info['unwritable_reason']}; cached data is served, new data streams")
    if info["datasets"]:
        lines.append("")
        lines.append(f"{'dataset':<50} {'items':>14} {'remote':>11} {'on disk':>11}")
        for d in info["datasets"]:
            name = d["url"] + (f" [{d['pattern']}]" if d["pattern"] else "")
            lines.append(
                f"{name:<50} {d['cached_items']:>6}/{d['items']:<7} {format_size(d['remote_bytes']):>11} {format_size(d['stored_bytes']):>11}"
            )
    _emit(args, info, "\n".join(lines))
    return EXIT_OK


def cmd_clear(args: argparse.Namespace) -> int:
    from fastload.cache import keys
    from fastload.read.reader import Reader

    reader = Reader(_settings(args))
    if args.url is None:
        reader.cache.clear()
        _emit(args, {"cleared": "all"}, f"cleared {reader.settings.cache_dir}")
        return EXIT_OK
    root = reader.canonical(args.url).rstrip("/")
    mine = [m for m in reader.identity.manifests() if m["root"] == root]
    if not mine:
        raise ConfigError(f"no staged dataset {root!r} in {reader.settings.cache_dir}; `fastload info` lists them")
    # Its objects' entries of every block size and version: dropping only the keys of this
    # run's block size said "cleared: 0 entries" and orphaned a dataset staged with
    # --block-size (issue 24; tests/unit/test_block_sizes.py).
    urls = {item.url for m in mine for item in m["items"]}
    dropped = reader.cache.drop_entries([e for e in reader.cache.entries() if e.url in urls])
    for url in urls:
        reader.cache.index.pop(keys.pin(url), None)
    for m in mine:
        reader.identity.forget_manifest(m["root"], m["pattern"])
    _emit(args, {"cleared": root, "entries": dropped}, f"cleared {root}: {dropped} entries")
    return EXIT_OK


def cmd_evict(args: argparse.Namespace) -> int:
    from fastload.cache import Cache

    cache = Cache(_settings(args))
    before = cache.volume()
    freed = cache.evict(args.to_bytes)
    cache.compact()  # the index's log too: on a small disk it can hold more than the payloads
    after = cache.volume()
    _emit(args, {"before_bytes": before, "freed_bytes": freed, "after_bytes": after},
          f"evicted {format_size(freed)}: {format_size(before)} -> {format_size(after)}")
    return EXIT_OK


def cmd_diagnose(args: argparse.Namespace) -> int:
    from fastload.diagnose.cli import diagnose_command

    return diagnose_command(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from fastload.diagnose.cli import bench_command

    return bench_command(args)


COMMANDS = {"cache": cmd_cache, "info": cmd_info, "clear": cmd_clear, "evict": cmd_evict,
            "diagnose": cmd_diagnose, "bench": cmd_bench}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 1 failure, 2 usage, 130 interrupted, 141 stdout closed)."""
    try:
        code = _run(argv)
        sys.stdout.flush()  # a reader that went away shows here, not as a traceback at exit
        return code
    except BrokenPipeError:
        # The reader of stdout closed it (`| head`): exit quietly. Python would print the
        # error again when it flushes stdout at exit, so stdout goes to /dev/null first
        # (tests/unit/test_cli_pipe.py).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_PIPE


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command == "cache" and (args.url is None) == (args.url_list is None):
            parser.error("cache: give a URL or --url-list FILE (one of them), e.g. fastload cache s3://bucket/train/")
        if args.command == "cache" and args.url_list is not None and args.pattern is not None:
            # As FileDataset([...], pattern=...): a URL list has no listing to filter.
            parser.error("cache: --pattern filters a listing and --url-list has none; filter the list itself")
    except SystemExit as exit_:
        return int(exit_.code or 0)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="fastload: %(message)s")
    try:
        return COMMANDS[args.command](args)
    except FastloadError as err:
        print(f"fastload {args.command}: error: {err}", file=sys.stderr)
        if args.json:
            print(json.dumps({"error": type(err).__name__, "message": str(err)}))
        return EXIT_FAIL
    except KeyboardInterrupt:
        # Staging's threads have ended by now, their requests cancelled (stage._Stop): the
        # process exits at once, as a Python caller of fastload.stage returns at once
        # (tests/integration/test_stage_interrupt.py).
        print(f"fastload {args.command}: interrupted; rerun the same command to resume", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
