"""``make gpu-bundle`` then ``gpu_check.py --wheels``, as on a GPU machine with no package registry.

The bundle is built for real (pip downloads from the registry, for this Python
and platform), and the check runs on a bare interpreter: a fresh venv with pip
and nothing else, no torch, no lz4, no xxhash. Skipped, with the reason, when
the registry cannot be reached.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.integration  # pip, a venv and the check as subprocesses

ROOT = Path(__file__).resolve().parents[2]
UNREACHABLE = ("Failed to establish", "NewConnectionError", "Temporary failure in name resolution",
               "Network is unreachable", "timed out", "ProxyError", "Max retries exceeded")


def _env() -> dict[str, str]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env.pop("PYTHONPATH", None)  # the check finds this checkout itself; the bundle gives the rest
    return env


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if platform.machine() != "x86_64":
        pytest.skip(f"the bundle's default platform is manylinux x86_64; this machine is {platform.machine()}")
    out = tmp_path_factory.mktemp("bundle")
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    done = subprocess.run([sys.executable, "scripts/gpu_bundle.py", "--python", here, "--out", str(out)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    if done.returncode != 0 and any(word in done.stderr for word in UNREACHABLE):
        pytest.skip(f"the package registry cannot be reached: {done.stderr.strip()[-300:]}")
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    return venv / "bin" / "python"


def test_bundle_holds_what_fastload_and_the_check_need_under_64_mib(
    bundle: Path, load_script: Callable[[str], ModuleType]
) -> None:
    script = load_script("scripts/gpu_bundle.py")
    wheels = sorted(bundle.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    assert 0 < total < 64 * 2**20, f"{total / 2**20:.1f} MiB"
    names = {w.name.split("-", 1)[0].lower().replace("_", "-") for w in wheels}
    assert {"lz4", "xxhash", "fsspec", "tqdm", "aiohttp", "numpy", "pytest", "pytest-timeout"} <= names
    manifest = json.loads((bundle / "bundle.json").read_text())
    assert manifest["bytes"] == total and manifest["wheels"] == [w.name for w in wheels]
    assert manifest["requirements"] == script.requirements()


def test_check_runs_on_a_bare_python_with_the_bundle_and_says_there_is_no_gpu(
    bundle: Path, bare_python: Path, tmp_path: Path
) -> None:
    without = tmp_path / "without.json"  # the bare interpreter alone cannot import fastload
    done = subprocess.run([str(bare_python), "scripts/gpu_check.py", "--out", str(without)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(without.read_text())["fastload"]["imports"] is False

    out = tmp_path / "with.json"
    done = subprocess.run([str(bare_python), "scripts/gpu_check.py", "--wheels", str(bundle), "--out", str(out)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "no GPU here" in done.stdout and "fastload imports" in done.stdout
    report = json.loads(out.read_text())
    assert report["status"] == "no_gpu" and "torch does not import" in report["reason"]
    assert report["wheels"]["status"] == "ok" and report["wheels"]["already_here"] == []
    assert {"lz4", "xxhash", "pytest"} <= set(report["wheels"]["installed"])
    assert report["fastload"]["imports"] is True and report["fastload"]["from"] == str(ROOT / "fastload")


def test_an_empty_wheels_folder_says_how_to_make_one(bare_python: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "r.json"
    done = subprocess.run([str(bare_python), "scripts/gpu_check.py", "--wheels", str(empty), "--out", str(out)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "no wheels in" in done.stderr and "make gpu-bundle" in done.stderr
