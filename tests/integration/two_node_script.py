"""One rank of a two-node job: ``torchrun --nnodes=2 --node_rank=K --nproc_per_node=2 ...``.

Usage: two_node_script.py URL PARTITION OUT_DIR. Reads the FileDataset at URL for 3
epochs through fastload.DataLoader(distributed=True, partition=PARTITION) and writes
OUT_DIR/rank{r}.json: the node, and the URLs this rank read per epoch. Each node's
cache is its own FASTLOAD_CACHE_DIR. tests/integration/test_two_nodes.py checks it.
"""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

import fastload

EPOCHS = 3


def main(url: str, partition: str, out_dir: str) -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ds = fastload.FileDataset(url)
    loader = fastload.DataLoader(ds, batch_size=4, shuffle=True, distributed=True, partition=partition, seed=5)
    epochs = []
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        epochs.append([u for batch in loader for u in batch["url"]])
        # A training step's all-reduce keeps ranks in step; without it one rank of a
        # node could ask for an item the other is still fetching.
        dist.barrier()
    result = {"rank": rank, "node": int(os.environ["GROUP_RANK"]), "steps": len(loader), "epochs": epochs}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
