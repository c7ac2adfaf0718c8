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
