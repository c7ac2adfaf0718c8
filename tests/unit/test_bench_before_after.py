"""The pure parts of benchmarks/before_after.py: parsing each child's output and the summary.

The run itself (git worktrees, shaped links, the reliability suite) takes minutes; what
can be wrong without running it is which figures are read, how medians and ratios are
taken, and when a change is called worse than the run's own noise.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest


@pytest.fixture(scope="module")
def ba(load_script: Callable[[str], ModuleType]) -> ModuleType:
    return load_script("benchmarks/before_after.py")


def _peers_run(cold: float, warm: list[float], error: str = "") -> dict[str, Any]:
    epochs = [{"epoch": 1, "samples_per_s": cold, "mb_s": cold * 0.11, "cpu_ms_per_sample": 0.5}]
    epochs += [{"epoch": i + 2, "samples_per_s": w, "mb_s": w * 0.11, "cpu_ms_per_sample": 0.1 * (i + 1)}
               for i, w in enumerate(warm)]
    return {"link": "1gbit", "peer": "fastload", "mode": "raw", "epochs": epochs} | ({"error": error} if error else {})


def test_peers_metrics_reads_every_fastload_run_and_skips_failed_ones(ba: ModuleType) -> None:
    res = {"links": [{"name": "1gbit", "limit": {"mb_s": 125.0}}],
           "all_runs": [_peers_run(1000, [10_000, 14_000, 20_000]), _peers_run(900, [9_000], error="boom"),
                        _peers_run(1100, [12_000])]}
    got = ba.peers_metrics(res)
    assert [m["peers.cold_samples_per_s"] for m in got] == [1000, 1100]
    assert got[0]["peers.warm_samples_per_s"] == 14_000  # the median of the warm epochs
    assert got[0]["peers.cold_link_share"] == pytest.approx(110 / 125)
    assert got[0]["peers.warm_cpu_ms_per_object"] == pytest.approx(0.2)
    assert "peers.link_mb_s" in got[0] and "peers.link_mb_s" not in got[1]  # measured once per invocation


def test_ordinary_metrics_gives_one_dict_per_fastload_run(ba: ModuleType) -> None:
    res = {"link_mb_per_s": 24.8, "plain_link_fraction": 0.97,
           "fastload": [{"link_fraction": 0.85, "mb_per_s": 21.0}, {"link_fraction": 0.9, "mb_per_s": 22.3}]}
    got = ba.ordinary_metrics(res)
    assert [m["ordinary.fastload_link_fraction"] for m in got] == [0.85, 0.9]
    assert got[0]["ordinary.link_mb_per_s"] == 24.8 and "ordinary.link_mb_per_s" not in got[1]


@pytest.mark.parametrize(("text", "want"), [
    ("....\n32 passed, 13 deselected in 121.14s (0:02:01)\n", {"passed": 32, "deselected": 13}),
    ("F.s\n1 failed, 31 passed, 2 skipped, 1 error in 3.0s\n", {"failed": 1, "passed": 31, "skipped": 2, "error": 1}),
    ("ImportError while loading conftest\n", {}),
])
def test_pytest_counts_reads_the_summary_line(ba: ModuleType, text: str, want: dict[str, int]) -> None:
    assert ba.pytest_counts(text) == want


def test_failed_tests_names_the_node_ids(ba: ModuleType) -> None:
    text = "FAILED tests/reliability/test_a.py::test_x[short] - AssertionError\nERROR tests/b.py::test_y\n.. 2 passed"
    assert ba.failed_tests(text) == ["tests/reliability/test_a.py::test_x[short]", "tests/b.py::test_y"]


def test_summarise_takes_medians_and_ratios(ba: ModuleType) -> None:
    rows = {r["metric"]: r for r in ba.summarise({
        "before": {"peers.cold_samples_per_s": [1000, 1100, 1050], "peers.link_mb_s": [125.0]},
        "after": {"peers.cold_samples_per_s": [1200, 1000, 1100], "peers.link_mb_s": [126.0]},
    })}
    cold = rows["peers.cold_samples_per_s"]
    assert (cold["before"], cold["after"]) == (1050, 1100)
    assert cold["after_over_before"] == pytest.approx(1100 / 1050)
    assert cold["spread"] == {"before": [1000, 1100], "after": [1000, 1200]}
    assert cold["worse"] is False
    assert rows["peers.link_mb_s"]["worse"] is None  # context, no direction


def test_summarise_calls_worse_only_beyond_the_spread_and_in_the_metric_direction(ba: ModuleType) -> None:
    def worse(name: str, before: list[float], after: list[float]) -> bool | None:
        return ba.summarise({"before": {name: before}, "after": {name: after}})[0]["worse"]

    assert worse("peers.cold_samples_per_s", [1000, 1010], [900, 905]) is True  # 10% down, spread 1%
    assert worse("peers.cold_samples_per_s", [1000, 1200], [950, 1100]) is False  # within the 20% spread
    assert worse("peers.cold_cpu_ms_per_object", [0.50, 0.51], [0.60, 0.61]) is True  # lower is better
    assert worse("peers.cold_cpu_ms_per_object", [0.50, 0.51], [0.40, 0.41]) is False
    assert worse("peers.cold_samples_per_s", [1000], [500]) is None  # one run: no spread to judge by
    assert worse("reliability.failed", [0], [1]) is True  # counts: any change the wrong way
    assert worse("reliability.passed", [32], [32]) is False


def test_plan_order_alternates_abba(ba: ModuleType) -> None:
    assert ba.plan_order(3) == ["before", "after", "after", "before", "before", "after"]
