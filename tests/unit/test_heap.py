"""The loader keeps freed batches' memory for the next batch (fastload.read.heap)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

import fastload
from fastload.read import heap

# A fresh process (the thresholds are process-wide): two batches of 64 samples of
# 112 KB, one after the other, as a training loop drops one and reads the next.
_BATCHES = """
import json, resource, sys
import fastload
loader = fastload.DataLoader(list(range(4)))  # constructing a loader is enough
from fastload.read import heap
def batch():
    return [b"x" * 112_000 for _ in range(64)]
b = batch(); del b
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
b = batch(); del b
print(json.dumps({"faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 64,
                  "allocator": heap.keep_freed()}))
"""


def _run(**env: str) -> dict[str, object]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "FASTLOAD_KEEP_FREED"}
    proc = subprocess.run([sys.executable, "-c", _BATCHES], env={**clean, **env}, capture_output=True, text=True,
                          timeout=120, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's (mallopt)")
def test_a_batch_reuses_the_memory_of_the_one_before() -> None:
    kept = _run()
    assert str(kept["allocator"]).startswith("set:")
    assert float(kept["faults"]) < 2  # type: ignore[arg-type]
    # Without it glibc hands the freed batch back and the next one faults its pages in.
    default = _run(FASTLOAD_KEEP_FREED="0")
    assert default["allocator"] == "left as it is: FASTLOAD_KEEP_FREED=0"
    assert float(default["faults"]) > 10  # type: ignore[arg-type]


def test_the_user_s_own_malloc_settings_are_left_alone() -> None:
    got = _run(MALLOC_TRIM_THRESHOLD_="1000000")
    assert got["allocator"] == "left as it is: MALLOC_TRIM_THRESHOLD_ or MALLOC_MMAP_THRESHOLD_ is set"


def test_keep_freed_acts_once_per_process() -> None:
    fastload.DataLoader(list(range(4)))
    assert heap.keep_freed() == heap.keep_freed() == heap._done[os.getpid()]
