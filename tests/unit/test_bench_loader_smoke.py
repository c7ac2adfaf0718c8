"""The loader benchmark runs end to end at tiny sizes (so it cannot rot)."""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from pathlib import Path
from types import ModuleType


def test_bench_main_tiny(tmp_path: Path, capsys: object, load_script: Callable[[str], ModuleType]) -> None:
    bench = load_script("benchmarks/loader/bench.py")
    out = tmp_path / "r.csv"
    args = bench.parse_args(
        [
            "--samples", "64", "--min-batches", "2", "--batch-sizes", "1,8", "--repeats", "1",
            "--read-samples", "16", "--read-latency-ms", "0.1", "--read-batch-size", "4",
            "--read-threads", "2", "--device-batches", "2", "--device-batch-size", "2",
            "--device-compute", "1", "--stats-pairs", "3", "--stats-chunk-ms", "0.5",
            "--workers-samples", "24", "--workers-bytes", "3000", "--workers-batch-size", "8",
            "--out", str(out),
        ]
    )  # fmt: skip
    assert bench.main(args) == 0
    text = out.read_text()
    assert "# python:" in text and "# torch:" in text
    rows = list(
        csv.DictReader(
            io.StringIO("".join(x for x in text.splitlines(True) if not x.startswith("#")))
        )
    )
    cases = {(r["case"], r["variant"], r["batch_size"]) for r in rows}
    assert ("overhead", "torch", "8") in cases and ("overhead", "fastload_stats_on", "1") in cases
    assert ("stats", "on_vs_off", "8") in cases
    assert any(c[0] == "read_batch" and c[1].startswith("fastload") for c in cases)
    assert any(c[0] == "device" for c in cases)
    workers = {r["variant"]: r for r in rows if r["case"] == "workers"}
    assert set(workers) == {
        "cold_workers0", "cold_workers2", "warm_workers0", "warm_workers2", "warm_workers2_reiterated",
        "warm_workers2_persistent",
    }  # fmt: skip
    assert float(workers["warm_workers0"]["ratio"]) == 1.0 and float(workers["warm_workers2"]["ratio"]) > 0
    assert all(float(r["seconds"]) > 0 for r in rows if r["variant"] != "skipped")
    assert bench.main(bench.parse_args(["--cases", "nope"])) == 2
