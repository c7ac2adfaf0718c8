"""``fastload diagnose --json --quick`` on this machine, and the pure rules behind it.

On a CPU-only machine every non-GPU field is measured with a plausible value,
and every GPU field is present, marked ``skipped`` with a reason.
"""

from __future__ import annotations

import contextlib
import doctest
import io
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fastload.cli import main
from fastload.config import format_size
from fastload.diagnose import _util
from fastload.diagnose import gpu as gpu_mod
from fastload.diagnose import link as link_mod
from fastload.diagnose import verdict as verdict_mod
from fastload.diagnose.env import warnings_for
from fastload.diagnose.gpu import throttle_names
from fastload.diagnose.link import classify_link, pcie_bytes_per_s
from fastload.diagnose.report import render
from fastload.diagnose.storage import probe_storage, saturating

HAS_CUDA = torch.cuda.is_available()
OPS = {"storage", "cache_disk", "cache_index", "cache_decode", "cpu_decode", "link", "gpu_decode", "model"}


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, dict[str, Any]]:
    code = main(argv)
    out = capsys.readouterr().out
    return code, json.loads(out)


@pytest.fixture(scope="module")
def jpeg_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fastload.samples import make_image_folder

    root = tmp_path_factory.mktemp("jpegs") / "train"
    make_image_folder(root, n=8)
    return root


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any], Path]:
    """``fastload diagnose --json --quick`` with no URL (storage skipped)."""
    cache = tmp_path_factory.mktemp("cache") / "c"
    buf = io.StringIO()  # a module-scoped fixture cannot use capsys
    with contextlib.redirect_stdout(buf):
        code = main(["diagnose", "--json", "--quick", "--cache-dir", str(cache)])
    return code, json.loads(buf.getvalue()), cache


@pytest.mark.timeout(120)
def test_every_non_gpu_field_is_measured(bare):
    code, r, cache = bare
    assert code == 0
    assert r["fastload_diagnose"] == 1 and r["mode"] == "quick"
    env = r["environment"]
    assert env["status"] == "ok"
    assert env["python"] == platform.python_version()
    assert env["cpu_usable"] >= 1 and env["cpu_count"] >= env["cpu_usable"]
    assert env["ram_bytes"] > 256e6
    assert env["torch"]["version"] == torch.__version__
    assert env["torch"]["cuda_available"] is HAS_CUDA
    assert "fsspec" in env["packages"] and "lz4" in env["packages"]
    assert isinstance(env["warnings"], list)
    # Cache: the disk was read, nothing was left behind, the empty cache was not created.
    disk = r["cache"]["disk"]
    assert disk["status"] == "ok"
    for key in ("seq_cold_bps", "random_cold_bps", "seq_hot_bps", "write_bps"):
        assert 1e6 < disk[key] < 1e12, key
    assert disk["file_bytes"] == 32 * 1024**2
    assert not list(cache.glob("**/*.part"))
    state = r["cache"]["state"]
    assert state["status"] == "ok" and state["exists"] is False and state["entries"] == 0
    # Compute on the built-in sample JPEGs.
    assert r["images"]["source"].endswith("built-in sample JPEGs (fastload.samples)")
    cpu = r["compute"]["cpu_decode"]
    assert cpu["status"] == "ok" and cpu["width_height"] == [500, 375]
    assert 1 < cpu["decode_resize_per_core"] < 1e5
    assert cpu["decode_per_core"] > 0 and cpu["threads"] == env["cpu_usable"]
    pay = r["compute"]["payload_decode"]
    assert pay["jpeg"]["stored_as"] == "raw" and pay["jpeg"]["ratio"] == pytest.approx(1.0, abs=0.01)
    assert pay["uint8_pixels"]["stored_as"] == "lz4" and pay["uint8_pixels"]["ratio"] > 1.05
    assert 1e7 < pay["jpeg"]["decode_bps_per_core"] < 1e12
    # No URL: storage says why; the verdict still names a limit from what was measured.
    assert r["storage"]["status"] == "skipped" and "no URL" in r["storage"]["reason"]
    v = r["verdict"]
    assert {s["name"] for s in v["ops"]} == OPS
    assert v["sample_bytes"] == 108_000 and "ImageNet" in v["sample_bytes_source"]
    by = {s["name"]: s for s in v["ops"]}
    assert by["cpu_decode"]["samples_per_s"] == pytest.approx(cpu["decode_resize_per_core"] * env["cpu_usable"])
    assert by["storage"]["samples_per_s"] is None and by["storage"]["detail"] == "not measured: no URL given"
    assert v["bottleneck"] in {"cpu", "disk", "link", "gpu"}


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only report; tests/gpu covers CUDA machines")
def test_gpu_fields_are_present_and_skipped_with_a_reason(bare):
    _, r, _ = bare
    for key in ("gpu", "gpu_sanity", "link"):
        assert r[key]["status"] == "skipped", key
        assert len(r[key]["reason"]) > 10, key
    assert r["gpu"]["devices"] == [] and r["link"]["devices"] == []
    assert r["compute"]["gpu_decode"]["status"] == "skipped"
    assert "CUDA" in r["compute"]["gpu_decode"]["reason"]
    by = {s["name"]: s for s in r["verdict"]["ops"]}
    assert by["link"]["samples_per_s"] is None and by["link"]["detail"].startswith("not measured: ")
    assert by["gpu_decode"]["samples_per_s"] is None


def test_human_rendering_of_the_same_report(bare):
    _, r, _ = bare
    text = render(r)
    assert text.startswith("fastload diagnose (quick, ")
    for heading in ("\nenvironment\n", "\ngpu\n", "\nstorage\n", "\ncache\n", "\ncompute\n", "\nverdict\n"):
        assert heading in text
    assert f"  verdict: {r['verdict']['headline']}" in text
    if not HAS_CUDA:
        assert "sanity    skipped: no CUDA device" in text


@pytest.mark.timeout(120)
def test_a_local_folder_url_fills_the_storage_section(capsys, tmp_path, jpeg_folder):
    code, r = _run(capsys, ["diagnose", "--json", "--quick", "--no-gpu", "--cache-dir", str(tmp_path / "c"),
                            str(jpeg_folder)])
    assert code == 0
    sizes = [p.stat().st_size for p in jpeg_folder.rglob("*.jpg")]
    s = r["storage"]
    assert s["status"] == "ok"
    assert s["objects"] == 8 and s["listing"]["items"] == 8 and s["sizes_from"] == "listing"
    assert s["avg_object_bytes"] == pytest.approx(sum(sizes) / 8)
    assert s["dataset_bytes"] == sum(sizes) and s["dataset_bytes_exact"] is True
    assert s["levels"][0]["connections"] == 1 and all(lv["bytes_per_s"] > 0 for lv in s["levels"])
    assert s["best_bps"] == max(lv["bytes_per_s"] for lv in s["levels"])
    assert s["saturating_connections"] in [lv["connections"] for lv in s["levels"]]
    assert s["ttfb_ms"]["n"] == 5 and s["ttfb_ms"]["median_ms"] > 0
    assert r["images"]["source"] == "4 JPEGs from the URL"
    v = r["verdict"]
    assert v["sample_bytes"] == pytest.approx(sum(sizes) / 8) and "measured average" in v["sample_bytes_source"]
    by = {x["name"]: x for x in v["ops"]}
    assert by["storage"]["samples_per_s"] == pytest.approx(s["best_bps"] / s["avg_object_bytes"])
    # --no-gpu skips every GPU probe, saying so.
    assert r["link"]["reason"] == "GPU probes disabled with --no-gpu"
    assert r["cache"]["state"]["url_cached_fraction"] == 0.0


def test_plot_without_matplotlib_says_how_to_get_it(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(_util.OPTIONAL, "matplotlib", ("fastload_no_such_module", "pip install 'fastload[diag]'"))
    code = main(["diagnose", "--quick", "--plot", str(tmp_path / "v.png")])
    err = capsys.readouterr().err
    assert code == 1
    assert "--plot needs matplotlib" in err and "pip install 'fastload[diag]'" in err
    assert not (tmp_path / "v.png").exists()


def test_plot_draws_the_op_table(bare, tmp_path):
    pytest.importorskip("matplotlib")
    from fastload.diagnose.plot import plot_verdict

    out = plot_verdict(bare[1]["verdict"], tmp_path / "v.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_url_is_an_error_section_not_a_crash(tmp_path):
    with pytest.raises(FileNotFoundError):
        probe_storage(str(tmp_path / "nope"))
    got = _util.guarded("storage", lambda: probe_storage(str(tmp_path / "nope")))
    assert got["status"] == "error" and "FileNotFoundError" in got["reason"]


# -- pure rules ---------------------------------------------------------------------


def test_saturating_concurrency_is_the_fewest_connections_near_the_best():
    levels = [{"connections": c, "bytes_per_s": b} for c, b in ((1, 10.0), (2, 19.0), (4, 30.0), (8, 31.0), (16, 30.5))]
    assert saturating(levels) == (4, 31.0)


def test_thunderbolt_egpu_reporting_gen1_is_flagged():
    got = classify_link(2.7e9, gen_current=1, width_current=4, gen_max=1, width_max=4)
    assert got["egpu_suspected"] is True
    assert any("reports Gen1 x4" in e and "tunneled" in e for e in got["evidence"])
    assert got["band"].startswith("Thunderbolt 3/4 or USB4")


def test_healthy_x16_link_is_not_flagged():
    got = classify_link(24e9, gen_current=4, width_current=16, gen_max=4, width_max=16, removable=False)
    assert got["egpu_suspected"] is False and got["slow"] is False and got["evidence"] == []
    assert got["expected_bps"] == pytest.approx(1.969e9 * 16 * 0.75)


def test_slow_link_for_its_generation_is_flagged_with_numbers():
    # A x16 card at 3 GB/s is a slow (or parked) slot, not an enclosure: only narrow links are eGPUs.
    got = classify_link(3.0e9, gen_current=4, width_current=16, gen_max=4, width_max=16)
    assert got["slow"] is True and got["egpu_suspected"] is False
    assert any("13% of the 23.6 GB/s expected from PCIe Gen4 x16" in e for e in got["evidence"])
    narrow = classify_link(3.0e9, gen_current=4, width_current=4, gen_max=4, width_max=16)
    assert narrow["slow"] is True and narrow["egpu_suspected"] is True
    assert any("over a x4 link" in e for e in narrow["evidence"])
    assert classify_link(9e9, removable=True)["egpu_suspected"] is True


@pytest.mark.parametrize(
    "bps,gen,width,egpu",
    [
        (25e9, 1, 16, False),  # parked at Gen1 when read, full speed under load: a desktop x16 card
        (3.3e9, 1, 16, False),  # Gen4 x16 card measured while still at Gen1 x16: slow, not an eGPU
        (2.7e9, 1, 4, True),  # a Thunderbolt port advertising 2.5 GT/s x4
        (6.6e9, 4, 4, False),  # OCuLink at full speed: nothing to say from the rate
        (2.7e9, None, None, False),  # no NVML: the rate alone proves nothing
    ],
)
def test_egpu_rules_need_a_narrow_link(bps, gen, width, egpu):
    got = classify_link(bps, gen_current=gen, width_current=width, gen_max=4, width_max=16 if width == 16 else 4)
    assert got["egpu_suspected"] is egpu, got["evidence"]


def test_classification_prefers_the_link_read_under_load():
    gpus = {"devices": [{"pci_bus_id": "00000000:01:00.0", "pcie": {"gen_current": 1, "width_current": 16,
                                                                     "gen_max": 4, "width_max": 16}}]}
    measured = {"devices": [{"pci_bus_id": "0000:01:00.0", "h2d_pinned_bps": 24e9,
                             "pcie_under_load": {"gen": 4, "width": 16}}]}
    link_mod.attach_classification(measured, gpus)
    cls = measured["devices"][0]["classification"]
    assert cls["egpu_suspected"] is False and cls["reported_bps"] == pytest.approx(1.969e9 * 16)
    idle_only = {"devices": [{"pci_bus_id": "0000:01:00.0", "h2d_pinned_bps": 24e9, "pcie_under_load": None}]}
    link_mod.attach_classification(idle_only, gpus)
    assert idle_only["devices"][0]["classification"]["reported_bps"] == pytest.approx(0.25e9 * 16)


class _FakeCuda:
    """Just enough of torch.cuda for link._rate: events stamp the host clock."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        outer = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.t = 0.0

            def record(self) -> None:
                self.t = time.perf_counter()

            def synchronize(self) -> None:
                outer.log.append("sync")

            def elapsed_time(self, end: Any) -> float:
                return (end.t - self.t) * 1e3

        self.Event = Event

    def synchronize(self) -> None:
        self.log.append("sync")


def test_rate_warms_up_for_a_fixed_time_and_reads_the_link_during_timed_copies():
    log: list[str] = []
    fake = SimpleNamespace(cuda=_FakeCuda(log))
    stamps: list[float] = []

    def copy() -> None:
        stamps.append(time.perf_counter())
        log.append("copy")
        time.sleep(0.01)

    seen: list[Any] = []
    bps = link_mod._rate(fake, copy, 10_000_000, 3, lambda: (log.append("read") or (4, 16)), seen)
    warm = len(stamps) - 3
    assert warm >= 2 and stamps[warm] - stamps[0] >= link_mod.WARMUP_S  # not one copy: a fixed time
    assert log[-9:] == ["copy", "read", "sync"] * 3  # each reading while a timed copy is in flight
    assert seen == [(4, 16)] * 3 and 0 < bps <= 1e9  # 10 MB per >= 10 ms, timed by the events


def test_pcie_rates_and_throttle_names():
    assert pcie_bytes_per_s(3, 16) == pytest.approx(15.76e9)
    assert pcie_bytes_per_s(None, 16) is None
    assert throttle_names(0x24) == ["sw_power_cap", "sw_thermal_slowdown"]
    assert throttle_names(0) == []


def test_environment_warnings_for_known_incompatibilities():
    facts = {
        "torch": {"installed": True, "version": "2.5.0+cpu", "cuda": None, "cuda_available": False},
        "driver": {"version": "550.54", "cuda": "12.4"},
        "gpu_hardware_present": True,
        "dali": {"version": "1.40", "distribution": "nvidia-dali-cuda110", "cuda_major": 11},
        "pillow": {"version": "10", "libjpeg_turbo": True},
        "cpu_usable": 16,
        "cpu_count": 16,
    }
    got = warnings_for(facts)
    assert any("CPU-only build on a machine with an NVIDIA GPU" in w for w in got)
    assert any("DALI 1.40 (nvidia-dali-cuda110) is built for CUDA 11 but the driver supports CUDA 12.4" in w
               and "install nvidia-dali-cuda120" in w for w in got)
    newer = dict(facts, torch={"installed": True, "version": "2.13", "cuda": "13.0", "cuda_available": True}, dali=None)
    assert any("torch is built for CUDA 13.0 but the driver 550.54 supports CUDA 12.4" in w for w in warnings_for(newer))
    fine = dict(newer, torch={"installed": True, "version": "2.13", "cuda": "12.4", "cuda_available": True})
    assert warnings_for(fine) == []
    busy = dict(fine, loadavg=[7.0, 5.0, 3.0], cpu_count=2, cpu_usable=2)
    assert any("busy (load average 7.0 on 2 cores)" in w for w in warnings_for(busy))


def test_rate_formatting():
    assert _util.fmt_rate(4318.2) == "4,300"
    assert _util.fmt_rate(17273) == "17,000"
    assert _util.fmt_rate(113.6) == "114"
    assert _util.fmt_bps(2.6e9) == "2.6 GB/s" and _util.fmt_bps(12.1e6) == "12.1 MB/s"
    assert format_size(108_000) == "108 KB"


@pytest.mark.parametrize("module", [_util, gpu_mod, link_mod, verdict_mod])
def test_docstring_examples_run(module: object) -> None:
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)  # type: ignore[arg-type]
    assert result.failed == 0 and result.attempted > 0


def test_cli_help_lists_the_new_commands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "diagnose" in out and "bench" in out
    assert main(["diagnose", "--quick", "--thorough"]) == 2  # mutually exclusive
    assert main(["diagnose", "--quick", "--step-ms", "100"]) == 2
    assert "--step-ms and --batch-size go together" in capsys.readouterr().err


def test_diagnose_command_imports_no_probe_until_run():
    # `fastload --help` must not pay for torch or the probes.
    code = (
        "import sys; import fastload.cli as c; c.build_parser(); "
        "print(sorted(m for m in sys.modules if m.startswith('fastload.diagnose') or m == 'torch'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['fastload.diagnose', 'fastload.diagnose.cli']"


def test_build_inputs_from_a_report_and_the_users_settings(bare):
    from fastload.config import Settings
    from fastload.diagnose.run import Options, build_inputs
    from fastload.diagnose.verdict import make_verdict

    _, r, cache = bare
    opts = Options(step_ms=100, batch_size=256, sample_bytes=150_000, link_payload="uint8", cache=False)
    x = build_inputs(r, opts, Settings(cache_dir=cache))
    assert x.model_img_s == pytest.approx(2560.0)
    assert x.sample_bytes == 150_000 and x.sample_bytes_source == "--sample-bytes"
    assert x.cache is False and x.link_payload == "uint8"
    assert x.cpu_decode_per_core == r["compute"]["cpu_decode"]["decode_resize_per_core"]
    assert x.cache_disk_bps == r["cache"]["disk"]["random_cold_bps"]
    assert x.why_missing["storage"].startswith("no URL given")
    v = make_verdict(x)
    assert v.op("model").samples_per_s == pytest.approx(2560.0)
    assert v.streams_every_epoch  # --no-cache


def test_nvml_reader_falls_back_to_the_index_and_survives_unsupported_queries():
    class FakeNvml:
        def __init__(self, supported: bool) -> None:
            self.supported = supported

        def nvmlDeviceGetHandleByPciBusId(self, bus_id: str) -> Any:
            raise ValueError(f"no device {bus_id}")

        def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
            return ("handle", index)

        def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: Any) -> int:
            if not self.supported:
                raise RuntimeError("NotSupported")
            return 4

        def nvmlDeviceGetCurrPcieLinkWidth(self, handle: Any) -> int:
            return 16

    read = link_mod._nvml_reader(FakeNvml(True), 1, "0000:81:00.0")
    assert read is not None and read() == (4, 16)
    unsupported = link_mod._nvml_reader(FakeNvml(False), 0, None)
    assert unsupported is not None and unsupported() == (None, None)
    assert link_mod.under_load([unsupported()]) == {"gen": None, "width": None}


def test_storage_probe_lists_as_the_datasets_do_and_says_why_nothing_matched(tmp_path: Path) -> None:
    from fastload.diagnose.storage import StorageBudget, probe_storage

    (tmp_path / "train" / "cat").mkdir(parents=True)
    (tmp_path / "train" / "cat" / "1.jpg").write_bytes(b"\xff\xd8\xff" + b"x" * 100)
    budget = StorageBudget(level_s=0.05, max_connections=1, ttfb_requests=1)
    got = probe_storage(str(tmp_path / "train"), pattern="*.jpg", budget=budget)
    # The datasets' EmptyDatasetError wording: what the listing found, and the nested glob.
    assert got["status"] == "skipped"
    assert "pattern '*.jpg' matches nothing: the listing found 1 folder and 1 file, 0 matching" in got["reason"]
    assert "'**/*.jpg'" in got["reason"]
    got = probe_storage(str(tmp_path / "train"), pattern="**/*.jpg", budget=budget)
    assert got["status"] == "ok" and got["listing"]["items"] == 1 and got["listing"]["matched"] == 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("name", "kind"), [("tokens.bin", "binary"), ("arrays.npy", "npy")])
def test_data_that_is_not_images_is_not_diagnosed_as_jpeg_decode(capsys, tmp_path, name, kind):
    # `fastload diagnose` on .bin / .npy data said "CPU-bound: JPEG decode ... decode on a GPU",
    # measured on built-in sample photos.
    import numpy as np

    folder = tmp_path / "data"
    folder.mkdir()
    for k in range(4):
        arr = np.random.default_rng(k).integers(0, 50_000, 100_000, dtype=np.int32)
        if kind == "npy":
            np.save(folder / f"{k}-{name}", arr)
        else:
            arr.tofile(folder / f"{k}-{name}")
    argv = ["diagnose", "--json", "--quick", "--no-gpu", "--cache-dir", str(tmp_path / "c"), str(folder)]
    code, r = _run(capsys, argv)
    assert code == 0
    assert r["data"] == {"status": "ok", "kind": kind, "kind_from": "the first bytes of the URL's first file",
                         "decode_on": "none"}
    assert r["compute"]["cpu_decode"]["status"] == "skipped" and f"the data is {kind}, not images" in r["compute"]["cpu_decode"]["reason"]
    assert r["images"]["status"] == "skipped"
    assert r["compute"]["payload_decode"]["raw"]["decode_bps_per_core"] > 0  # the data's own bytes
    v = r["verdict"]
    assert "JPEG" not in v["headline"] and "decode" not in v["headline"].split(":")[0]
    by = {x["name"]: x for x in v["ops"]}
    assert not by["cpu_decode"]["in_path"] and not by["gpu_decode"]["in_path"]
    assert not any("JPEG" in a["value"] + a["why"] for a in v["advice"])
    # --decode-on none on image data skips decoding too; cpu measures it.
    code, r = _run(capsys, [*argv[:-1], "--decode-on", "cpu", str(folder)])
    assert r["data"]["decode_on"] == "cpu" and r["compute"]["cpu_decode"]["status"] == "ok"


def test_the_kind_of_data_is_read_from_its_first_bytes():
    from fastload.diagnose.compute import data_kind, sample_jpegs

    assert data_kind(sample_jpegs(1)[0]) == "jpeg"
    assert data_kind(b"\x89PNG\r\n\x1a\n....") == "png"
    assert data_kind(b"\x93NUMPY\x01\x00v\x00{'descr'") == "npy"
    assert data_kind(bytes(range(256)) * 2) == "binary"
    assert data_kind(b"hello, world\n") == "text"


def test_the_index_probe_times_look_ups_of_the_caches_own_entries(tmp_path: Path) -> None:
    import os

    from fastload.cache import Cache
    from fastload.config import Settings
    from fastload.diagnose import disk as disk_probe

    s = Settings(cache_dir=tmp_path / "c")
    assert disk_probe.probe_index(s)["status"] == "skipped"  # no cache yet: and none is made
    assert not (tmp_path / "c").exists()
    cache = Cache(s)
    cache.put_many([(f"k{i:04d}", os.urandom(100), f"mem://{i}", 0) for i in range(50)])
    few = disk_probe.probe_index(s)
    assert few["status"] == "skipped" and "50 entries" in few["reason"]
    cache.put_many([(f"m{i:04d}", os.urandom(100), f"mem://m{i}", 0) for i in range(450)])
    got = disk_probe.probe_index(s, sample=300)
    assert got["status"] == "ok" and (got["entries"], got["looked_up"]) == (500, 300)
    assert got["lookups_per_s"] > 0
