"""Every command exits quietly when the reader of its stdout has gone (``fastload info | head -4``).

It ended in a BrokenPipeError traceback (issue 24, item 13).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXIT_PIPE = 141  # 128 + SIGPIPE: fastload.cli.EXIT_PIPE

ROOT = Path(__file__).resolve().parents[2]


def _fastload(*argv: str, stdout: int) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    return subprocess.run([sys.executable, "-m", "fastload", *argv], stdout=stdout, stderr=subprocess.PIPE, env=env,
                          text=True, timeout=120)


@pytest.mark.parametrize("command", [["info"], ["info", "--json"], ["cache", "DATA", "--no-progress"],
                                     ["cache", "DATA", "--dry-run"], ["evict", "--to", "1MB"], ["clear"]],
                         ids=lambda c: " ".join(c))
def test_a_closed_stdout_ends_the_command_quietly(command: list[str], tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    for i in range(3):
        (data / f"{i}.bin").write_bytes(os.urandom(1000))
    cache_dir = str(tmp_path / "cache")
    staged = _fastload("cache", str(data), "--cache-dir", cache_dir, "--no-progress", stdout=subprocess.DEVNULL)
    assert staged.returncode == 0, staged.stderr
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command writes: its first write meets a closed pipe
    try:
        done = _fastload(*[str(data) if a == "DATA" else a for a in command], "--cache-dir", cache_dir, stdout=write)
    finally:
        os.close(write)
    assert done.stderr == "", done.stderr  # no traceback, no "Exception ignored" at exit
    assert done.returncode == EXIT_PIPE

