"""Real DDP: torchrun with two processes on the gloo backend (CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).with_name("ddp_script.py")
ROOT = Path(__file__).resolve().parents[2]
N = 50


def _torchrun(out: Path) -> list[dict[str, Any]]:
    out.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node=2", "--standalone", str(SCRIPT), str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    base = tmp_path_factory.mktemp("ddp")
    return [_torchrun(base / "a"), _torchrun(base / "b")]


def test_ranks_are_disjoint_and_cover_the_dataset(runs: list[list[dict[str, Any]]]) -> None:
    ranks = runs[0]
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["world"] == 2
    for epoch in range(2):
        shards = [r["distributed"][epoch] for r in ranks]
        assert len(shards[0]) == len(shards[1]) == N // 2
        assert not set(shards[0]) & set(shards[1])
        assert sorted(shards[0] + shards[1]) == list(range(N))
    assert ranks[0]["distributed"][0] != ranks[0]["distributed"][1]  # set_epoch reshuffles
    assert all(r["steps_equal"] for r in ranks)


def test_matches_distributed_sampler(runs: list[list[dict[str, Any]]]) -> None:
    for r in runs[0]:
        assert r["sampler"] == r["distributed"][1]


def test_reproducible_across_runs(runs: list[list[dict[str, Any]]]) -> None:
    assert runs[0] == runs[1]


def test_resume_under_ddp(runs: list[list[dict[str, Any]]]) -> None:
    for r in runs[0]:
        assert r["resumed"] == r["distributed"][1]
        assert r["sampler_resumed"] == r["sampler"]
