"""Before workers fork, the parent does what each would do at its start (fastload.loader.forks)."""

from __future__ import annotations

import subprocess
import sys

_PASS = """
import linecache, sys
import fastload
import torch.utils.data._utils.worker as worker
assert "numpy.random" not in sys.modules and "numpy.ma" not in sys.modules, "imported before any worker starts"
assert worker.__file__ not in linecache.cache
loader = fastload.DataLoader(list(range(8)), batch_size=4, num_workers={workers}{ctx})
assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
print("numpy.random" in sys.modules, worker.__file__ in linecache.cache, "numpy.ma" in sys.modules)
"""


def _pass(workers: int, ctx: str = "fork") -> str:
    code = _PASS.format(workers=workers, ctx=f", multiprocessing_context={ctx!r}" if workers else "")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout.strip()


def test_forked_workers_find_numpy_random_imported_and_torch_s_lines_read() -> None:
    # numpy.ma too: numpy.unique (a FileDataset's warm read) imports it on first use, 17-18 ms per worker
    assert _pass(2) == "True True True"


def test_nothing_is_done_without_forked_workers() -> None:
    assert _pass(0) == "False False False"
    assert _pass(1, "spawn") == "False False False"  # a spawned worker starts from nothing anyway
