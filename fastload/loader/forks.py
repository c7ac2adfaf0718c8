"""Work a forked DataLoader worker would do at its start, done once in the parent instead.

Without ``persistent_workers`` (the default) torch forks new workers for every pass, and
each does the same start-up before its first batch. Two parts of it cost more than
the fork itself on the benchmark machine (profiled in forked workers, 3,000 files of
112 KB, ``benchmarks/loader/bench.py --cases workers``):

* torch's worker loop seeds numpy's global RNG, which imports ``numpy.random`` (about
  30 ms per worker) where the parent never did;
* its ``torch.manual_seed`` queues the CUDA and XPU seeding with the stack at that point
  (``traceback.format_stack``), reading the source file of every frame on it (about
  10 ms per worker);
* a FileDataset's first warm batch (``Cache.read_rows``) calls ``numpy.unique``, which
  imports ``numpy.ma`` on first use (numpy 2.x): 17-18 ms in each worker's first
  ``read_batch``, every epoch, where a parent that forks workers never reads a batch itself.

Modules imported and lines read in the parent are the workers' too, as the fork copies them.
"""

from __future__ import annotations

import importlib
import linecache
import sys
import traceback

# The frames a worker's stack adds below the parent's when torch.manual_seed queues
# its device seeding (torch.utils.data._utils.worker._worker_loop and what it calls).
_WORKER_FRAMES = (
    "multiprocessing.process", "multiprocessing.popen_fork", "multiprocessing.context",
    "torch.utils.data._utils.worker", "torch.random", "torch.cuda", "torch.cuda.random",
    "torch.xpu", "torch.xpu.random", "torch.mtia",
)  # fmt: skip


def before_fork() -> None:
    """Import and read in this process what each forked worker would at its start."""
    for name in ("numpy.random", "numpy.ma"):
        try:
            importlib.import_module(name)
        except ImportError:  # torch's workers seed numpy only where it imports
            pass
    for name in _WORKER_FRAMES:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path:
            linecache.getlines(path)
    traceback.extract_stack()  # reads this stack's files: the top of each worker's
