"""The CLI: exit codes, JSON output, dry run, info, clear, evict."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastload.cache import Cache
from fastload.cli import main
from fastload.config import Settings


@pytest.fixture()
def dataset(tmp_path: Path) -> Path:
    root = tmp_path / "ds"
    (root / "a").mkdir(parents=True)
    for i in range(5):
        (root / "a" / f"{i}.txt").write_bytes(b"line of text %d\n" % i * 3000)
    (root / "skip.bin").write_bytes(os.urandom(1000))
    return root


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cache_json_report_and_resume(dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cd = str(tmp_path / "c")
    code, out, _ = run(capsys, "cache", str(dataset), "--pattern", "**/*.txt", "--cache-dir", cd, "--json")
    report = json.loads(out)
    assert code == 0 and report["items"] == 5 and report["fetched_blocks"] == 5 and report["ratio"] > 1.5
    code, out, _ = run(capsys, "cache", str(dataset), "--pattern", "**/*.txt", "--cache-dir", cd, "--json")
    assert code == 0 and json.loads(out)["skipped_blocks"] == 5 and json.loads(out)["fetched_blocks"] == 0


def test_human_report_names_the_numbers(dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "cache", str(dataset), "--cache-dir", str(tmp_path / "c"), "--no-progress")
    assert code == 0
    for word in ("items", "remote", "on disk", "ratio", "MB/s"):
        assert word in out


def test_progress_bar_is_shown_on_request(dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "cache", str(dataset), "--cache-dir", str(tmp_path / "c"), "--progress")
    assert code == 0 and "staging" in err and "100%" in err


def test_dry_run_reports_fit_and_fetches_nothing(dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cd = str(tmp_path / "c")
    code, out, _ = run(capsys, "cache", str(dataset), "--cache-dir", cd, "--dry-run", "--json")
    assert code == 0 and json.loads(out)["fits"] is True
    code, out, _ = run(capsys, "cache", str(dataset), "--cache-dir", cd, "--dry-run", "--cache-limit", "10KB")
    assert code == 1 and "does NOT fit" in out
    assert not list(Cache(Settings(cache_dir=Path(cd))).entries())


def test_dataset_over_the_limit_fails_with_the_fix(dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "cache", str(dataset), "--cache-dir", str(tmp_path / "c"), "--cache-limit", "10KB")
    assert code == 1 and "raise --cache-limit" in err and str(dataset) in err


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "cache")[0] == 2
    assert run(capsys, "cache", "x", "--storage-options", "{not json")[0] == 2
    assert run(capsys, "evict", "--to", "lots")[0] == 2
    assert run(capsys, "frobnicate")[0] == 2


def test_missing_source_exits_1_with_a_named_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "cache", str(tmp_path / "nope"), "--cache-dir", str(tmp_path / "c"))
    assert code == 1 and "nope" in err and "not found" in err


def test_info_clear_and_evict(dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cd = str(tmp_path / "c")
    run(capsys, "cache", str(dataset), "--cache-dir", cd)
    code, out, _ = run(capsys, "info", "--cache-dir", cd, "--json")
    info = json.loads(out)
    assert code == 0 and info["entries"] == 6 and info["datasets"][0]["cached_items"] == 6
    code, out, _ = run(capsys, "evict", "--to", "0", "--cache-dir", cd, "--json")
    assert code == 0 and json.loads(out)["after_bytes"] == 0
    run(capsys, "cache", str(dataset), "--cache-dir", cd)
    code, out, _ = run(capsys, "clear", str(dataset), "--cache-dir", cd, "--json")
    assert code == 0 and json.loads(out)["entries"] == 6
    code, out, _ = run(capsys, "info", "--cache-dir", cd, "--json")
    assert json.loads(out)["entries"] == 0 and json.loads(out)["datasets"] == []
    assert run(capsys, "clear", str(dataset), "--cache-dir", cd)[0] == 1  # nothing staged any more


def test_console_script_and_module_entry_points(tmp_path: Path) -> None:
    for cmd in (["fastload"], [sys.executable, "-m", "fastload"]):
        exe = cmd if cmd[0] != "fastload" else [str(Path(sys.executable).parent / "fastload")]
        out = subprocess.run([*exe, "info", "--cache-dir", str(tmp_path / "c"), "--json"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and json.loads(out.stdout)["entries"] == 0


def test_lz4_hc_level_is_not_larger(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import numpy as np

    root = tmp_path / "tok"
    root.mkdir()
    np.random.default_rng(0).zipf(1.2, 300_000).clip(0, 32_000).astype(np.int32).tofile(root / "t.bin")
    sizes = []
    for level in ("0", "9"):
        code, out, _ = run(capsys, "cache", str(root), "--cache-dir", str(tmp_path / f"c{level}"), "--level", level, "--json")
        assert code == 0
        sizes.append(json.loads(out)["stored_bytes"])
    assert sizes[1] < sizes[0] < (root / "t.bin").stat().st_size


def test_a_rerun_on_a_changed_remote_says_how_many_changed_and_points_to_refresh(
    dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    # Staging from the recorded listing stages that snapshot (exit 0), and said nothing of a
    # remote that had changed since (issue 24, item 7).
    cd = str(tmp_path / "c")
    assert run(capsys, "cache", str(dataset), "--cache-dir", cd, "--json")[0] == 0
    code, out, _ = run(capsys, "cache", str(dataset), "--cache-dir", cd, "--json")
    assert code == 0 and (json.loads(out)["remote_changed"], json.loads(out)["remote_new"]) == (0, 0)
    assert not [r for r in caplog.records if "differs" in r.getMessage()]

    (dataset / "a" / "0.txt").write_bytes(b"longer now" * 9000)  # a new size
    os.utime(dataset / "a" / "1.txt", (1, 1))  # a new version (local files: the mtime)
    (dataset / "new.bin").write_bytes(b"n")
    (dataset / "skip.bin").unlink()
    code, out, _ = run(capsys, "cache", str(dataset), "--cache-dir", cd, "--json")
    report = json.loads(out)
    assert code == 0 and report["skipped_blocks"] == 6 and report["fetched_blocks"] == 0  # the snapshot, as documented
    assert (report["remote_changed"], report["remote_new"], report["remote_gone"]) == (2, 1, 1)
    said = [r.getMessage() for r in caplog.records if "differs" in r.getMessage()]
    assert len(said) == 1 and "2 changed, 1 new, 1 gone" in said[0] and "--refresh" in said[0], said

    code, out, _ = run(capsys, "cache", str(dataset), "--cache-dir", cd, "--json", "--refresh")
    assert code == 0 and json.loads(out)["fetched_blocks"] == 3  # the two changed and the new one


def test_glob_classes_match_fresh_and_from_a_recorded_listing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 'class_[01]/*.jpg' matched nothing, and the example it offered matched the pattern (issue 24, item 9).
    root = tmp_path / "imgs"
    for c in range(4):
        (root / f"class_{c}").mkdir(parents=True)
        for i in range(5):
            (root / f"class_{c}" / f"{i:04d}.jpg").write_bytes(b"j" * 100)
    cd = str(tmp_path / "c")
    code, out, err = run(capsys, "cache", str(root), "--pattern", "class_[01]/*.jpg", "--cache-dir", cd, "--json")
    assert code == 0 and json.loads(out)["items"] == 10, err
    assert run(capsys, "cache", str(root), "--cache-dir", cd, "--json")[0] == 0  # the whole folder, recorded
    code, out, err = run(capsys, "cache", str(root), "--pattern", "class_[!0]/000?.jpg", "--cache-dir", cd, "--json")
    assert code == 0 and json.loads(out)["items"] == 15, err  # served by the recorded listing
    code, _, err = run(capsys, "cache", str(root), "--pattern", "class_**.jpg", "--cache-dir", cd)
    assert code == 1 and "'**' a whole path component, e.g. '**/class_*.jpg'" in err, err


def test_info_is_the_one_command_that_shows_the_cache(capsys: pytest.CaptureFixture[str]) -> None:
    # `ls` was a second name for `info`; one meaning, one name.
    assert main(["ls"]) == 2 and "invalid choice: 'ls'" in capsys.readouterr().err


def test_workers_flag_is_max_requests_old_name(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from fastload import cli, config

    seen: list[int] = []
    real = cli._settings
    monkeypatch.setattr(cli, "_settings", lambda args: seen.append(real(args).max_requests) or real(args))
    monkeypatch.setattr(config, "_warned", set())
    data = tmp_path / "d"
    data.mkdir()
    (data / "a.bin").write_bytes(b"a")
    assert main(["cache", str(data), "--max-requests", "3", "--cache-dir", str(tmp_path / "c"), "--no-progress"]) == 0
    with pytest.warns(FutureWarning, match="'--workers' is now '--max-requests'"):
        assert main(["cache", str(data), "--workers", "5", "--cache-dir", str(tmp_path / "c"), "--no-progress"]) == 0
    assert 3 in seen and 5 in seen and 64 not in seen[seen.index(5):]
