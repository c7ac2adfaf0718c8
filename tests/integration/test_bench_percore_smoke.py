"""Smoke test for benchmarks/percore/bench.py (issue 36), so the benchmark cannot rot.

A tiny run (50 small objects, 2 large of 4 MB): every client row over every scheme it
speaks is measured, on both data sets, with one GET per object where the client sends one;
the engine row is the ratios' base, and the write row (no network) the page-cache ceiling's. Speed is not checked (STYLE.md, "Tests").
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

from fastload.transport import curl

pytestmark = pytest.mark.integration  # nginx, and clients in pinned subprocesses


def test_tiny_run_measures_every_row(load_script: Callable[[str], ModuleType], nginx_server: Any) -> None:
    bench = load_script("benchmarks/percore/bench.py")
    why = bench.unavailable()  # nginx is checked by the fixture (a failure in CI); taskset and the cores here
    if why:
        pytest.skip(why)
    if curl.engine() is None:
        pytest.skip(f"libcurl's engine cannot run here: {curl.unavailable()}")
    # No --peers-python: the s3torchconnector row must say it was not run, not vanish.
    report = bench.main(bench.parse_args(["--objects", "50", "--kb", "20", "--large", "2", "--large-mb", "4",
                                          "--peers-python", ""]))
    assert report["client_cores"] == [bench.CLIENT_CORE] and report["nginx_cores"] == [bench.SERVER_CORE]
    summary = {(s["size"], s["scheme"], s["client"]): s for s in report["summary"]}
    want = {(size, scheme, client) for size in bench.SIZES for client in bench.CLIENTS for scheme in bench.SPEAKS[client]}
    assert set(summary) == want
    assert summary[("small", "s3", "s3torchconnector")]["error"].startswith("not run")
    for size, n, nbytes in (("small", 50, 20_000), ("large", 2, 4_000_000)):
        for (s, scheme, client), line in summary.items():
            if s != size or client == "s3torchconnector":
                continue
            row = next(r for r in report["rows"] if (r["size"], r["scheme"], r["client"]) == (s, scheme, client))
            assert "error" not in row, row
            assert row["n"] == n and row["bytes"] == n * nbytes, row
            assert row["mb_s"] > 0 and row["objects_per_s"] > 0 and row["cpu_ms_per_object"] > 0, row
            assert row["setup_cpu_s"] > 0, row  # the process's start at least: measured apart from the epoch
            if client == "write":  # the page-cache ceiling: no request at all
                assert row["requests_per_object"] == 0 and line["x_write_mb_s"] == 1.0, row
            else:
                assert row["requests_per_object"] >= 1.0, row  # every object came from nginx, none from a cache
            assert line["x_engine_objects_per_s"] > 0 and line["x_engine_cpu"] > 0 and line["x_write_mb_s"] > 0
        for scheme in bench.SCHEMES:
            engine = summary[(size, scheme, "engine")]
            assert engine["x_engine_objects_per_s"] == 1.0 and engine["requests_per_object"] == 1.0
    assert "| small | http | engine |" in bench.table(report["summary"])
