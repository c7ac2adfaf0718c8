"""Area 4: bit rot in payload files (flipped bytes, truncation, deletion) is always caught."""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from faults import FAULTS
from helpers import make_files

import fastload
from fastload import codec
from fastload.cache import Cache, Entry, keys, packs
from fastload.cli import main as cli_main
from fastload.config import Settings

pytestmark = pytest.mark.integration

KINDS = ("flip", "truncate", "delete")


def gets(server: Any) -> int:
    log = server.workdir / "access.log"
    return sum(1 for line in log.read_text().splitlines() if '"GET /class_' in line)


def stored_bytes(cache: Cache, e: Entry) -> bytes:
    """An entry's payload where it lies: its file, or its range of a pack."""
    with open(cache.data_dir / e.path, "rb") as f:
        f.seek(e.offset or 0)
        return f.read(e.stored if e.offset is not None else -1)


def write_stored(cache: Cache, e: Entry, data: bytes) -> None:
    if e.offset is None:
        (cache.data_dir / e.path).write_bytes(data)
        return
    with open(cache.data_dir / e.path, "r+b") as f:
        f.seek(e.offset)
        f.write(data)


def rot(cache: Cache, e: Entry, kind: str, rng: random.Random) -> None:
    """Rot one payload: flip bytes, cut it short, or lose it. In a pack, where its
    neighbours must survive: a torn tail is zeros, and a lost one has its blocks punched out."""
    path = cache.data_dir / e.path
    data = bytearray(stored_bytes(cache, e))
    if kind == "flip":
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= rng.randint(1, 255)
        write_stored(cache, e, bytes(data))
    elif kind == "truncate":
        cut = rng.randrange(len(data))
        if e.offset is None:
            os.truncate(path, cut)
        else:
            write_stored(cache, e, bytes(data[:cut]) + bytes(len(data) - cut))
    elif e.offset is None:
        path.unlink()
    else:
        packs.punch_at(path, [(e.offset, e.charged)])


def epoch(url: str, settings: Settings, files: dict[str, bytes]) -> fastload.LoaderStats:
    ds = fastload.FileDataset(url, settings=settings)
    root = ds.reader.manifest_root(url) + "/"
    loader = fastload.DataLoader(ds, batch_size=16, collate_fn=lambda b: b)
    n = 0
    for batch in loader:
        for sample in batch:
            assert sample["data"] == files[sample["url"][len(root) :]], sample["url"]
            n += 1
    assert n == len(files)
    return loader.stats()


def flip_sweep(settings: Settings, masks: tuple[int, ...]) -> int:
    """Every byte of a small LZ4 and a small raw payload, flipped with each mask: all caught."""
    cache = Cache(settings)
    rng = random.Random(5)
    flips = 0
    for raw in (bytes(rng.getrandbits(8) for _ in range(64)) * 40, os.urandom(300)):
        key = f"sweep{len(raw)}".ljust(40, "0")
        entry = cache.put(key, raw, url=f"memory://sweep/{len(raw)}")
        record = cache.index.get(keys.entry(key))
        good = stored_bytes(cache, entry)
        assert codec.parse_header(good).codec == (codec.LZ4 if len(raw) > 300 else codec.RAW)
        for pos in range(len(good)):
            for mask in masks:
                bad = bytearray(good)
                bad[pos] ^= mask
                write_stored(cache, entry, bytes(bad))
                cache.index.set(keys.entry(key), record)  # as if the entry had never been dropped
                before = cache.corrupt_count()
                assert cache.get(key) is None, f"flip {mask:#x} at byte {pos} of a {len(good)} B payload went unnoticed"
                assert cache.corrupt_count() == before + 1
                flips += 1
        write_stored(cache, entry, good)
        cache.index.set(keys.entry(key), record)
        assert cache.get(key) == raw
    cache.close()
    return flips


@pytest.mark.parametrize("variant", [pytest.param("short", id="short"), pytest.param("full", id="full", marks=pytest.mark.slow)])
def test_rotten_payloads_are_detected_refetched_and_counted(
    variant: str, tmp_path: Path, nginx_server: Callable[..., Any], record: Callable[..., None],
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    rounds = FAULTS["bitrot-flip"].trials_full if variant == "full" else FAULTS["bitrot-flip"].trials_short
    n = 300 if variant == "short" else 600
    files = make_files(tmp_path / "www", n, 12_000)
    server = nginx_server(tmp_path / "www")
    url = server.url + "/"
    settings = Settings(cache_dir=tmp_path / "cache", block_bytes=64 * 1024, max_requests=4)
    fastload.stage(url, settings=settings, progress=False)
    rng = random.Random(9)
    per_kind = max(1, n // 100)  # 1% of payload files per kind
    totals = {k: 0 for k in KINDS}
    detected = {k: 0 for k in KINDS}
    cache = Cache(settings)
    for _ in range(rounds):
        entries = rng.sample(sorted(cache.entries(), key=lambda e: e.key), 3 * per_kind)
        victims = {kind: entries[i * per_kind : (i + 1) * per_kind] for i, kind in enumerate(KINDS)}
        for kind, group in victims.items():
            for e in group:
                rot(cache, e, kind, rng)
        corrupt_before, fetched_before = cache.corrupt_count(), gets(server)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fastload"):
            stats = epoch(url, settings, files)
        warned = "\n".join(r.getMessage() for r in caplog.records)
        for kind, group in victims.items():
            totals[kind] += len(group)
            for e in group:
                # Detected on read (a warning naming the URL), refetched (a fresh, valid entry).
                if e.url in warned and cache.entry(e.key) is not None and cache.get(e.key) is not None:
                    detected[kind] += 1
        rotten = 3 * per_kind
        assert stats.counters.get("cache_corrupt", 0) == rotten, stats.counters
        assert stats.counters.get("cache_miss", 0) == rotten
        assert cache.corrupt_count() - corrupt_before == rotten
        assert gets(server) - fetched_before == rotten  # exactly the rotten ones crossed the link again
        assert epoch(url, settings, files).counters.get("cache_miss", 0) == 0  # repaired for good
    assert detected == totals, (detected, totals)
    assert cli_main(["info", "--json", "--cache-dir", str(settings.cache_dir)]) == 0
    assert json.loads(capsys.readouterr().out)["corrupt_detected"] == cache.corrupt_count() == sum(totals.values())
    masks = (0xFF,) if variant == "short" else (0x01, 0x80, 0xFF)
    swept = flip_sweep(Settings(cache_dir=tmp_path / "sweep"), masks)
    for kind in KINDS:
        record(
            f"bitrot-{kind}", rounds,
            f"pass: {detected[kind]}/{totals[kind]} rotten files detected, refetched and counted"
            + (f"; plus {swept} single-byte flips of small LZ4/raw payloads, all detected" if kind == "flip" else ""),
            detected=detected[kind], injected=totals[kind], files=n,
        )  # fmt: skip
