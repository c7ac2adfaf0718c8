"""Training on a Hugging Face ``datasets`` IterableDataset stops mid-epoch and resumes with the same losses."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch

from fastload.loader.dataloader import DataLoader

datasets = pytest.importorskip("datasets")

EPOCHS = 2
BATCH = 4


def _stream() -> Any:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 3, generator=g)
    y = x @ torch.tensor([1.5, -2.0, 0.5]) + 0.1 * torch.randn(48, generator=g)
    table = datasets.Dataset.from_dict({"x": x.tolist(), "y": y.tolist()})
    return table.to_iterable_dataset(num_shards=4).with_format("torch")


def _loader(workers: int, every: int = 1) -> DataLoader:
    return DataLoader(_stream(), batch_size=BATCH, num_workers=workers, snapshot_every_n_steps=every)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> float:
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(batch["x"]).squeeze(-1), batch["y"])
    loss.backward()
    opt.step()
    return loss.item()


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def _train(loader: DataLoader, model: torch.nn.Module, opt: torch.optim.Optimizer, epochs: range, stop: int | None = None) -> tuple[list[float], Any]:
    losses: list[float] = []
    for epoch in epochs:
        loader.set_epoch(epoch)
        for batch in loader:
            losses.append(_step(model, opt, batch))
            if stop is not None and len(losses) == stop:
                ckpt = {"loader": loader.state_dict(), "model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch}
                return losses, copy.deepcopy(ckpt)
    return losses, None


@pytest.mark.parametrize(("workers", "every"), [(0, 1), (2, 1), (2, 3)])
def test_hf_iterable_dataset_resumes_mid_epoch_with_the_same_losses(workers: int, every: int) -> None:
    # every=3: the workers' snapshots lag; the resumed workers replay HF's stream.
    model, opt = _fresh()
    expected, _ = _train(_loader(workers), model, opt, range(EPOCHS))
    assert len(expected) == EPOCHS * 48 // BATCH

    model, opt = _fresh()
    head, ckpt = _train(_loader(workers, every), model, opt, range(EPOCHS), stop=5)  # mid-epoch 0
    assert ckpt is not None
    loader_state = json.loads(json.dumps(ckpt["loader"]))

    model, opt = _fresh()
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    resumed = _loader(workers, every)
    resumed.load_state_dict(loader_state)
    tail, _ = _train(resumed, model, opt, range(ckpt["epoch"], EPOCHS))
    assert head + tail == expected
