"""Smoke test for benchmarks/formats/bench.py, so the benchmark cannot rot.

A tiny run of each format whose library is installed (neither is in the test extra:
tests/integration/test_formats_mds.py and test_formats_litdata.py say why): every pass
is timed and every sample counted. Speed is not checked (STYLE.md, "Tests").
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from types import ModuleType

import pytest

pytestmark = pytest.mark.integration  # a real nginx


@pytest.mark.usefixtures("nginx_server")  # skips (or, in CI, fails) where nginx is missing; the script starts its own
@pytest.mark.parametrize("fmt,module", [("mds", "streaming"), ("litdata", "litdata")])
def test_tiny_run_times_every_pass(load_script: Callable[[str], ModuleType], fmt: str, module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (not in the test extra); the benchmark reports {fmt} as skipped")
    bench = load_script("benchmarks/formats/bench.py")
    (out,) = bench.main(bench.parse_args(["--samples", "40", "--size", "2000", "--batch", "8", "--shard-mb", "0.02",
                                          "--formats", fmt]))
    if "skipped" in out:  # the library is present but does not import (the bench catches ImportError only)
        pytest.skip(f"benchmarks/formats/bench.py skipped {fmt}: {out['skipped']}")
    assert out["samples"] == 40 and out["shards"] > 1
    for key in ("fastload_cold_samples_s", "fastload_warm_samples_s", "own_local_first_samples_s",
                "own_local_second_samples_s", "link_mb_s"):
        assert out[key] > 0, key
