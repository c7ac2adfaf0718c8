"""Smoke tests for benchmarks/s3 (bench.py, signing.py), so the benchmarks cannot rot.

Tiny unshaped runs: every row must be measured, over http:// and https://, with one
request per object counted in nginx's log; issue 34's configurations (``--done-when``)
check every byte. Speed is not checked (STYLE.md, "Tests").
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
                                          "--schemes", "http,https",
                                          "--clients", "fastload_s3,fastload_s3_listed,fastload_s3fs,engine,obstore"]))
    rows = {(r["scheme"], r["client"]): r for r in report["rows"]}
    assert {scheme for scheme, _ in rows} == {"http", "https"}  # every client over both: nginx ssl, a private CA
    for scheme in ("http", "https"):
        for name in ("fastload_s3", "fastload_s3_listed", "engine"):
            row = rows[(scheme, name)]
            assert "error" not in row, row
            assert row["n"] == 30 and row["bytes"] == 30 * 20_000
            assert row["requests_per_object"] == 1.0  # one GET each, no HEAD
        assert rows[(scheme, "fastload_s3fs")]["requests_per_object"] == 2.0  # the road before: a HEAD and a GET
        assert rows[(scheme, "obstore")]["error"].startswith("not run")  # no --peers-python: said, not dropped
    assert [link["scheme"] for link in report["links"]] == ["http", "https"]
    assert all(link["link_mb_s"] > 0 for link in report["links"])


def test_done_when_rows_check_every_byte_and_count_requests(load_script: Callable[[str], ModuleType],
                                                            nginx_server: Any) -> None:
    # Issue 34's configurations: whichever road each takes today, every byte must be right and
    # its requests counted; 1 or 2 per object (the fast road, or the fallback to s3fs).
    if curl.engine() is None:
        pytest.skip(f"libcurl's engine cannot run here: {curl.unavailable()}")
    bench = load_script("benchmarks/s3/bench.py")
    args = bench.parse_args(["--done-when", "--no-shaping", "--objects", "12", "--kb", "5", "--delay-ms", "0"])
    assert args.configs == list(bench.CONFIGS)
    report = bench.main(args)
    rows = {r["config"]: r for r in report["rows"]}
    assert set(rows) == set(bench.CONFIGS)
    for name, row in rows.items():
        assert "error" not in row, row
        assert row["scheme"] == bench.CONFIGS[name][0]
        assert row["bytes_right"] is True and row["wrong"] == 0 and row["n"] == 12
        assert row["requests_per_object"] in (1.0, 2.0)
        assert row["cpu_ms_per_object_with_setup"] > row["cpu_ms_per_object"] > 0
    assert rows["http_options"]["requests_per_object"] == 1.0  # the baseline is on the fast road


def test_done_when_defaults_and_bad_names(load_script: Callable[[str], ModuleType]) -> None:
    bench = load_script("benchmarks/s3/bench.py")
    done_when = bench.parse_args(["--done-when"])
    assert done_when.objects == 5000 and done_when.batch_size == 0  # the 5,000 keys, DataLoader defaults
    assert bench.parse_args([]).objects == 2000 and bench.parse_args([]).schemes == ["http", "https"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--done-when", "--configs", "https_nope"])


def test_signing_run_reports_both_modes(load_script: Callable[[str], ModuleType], nginx_server: Any) -> None:
    if curl.engine() is None:
        pytest.skip(f"libcurl's engine cannot run here: {curl.unavailable()}")
    signing = load_script("benchmarks/s3/signing.py")
    report = signing.main(signing.parse_args(["--objects", "40", "--kb", "5", "--rounds", "1"]))
    assert report["sign_us"] > 0
    assert [(r["mode"], r["ok"]) for r in report["rows"]] == [("unsigned", 40), ("signed", 40)]
