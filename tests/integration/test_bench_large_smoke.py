"""Smoke test for benchmarks/large/bench.py, so the benchmark cannot rot.

A tiny run: every way it was asked for reports a rate and a peak RSS, and fastload's
ratio to curl. Speed is not checked (STYLE.md, "Tests").
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.integration  # a real nginx, curl and `fastload cache` in subprocesses


@pytest.mark.usefixtures("nginx_server")  # skips (or, in CI, fails) where nginx is missing; the script starts its own
def test_tiny_run_reports_every_way(load_script: Callable[[str], ModuleType], tmp_path: Path) -> None:
    if shutil.which("curl") is None or not Path("/usr/bin/time").exists():
        pytest.skip("curl or /usr/bin/time missing")
    bench = load_script("benchmarks/large/bench.py")
    out = bench.main(bench.parse_args(["--big", "20MB", "--parts", "2", "--part-size", "4MB", "--rounds", "1",
                                       "--curl-parts", "2", "--ways", "curl,fastload", "--dir", str(tmp_path)]))
    assert [s["set"] for s in out["sets"]] == ["big", "parts"]
    for s in out["sets"]:
        for way in ("curl", "curl_2_parts", "fastload"):
            assert s[way]["mb_s"] > 0 and s[way]["peak_rss_mb"] > 0
        assert s["fastload_to_curl"] > 0
    assert list(tmp_path.iterdir()) == []  # data and caches deleted
