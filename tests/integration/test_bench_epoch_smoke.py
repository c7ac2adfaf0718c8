"""Smoke test: the epoch benchmark runs end to end on a tiny dataset."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_epoch_bench_runs(tmp_path: Path, nginx_server: Callable) -> None:
    spec = importlib.util.spec_from_file_location("epoch_bench", Path(__file__).parents[2] / "benchmarks/epoch/bench.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(bench.parse_args(["--n", "20", "--workers", "1", "--epochs", "1", "--batch-size", "8", "--out", str(tmp_path)])) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert set(result["samples_per_s"]) == {"torch_http", "torch_local", "fastload_workers", "fastload_threads"}
    assert all(v > 0 for v in result["samples_per_s"].values())
