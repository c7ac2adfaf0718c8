"""benchmarks/gcs/bench.py and http2.py run end to end on a few objects and count each road's requests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from fastload import _servers
from fastload.transport import curl

pytestmark = pytest.mark.integration


def test_gcs_bench_rows_count_one_get_per_object_on_the_engine(
        load_script: Callable[[str], Any], gcs_emulator: _servers.GcsEmulator) -> None:
    if curl.engine() is None:
        pytest.skip(f"libcurl's engine cannot run here: {curl.unavailable()}")
    bench = load_script("benchmarks/gcs/bench.py")
    result = bench.run(bench.parse_args(["--objects", "12", "--kb", "20", "--clients", "engine,gcsfs"]))
    rows = {r["client"]: r for r in result["rows"]}
    assert (rows["engine"]["get_per_object"], rows["engine"]["metadata_per_object"]) == (1.0, 0.0)
    assert rows["gcsfs"]["metadata_per_object"] == 1.0  # the road before: a metadata request each
    assert all(r["mb_s"] > 0 and r["cpu_ms_per_object"] > 0 for r in rows.values())


def test_http2_bench_answers_each_client_in_the_version_it_asked_for(
        load_script: Callable[[str], Any], nginx_server: Any) -> None:
    # nginx_server is requested only for its skip-or-fail check; the benchmark runs its own (ssl http2).
    if curl.engine() is None:
        pytest.skip(f"libcurl's engine cannot run here: {curl.unavailable()}")
    bench = load_script("benchmarks/gcs/http2.py")
    report = bench.main(bench.parse_args(["--no-shaping", "--objects", "10", "--kb", "5", "--delay-ms", "0",
                                          "--repeats", "1", "--inflight", "4"]))
    rows = {r["client"]: r for r in report["rows"]}
    assert set(rows) == set(bench.CLIENTS)
    for name, row in rows.items():
        assert "error" not in row, row
        assert row["bytes_right"] and row["requests_per_object"] == 1.0
        assert row["protocols"] == (["HTTP/2.0"] if name.endswith("h2") else ["HTTP/1.1"])
    assert rows["curl_h2"]["connections"] == 1  # the curl tool multiplexes its streams on one connection
