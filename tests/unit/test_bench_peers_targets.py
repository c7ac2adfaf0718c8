"""Issue 12's done-when rows of benchmarks/peers/bench.py, rendered from a small results dict.

The renderer is pure (results JSON in, markdown out), so each target's verdict can be
pinned without running a benchmark: met, MISSED, and NOT MEASURED when a peer failed or
was not run (which must count as missed, so that a broken peer cannot pass a target).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

AVG = 110_000  # bytes per JPEG


@pytest.fixture(scope="module")
def bench(load_script: Callable[[str], ModuleType]) -> ModuleType:
    return load_script("benchmarks/peers/bench.py")


def _run(link: str, peer: str, mode: str, cold: float, warm: float, cpu_ms: float | None = None) -> dict[str, Any]:
    """A completed run whose cold epoch moved ``cold`` samples/s and warm ``warm``."""
    epochs = [{"epoch": 1, "samples_per_s": cold, "mb_s": cold * AVG / 1e6, "samples": 3000},
              {"epoch": 2, "samples_per_s": warm, "mb_s": warm * AVG / 1e6, "samples": 3000}]
    if cpu_ms is not None:
        epochs[0] |= {"cpu_ms_per_sample": cpu_ms, "setup_cpu_s": 0.06}  # 0.02 ms of it per sample
    return {"link": link, "peer": peer, "mode": mode, "workers": 0, "epochs": epochs, "cache_bytes": 1, "peak_rss_mb": 1}


def _results(runs: list[dict[str, Any]]) -> dict[str, Any]:
    links = [{"name": n, "limit": {"mb_s": 125.0}} for n in ("1gbit", "1gbit+20ms")]  # 1,136 samples/s of 110 KB
    return {"links": links, "runs": runs, "ceilings": {"raw": {"samples_per_s": 9000, "mb_s": 990}},
            "dataset": {"avg_jpeg_bytes": AVG, "jpeg_bytes": 3000 * AVG, "uint8_bytes": 1}}


def _full_run() -> list[dict[str, Any]]:
    runs = []
    for link in ("1gbit", "1gbit+20ms"):
        runs += [_run(link, "fastload", "raw", 1100, 15000, cpu_ms=0.35),   # 0.968 of the link
                 _run(link, "fastload_w2", "raw", 900, 5000),               # 0.792: misses 0.85
                 _run(link, "webdataset", "raw", 950, 4000), _run(link, "streaming", "raw", 600, 4000),
                 _run(link, "litdata", "raw", 650, 4000)]
    runs += [_run("1gbit", "fastload", "decode", 500, 600), _run("1gbit", "torch_fsspec", "decode", 480, 500),
             _run("1gbit", "fastload_w2", "decode", 450, 500)]
    return runs


def test_every_issue12_target_has_a_row_with_its_verdict(bench: ModuleType) -> None:
    res = _results(_full_run())
    res["targets"] = bench.evaluate(res)
    text = bench.targets_text(res)
    issue, _, earlier = text.partition("Earlier targets:")
    lines = set(issue.splitlines())
    for link in ("1gbit", "1gbit+20ms"):
        assert f"- cold_vs_link[{link}]: 0.968 (target >= 0.90) met" in lines
        assert f"- cold_vs_shard_peers[{link}]: 1.158 (target > 1.00) met (best peer: webdataset)" in lines
        assert f"- cold_vs_link[{link}] num_workers=2: 0.792 (target >= 0.85) MISSED" in lines
        assert f"- cpu_ms_per_object[{link}]: 0.35 (0.02 of it in the setup: listing, first imports) (target <= 0.40) met" in lines
        assert f"- warm_samples_per_s[{link}]: 15,000 (target >= 10,000) met" in lines
    assert "- cold_decode_vs_torch_fsspec[1gbit]: 1.042 (target >= 1.00) met" in lines
    assert "- cold_decode_vs_torch_fsspec[1gbit] num_workers=2: 0.9375 (info, not a target)" in lines
    assert issue.startswith("Issue 12, done when (9 met, 2 missed):")
    assert "warm_vs_disk[1gbit,raw]" in earlier and "cold_vs_link" not in earlier  # one row per target

    md = bench.markdown(res | _render_fields())
    assert "## Targets" in md and "- cold_vs_link[1gbit] num_workers=2: 0.792 (target >= 0.85) MISSED" in md
    assert "| fastload_w2 | 2 worker processes |" in md and "| fastload | 1 process, read threads = CPUs (2) |" in md


def test_a_failed_or_absent_peer_is_not_measured_and_counts_as_missed(bench: ModuleType) -> None:
    runs = [r for r in _full_run() if r["peer"] != "fastload_w2"]
    for r in runs:
        if r["peer"] == "litdata" and r["link"] == "1gbit":
            r.pop("epochs")
            r["error"] = "exited 1: BadScheme"
        if r["peer"] == "fastload" and r["link"] == "1gbit+20ms":
            r["epochs"][0]["cpu_ms_per_sample"] = 0.55  # over 0.40
    res = _results(runs)
    res["targets"] = bench.evaluate(res)
    lines = set(bench.targets_text(res).splitlines())
    assert ("- cold_vs_link[1gbit] num_workers=2: NOT MEASURED (fastload_w2 (raw) not in this run "
            "(--peers / --decode-peers / --modes); target >= 0.85) MISSED") in lines
    # fastload is ahead of the two shard peers that ran, but the third failed: not shown to be ahead of all three.
    shard = res["targets"]["cold_vs_shard_peers[1gbit]"]
    assert shard["value"] == pytest.approx(1100 / 950, abs=1e-4) and not shard["pass"]
    assert "litdata failed: exited 1: BadScheme" in shard["what"]
    assert "- cpu_ms_per_object[1gbit+20ms]: 0.55 (0.02 of it in the setup: listing, first imports) (target <= 0.40) MISSED" in lines
    missed = [k for k, v in res["targets"].items() if not v["pass"]]
    assert {"cold_vs_link[1gbit] num_workers=2", "cold_vs_shard_peers[1gbit]", "cpu_ms_per_object[1gbit+20ms]"} <= set(missed)
    assert "cold_decode_vs_torch_fsspec[1gbit] num_workers=2" not in res["targets"]  # info rows only when measured


def test_a_run_without_the_issue12_links_reports_them_not_measured(bench: ModuleType) -> None:
    res = {"links": [{"name": "200mbit", "limit": {"mb_s": 25.0}}], "runs": [_run("200mbit", "fastload", "raw", 220, 9000)],
           "ceilings": {}, "dataset": {"avg_jpeg_bytes": AVG, "jpeg_bytes": 1, "uint8_bytes": 1}}
    targets = bench.evaluate(res)
    assert targets["cold_vs_link[1gbit]"]["value"] is None and not targets["cold_vs_link[1gbit]"]["pass"]
    assert targets["cold_vs_link[1gbit]"]["missing"] == "link 1gbit not in this run (--links)"
    assert targets["cold_vs_link[200mbit]"]["pass"] and "issue" not in targets["cold_vs_link[200mbit]"]


def _render_fields() -> dict[str, Any]:
    """What markdown() reads besides runs and targets."""
    machine = {"date_utc": "2026-12-01 14:15 UTC", "loadavg_at_start": "0.1 0.1 0.1", "loadavg_at_end": "0.2", "cpus": 2}
    return {"command": "python benchmarks/peers/bench.py", "wall_s": 1.0, "machine": machine, "versions": {},
            "epoch_budget_s": 40,
            "dataset": {"avg_jpeg_bytes": AVG, "jpeg_bytes": 3000 * AVG, "uint8_bytes": 1, "images": 3000, "kind": "test",
                        "uint8_arrays": 1, "tar_shards": 30, "formats": {}},
            "links": [{"name": n, "limit": {"mb_s": 125.0, "runs_mb_s": [125.0], "nominal_mb_s": 125.0}, "description": "test"}
                      for n in ("1gbit", "1gbit+20ms")]}


def test_repeats_take_the_median_run_and_show_every_runs_share(bench: ModuleType) -> None:
    rows = [_run("1gbit", "fastload", "raw", cold, 15000, cpu_ms=0.3) for cold in (900, 1100, 1000)]
    failed = {"link": "1gbit", "peer": "fastload", "mode": "raw", "error": "timed out after 420 s"}
    pick = bench.median_run([*rows, failed])
    assert pick["epochs"][0]["samples_per_s"] == 1000  # the middle of the three that completed
    assert pick["repeats"]["cold_samples_per_s"] == [900, 1100, 1000, None] and pick["repeats"]["failed"] == 1
    assert bench.median_run(rows[:2])["epochs"][0]["samples_per_s"] == 900  # an even count takes the lower middle
    assert bench.median_run([failed])["error"] == "timed out after 420 s"

    res = _results([pick])
    res["targets"] = bench.evaluate(res)
    lines = set(bench.targets_text(res).splitlines())
    assert "- cold_vs_link[1gbit]: 0.88 (median; runs 0.792, 0.968, 0.88, failed) (target >= 0.90) MISSED" in lines


def test_a_failed_runs_line_names_the_exception_not_a_traceback_fragment(bench: ModuleType) -> None:
    error = "exited 1:            ~~~~~~^^^^\n  File \"reader.py\", line 9, in read\nChunkWaitTimeoutError: Timed out after 120s"
    assert bench.error_line(error) == "exited 1: ChunkWaitTimeoutError: Timed out after 120s"
    assert bench.error_line("timed out after 420 s; stderr tail:\nKilled") == "timed out after 420 s; stderr tail: Killed"
    assert bench.error_line("its writer failed: BadScheme") == "its writer failed: BadScheme"


def test_issue36_warm_rows_take_the_median_warm_epoch(bench: ModuleType) -> None:
    def run(peer: str, warm: list[float]) -> dict[str, Any]:
        r = _run("1gbit", peer, "raw", 1000, warm[0])
        r["epochs"] += [{"epoch": k + 3, "samples_per_s": w, "mb_s": w * AVG / 1e6, "samples": 3000}
                        for k, w in enumerate(warm[1:])]
        return r

    res = _results([run("fastload", [20000, 30000, 31000, 90000]), run("fastload_w2", [9000, 27000, 28000, 26000]),
                    run("webdataset", [9000, 11000, 10000, 10000])])
    res["ceilings"]["raw2"] = {"samples_per_s": 32000, "mb_s": 3520}
    got = bench.evaluate(res)
    # fastload's warm median is 30,500 (its epochs 2-5): one fast or slow epoch does not decide.
    assert got["warm_vs_disk2[1gbit,raw]"]["value"] == round(30500 / 32000, 4) and got["warm_vs_disk2[1gbit,raw]"]["pass"]
    assert got["warm_vs_webdataset[1gbit,raw]"]["value"] == round(30500 / 10000, 4)
    assert got["warm_vs_webdataset[1gbit,raw]"]["pass"]
    workers = got["warm_workers_vs_threads[1gbit,raw]"]
    assert workers["value"] == round(26500 / 30500, 4) and workers["pass"] and workers["issue"] == 36
    res["runs"] = [r for r in res["runs"] if r["peer"] != "webdataset"]
    absent = bench.evaluate(res)["warm_vs_webdataset[1gbit,raw]"]  # not run: not measured, counted as missed
    assert absent["value"] is None and not absent["pass"]
    assert "warm_vs_webdataset[1gbit,raw]: NOT MEASURED" in bench.targets_text(res | {"targets": bench.evaluate(res)})
