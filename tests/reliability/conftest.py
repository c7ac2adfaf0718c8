"""Fixtures of the reliability suite: fault proxy, tmpfs mounts, result recording.

Every test records what it measured with ``record(fault_id, trials, summary)``.
With ``FASTLOAD_RELIABILITY_RESULTS=path.json`` set, the session merges those
records into that file when it ends (``make reliability-doc`` does it and
re-renders docs/reliability.md from it).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from faultproxy import FaultProxy
from faults import FAULTS, RESULTS_ENV

_RESULTS: dict[str, dict[str, Any]] = {}


def variant_of(node: pytest.Item) -> str:
    """``"full"`` for the slow (make test-all) variant of a test, else ``"short"``."""
    return "full" if node.get_closest_marker("slow") else "short"


@pytest.fixture
def record(request: pytest.FixtureRequest) -> Callable[..., None]:
    """``record(fault_id, trials, summary, **details)``; call it last, after the asserts."""
    variant = variant_of(request.node)

    def rec(fault_id: str, trials: int, summary: str, **details: Any) -> None:
        fault = FAULTS[fault_id]
        expected = fault.trials_full if variant == "full" else fault.trials_short
        # The doc promises these counts; a test that ran fewer must not claim them.
        assert trials == expected, f"{fault_id} ({variant}) ran {trials} trials, the registry says {expected}"
        _RESULTS.setdefault(fault_id, {})[variant] = {
            "trials": trials,
            "result": "pass",
            "summary": summary,
            "details": details,
            "test": request.node.nodeid,
        }

    return rec


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = os.environ.get(RESULTS_ENV)
    if not path or not _RESULTS:
        return
    out = Path(path)
    data: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    faults = data.setdefault("faults", {})
    for fault_id, variants in _RESULTS.items():
        faults.setdefault(fault_id, {}).update(variants)
    data["machine"] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "system": f"{platform.system()} {platform.release()}",
    }
    data["updated"] = time.strftime("%Y-%m-%d")
    out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


@pytest.fixture
def fault_proxy() -> Iterator[Callable[..., FaultProxy]]:
    """Factory: ``fault_proxy(upstream_url, rates, **kwargs)``; every proxy stops on teardown."""
    started: list[FaultProxy] = []

    def start(upstream: str, rates: dict[str, float] | None = None, **kwargs: Any) -> FaultProxy:
        proxy = FaultProxy(upstream, rates, **kwargs)
        started.append(proxy)
        return proxy.start()

    yield start
    for proxy in reversed(started):
        proxy.stop()


@pytest.fixture
def fast_worker_shutdown(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch polls worker status every 5 s; ending an iterator whose worker raised
    waits that out twice. Poll every 0.5 s instead (forked workers inherit it)."""
    import torch.utils.data._utils as utils
    import torch.utils.data._utils.worker as worker

    monkeypatch.setattr(utils, "MP_STATUS_CHECK_INTERVAL", 0.5)
    monkeypatch.setattr(worker, "MP_STATUS_CHECK_INTERVAL", 0.5)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """Factory: ``tmpfs(size_bytes, at=None)`` mounts a fresh tmpfs (at ``at``, an empty dir) and returns its path.

    Needs root (mount(2)); skips otherwise. Every mount is unmounted on teardown,
    lazily if something still holds it, so a failing test never leaves one behind.
    """
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted: list[Path] = []

    def mount(size: int, at: Path | None = None) -> Path:
        point = at if at is not None else tmp_path / f"tmpfs-{uuid.uuid4().hex[:8]}"
        point.mkdir(exist_ok=True)
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(point)],
            capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in reversed(mounted):
        if subprocess.run(["umount", str(point)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(point)], capture_output=True)
