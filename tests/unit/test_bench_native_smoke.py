"""The native benchmark runs end to end at tiny sizes (so it cannot rot)."""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from pathlib import Path
from types import ModuleType


def test_bench_main_tiny(tmp_path: Path, load_script: Callable[[str], ModuleType]) -> None:
    bench = load_script("benchmarks/native/bench.py")
    out = tmp_path / "r.csv"
    args = bench.parse_args(
        [
            "--cases", "assemble,loader,files", "--sizes", "8192", "--samples", "24", "--batches", "2",
            "--batch-size", "4", "--tokens", "300000", "--loader-batches", "2", "--read-threads", "2,1",
            "--repeats", "1", "--out", str(out),
        ]
    )  # fmt: skip
    assert bench.main(args) == 0
    text = out.read_text()
    assert "# python:" in text and "# native:" in text and "# command: python benchmarks/native/bench.py" in text
    rows = list(csv.DictReader(io.StringIO("".join(x for x in text.splitlines(True) if not x.startswith("#")))))
    got = {(r["case"], r["variant"], r["codec"], r["read_threads"]) for r in rows}
    assert ("assemble", "python", "lz4", "") in got and ("assemble", "python", "raw", "") in got
    assert ("loader", "python", "lz4", "1") in got and ("loader", "per_sample", "lz4", "2") in got
    assert ("files", "python", "lz4", "2") in got
    assert all(float(r["seconds"]) > 0 and float(r["items_per_s"]) > 0 for r in rows)
    assert all(float(r["ratio"]) == 1.0 for r in rows if r["variant"] == "python")
    if bench.gather.backend() == "native":
        assert ("assemble", "native", "lz4", "") in got and ("files", "native", "lz4", "1") in got
        assert {r["case"] for r in rows if r["variant"] == "best_vs_best"} == {"loader", "files"}
    assert bench.main(bench.parse_args(["--cases", "nope"])) == 2
