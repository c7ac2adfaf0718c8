"""The loader layer: ``fastload.DataLoader``, torch's drop-in, and what one pass of it runs.

Layer: above the faces (fastload.dataset, fs, stage) and everything below them; beside
fastload.pipelines (neither imports the other); imported by fastload.diagnose, the CLI
and ``fastload/__init__.py``. Modules:

* dataloader: the class, its arguments and index order; chain: one pass's iterators;
  iterator: the iterator the user holds (torch's surface, timing, live stats);
* sampler: index order, ranks and node parts, resumable; listing_check: the ranks agree
  on the items they split; resume / snapshot: the state
  and a worker's part of it; received: what torch's worker messages tell the parent
  besides the batch; readahead: the read_batch path's threads; forks: a forked
  worker's start-up done once in the parent;
* worker_stats: what workers ship with each batch; torch_surface: torch's classes as
  imported; patch: ``patch_torch()``; live: ``log_every=`` and ``summary_writer=``.

Nothing here is imported at ``import fastload``: these modules need torch.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # `fastload.loader` was the DataLoader's module before the layout of issue 37: a
    # pickle or script that names fastload.loader.DataLoader still finds it.
    if name == "DataLoader":
        from fastload.loader.dataloader import DataLoader

        return DataLoader
    raise AttributeError(f"module 'fastload.loader' has no attribute {name!r}")
