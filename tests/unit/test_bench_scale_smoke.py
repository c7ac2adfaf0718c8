"""Smoke test for benchmarks/scale/bench.py, so the benchmark cannot rot.

A ``--sizes 2000`` run (about 20 s on 2 cores) must complete end to end against a
real nginx and report every figure, present, finite and positive; the warm epoch
must make no request. Speed itself is not checked: timing belongs in the benchmark
(STYLE.md, "Tests"); this checks what the benchmark reports, not how fast.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil
import pytest


@pytest.fixture(scope="module")
def bench(load_script: Callable[[str], ModuleType]) -> ModuleType:
    return load_script("benchmarks/scale/bench.py")


def test_parse_args_defaults_and_errors(bench: ModuleType) -> None:
    full = bench.parse_args([])
    assert (full.sizes, full.workers, full.skip, full.batch_size) == ([10000, 100000], [0, 2], set(), 256)
    small = bench.parse_args(["--sizes", "2000,1000", "--skip", "epoch,rerun"])
    assert small.sizes == [1000, 2000] and small.skip == {"epoch", "rerun"}
    for bad in (["--skip", "nope"], ["--sizes", "10k"], ["--sizes", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_tree_is_reused_only_when_its_n_matches(bench: ModuleType, tmp_path: Path) -> None:
    first = bench.make_tree(tmp_path, 1001)
    files = bench.tree_files(first["root"])
    assert not first["reused"] and len(files) == 1001
    assert {Path(f).parent.name for f in files} == {"d0000", "d0001"}  # 1,000 per folder
    assert {Path(f).stat().st_size for f in files} == {bench.OBJECT_BYTES}
    assert bench.make_tree(tmp_path, 1001)["reused"]
    (tmp_path / "n1001.json").write_text(json.dumps(bench._tree_spec(1000)))  # a marker for another N
    again = bench.make_tree(tmp_path, 1001)
    assert not again["reused"] and len(bench.tree_files(again["root"])) == 1001


def _numbers(tree: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _numbers(value, f"{path}.{key}")
    elif isinstance(tree, list):
        for k, value in enumerate(tree):
            yield from _numbers(value, f"{path}[{k}]")
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        yield path, tree


@pytest.mark.integration  # a real nginx and child processes
def test_run_at_2000_reports_every_figure(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str], nginx_server: Any
) -> None:
    # nginx_server is requested only for its skip-or-fail check (nginx missing);
    # the benchmark starts and stops its own nginx.
    out, work = tmp_path / "results" / "scale.json", tmp_path / "work"
    assert bench.main(bench.parse_args(["--sizes", "2000", "--out", str(out), "--work", str(work)])) == 0
    res = json.loads(out.read_text())
    table = capsys.readouterr().out

    [row] = res["rows"]
    assert row["n"] == 2000
    assert set(bench.PHASES) | {"disk"} <= set(row)
    for phase in ("listing", "staging", "rerun", "info", "disk", "epoch"):
        for path, value in _numbers(row[phase], phase):
            assert math.isfinite(value), path
            if path.endswith("rss_bytes_per_object"):
                continue  # (peak at N - peak at 1 object) / N: finite, its sign is not the test's business
            if path.endswith("requests") and path.startswith("epoch"):
                assert value == 0, f"{path}: a warm epoch over a staged cache sent {value} requests"
            elif not path.endswith(("cuts", "generate_s")):
                assert value > 0, path
    assert row["staging"]["fastload_requests"] >= 2000 and row["staging"]["baseline_requests"] >= 2000
    assert row["rerun"]["requests"] < 2000  # it lists again, and fetches nothing
    assert row["info"]["entries"] == 2000 and row["disk"]["payload_bytes"] == 2000 * bench.OBJECT_BYTES
    assert set(row["epoch"]) == {"batch_size", "workers0", "workers2"}
    assert row["epoch"]["workers0"]["fastload_vs_smallest_n"] == 1.0  # the only N is the smallest
    assert res["at_rest"]["fastload_peak_rss_bytes"] > 0

    for title in ("listing", "staging", "rerun", "disk", "warm epoch"):
        assert title in table
    assert table.count("\n     2000 ") == 6  # one row per section: listing, staging, rerun, disk, 2 epochs
    assert "| kernel |" in out.with_suffix(".md").read_text()

    # The generated trees stay under --work (reused next time); the caches and nginx are gone.
    assert sorted(p.name for p in (work / "trees").iterdir()) == ["n1", "n1.json", "n2000", "n2000.json"]
    assert [p.name for p in work.iterdir()] == ["trees"]
    assert not [p for p in psutil.Process().children(recursive=True) if "nginx" in p.name()]
