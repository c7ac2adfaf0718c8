"""Run under ``torchrun --nproc_per_node=2 --standalone``: writes each rank's sample indices.

Usage: torchrun ... ddp_script.py OUT_DIR. Writes OUT_DIR/rank{r}.json with the indices
this rank saw per epoch with distributed=True, with a user DistributedSampler (workers),
and across a mid-epoch save/restore. tests/integration/test_ddp.py checks the files.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler

from fastload.loader.dataloader import DataLoader

N = 50


class IndexDS(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


def flat(batches: list[torch.Tensor]) -> list[int]:
    return [int(i) for b in batches for i in b]


def main(out_dir: str) -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict[str, object] = {"rank": rank, "world": world}

    # 1. distributed=True takes rank and world size from the process group.
    loader = DataLoader(IndexDS(), batch_size=4, shuffle=True, distributed=True, seed=3)
    epochs = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        epochs.append(flat(list(loader)))
    result["distributed"] = epochs

    # Every rank must run the same number of steps, or collectives would hang.
    steps = torch.tensor([len(loader)])
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    result["steps_equal"] = int(steps) == len(loader)

    # 2. A user-passed DistributedSampler, with worker processes.
    sampler = DistributedSampler(IndexDS(), shuffle=True, seed=3)
    sampler.set_epoch(1)
    result["sampler"] = flat(
        list(DataLoader(IndexDS(), batch_size=4, sampler=sampler, num_workers=2))
    )

    # 3. Resume mid-epoch: stop after 3 batches, save, rebuild, load, continue.
    first = DataLoader(IndexDS(), batch_size=4, shuffle=True, distributed=True, seed=3)
    first.set_epoch(1)
    it = iter(first)
    head = [next(it) for _ in range(3)]
    path = os.path.join(out_dir, f"state{rank}.pt")
    torch.save(first.state_dict(), path)
    del it, first
    resumed = DataLoader(IndexDS(), batch_size=4, shuffle=True, distributed=True, seed=3)
    resumed.load_state_dict(torch.load(path, weights_only=True))
    result["resumed"] = flat(head + list(resumed))

    # 4. The same with a user DistributedSampler and workers.
    s1 = DistributedSampler(IndexDS(), shuffle=True, seed=3)
    s1.set_epoch(1)
    l1 = DataLoader(IndexDS(), batch_size=4, sampler=s1, num_workers=2)
    it = iter(l1)
    head = [next(it) for _ in range(2)]
    state = l1.state_dict()
    del it
    s2 = DistributedSampler(IndexDS(), shuffle=True, seed=3)
    l2 = DataLoader(IndexDS(), batch_size=4, sampler=s2, num_workers=2)
    l2.load_state_dict(state)
    result["sampler_resumed"] = flat(head + list(l2))

    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
