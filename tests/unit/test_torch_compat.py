"""fastload._torch_compat on the torch this venv has, and with the newer APIs hidden."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fastload import _torch_compat
from fastload.loader import DataLoader


class _Squares(torch.utils.data.Dataset[Any]):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i * i])

    def read_batch(self, indices: list[int]) -> list[torch.Tensor]:
        return [self[i] for i in indices]


def test_read_batch_path_with_pin_memory_on_torch_without_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch < 2.6 has no torch.accelerator: pin_memory=True must still work (on CUDA only).
    # Hiding the attribute for the whole run would also break torch 2.13's own iterator
    # (it reads torch.accelerator), so fastload's code is checked not to name it, and
    # the compat answer is checked with it hidden.
    import fastload

    root = Path(fastload.__file__).parent
    naming = [p.relative_to(root).as_posix() for p in root.rglob("*.py")
              if p.name != "_torch_compat.py" and "torch.accelerator." in p.read_text()]  # fmt: skip
    assert not naming, f"torch.accelerator is used outside fastload/_torch_compat.py: {naming}"
    got = [b.flatten().tolist() for b in DataLoader(_Squares(), batch_size=4, pin_memory=True)]
    assert got == [[0, 1, 4, 9], [16, 25, 36, 49], [64, 81]]
    monkeypatch.delattr(torch, "accelerator", raising=False)
    assert _torch_compat.accelerator_available() is torch.cuda.is_available()


def test_accelerator_available_uses_torch_accelerator_where_it_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    if not hasattr(torch, "accelerator"):
        pytest.skip(f"torch {torch.__version__} has no torch.accelerator")
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    assert _torch_compat.accelerator_available() is True


def test_empty_host_cache_falls_back_and_says_when_it_cannot(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.delattr(torch, "accelerator", raising=False)
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: calls.append("private"), raising=False)
    assert _torch_compat.empty_host_cache() is True and calls == ["private"]
    monkeypatch.delattr(torch._C, "_host_emptyCache")
    assert _torch_compat.empty_host_cache() is False  # torch < 2.5: the cache is kept
