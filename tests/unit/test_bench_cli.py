"""``fastload bench``: the real DataLoader over sample JPEGs, cold then warm, small."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fastload.cli import main
from fastload.diagnose import _util
from fastload.stats import default_collector

N = 12


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fastload.samples import make_image_folder

    root = tmp_path_factory.mktemp("bench") / "train"
    make_image_folder(root, n=N)
    return root


def _bench(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, Any]:
    assert main(["bench", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_bench_sample_runs_cold_then_warm(capsys):
    r = _bench(capsys, ["--sample", "--sample-images", str(N), "--batch-size", "4", "--epochs", "2"])

    assert r["fastload_bench"] == 1 and r["items"] == N
    assert r["dataset"].startswith(f"{N} built-in sample JPEGs")
    assert r["decode"] == "cpu, Pillow, to uint8 3x224x224"
    cold, warm = r["runs"]
    assert (cold["epoch"], cold["regime"], cold["cache_hit_rate"]) == (1, "cold", 0.0)
    assert (warm["epoch"], warm["regime"], warm["cache_hit_rate"]) == (2, "warm", 1.0)
    for run in (cold, warm):
        assert run["loader"] == "fastload"
        assert run["batches"] == N // 4 and run["samples"] == N
        assert run["samples_per_s"] > 0
        assert 0.0 <= run["data_stall_fraction"] <= 1.0
        assert run["peak_rss_bytes"] > 50e6
        assert len(run["wait_ms_per_batch"]) == N // 4
        assert run["ops"]["decode"]["items"] == N
        assert run["ops"]["decode"]["bytes"] == N * 3 * 224 * 224
        assert run["loader_stats"]["batches"] == N // 4
        assert run["limit"] in run["ops"]
    # Cold epoch fetched every file; the warm one read them all from the cache.
    assert cold["ops"]["fetch"]["items"] == N and "cache_read" not in cold["ops"]
    assert warm["ops"]["cache_read"]["items"] == N and "fetch" not in warm["ops"]
    assert cold["loader_stats"]["counters"] == {"cache_miss": N}
    assert r["ru_maxrss_bytes"] >= cold["peak_rss_bytes"]


def test_bench_compare_batches_and_step(capsys, folder):
    leaked_before = default_collector().snapshot().op("fetch").items
    r = _bench(capsys, [str(folder), "--batch-size", "4", "--epochs", "2", "--batches", "2", "--compare",
                        "--step-ms", "2"])

    runs = {(x["loader"], x["epoch"]): x for x in r["runs"]}
    assert set(runs) == {("fastload", 1), ("fastload", 2), ("torch", 1), ("torch", 2)}
    for run in r["runs"]:
        assert run["batches"] == 2 and run["samples"] == 8
        assert run["consumer_per_s"] == pytest.approx(4 * 1000 / 2)
    # --batches 2 with no shuffle: epoch 2 reads exactly what epoch 1 cached.
    assert runs[("fastload", 2)]["cache_hit_rate"] == 1.0
    assert runs[("fastload", 1)]["vs_torch"] == pytest.approx(
        runs[("fastload", 1)]["samples_per_s"] / runs[("torch", 1)]["samples_per_s"])
    # torch reads in the calling thread; its dataset's ops are recorded, not leaked.
    assert runs[("torch", 1)]["ops"]["fetch"]["items"] == 8 and runs[("torch", 1)]["cache_hit_rate"] == 0.0
    assert runs[("torch", 2)]["ops"]["cache_read"]["items"] == 8 and runs[("torch", 2)]["cache_hit_rate"] == 1.0
    assert runs[("torch", 2)]["ops"]["decode"]["threads"] == 1
    assert default_collector().snapshot().op("fetch").items == leaked_before
    assert r["url"] == str(folder)


def test_bench_without_decode_moves_raw_bytes(capsys, folder):
    r = _bench(capsys, [str(folder), "--batch-size", "6", "--epochs", "1", "--decode", "none"])

    (run,) = r["runs"]
    assert r["decode"] == "none (raw bytes)"
    assert "decode" not in run["ops"] and run["samples"] == N
    assert run["ops"]["fetch"]["bytes"] == sum(p.stat().st_size for p in folder.rglob("*.jpg"))


def test_bench_human_output_and_plot(capsys, tmp_path, folder):
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    assert main(["bench", str(folder), "--batch-size", "4", "--epochs", "2", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "fastload epoch 1 (cold): loader.stats()" in out and "fastload epoch 2 (warm)" in out
    assert "slowest op:" in out and f"plot: {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_usage_errors(capsys, monkeypatch, tmp_path):
    assert main(["bench"]) == 2
    assert "give DATASET_OR_URL or --sample" in capsys.readouterr().err
    assert main(["bench", "--sample", "--epochs", "0"]) == 2
    monkeypatch.setitem(_util.OPTIONAL, "matplotlib", ("fastload_no_such_module", "pip install 'fastload[diag]'"))
    assert main(["bench", "--sample", "--plot", str(tmp_path / "x.png")]) == 1
    assert "pip install 'fastload[diag]'" in capsys.readouterr().err


def test_bench_epoch_waits_only_for_its_own_reads() -> None:
    # After --batches stops an epoch early, bench waits for its own loader's reads
    # still running (so they don't count in the next epoch), not for other threads
    # that merely share the "fastload-read" name.
    import threading
    import time

    import torch

    from fastload.diagnose.bench import BenchOptions, _epoch
    from fastload.loader.dataloader import DataLoader
    from fastload.stats import current_collector

    class SlowReads(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> int:
            return i

        def read_batch(self, indices: list[int]) -> list[int]:
            time.sleep(0.2)
            current_collector().add("fetch", items=len(indices))  # the loader's collector
            return list(indices)

    release = threading.Event()
    other = threading.Thread(target=release.wait, name="fastload-read-someone-else", daemon=True)
    other.start()
    # A bench that joined every "fastload-read*" thread would wait for this one, which
    # only ends when the timer fires.
    timer = threading.Timer(5.0, release.set)
    timer.start()
    try:
        loader = DataLoader(SlowReads(), batch_size=4, read_threads=2, read_ahead=2)
        run = _epoch(loader, BenchOptions(batches=1, batch_size=4))
        assert run["batches"] == 1
        assert other.is_alive()  # not waited for
        after = loader.stats().op("fetch").items
        time.sleep(0.5)
        assert loader.stats().op("fetch").items == after  # its own reads were
    finally:
        release.set()
        timer.cancel()
        other.join(5)


def test_bench_help_shows_the_read_threads_default_the_run_uses(capsys, monkeypatch):
    import fastload.config
    from fastload.loader.chain import DEFAULT_READ_THREADS

    assert main(["bench", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps help lines
    assert f"(default {DEFAULT_READ_THREADS}:" in text, text
    # The help follows the machine, not a constant: 3 CPUs -> 3 threads.
    monkeypatch.setattr(fastload.config.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert main(["bench", "--help"]) == 0
    assert "(default 3:" in " ".join(capsys.readouterr().out.split())


def test_diagnose_assumes_the_read_threads_default_bench_runs_with(capsys, monkeypatch):
    # diagnose compares against "your loader's read threads": unless told, the
    # DataLoader's default on this machine, as bench runs with (it once assumed 8).
    import fastload.config
    from fastload.cli import build_parser

    monkeypatch.setattr(fastload.config.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert build_parser().parse_args(["diagnose"]).read_threads == 3
    assert build_parser().parse_args(["diagnose", "--read-threads", "5"]).read_threads == 5
    helps = []
    for command in ("diagnose", "bench"):
        assert main([command, "--help"]) == 0
        text = " ".join(capsys.readouterr().out.split())
        option = text[text.rindex("--read-threads READ_THREADS"):]  # the options list, not the usage line
        helps.append(option[option.index("(default"):].split(")", 1)[0])
    assert helps[0] == helps[1] and helps[0].startswith("(default 3:"), helps
