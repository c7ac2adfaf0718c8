"""Smoke test: the tar benchmark runs end to end on tiny shards (speed is not checked)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.usefixtures("nginx_server")  # skips (or, in CI, fails) where nginx is missing; the script starts its own
def test_tar_bench_runs(tmp_path: Path, load_script: Callable[[str], ModuleType]) -> None:
    pytest.importorskip("webdataset", reason="the peer: pip install -r benchmarks/tar/requirements.txt")
    bench = load_script("benchmarks/tar/bench.py")
    args = ["--shards", "2", "--samples", "20", "--member-bytes", "2000", "--rounds", "1", "--per-member-samples", "5",
            "--out", str(tmp_path)]
    assert bench.main(bench.parse_args(args)) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert set(result["samples_per_s"]) == {"webdataset", "fastload_cold", "fastload_warm_kept", "fastload_warm_kept_quarter", "fastload_warm_batch",
                                            "fastload_warm_batch_1mib", "fastload_warm_per_member"}
    assert all(v > 0 for v in result["samples_per_s"].values()) and result["link_mb_s"] > 0
    assert result["cold_indexed_vs_link"] > 0
