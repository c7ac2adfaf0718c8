"""Smoke test: the epoch benchmark runs end to end on a tiny dataset."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.integration


def test_epoch_bench_runs(tmp_path: Path, nginx_server: Callable, load_script: Callable[[str], ModuleType]) -> None:
    bench = load_script("benchmarks/epoch/bench.py")
    assert bench.main(bench.parse_args(["--n", "20", "--workers", "1", "--epochs", "1", "--batch-size", "8", "--out", str(tmp_path)])) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert set(result["samples_per_s"]) == {"torch_http", "torch_local", "fastload_workers", "fastload_threads"}
    assert all(v > 0 for v in result["samples_per_s"].values())
