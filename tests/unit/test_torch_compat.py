"""fastload.device.torch_compat: the newest torch API where it exists, what older torch has otherwise."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import fastload
from fastload.device import torch_compat


def _old_torch(**c_attrs: object) -> SimpleNamespace:
    """A torch < 2.6 as torch_compat sees it: no torch.accelerator."""
    return SimpleNamespace(cuda=torch.cuda, _C=SimpleNamespace(**c_attrs))


def test_accelerator_available_without_torch_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_compat, "torch", _old_torch())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert torch_compat.accelerator_available() is True  # torch < 2.6 pinned for CUDA only
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert torch_compat.accelerator_available() is False


def test_accelerator_available_uses_torch_accelerator_where_it_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    accelerator = SimpleNamespace(is_available=lambda: True)
    monkeypatch.setattr(torch_compat, "torch", SimpleNamespace(accelerator=accelerator, cuda=torch.cuda))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert torch_compat.accelerator_available() is True  # e.g. an XPU or MPS machine


def test_empty_host_cache_prefers_the_public_api_and_says_when_it_cannot(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    new = SimpleNamespace(accelerator=SimpleNamespace(empty_host_cache=lambda: calls.append("public")),
                          _C=SimpleNamespace(_host_emptyCache=lambda: calls.append("private")))
    monkeypatch.setattr(torch_compat, "torch", new)
    assert torch_compat.empty_host_cache() is True and calls == ["public"]
    monkeypatch.setattr(torch_compat, "torch", _old_torch(_host_emptyCache=lambda: calls.append("private")))
    assert torch_compat.empty_host_cache() is True and calls == ["public", "private"]
    monkeypatch.setattr(torch_compat, "torch", _old_torch())
    assert torch_compat.empty_host_cache() is False  # torch < 2.5: the cache is kept


def test_only_torch_compat_names_version_dependent_torch_apis() -> None:
    # pyproject allows torch>=2.1: torch.accelerator (2.6) and the host-cache call go
    # through _torch_compat, so pin_memory=True on the read_batch path works on 2.1.
    root = Path(fastload.__file__).parent
    offenders = [
        f"{path.relative_to(root)}:{n}"
        for path in root.rglob("*.py")
        if path.name != "torch_compat.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"torch\.accelerator\b|_host_emptyCache", line.split("#")[0])
    ]
    assert offenders == []
