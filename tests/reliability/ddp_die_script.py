"""Run under ``torchrun --nproc_per_node=2``: rank 1 SIGKILLs itself mid-epoch.

Usage: torchrun ... ddp_die_script.py DATA_DIR CACHE_DIR OUT_DIR. Both ranks train
on a fastload FileDataset (distributed=True, one shared cache) with an
all_reduce per step, as DDP's gradient sync does. Rank 1 dies at step 3. The
survivor writes OUT_DIR/rank0.json saying how it ended: the exception it got
in the collective, or the SIGTERM that torchrun's agent sent it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import fastload
from fastload.config import Settings

DIE_AT = 3


def as_list(batch: list[Any]) -> list[Any]:
    return batch


def main(data_dir: str, cache_dir: str, out_dir: str) -> int:
    # A bounded wait for every collective: the backstop if the peer's death went unseen.
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank = dist.get_rank()
    out = os.path.join(out_dir, f"rank{rank}.json")
    state: dict[str, Any] = {"rank": rank, "steps": 0, "last_ok": time.monotonic()}

    def report(**fields: Any) -> None:
        fields |= {"rank": rank, "steps": state["steps"], "after_s": round(time.monotonic() - state["last_ok"], 3)}
        with open(out, "w") as f:
            json.dump(fields, f)

    def on_term(signum: int, frame: Any) -> None:
        report(ended="terminated by the torchrun agent (SIGTERM)")
        os._exit(143)

    signal.signal(signal.SIGTERM, on_term)
    ds = fastload.FileDataset(data_dir, settings=Settings(cache_dir=cache_dir))
    loader = fastload.DataLoader(ds, batch_size=2, shuffle=True, distributed=True, seed=1, collate_fn=as_list)
    try:
        for epoch in range(3):
            loader.set_epoch(epoch)
            for batch in loader:
                if rank == 1 and state["steps"] == DIE_AT:
                    os.kill(os.getpid(), signal.SIGKILL)
                grad = torch.tensor([float(len(b["data"])) for b in batch]).sum()
                dist.all_reduce(grad)
                state["steps"] += 1
                state["last_ok"] = time.monotonic()
    except Exception as err:  # the point of the test: what the survivor sees
        report(ended="exception", error=type(err).__name__, message=str(err)[:2000])
        return 1
    report(ended="finished")  # never reached by the survivor while its peer is dead
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
