"""benchmarks/open/align.py runs end to end on a coarse grid (so it cannot rot)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_align_draws_both_grids_and_splits_cells_by_the_rule(tmp_path: Path) -> None:
    data = tmp_path / "data.bin"
    data.write_bytes(bytes(range(256)) * (17 << 12))  # 17 MiB: 16 reads of 1 MiB past a line's offset
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks/open/align.py"), "--step", "16", "--file", str(data)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    for name in ("read", "memmove"):
        assert f"{name}: GB/s, rows: source's place in its line" in done.stdout
        assert f"{name}: cells the rule calls slow: median" in done.stdout
    assert data.exists()  # a file given is read, not removed
