"""Smoke test for benchmarks/open/bench.py, so the benchmark cannot rot.

A tiny run: it must report all three ways, and warm opens must send nginx no
request. Speed is not checked (STYLE.md, "Tests").
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest

pytestmark = pytest.mark.integration  # a real nginx


@pytest.mark.usefixtures("nginx_server")  # skips (or, in CI, fails) where nginx is missing; the script starts its own
def test_tiny_run_reports_every_way_and_warm_opens_stay_local(load_script: Callable[[str], ModuleType]) -> None:
    bench = load_script("benchmarks/open/bench.py")
    out = bench.main(["--files", "12", "--size", "20000", "--threads", "2", "--rounds", "1"])
    assert out["plain_open_mb_s"] > 0 and out["fastload_open_mb_s"] > 0 and out["fsspec_fastload_mb_s"] > 0
    assert 0 < out["open_ratio"] and 0 < out["fsspec_ratio"]
    assert out["requests_while_warm"] == 0
