"""GPU probes of ``fastload diagnose`` and ``fastload bench --device cuda`` on a real GPU.

Skipped (with the reason) where CUDA is absent, by tests/gpu/conftest.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from fastload.cli import main
from fastload.diagnose import compute, env, gpu, link

pytestmark = pytest.mark.gpu


def test_link_measures_both_directions_and_classifies(tmp_path):
    got = link.measure_link(nbytes=16 * 1024**2, repeats=3)
    assert got["status"] == "ok"
    assert len(got["devices"]) == torch.cuda.device_count()
    for d in got["devices"]:
        for key in ("h2d_pageable_bps", "h2d_pinned_bps", "d2h_pageable_bps", "d2h_pinned_bps"):
            assert 1e8 < d[key] < 1e12, key  # anything from a x1 riser to NVLink-C2C
        assert d["name"] == torch.cuda.get_device_name(d["index"])
        loaded = d["pcie_under_load"]  # read by NVML while the pinned copies ran
        if gpu.gpu_devices()["status"] == "ok" and loaded["gen"] is not None:
            assert 1 <= loaded["gen"] <= 6 and loaded["width"] in (1, 2, 4, 8, 16, 32)
    gpus = gpu.gpu_devices()
    link.attach_classification(got, gpus)
    for d in got["devices"]:
        cls = d["classification"]
        assert isinstance(cls["egpu_suspected"], bool) and cls["band"]


def test_nvml_reports_every_device():
    pytest.importorskip("pynvml")
    got = gpu.gpu_devices()
    assert got["status"] == "ok", got
    assert len(got["devices"]) >= torch.cuda.device_count()
    d = got["devices"][0]
    assert d["name"] and d["memory_total_bytes"] > 1e9
    assert d["pcie"]["gen_max"] is None or 1 <= d["pcie"]["gen_max"] <= 6
    assert isinstance(d["throttle_reasons"], list)


def test_sanity_matmul_passes():
    got = env.gpu_sanity()
    assert got["status"] == "ok" and got["all_ok"] is True
    assert all(d["max_abs_error"] < 1.0 for d in got["devices"])


def test_gpu_decode_runs_or_names_the_missing_piece(sample_photos):
    jpegs = compute.sample_jpegs(4)
    got = compute.gpu_decode(jpegs, batch=8, budget_s=0.3)
    try:
        import torchvision.io  # noqa: F401
    except ImportError:
        assert got["status"] == "skipped" and "torchvision" in got["reason"]
    else:
        assert got["status"] == "ok" and got["img_per_s"] > 0


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, Any]:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_diagnose_fills_the_link_row_on_a_gpu(capsys, tmp_path):
    r = _json(capsys, ["diagnose", "--json", "--quick", "--cache-dir", str(tmp_path / "c")])
    assert r["link"]["status"] == "ok" and r["gpu_sanity"]["status"] == "ok"
    by = {s["name"]: s for s in r["verdict"]["ops"]}
    pinned = r["link"]["devices"][0]["h2d_pinned_bps"]
    assert by["link"]["samples_per_s"] == pytest.approx(pinned / (224 * 224 * 3 * 4))


def test_bench_on_cuda_records_h2d(capsys, sample_photos):
    r = _json(capsys, ["bench", "--json", "--sample", "--sample-images", "8", "--batch-size", "4",
                       "--epochs", "1", "--device", "cuda"])
    (run,) = r["runs"]
    assert run["ops"]["h2d"]["items"] == 2 and run["ops"]["h2d"]["bytes"] > 0
