"""Smoke test for benchmarks/ordinary_server/bench.py, so the benchmark cannot rot.

A tiny unshaped run: it must report the link, the plain loop and fastload's run
with the request limit it settled on. Speed is not checked (STYLE.md, "Tests").
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest

pytestmark = pytest.mark.integration  # runs a real http.server and fastload in subprocesses


def test_tiny_unshaped_run_reports_every_figure(load_script: Callable[[str], ModuleType]) -> None:
    bench = load_script("benchmarks/ordinary_server/bench.py")
    result = bench.main(bench.parse_args(["--no-shaping", "--files", "8", "--kb", "5", "--workers", "2"]))
    assert result["link"].startswith("plain loopback, unshaped")
    assert result["link_mb_per_s"] > 0 and result["plain_loop_mb_per_s"] > 0
    (run,) = result["fastload"]
    assert run["workers"] == 2 and run["mb_per_s"] > 0 and isinstance(run["link_fraction"], float)
    assert run["concurrency"]["cap"] == 2 and 1 <= run["concurrency"]["peak"] <= 2
    # The issue-12 target is about the defaults: only --workers 2 ran, so it is not measured, and not met.
    assert result["target"]["value"] is None and result["target"]["verdict"].startswith("NOT MEASURED")
    assert not result["target"]["pass"]
    # The keep-alive, Range-speaking handler, with the plain clients that measure the server itself.
    keep = result["keepalive"]
    assert keep["server"].endswith("keepalive_server.py") and keep["plain_loop_mb_per_s"] > 0
    assert keep["plain_keepalive_mb_per_s"] > 0 and keep["plain_8_connections_mb_per_s"] > 0
    (run,) = keep["fastload"]
    assert run["workers"] == 2 and run["mb_per_s"] > 0 and run["concurrency"]["cap"] == 2


def test_target_is_the_median_of_the_default_runs(load_script: Callable[[str], ModuleType]) -> None:
    bench = load_script("benchmarks/ordinary_server/bench.py")
    runs = [{"workers": "default", "link_fraction": f} for f in (0.80, 0.88, 0.90)] + [{"workers": 4, "link_fraction": 0.1}]
    got = bench.target(runs)
    assert got["value"] == 0.88 and got["pass"] and got["verdict"] == "met" and got["runs"] == [0.80, 0.88, 0.90]
    assert bench.target(runs[:1])["verdict"] == "MISSED"
