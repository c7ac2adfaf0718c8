"""Small shared helpers of the reliability suite (datasets, cache inspection, subprocesses)."""

from __future__ import annotations

import hashlib
import os
import random
import sys
from pathlib import Path

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
    data = cache_dir / "data"
    return sorted(data.glob("*/*.flp")) if data.exists() else []


def payload_bytes(cache_dir: Path) -> int:
    """Bytes of payload files and in-progress temp files (races with deleters are skipped)."""
    total = 0
    for folder, pattern in (("data", "*/*.flp"), ("data", "*/*.part"), ("tmp", "*.part")):
        base = cache_dir / folder
        if not base.exists():
            continue
        for path in base.glob(pattern):
            try:
                total += path.stat().st_size
            except FileNotFoundError:
                continue
    return total


def tree_bytes(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        try:
            if p.is_file():
                total += p.stat().st_size
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
