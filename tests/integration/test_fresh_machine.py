"""A fresh machine: no nginx (and no apt-get). The tests that need nginx skip with one
line saying how to get it, and the install step `make test` and `.ci/run` share
(scripts/install-test-deps) says what is missing, or installs it with apt-get.

nginx is hidden for real, not patched: each command runs in a private mount
namespace where /dev/null (not executable) is bind-mounted over every nginx that
fastload._servers.find_nginx would find (PATH and its fixed candidates), and over
apt-get where the test says so. That needs root; elsewhere these tests skip.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fastload._servers import nginx as nginx_module

pytestmark = pytest.mark.integration  # subprocesses, a mount namespace

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "install-test-deps"


def _nginx_paths() -> list[str]:
    found = {shutil.which("nginx"), *nginx_module._NGINX_CANDIDATES}
    return sorted(p for p in found if p and os.path.exists(p))


@functools.cache
def _hiding_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "hiding nginx needs root (a private mount namespace)"
    if shutil.which("unshare") is None:
        return "hiding nginx needs unshare (util-linux)"
    probe = subprocess.run(_hidden(["true"], ["/dev/null"]), capture_output=True, timeout=30)
    if probe.returncode != 0:
        return f"cannot bind-mount in a private mount namespace here: {probe.stderr.decode()[-300:]}"
    return None


def _hidden(cmd: list[str], paths: list[str]) -> list[str]:
    """``cmd`` run where every path in ``paths`` is /dev/null (so not executable)."""
    mounts = " && ".join(f"mount --bind /dev/null '{p}'" for p in paths) or "true"
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", f'{mounts} && exec "$@"', "sh", *cmd]


@pytest.fixture
def no_nginx() -> list[str]:
    """The paths to hide so that this machine has no nginx."""
    reason = _hiding_unavailable()
    if reason is not None:
        pytest.skip(reason)
    return _nginx_paths()


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "FASTLOAD_REQUIRE_SERVERS"}
    env["PYTHONPATH"] = str(ROOT)
    return env


def test_hiding_really_hides_nginx(no_nginx: list[str]) -> None:
    code = "from fastload._servers import find_nginx, nginx_available; print(find_nginx(), nginx_available())"
    done = subprocess.run(_hidden([sys.executable, "-c", code], no_nginx), capture_output=True, text=True,
                          timeout=60, env=_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["None", "False"]


def test_tests_that_need_nginx_skip_with_one_line_saying_how_to_get_it(no_nginx: list[str]) -> None:
    # The test that failed on a machine without nginx, and one that always skipped right.
    tests = ["tests/integration/test_bench_peers_smoke.py::test_cpu_per_object_reports_both_epochs",
             "tests/integration/test_http.py"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests]
    done = subprocess.run(_hidden(cmd, no_nginx), capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " failed" not in done.stdout and " skipped" in done.stdout, done.stdout[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("fastload: ") and "nginx not found" in line]
    assert len(lines) == 1, done.stdout[-2000:]
    assert "tests skipped: nginx not found; `sudo make test` installs it" in lines[0], lines
    assert "apt-get install nginx" in lines[0], lines


def test_install_step_without_apt_says_what_is_missing_and_passes(no_nginx: list[str]) -> None:
    apt = shutil.which("apt-get")
    hide = [*no_nginx, *([apt] if apt else [])]
    done = subprocess.run(_hidden([str(SCRIPT)], hide), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "missing nginx (no apt-get here)" in done.stdout and "will skip" in done.stdout, done.stdout
    # .ci/run's variant: a server it cannot install is an error, not a skip.
    done = subprocess.run(_hidden([str(SCRIPT), "--require"], hide), capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "missing nginx (no apt-get here)" in done.stderr, done.stderr


def test_install_step_as_root_installs_the_missing_packages_with_apt(no_nginx: list[str], tmp_path: Path) -> None:
    # A real apt-get would install nginx on this machine for good, so a recording one
    # stands in for it (hiding the real one): what is checked is the script's choice.
    apt = shutil.which("apt-get")
    log = tmp_path / "apt.log"
    fake = tmp_path / "bin" / "apt-get"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    done = subprocess.run(_hidden([str(SCRIPT)], [*no_nginx, *([apt] if apt else [])]), capture_output=True,
                          text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    calls = log.read_text().splitlines()
    assert calls[0] == "install -y -q nginx", calls
    # The recording apt-get installed nothing, so the script says nginx is still missing.
    assert "missing nginx (apt-get could not install it)" in done.stdout, done.stdout


def test_make_test_and_ci_share_the_install_step() -> None:
    make = subprocess.run(["make", "--no-print-directory", "-n", "test"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert make.returncode == 0, make.stderr
    assert make.stdout.splitlines()[0] == "scripts/install-test-deps", make.stdout[:500]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "scripts/install-test-deps --require" in ci and "apt-get" not in ci
