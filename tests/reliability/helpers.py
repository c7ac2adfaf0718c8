"""Small shared helpers of the reliability suite (datasets, cache inspection, subprocesses)."""

from __future__ import annotations

import hashlib
import os
import random
import sqlite3
import sys
from pathlib import Path
from typing import Any

from fastload.cache import keys
from fastload.cache.index import INDEX_FILE, TABLE

ROOT = Path(__file__).resolve().parents[2]


def content(name: str, size: int) -> bytes:
    """Deterministic bytes for a file name: compressible rows plus a noisy tail.

    Compressible so payloads are LZ4 (chunk tables, match offsets); the noise keeps
    files distinct. A child process regenerates the same bytes to check its reads.
    """
    rng = random.Random(name)
    row = bytes(rng.getrandbits(8) for _ in range(64))
    noise = hashlib.sha256(name.encode()).digest() * (size // 256 + 1)
    body = (row * (size // 64 + 1))[: size - size // 8] + noise[: size // 8]
    return body[:size]


def make_files(root: Path, n: int, size: int, *, classes: int = 4) -> dict[str, bytes]:
    """``n`` files of ``size`` bytes under ``root/class_k/``; returns relative path -> bytes."""
    files = {}
    for i in range(n):
        rel = f"class_{i % classes}/item_{i:05d}.bin"
        data = content(rel, size)
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        files[rel] = data
    return files


def payload_files(cache_dir: Path) -> list[Path]:
    """Files that hold payloads: one per whole payload, and the packs of small ones."""
    data = cache_dir / "data"
    return sorted([*data.glob("*/*.flp"), *data.glob("packs/*.pack")]) if data.exists() else []


def payload_bytes(cache_dir: Path) -> int:
    """Bytes of payload files, packs and in-progress temp files (races with deleters are skipped).

    A pack counts the blocks it holds on disk: what eviction punched out of it is free.
    """
    total = 0
    for folder, pattern in (("data", "*/*.flp"), ("data", "*/*.part"), ("tmp", "*.part"), ("data", "packs/*.pack")):
        base = cache_dir / folder
        if not base.exists():
            continue
        for path in base.glob(pattern):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            total += min(st.st_size, st.st_blocks * 512) if path.suffix == ".pack" else st.st_size
    return total


def count_published(cache_dir: Path) -> int:
    """Entries published in the index (read-only; 0 before the index exists)."""
    db = cache_dir / "index" / INDEX_FILE
    if not db.exists():
        return 0
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            return int(con.execute(f"SELECT count(*) FROM {TABLE} WHERE key LIKE '{keys.ENTRY}%'").fetchone()[0])
        finally:
            con.close()
    except sqlite3.OperationalError:  # the writer is creating the index right now
        return 0


def tree_bytes(path: Path) -> int:
    """Bytes the files under ``path`` take; a sparse file (a pack with holes punched out
    of it) counts the blocks it holds, not its length."""
    total = 0
    for p in path.rglob("*"):
        try:
            if p.is_file():
                st = p.stat()
                total += min(st.st_size, st.st_blocks * 512)
        except FileNotFoundError:
            continue
    return total


def child_env(**extra: str) -> dict[str, str]:
    """Environment for child Python processes: this checkout importable, one thread each."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


PYTHON = sys.executable


def noise(name: str, size: int) -> bytes:
    """Deterministic incompressible bytes (stored raw, so disk use equals data size)."""
    out = bytearray()
    counter = 0
    while len(out) < size:
        out += hashlib.blake2b(f"{name}:{counter}".encode(), digest_size=64).digest()
        counter += 1
    return bytes(out[:size])


def make_noise_files(root: Path, n: int, size: int) -> dict[str, bytes]:
    """``n`` incompressible files ``root/item_k.bin``; returns relative path -> bytes."""
    root.mkdir(parents=True, exist_ok=True)
    files = {}
    for i in range(n):
        rel = f"item_{i:05d}.bin"
        files[rel] = noise(rel, size)
        (root / rel).write_bytes(files[rel])
    return files


def unreferenced_tails(cache: Any) -> list[str]:
    """Packs that run past the end of their last entry, or that no entry refers to:
    bytes that only a writer killed mid-append can leave, and ``check()`` reclaims."""
    ends: dict[str, int] = {}
    for e in cache.entries():
        if e.offset is not None:
            ends[e.path] = max(ends.get(e.path, 0), e.offset + e.charged)
    out = []
    for path in (cache.data_dir / "packs").glob("*.pack"):
        rel = f"packs/{path.name}"
        if path.stat().st_size > ends.get(rel, -1):
            out.append(f"{rel}: {path.stat().st_size} B, entries end at {ends.get(rel)}")
    return out
