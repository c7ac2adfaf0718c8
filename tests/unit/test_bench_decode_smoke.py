"""The decode benchmark runs end to end at tiny sizes (so it cannot rot)."""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest


def test_bench_main_tiny(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], load_script: Callable[[str], ModuleType]
) -> None:
    bench: object = load_script("benchmarks/decode/bench.py")
    out = tmp_path / "r.csv"
    args = bench.parse_args(  # type: ignore[attr-defined]
        ["--images", "6", "--batch-size", "3", "--threads", "1", "--repeats", "1", "--size", "64",
         "--backends", "torch,dali", "--out", str(out)]
    )  # fmt: skip
    assert bench.main(args) == 0  # type: ignore[attr-defined]
    text = out.read_text()
    assert "# python:" in text and "# cpus:" in text and "# command:" in text and "# load average" in text
    rows = list(csv.DictReader(io.StringIO("".join(x for x in text.splitlines(True) if not x.startswith("#")))))
    decode = [r for r in rows if r["case"] == "decode"]
    assert {(r["variant"], r["mode"]) for r in decode} >= {("torch", "val"), ("torch", "train")}
    assert all(float(r["img_s"]) > 0 and float(r["img_s_per_core"]) > 0 for r in decode)
    link = {r["variant"]: r for r in rows if r["case"] == "link"}
    assert list(link) == ["jpeg", "lz4_uint8", "uint8", "fp16", "fp32"]
    assert int(link["uint8"]["bytes_per_sample"]) == 64 * 64 * 3
    assert int(link["fp32"]["bytes_per_sample"]) == 4 * int(link["uint8"]["bytes_per_sample"])
    assert int(link["fp32"]["link_cap_img_s"]) < int(link["uint8"]["link_cap_img_s"])
    assert bench.main(bench.parse_args(["--cases", "nope"])) == 2  # type: ignore[attr-defined]
    md = bench.parse_args(["--cases", "link", "--images", "2", "--format", "md", "--size", "32"])  # type: ignore[attr-defined]
    assert bench.main(md) == 0  # type: ignore[attr-defined]
    assert "| lz4_uint8 |" in capsys.readouterr().out
