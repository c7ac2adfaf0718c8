"""Real DDP (torchrun, 2 ranks, gloo): ranks whose listings differ fail before the first batch, on every rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).with_name("listing_script.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("listing")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", str(SCRIPT), str(out)]
    # A hang (a rank left in a collective) ends at the timeout, as a failure.
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_agreeing_listings_split_as_before(ranks: list[dict[str, Any]]) -> None:
    urls = [f"http://host/data/{i:03d}.bin" for i in range(10)]
    for case in ("agree_global", "agree_node"):
        seen = [[u for b in r[case]["batches"] for u in b] for r in ranks]
        assert all(r[case]["error"] is None for r in ranks)
        assert len(seen[0]) == len(seen[1]) == 5 and sorted(seen[0] + seen[1]) == urls


@pytest.mark.parametrize(
    "case, held, first",
    [
        ("fewer_global", "rank 0: 10 items", "First difference at item 9: rank 0 has 'http://host/data/009.bin', rank 1 has no item"),
        ("other_url_node", "rank 1: 10 items", "rank 0 has 'http://host/data/004.bin' (100 B), rank 1 has 'http://host/data/new.bin' (100 B)"),
        ("other_size_node", "rank 1: 10 items", "First difference at item 3: rank 0 has 'http://host/data/003.bin' (100 B), rank 1 has 'http://host/data/003.bin' (101 B)"),
        ("plain_fewer_global", "rank 1: 9 items", "rank 0: 10 items"),
    ],
)  # fmt: skip
def test_differing_listings_fail_on_every_rank_before_the_first_batch(
    ranks: list[dict[str, Any]], case: str, held: str, first: str
) -> None:
    errors = [r[case]["error"] for r in ranks]
    assert errors[0] is not None and errors[0] == errors[1]  # the same error on both ranks
    assert "batches" not in ranks[0][case] and held in errors[0] and first in errors[0]
    assert "--refresh" in errors[0] and "refresh=True" in errors[0]
