"""``make gpu-check`` (scripts/gpu_check.py) and benchmarks/gpu/bench.py, where there is no GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _no_cuda_env() -> dict[str, str]:
    # Hides a GPU where there is one, so this test checks the same thing everywhere;
    # no PYTHONPATH: the script finds this checkout's fastload itself.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env.pop("PYTHONPATH", None)
    return env


def test_without_a_gpu_it_says_so_writes_the_report_and_exits_0(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    done = subprocess.run([sys.executable, "scripts/gpu_check.py", "--out", str(out)], cwd=ROOT,
                          env=_no_cuda_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "no GPU here" in done.stdout and "is_available() is False" in done.stdout
    report = json.loads(out.read_text())
    assert report["status"] == "no_gpu" and "steps" not in report and report["machine"]["torch"]


def test_make_target_runs_the_script_on_the_gpu_python_and_never_builds_the_venv() -> None:
    # .venv's build step may install the pinned CPU torch; on a GPU machine that would hide the GPU.
    done = subprocess.run(["make", "--no-print-directory", "-n", "gpu-check", "GPU_PY=/opt/cuda-python"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "/opt/cuda-python scripts/gpu_check.py --out benchmarks/gpu/results/gpu-check.json"


def test_steps_run_and_report_where_cuda_is_faked(
    tmp_path: Path, load_script: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    # The steps for real, as subprocesses: on this CPU every GPU test skips and
    # every benchmark case says there is no CUDA, which the report must carry.
    check = load_script("scripts/gpu_check.py")
    monkeypatch.setattr(check, "gpu_present", lambda torch: True)
    out = tmp_path / "r.json"
    code = check.main(check.parse_args(["--out", str(out), "--steps", "pytest_gpu,inflate"]))
    report = json.loads(out.read_text())
    # Nothing ran, so nothing passed: skips are "not run", in the JSON and the summary line.
    assert code == 0 and report["status"] == "partial", report
    assert report["not_run"] == ["pytest_gpu", "inflate"]
    assert "; not run: pytest_gpu, inflate;" in capsys.readouterr().out
    tests = report["steps"]["pytest_gpu"]
    assert tests["status"] == "not_run"
    assert tests["counts"].get("skipped", 0) >= 20 and set(tests["counts"]) == {"skipped"}
    assert all(t["message"] for t in tests["tests"].values())  # each skip says why
    dropped = "tests.gpu.test_prefetch_gpu::test_dropped_batch_never_lands_in_a_later_tensor"
    assert "needs CUDA" in tests["tests"][dropped]["message"]
    assert tests["guards"]["15.1: a dropped batch's copy never writes into a later tensor"] == ["skipped"]
    assert report["steps"]["inflate"]["status"] == "not_run"
    assert check.main(check.parse_args(["--out", str(out), "--steps", "nope"])) == 2


def test_junit_outcomes_and_guards(tmp_path: Path, load_script: Callable[[str], ModuleType]) -> None:
    check = load_script("scripts/gpu_check.py")
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.gpu.test_prefetch_gpu" name="test_overlap_hides_copy_time_behind_compute[0]">'
        '<failure message="assert 1.2 &lt; 1.0">trace</failure></testcase>'
        '<testcase classname="tests.gpu.test_prefetch_gpu" name="test_overlap_hides_copy_time_behind_compute[2]"/>'
        '<testcase classname="tests.gpu.test_pipelines_gpu" name="test_dali_inflate_round_trip_bit_exact">'
        '<skipped message="nvidia-dali not installed"/></testcase>'
        "</testsuite></testsuites>"
    )
    got = check.parse_junit(xml)
    assert got["counts"] == {"failed": 1, "passed": 1, "skipped": 1}
    name = "tests.gpu.test_prefetch_gpu::test_overlap_hides_copy_time_behind_compute[0]"
    assert got["tests"][name] == {"outcome": "failed", "message": "assert 1.2 < 1.0"}
    assert check.guarded(got["tests"]) == {
        "15.2, 15.6: overlap at depth 0 and 2, bound max + min/2": ["failed", "passed"]
    }


def test_skips_are_reported_as_not_run(tmp_path: Path, load_script: Callable[[str], ModuleType]) -> None:
    check = load_script("scripts/gpu_check.py")
    assert check.pytest_status(0, {"skipped": 30}) == "not_run"
    assert check.pytest_status(0, {"passed": 3, "skipped": 2}) == "partial"
    assert check.pytest_status(0, {"passed": 3}) == "passed"
    assert check.pytest_status(1, {"passed": 3, "failed": 1}) == "failed"
    steps = {"pytest_gpu": {"status": "partial", "counts": {"passed": 3, "skipped": 2}},
             "prefetch": {"status": "passed"}, "inflate": {"status": "not_run"}}
    assert check.summary(steps) == ("partial", [], ["inflate", "2 GPU test(s) skipped"])
    assert check.summary({"decode": {"status": "timed_out"}})[:2] == ("failed", ["decode"])
    xml = tmp_path / "j.xml"  # a measured value (record_property) comes along with the outcome
    xml.write_text('<testsuites><testsuite name="pytest"><testcase classname="m" name="t"><properties>'
                   '<property name="mean_levels" value="0.41"/></properties></testcase></testsuite></testsuites>')
    assert check.parse_junit(xml)["tests"]["m::t"] == {"outcome": "passed", "measured": {"mean_levels": "0.41"}}


def test_bench_says_no_cuda_and_runs_every_case_on_the_cpu(
    tmp_path: Path, load_script: Callable[[str], ModuleType], capsys: Any
) -> None:
    bench = load_script("benchmarks/gpu/bench.py")
    assert bench.main(bench.parse_args(["--cases", "nope"])) == 2
    if not bench.torch.cuda.is_available():
        assert bench.main(bench.parse_args(["--out", str(tmp_path / "a.json")])) == 0
        skipped = json.loads((tmp_path / "a.json").read_text())["results"]
        assert {c: r["status"] for c, r in skipped.items()} == dict.fromkeys(bench.CASES, "skipped")
    tiny = ["--device", "cpu", "--batch-mb", "0.0625", "--batches", "3", "--repeats", "1", "--matmul", "32",
            "--decode-batch", "2", "--decode-batches", "1", "--inflate-batch", "3", "--inflate-runs", "1",
            "--inflate-shapes", "40x40x3", "--chunk-bytes", "4096,8192", "--out", str(tmp_path / "b.json")]
    assert bench.main(bench.parse_args(tiny)) == 0
    got = json.loads((tmp_path / "b.json").read_text())["results"]
    prefetch = got["prefetch"]
    assert prefetch["status"] == "ok" and set(prefetch["overlap"]) == {"depth_0", "depth_1"}
    assert all(v > 0 for v in prefetch["h2d_gb_per_s"].values())
    assert got["decode"]["status"] == "ok" and got["decode"]["output"].startswith("(2, 3, 224, 224)")
    if got["inflate"]["status"] == "ok":  # DALI installed: its CPU pipeline, host-decoded LZ4
        per = got["inflate"]["shapes"]["40x40x3"]["per_chunk_bytes"]
        assert all(r["bit_exact"] and r["ratio"] > 1.5 for r in per.values())
        assert [r["chunks_per_sample"] for r in per.values()] == [2, 1]  # 4800 B in 4 KiB / 8 KiB chunks
        assert got["inflate"]["corrupt_chunk"]["raised"] is True  # the host decoder checks; nvCOMP would not


def test_tiled_arrays_compress_and_jpegs_decode(load_script: Callable[[str], ModuleType]) -> None:
    bench = load_script("benchmarks/gpu/bench.py")
    from fastload import codec

    arrays = bench.tiled_arrays(2, (64, 64, 3))
    assert all(a.shape == (64, 64, 3) and a.dtype == np.uint8 for a in arrays)
    assert codec.parse_header(codec.encode(arrays[0].tobytes())).codec == codec.LZ4
    jpegs, _ = bench.synthetic_jpegs(2, (48, 64))
    assert all(j[:2] == b"\xff\xd8" for j in jpegs)


def test_a_missing_dependency_of_fastload_is_named(
    tmp_path: Path, load_script: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    check = load_script("scripts/gpu_check.py")
    monkeypatch.setattr(check, "gpu_present", lambda torch: True)
    monkeypatch.setitem(sys.modules, "fastload", None)  # import fastload now raises ImportError
    out = tmp_path / "r.json"
    assert check.main(check.parse_args(["--out", str(out)])) == 1
    report = json.loads(out.read_text())
    assert report["status"] == "failed" and "pip install -e ." in report["reason"]


def test_every_guard_names_a_gpu_test_that_exists(load_script: Callable[[str], ModuleType]) -> None:
    # The report says which issue-15 bug each outcome guards; a renamed test would
    # silently drop its line from the report.
    check = load_script("scripts/gpu_check.py")
    defined = {
        line.split("def ", 1)[1].split("(", 1)[0]
        for path in (ROOT / "tests" / "gpu").glob("test_*.py")
        for line in path.read_text().splitlines()
        if line.startswith("def test_")
    }
    assert set(check.GUARDS) - defined == set()


def test_sync_count_leaves_out_the_debug_modes_own_notice(load_script: Callable[[str], ModuleType]) -> None:
    # set_sync_debug_mode warns once per process that it is a prototype, in words that
    # contain "synchronizing": counted, a pipeline without syncs read 1 per batch.
    bench = load_script("benchmarks/gpu/bench.py")
    notice = "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations"
    sync = "called a synchronizing CUDA operation (Triggered internally at c10/cuda/CUDAFunctions.cpp:148.)"
    assert bench.sync_warnings([notice]) == 0
    assert bench.sync_warnings([notice, sync, "something else", sync]) == 2
