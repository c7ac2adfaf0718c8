"""Run under ``torchrun --nproc_per_node=2 --standalone``: ranks whose listings differ.

Usage: torchrun ... listing_script.py OUT_DIR. Builds fastload.DataLoader(distributed=True)
over datasets that agree on both ranks, and over ones where rank 1 lists one item
fewer, another URL, or another size; writes OUT_DIR/rank{r}.json with each case's
error message (None when there was none) and the agreeing cases' batches.
tests/integration/test_listing_agree.py checks the files.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch.distributed as dist
from torch.utils.data import Dataset

from fastload.errors import ConfigError
from fastload.loader.dataloader import DataLoader

N = 10


class Listed(Dataset):
    """Items named by URL with sizes, as a FileDataset names them (item_keys, item_sizes)."""

    def __init__(self, urls: list[str], sizes: list[int]) -> None:
        self.urls, self.sizes = urls, sizes

    def __len__(self) -> int:
        return len(self.urls)

    def __getitem__(self, i: int) -> str:
        return self.urls[i]

    def item_keys(self) -> list[str]:
        return list(self.urls)

    def item_sizes(self) -> list[int]:
        return list(self.sizes)


class Plain(Dataset):
    """No keys: only the length can be compared."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def urls(n: int = N) -> list[str]:
    return [f"http://host/data/{i:03d}.bin" for i in range(n)]


def main(out_dir: str) -> int:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # a missed collective fails, not hangs
    rank = dist.get_rank()
    one = rank == 1
    other = urls()
    other[4] = "http://host/data/new.bin"
    cases = {
        "agree_global": (Listed(urls(), [100] * N), "global"),
        "agree_node": (Listed(urls(), [100] * N), "node"),
        "fewer_global": (Listed(urls(N - 1 if one else N), [100] * (N - 1 if one else N)), "global"),
        "other_url_node": (Listed(other if one else urls(), [100] * N), "node"),
        "other_size_node": (Listed(urls(), [100] * 3 + [101 if one else 100] + [100] * (N - 4)), "node"),
        "plain_fewer_global": (Plain(N - 1 if one else N), "global"),
    }
    result: dict[str, object] = {"rank": rank}
    for name, (ds, partition) in cases.items():
        node = partition == "node"  # then 2 nodes of 1 rank
        try:
            loader = DataLoader(
                ds, batch_size=2, distributed=True, partition=partition, collate_fn=list,
                nodes=2 if node else None, node_rank=rank if node else None,
            )  # fmt: skip
        except ConfigError as err:
            result[name] = {"error": str(err)}
        else:
            result[name] = {"error": None, "batches": list(loader)}
        dist.barrier()  # every rank left the case: none hangs in a collective the other skipped
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
