"""Smoke test for benchmarks/cache/bench.py, so the benchmark cannot rot.

A ``--quick --no-shaping`` run (a few seconds) must complete end to end through
the in-process throttle fallback and report every measurement with sane values.
Speed itself is not checked here: timing belongs in the benchmark
(STYLE.md, "Tests"); this checks what the benchmark reports, not how fast.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("PIL", reason="the benchmark's sample data needs Pillow")
pytest.importorskip("sklearn", reason="the benchmark's sample data needs scikit-learn")

pytestmark = pytest.mark.integration  # runs a real nginx



@pytest.fixture(scope="module")
def bench(load_script: Callable[[str], ModuleType]) -> ModuleType:
    return load_script("benchmarks/cache/bench.py")


def test_parse_args_defaults_describe_the_full_run(bench: ModuleType) -> None:
    full = bench.parse_args([])
    assert (full.images, full.big_mb, full.workers, full.repeats) == (600, 50.0, [8, 16, 32], 3)
    assert (full.rate, full.burst, full.latency) == ("200mbit", "128kb", "100ms")
    quick = bench.parse_args(["--quick", "--workers", "2,3"])
    assert quick.images < full.images and quick.workers == [2, 3] and quick.repeats == 1


def test_tc_units_match_iproute2(bench: ModuleType) -> None:
    assert bench._tc_value("200mbit", bench._TC_RATE, "rate") == 25e6
    assert bench._tc_value("1gbit", bench._TC_RATE, "rate") == 125e6
    assert bench._tc_value("128kb", bench._TC_SIZE, "burst") == 128 * 1024
    with pytest.raises(ValueError, match="tc units"):
        bench._tc_value("fast", bench._TC_RATE, "rate")


def test_quick_fallback_run_reports_every_measurement(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str], nginx_server: Any
) -> None:
    # nginx_server is requested only for its skip-or-fail check (nginx missing);
    # the benchmark starts and stops its own nginx.
    out = tmp_path / "out"
    args = bench.parse_args(["--quick", "--no-shaping", "--out", str(out), "--work-dir", str(tmp_path)])
    assert bench.main(args) == 0

    res = json.loads((out / "results.json").read_text())
    assert json.loads(capsys.readouterr().out) == res  # stdout carries exactly the JSON
    assert list(tmp_path.glob("fastload-bench-cache-*")) == []  # work folder removed

    link = res["link"]
    assert link["mode"] == "proxy-token-bucket"
    assert "--no-shaping" in link["fallback_reason"] and "FALLBACK" in link["description"]
    assert link["nominal_mb_s"] == 25.0 and link["mb_s"] > 0
    # The token bucket shaped the download: it held it back (a file larger than its burst), and said so.
    assert link["bucket_held_s"] > 0 and link["file_bytes"] > 128 * 1024

    ds = res["dataset"]
    assert ds["items"] == args.images and 50_000 < ds["avg_item_bytes"] < 200_000

    assert [c["workers"] for c in res["cold"]] == args.workers
    for cold in res["cold"]:
        assert cold["mb_s"] > 0 and cold["pct_of_link"] > 0
        for run in cold["runs"]:
            assert run["items"] == ds["items"] and run["fetched_bytes"] == ds["bytes"]
            assert 0.9 < run["ratio"] <= 1.0  # JPEG is stored raw; headers cost a little

    warm = res["warm"]
    assert warm["threads_1"]["mb_s"] > 0 and warm["threads_1"]["remote_requests"] == 0
    assert warm["threads_1_page_cache_cold"]["mb_s"] > 0
    assert res["disk"]["payloads"] == ds["items"] and 1 <= res["disk"]["files"] <= ds["items"]  # small ones share packs
    assert res["disk"]["page_cache_hot_mb_s"] > 0 and res["disk"]["page_cache_cold_mb_s"] > 0

    codecs = res["codec"]
    assert set(codecs) == {"jpeg", "uint8", "int32_tokens"}
    assert codecs["jpeg"]["codecs"] == {"raw": ds["items"]}
    assert codecs["int32_tokens"]["ratio"] > 1.2  # Zipf token ids compress under LZ4
    for kind in codecs.values():
        assert kind["ratio"] > 0 and kind["decode_gb_s"] > 0 and kind["encode_gb_s"] > 0

    targets = res["targets"]
    assert set(targets) == {"cold_vs_link", "warm_vs_cold"}
    assert all(t["value"] > 0 and isinstance(t["pass"], bool) for t in targets.values())

    md = (out / "results.md").read_text()
    assert "FALLBACK" in md and "| kernel |" in md and "| nginx |" in md
