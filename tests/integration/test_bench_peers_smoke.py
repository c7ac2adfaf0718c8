"""Smoke test for benchmarks/peers/bench.py, so the benchmark cannot rot.

A ``--quick`` run (no shaping, the naive torch+fsspec peer and fastload, both
modes, 20 images, peers from this interpreter instead of .venv-peers) must run
end to end and report every field the results table needs. Speed itself is not
checked: timing belongs in the benchmark (STYLE.md, "Tests").
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("PIL", reason="the benchmark's sample data needs Pillow")
pytest.importorskip("sklearn", reason="the benchmark's sample data needs scikit-learn")
pytest.importorskip("psutil", reason="the benchmark measures peak RSS with psutil")

pytestmark = pytest.mark.integration  # real nginx, subprocesses



@pytest.fixture(scope="module")
def bench(load_script: Callable[[str], ModuleType]) -> ModuleType:
    return load_script("benchmarks/peers/bench.py")


def test_parse_args_full_run_covers_every_peer_and_both_links(bench: ModuleType) -> None:
    full = bench.parse_args([])
    assert full.images == 3000 and full.epochs == 2
    assert [link.name for link in full.links] == ["200mbit", "1gbit", "1gbit+20ms"]
    assert [link.delay_ms for link in full.links] == [0, 0, 20]
    assert set(full.peers) >= {"torch_fsspec", "fsspec_simplecache", "fsspec_filecache", "webdataset",
                               "streaming", "litdata", "dali", "fastload"}
    assert full.links[1].burst == "1mb" and full.links[0].burst == "128kb"  # tbf needs rate/HZ at 1 Gbit
    quick = bench.parse_args(["--quick"])
    assert quick.peers == ["torch_fsspec", "fastload"] and [link.name for link in quick.links] == ["none"]
    tls = bench.parse_args(["--links", "1gbit+tls,1gbit+20ms+tls,none+tls"]).links
    assert [(link.rate, link.delay_ms, link.tls) for link in tls] == [("1gbit", 0, True), ("1gbit", 20, True),
                                                                       (None, 0, True)]
    assert not any(link.tls for link in full.links)


def test_quick_run_over_https_reads_every_sample(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str], nginx_server: Any
) -> None:
    # A +tls link: nginx ssl with a private CA, told to each peer by SSL_CERT_FILE and friends.
    out = tmp_path / "out"
    args = bench.parse_args(["--quick", "--images", "10", "--links", "none+tls", "--modes", "raw", "--epochs", "1",
                             "--out", str(out), "--work-dir", str(tmp_path)])
    assert bench.main(args) == 0
    res = json.loads(capsys.readouterr().out)
    assert "https://" in res["links"][0]["description"]
    runs = {r["peer"]: r for r in res["runs"]}
    assert set(runs) == {"torch_fsspec", "fastload"}
    for run in runs.values():
        assert "error" not in run, run.get("error")
        assert run["epochs"][0]["samples"] == 10 and run["epochs"][0]["complete"]


def test_quick_run_reports_every_peer_mode_and_epoch(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str], nginx_server: Any
) -> None:
    # nginx_server is requested only for its skip-or-fail check; the benchmark runs its own.
    out = tmp_path / "out"
    args = bench.parse_args(["--quick", "--images", "20", "--out", str(out), "--work-dir", str(tmp_path)])
    assert bench.main(args) == 0

    res = json.loads((out / "results.json").read_text())
    assert json.loads(capsys.readouterr().out) == res  # stdout carries exactly the JSON
    assert list(tmp_path.glob("fastload-bench-peers-*")) == []  # work folder removed
    assert res["dataset"]["images"] == 20 and 50_000 < res["dataset"]["avg_jpeg_bytes"] < 200_000

    runs = {(r["peer"], r["mode"]): r for r in res["runs"]}
    assert set(runs) == {(p, m) for p in ("torch_fsspec", "fastload") for m in ("raw", "decode")}
    for (peer, mode), run in runs.items():
        assert "error" not in run, run.get("error")
        assert [e["epoch"] for e in run["epochs"]] == [1, 2]
        for epoch in run["epochs"]:
            assert epoch["samples"] == 20 and epoch["complete"] and epoch["samples_per_s"] > 0
            if mode == "decode":
                assert epoch["delivered_bytes"] == 20 * 224 * 224 * 3
        assert run["peak_rss_mb"] > 0
        # fastload caches the JPEGs (raw, plus headers and its index); the naive peer has no cache.
        if peer == "fastload":
            assert run["cache_bytes"] >= res["dataset"]["jpeg_bytes"]
        else:
            assert run["cache_bytes"] == 0

    assert res["links"][0]["limit"]["mb_s"] > 0
    assert set(res["ceilings"]) == {"raw", "raw2", "decode"}
    targets = res["targets"]
    assert {"cold_vs_link[none]", "warm_vs_best_peer[none,raw]", "warm_vs_disk[none,raw]"} <= set(targets)

    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 8 and {r["epoch"] for r in rows} == {"1", "2"}
    md = (out / "results.md").read_text()
    assert "| fastload |" in md and "## Machine" in md and "## Targets" in md
    assert (out / "results.png").stat().st_size > 1000


def test_cpu_per_object_reports_both_epochs(
    capsys: pytest.CaptureFixture[str], load_script: Callable[[str], ModuleType], nginx_server: Any
) -> None:
    # nginx_server is requested only for its skip-or-fail check; the script runs its own
    # (a machine without nginx: tests/integration/test_fresh_machine.py).
    module = load_script("benchmarks/peers/cpu_per_object.py")
    assert module.main(["--images", "30", "--read-threads", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["read_threads"] == 2
    for epoch in ("cold", "warm"):
        r = out[epoch]
        assert r["objects"] == 30 and r["objects_per_s"] > 0
        assert r["user_ms_per_object"] >= 0 and r["sys_ms_per_object"] >= 0


def test_transfer_clients_reports_cpu_per_get_for_each_client(
    load_script: Callable[[str], ModuleType], capsys: pytest.CaptureFixture[str], nginx_server: Any
) -> None:
    script = load_script("benchmarks/peers/transfer_clients.py")
    assert script.main(script.parse_args(["--images", "6", "--repeats", "1", "--clients", "fsspec,aiohttp,fastload", "--json"])) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"fsspec", "aiohttp", "fastload"}
    for runs in out.values():
        assert len(runs) == 1 and runs[0]["gets_per_s"] > 0 and runs[0]["user_ms"] + runs[0]["sys_ms"] >= 0


def test_timeline_splits_an_epoch_with_every_instrument_in_place(
    load_script: Callable[[str], ModuleType], tmp_path: Path, nginx_server: Any
) -> None:
    # Unshaped: the figures mean nothing here; that every instrument still finds the
    # internals it wraps, and every part of the split is reported, does.
    script = load_script("benchmarks/peers/timeline.py")
    out = tmp_path / "timeline.json"
    args = script.parse_args(["--link", "none", "--images", "20", "--work-dir", str(tmp_path), "--out", str(out)])
    assert script.main(args) == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert "missing_instruments" not in run
    assert run["series"]["samples"] == 20 and len(run["series"]["batches"]) == 1
    assert round([r for r in run["series"]["requests"] if r[2] >= 0][0][0], 3) == run["setup_s"] > 0
    assert run["listing_s"] > 0 and run["tail_s"] >= 0 and run["stall_s"] >= 0 and run["seconds"] > 0
    assert list(tmp_path.glob("fastload-timeline-*")) == []  # work folder removed
