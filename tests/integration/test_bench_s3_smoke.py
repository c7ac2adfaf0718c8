"""Smoke tests for benchmarks/s3 (bench.py, signing.py), so the benchmarks cannot rot.

Tiny unshaped runs: every row must be measured, with one request per object counted
in nginx's log. Speed is not checked (STYLE.md, "Tests").
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

from fastload.transport import curl

pytestmark = pytest.mark.integration  # nginx, and fastload in subprocesses


def test_tiny_unshaped_run_measures_every_fastload_row(load_script: Callable[[str], ModuleType], nginx_server: Any) -> None:
    if curl.engine() is None:
        pytest.skip(f"libcurl's engine cannot run here: {curl.unavailable()}")
    bench = load_script("benchmarks/s3/bench.py")
    report = bench.main(bench.parse_args(["--no-shaping", "--objects", "30", "--kb", "20", "--delay-ms", "0",
                                          "--clients", "fastload_s3,fastload_s3_listed,fastload_s3fs,engine,obstore"]))
    rows = {r["client"]: r for r in report["rows"]}
    for name in ("fastload_s3", "fastload_s3_listed", "engine"):
        assert "error" not in rows[name], rows[name]
        assert rows[name]["n"] == 30 and rows[name]["bytes"] == 30 * 20_000
        assert rows[name]["requests_per_object"] == 1.0  # one GET each, no HEAD
    assert rows["fastload_s3fs"]["requests_per_object"] == 2.0  # the road before: a HEAD and a GET
    assert rows["obstore"]["error"].startswith("not run")  # no --peers-python: said, not dropped
    assert report["links"][0]["link_mb_s"] > 0


def test_signing_run_reports_both_modes(load_script: Callable[[str], ModuleType], nginx_server: Any) -> None:
    if curl.engine() is None:
        pytest.skip(f"libcurl's engine cannot run here: {curl.unavailable()}")
    signing = load_script("benchmarks/s3/signing.py")
    report = signing.main(signing.parse_args(["--objects", "40", "--kb", "5", "--rounds", "1"]))
    assert report["sign_us"] > 0
    assert [(r["mode"], r["ok"]) for r in report["rows"]] == [("unsigned", 40), ("signed", 40)]
