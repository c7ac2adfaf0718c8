"""A real third-party trainer: Lightning's Trainer.fit with torch's class, then under patch_torch()."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pytorch_lightning", reason="pip install 'fastload[test]' (pytorch-lightning)")

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).with_name("lightning_script.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=240,
        cwd=tmp_path_factory.mktemp("lightning"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result: dict[str, dict[str, Any]] = json.loads(proc.stdout)
    return result


@pytest.mark.parametrize("config", ["workers0", "workers2", "persistent2"])
def test_fit_under_patch_torch_is_identical(runs: dict[str, dict[str, Any]], config: str) -> None:
    theirs, ours = runs[config]["torch"], runs[config]["fastload"]
    assert theirs["loader_classes"] == ["torch.utils.data.dataloader.DataLoader"]
    assert ours["loader_classes"] == ["fastload.loader.dataloader.DataLoader"]
    assert ours["fastload_batches"] == 2 * 8 + 2 + 2 * 3  # 2 epochs of 8, sanity check, 2 validations
    assert len(theirs["losses"]["train"]) == 16 and len(theirs["losses"]["val"]) == 8
    assert ours["losses"] == theirs["losses"]  # dropout and the dataset's noise interleave alike
    assert ours["logged"] == theirs["logged"] and set(ours["logged"]) == {"train_loss", "val_loss"}
    assert ours["weights"] == theirs["weights"]
    # Lightning's teardown shuts persistent workers down through loader._iterator.
    assert ours["iterators_left"] == theirs["iterators_left"] == 0
