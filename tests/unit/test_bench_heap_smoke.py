"""benchmarks/loader/heap.py runs end to end at a tiny size (so it cannot rot)."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="compares glibc's thresholds")
def test_heap_bench_compares_a_default_child_with_a_kept_one(tmp_path: Path) -> None:
    out = tmp_path / "heap.md"
    cmd = [sys.executable, str(ROOT / "benchmarks/loader/heap.py"), "--samples", "40", "--bytes", "3000",
           "--batch-size", "8", "--epochs", "1", "--copies", "2", "--rounds", "2", "--work", str(tmp_path / "w"),
           "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    assert "default: left as it is: FASTLOAD_KEEP_FREED=0; kept: set: mmap threshold 32 MiB" in text
    for row in ("copy, us per sample", "warm workers0", "warm reiterated", "warm persistent"):
        assert f"| {row}" in text
