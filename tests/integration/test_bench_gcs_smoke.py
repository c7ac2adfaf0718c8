"""benchmarks/gcs/bench.py runs end to end on a few objects and counts each road's requests."""

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
