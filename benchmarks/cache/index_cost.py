"""The cache index's cost per object on the cold path, three ways side by side (issue 25).

What a cold epoch asks of the index per object, in batches of ``--batch`` objects:
look the entries up (misses) and the pins up (get_many), then in one transaction
set the pins and add the entry records, then look the entries up again (hits).
Each way runs on a fresh index in a fresh folder; the ways alternate, ``--rounds``
times, and the figure is wall time over the objects (ms per object):

* ``fastload``: the index fastload opens (``CacheBase(...).index``), as this
  checkout has it (before issue 25 part 4: diskcache through its private API,
  batched; after: fastload's own one-table sqlite3 index).
* ``diskcache-private``: what fastload did before issue 25 part 4 (GatedIndex at
  72b29f5), replayed here: diskcache's own table written with its own ``Disk``
  encoding, one ``executemany`` per batch, ``SELECT ... IN`` look-ups (skipped when
  diskcache is not installed). Kept so the choice can be measured again.
* ``diskcache-public``: diskcache's public API done as well as it can be:
  ``with cache.transact(): for ...: cache.set / cache.add``, ``cache.get`` per key
  (skipped when diskcache is not installed).
* ``sqlite3``: a plain one-table sqlite3 index (key TEXT PRIMARY KEY, pickled
  value), WAL, ``executemany`` in one transaction, ``SELECT ... IN`` look-ups.

Usage::

    python benchmarks/cache/index_cost.py [--objects 3000] [--batch 64] [--rounds 3] [--out FILE.json] [--label L]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fastload.cache import keys
from fastload.cache.base import CacheBase
from fastload.config import Settings


def _objects(n: int) -> list[tuple[str, tuple[Any, ...], str, tuple[Any, ...]]]:
    """(entry key, entry record, pin key, pin) per object, shaped as fastload writes them."""
    out = []
    for i in range(n):
        key = f"{i:040x}"
        url = f"http://127.0.0.1:8080/train/class{i % 100}/img{i}.jpg"
        rec = ("packs/123-abcdef.pack", 110_000, 112_000, "lz4", 0x1234567890ABCDEF, url, 0, 0xFEDCBA0987654321,
               i * 4096, 1.7e9)  # fmt: skip
        out.append((keys.entry(key), rec, keys.pin(url), (112_000, f'"etag-{i}"')))
    return out


Batch = list[tuple[str, tuple[Any, ...], str, tuple[Any, ...]]]


def _cold(batches: Sequence[Batch], get_many: Callable[[list[str]], Any], write: Callable[[Batch], None]) -> None:
    for batch in batches:
        get_many([e for e, _, _, _ in batch])  # misses
        get_many([p for _, _, p, _ in batch])  # pins not recorded yet
        write(batch)
        get_many([e for e, _, _, _ in batch])  # hits: the reads


def run_fastload(folder: Path, batches: Sequence[Batch]) -> None:
    cache = CacheBase(Settings(cache_dir=folder))
    index = cache.index

    def write(batch: Batch) -> None:
        with index.transact():
            index.set_many({p: pin for _, _, p, pin in batch})
            index.add_many([(e, rec) for e, rec, _, _ in batch])

    _cold(batches, index.get_many, write)
    cache.close()


_COLUMNS = "key, raw, store_time, expire_time, access_time, access_count, tag, size, mode, filename, value"
_INSERT = f"INSERT INTO Cache({_COLUMNS}) VALUES (?, 1, ?, NULL, ?, 0, NULL, ?, ?, ?, ?)"
_UPSERT = (_INSERT + " ON CONFLICT(key, raw) DO UPDATE SET store_time = excluded.store_time, expire_time = NULL,"
           " access_time = excluded.access_time, tag = NULL, size = excluded.size, mode = excluded.mode,"
           " filename = excluded.filename, value = excluded.value")


def run_diskcache_private(folder: Path, batches: Sequence[Batch]) -> None:
    import diskcache

    cache = diskcache.Cache(str(folder / "index"), eviction_policy="none", size_limit=2**62, timeout=60)

    def select(names: list[str]) -> list[tuple[Any, ...]]:
        marks = ",".join("?" * len(names))
        return cache._sql(f"SELECT key, mode, filename, value FROM Cache WHERE raw = 1 AND key IN ({marks})",
                          names).fetchall()

    def get_many(names: list[str]) -> dict[str, Any]:
        return {k: cache._disk.fetch(mode, fn, v, False) for k, mode, fn, v in select(names)}

    def rows(items: list[tuple[str, Any]]) -> list[tuple[Any, ...]]:
        now = time.time()
        return [(k, now, now, *cache._disk.store(v, False, key=k)) for k, v in items]

    def write(batch: Batch) -> None:
        with cache.transact():
            cache._con.executemany(_UPSERT, rows([(p, pin) for _, _, p, pin in batch]))
            taken = {r[0] for r in select([e for e, _, _, _ in batch])}
            cache._con.executemany(_INSERT, rows([(e, rec) for e, rec, _, _ in batch if e not in taken]))

    _cold(batches, get_many, write)
    cache.close()


def run_diskcache_public(folder: Path, batches: Sequence[Batch]) -> None:
    import diskcache

    cache = diskcache.Cache(str(folder / "index"), eviction_policy="none", size_limit=2**62, timeout=60)

    def get_many(names: list[str]) -> dict[str, Any]:
        out = {}
        for name in names:
            value = cache.get(name)
            if value is not None:
                out[name] = value
        return out

    def write(batch: Batch) -> None:
        with cache.transact():
            for _, _, p, pin in batch:
                cache.set(p, pin)
            for e, rec, _, _ in batch:
                cache.add(e, rec)

    _cold(batches, get_many, write)
    cache.close()


def run_sqlite3(folder: Path, batches: Sequence[Batch]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    con = sqlite3.connect(str(folder / "index.db"), isolation_level=None, timeout=60)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA synchronous=NORMAL")
    con.execute("CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY, value)")

    def get_many(names: list[str]) -> dict[str, Any]:
        marks = ",".join("?" * len(names))
        rows = con.execute(f"SELECT key, value FROM entries WHERE key IN ({marks})", names).fetchall()
        return {k: pickle.loads(v) for k, v in rows}

    def write(batch: Batch) -> None:
        con.execute("BEGIN IMMEDIATE")
        con.executemany("INSERT OR REPLACE INTO entries VALUES (?, ?)",
                        [(p, pickle.dumps(pin, pickle.HIGHEST_PROTOCOL)) for _, _, p, pin in batch])
        con.executemany("INSERT OR IGNORE INTO entries VALUES (?, ?)",
                        [(e, pickle.dumps(rec, pickle.HIGHEST_PROTOCOL)) for e, rec, _, _ in batch])
        con.execute("COMMIT")

    _cold(batches, get_many, write)
    con.close()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--objects", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    ap.add_argument("--label", default=None, help="what the fastload way is (default: this checkout's commit)")
    args = ap.parse_args(argv)
    objs = _objects(args.objects)
    batches = [objs[i : i + args.batch] for i in range(0, len(objs), args.batch)]
    ways: dict[str, Callable[[Path, Sequence[Batch]], None]] = {"fastload": run_fastload}
    try:
        import diskcache  # noqa: F401

        ways["diskcache-private"] = run_diskcache_private
        ways["diskcache-public"] = run_diskcache_public
    except ImportError:
        print("diskcache not installed: diskcache-public skipped", file=sys.stderr)
    ways["sqlite3"] = run_sqlite3
    ms: dict[str, list[float]] = {name: [] for name in ways}
    with tempfile.TemporaryDirectory(prefix="index_cost-") as tmp:
        for r in range(args.rounds):
            for name, fn in ways.items():
                folder = Path(tmp) / f"{name}-{r}"
                t0 = time.perf_counter()
                fn(folder, batches)
                ms[name].append((time.perf_counter() - t0) * 1000 / args.objects)
    commit = args.label or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                          cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    result = {"fastload": commit, "objects": args.objects, "batch": args.batch, "rounds": args.rounds,
              "sqlite": sqlite3.sqlite_version, "python": sys.version.split()[0],
              "ms_per_object": {name: {"median": round(statistics.median(v), 4), "min": round(min(v), 4),
                                      "runs": [round(x, 4) for x in v]}
                                for name, v in ms.items()}}  # fmt: skip
    print(f"{args.objects} objects, batches of {args.batch}, {args.rounds} rounds alternated (commit {commit})")
    for name, v in ms.items():
        print(f"  {name:18s} median {statistics.median(v):.4f}  min {min(v):.4f} ms/object"
              f"  (runs: {', '.join(f'{x:.4f}' for x in v)})")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
