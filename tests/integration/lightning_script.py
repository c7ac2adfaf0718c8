"""PyTorch Lightning's Trainer.fit with torch's DataLoader, then under fastload.patch_torch().

Run by tests/integration/test_lightning.py in its own process (Lightning turns on
deterministic algorithms and seeds globals). Prints one JSON object: per
configuration and loader class, the losses logged, the final weights and what
the loaders were.
"""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any

import pytorch_lightning as pl
import torch
import torch.utils.data
from torch import nn

import fastload

CONFIGS = {
    "workers0": {"num_workers": 0},
    "workers2": {"num_workers": 2},
    "persistent2": {"num_workers": 2, "persistent_workers": True},
}


class Noisy(torch.utils.data.Dataset):
    """A user dataset whose __getitem__ augments with the global RNG (noise)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(n)
        self.x = torch.randn(n, 8, generator=g)
        self.y = (self.x.sum(1, keepdim=True) > 0).float()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.05 * torch.randn(8), self.y[i]


class Data(pl.LightningDataModule):
    def __init__(self, **kw: Any) -> None:
        super().__init__()
        self.kw = kw
        self.loaders: list[Any] = []

    def _loader(self, n: int, shuffle: bool) -> Any:
        # Looked up at call time, as a framework or a user's module does.
        loader = torch.utils.data.DataLoader(Noisy(n), batch_size=8, shuffle=shuffle, **self.kw)
        self.loaders.append(loader)
        return loader

    def train_dataloader(self) -> Any:
        return self._loader(64, True)

    def val_dataloader(self) -> Any:
        return self._loader(24, False)


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 1))
        self.losses: dict[str, list[float]] = {"train": [], "val": []}

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.binary_cross_entropy_with_logits(self.net(x), y)

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        self.losses["train"].append(loss.item())
        return loss

    def validation_step(self, batch: Any, index: int) -> None:
        loss = self._loss(batch)
        self.log("val_loss", loss)
        self.losses["val"].append(loss.item())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(kw: dict[str, Any]) -> dict[str, Any]:
    pl.seed_everything(7, verbose=False)
    model, data = Model(), Data(**kw)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, deterministic=True, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, datamodule=data)
    fastload_loaders = [lo for lo in data.loaders if isinstance(lo, fastload.DataLoader)]
    return {
        "losses": model.losses,
        "logged": {k: float(v) for k, v in trainer.logged_metrics.items()},
        "weights": {k: v.tolist() for k, v in model.state_dict().items()},
        "loader_classes": sorted({f"{type(lo).__module__}.{type(lo).__qualname__}" for lo in data.loaders}),
        "fastload_batches": sum(lo.stats().batches for lo in fastload_loaders),
        "iterators_left": sum(getattr(lo, "_iterator", None) is not None for lo in data.loaders),
    }


def main() -> None:
    warnings.filterwarnings("ignore")  # Lightning's advice on num_workers, logging, etc.
    out: dict[str, Any] = {}
    for name, kw in CONFIGS.items():
        out[name] = {"torch": fit(kw)}
        with fastload.patch_torch():
            out[name]["fastload"] = fit(kw)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
